"""The recipe: one validated, typed config, built the same way from YAML, CLI and Python.

Unknown keys, wrong types and out-of-range values are rejected before any
compute, with the key path in the message (`selection.target: ...`). The
resolved recipe is saved next to every result.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator

from pruner.scoring import SCORERS


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class ModelSpec(_Strict):
    path: str = Field(min_length=1, description="shipped name, local folder or Hub id")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    device: str = "cpu"
    device_map: str | None = None
    mlm_readout: str | None = Field(default=None, description="'shipped' for all-MiniLM-L6-v2's readout")
    trust_remote_code: bool = Field(False, description="run Python code shipped with the checkpoint (auto_map)")


class DataSpec(_Strict):
    """Calibration text (the shipped Shakespeare calibration plays unless `data` says otherwise)."""

    data: str = Field("shakespeare:calibration", min_length=1,
                      description="shakespeare:<split>, local file/folder, or Hub dataset id")
    split: str = "train"
    text_column: str = "text"
    name: str | None = None
    unit: Literal["windows", "lines"] = "windows"
    length: int = Field(128, ge=4, le=131072)
    stride: int | None = Field(None, ge=1)
    num_samples: int | None = Field(64, ge=1)
    bos: bool = True
    seed: int = 0
    batch_size: int = Field(8, ge=1)


class SinkSection(_Strict):
    mode: Literal["first", "bos", "special", "ids", "positions", "auto"] | None = None
    ids: list[int] = []
    positions: list[int] = []
    eps: float = Field(0.3, gt=0, lt=1)

    @model_validator(mode="after")
    def _values(self):
        if self.mode == "ids" and not self.ids:
            raise ValueError("mode 'ids' needs at least one token id in sinks.ids")
        if self.mode == "positions" and not self.positions:
            raise ValueError("mode 'positions' needs at least one position in sinks.positions")
        if any(p < 0 for p in self.positions):
            raise ValueError("sink positions must be >= 0")
        return self


class ScorerSpec(_Strict):
    name: str = "sink-aware"
    convention: Literal["full", "content"] | None = None

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in SCORERS:
            near = difflib.get_close_matches(v, SCORERS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown scorer {v!r}{hint}; valid: {', '.join(SCORERS)}")
        return v


class SelectionSpec(_Strict):
    target: float = Field(0.25, gt=0, description="fraction of heads (0, 1) or a whole head count (>= 1)")
    budget: Literal["global", "layer"] = "global"
    min_heads_per_layer: int = Field(1, ge=1)
    gqa: Literal["equal", "group"] = "equal"
    seed: int = 0

    @field_validator("target", mode="before")
    @classmethod
    def _fraction_or_count(cls, v):
        """A float must be a fraction in (0, 1); a head count is written as a whole number (8, not 8.0)."""
        if isinstance(v, bool):
            raise ValueError("must be a number, not a boolean")
        if isinstance(v, float) and v >= 1:
            raise ValueError("a fraction of heads must be in (0, 1); a head count is a whole number "
                             f"(got {v!r})")
        return v

    @field_serializer("target")
    def _whole_count(self, v: float) -> int | float:
        """Counts are saved as whole numbers, so a saved recipe reloads (8.0 would be refused)."""
        return int(v) if v >= 1 else v


class SurgerySpec(_Strict):
    """How heads go: masked or removed, and what is kept of them (see pruner.surgery)."""

    mode: Literal["mask", "remove"] = "mask"
    # refit by default: with the sink-aware scorer, the pair chosen on the development split
    # (eval/refit_study.py; README "Compensation"); it needs no bias, so every family gets it
    compensation: Literal["zero", "mean", "refit"] = "refit"
    ridge: float = Field(1e-3, ge=0, description="refit: ridge, relative to the mean diagonal of each layer's "
                                                 "second moment")
    refit_mode: Literal["oneshot", "sequential"] = Field(
        "oneshot", description="refit: from the unpruned model's moments, or layer by layer from moments "
                               "re-collected on the model already pruned below")


class EvaluationSpec(DataSpec):
    data: str = Field("shakespeare:evaluation", min_length=1,
                      description="shakespeare:<split>, local file/folder, or Hub dataset id")
    num_samples: int | None = Field(64, ge=1, description="max windows / lines evaluated")
    bootstrap: int = Field(1000, ge=0)
    latency: bool = True
    tasks: list[str] = Field([], description="downstream tasks: lm-evaluation-harness names (the shipped offline "
                                             "suite: `shakespeare`), or the shipped embedding task")
    task_paths: list[str] = Field([], description="folders of your own lm-evaluation-harness task YAML")
    task_limit: int | None = Field(None, ge=1, description="score the first N documents of each task")
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples (default: each task's own)")

    @field_validator("tasks", "task_paths")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        if any(not x.strip() for x in v):
            raise ValueError("names must be non-empty")
        return v

    @model_validator(mode="after")
    def _task_options_need_tasks(self):
        unused = [k for k in ("task_paths", "task_limit", "num_fewshot") if getattr(self, k) not in (None, [])]
        if unused and not self.tasks:
            raise ValueError(f"{', '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} only with "
                             "evaluation.tasks")
        return self


class ExportSpec(_Strict):
    """`pruner prune` also exports (into RUN_DIR/export-FORMAT) and pushes, as `pruner export` would."""

    format: Literal["none", "dense", "compact"] = "none"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="storage dtype of saved checkpoints (model/ and exports); auto: the base checkpoint's own")
    push_to_hub: str | None = Field(None, description="Hub repo id NAMESPACE/NAME to upload the export to")
    private: bool = False

    @field_validator("push_to_hub")
    @classmethod
    def _repo_id(cls, v: str | None) -> str | None:
        if v is not None:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(v)
            except HFValidationError as e:
                raise ValueError(f"invalid Hub repo id {v!r}: {e}") from None
        return v

    @model_validator(mode="after")
    def _push_needs_export(self):
        if self.push_to_hub and self.format == "none":
            raise ValueError("push_to_hub needs an export: set export.format to dense or compact")
        if self.private and not self.push_to_hub:
            raise ValueError("private applies only with export.push_to_hub")
        return self


class CaptureSpec(_Strict):
    """Calibration capture. The scorers read the cosine matrices (always captured); each further
    pair metric costs a pass per pair of heads (O(heads^2 T^2) logarithms for JS), so none by default."""

    chunk_size: int = Field(128, ge=1)
    metrics: list[Literal["cosine", "js", "hellinger", "tv", "aitchison"]] = ["cosine"]
    memory_check: bool = Field(True, description="refuse, before calibration, a peak-memory estimate larger than "
                                                 "the free memory")


class CheckpointSpec(_Strict):
    """How often a run saves its calibration sums and finished evaluations for `--resume`
    (into its partial folder; removed when the run completes). Either trigger saves."""

    every_seconds: float | None = Field(600, ge=0, description="seconds between saves; null: never by time")
    every_batches: int | None = Field(None, ge=1, description="batches (or examples) between saves")


class BenchSpec(_Strict):
    """What `prune` measures of the pruned compact model against the base (parameters, checkpoint bytes,
    KV cache, peak memory, prefill latency, decode throughput; see pruner.bench). Small by default so a
    run stays quick; `pruner bench RUN_DIR` measures at full length."""

    enabled: bool = True
    lengths: list[int] = Field([128, 512], description="prefill latency at batch 1, tokens (capped at the "
                                                        "position table)")
    decode: list[tuple[int, int]] = Field([(1, 16), (8, 256)], description="greedy decode cases "
                                                                          "[batch, prompt tokens]")
    new_tokens: int = Field(32, ge=2, description="tokens each decode case generates")
    repeats: int = Field(3, ge=1, description="interleaved rounds (figures are medians)")

    @model_validator(mode="after")
    def _positive(self):
        if any(t < 1 for t in self.lengths) or any(b < 1 or p < 1 for b, p in self.decode):
            raise ValueError("lengths, batch sizes and prompt lengths must be >= 1")
        if self.enabled and not self.lengths and not self.decode:
            raise ValueError("nothing to measure: give lengths or decode cases (or enabled: false)")
        return self


class Recipe(_Strict):
    model: ModelSpec
    calibration: DataSpec = DataSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    sinks: SinkSection = SinkSection()
    scorer: ScorerSpec = ScorerSpec()
    selection: SelectionSpec = SelectionSpec()
    surgery: SurgerySpec = SurgerySpec()
    export: ExportSpec = ExportSpec()
    capture: CaptureSpec = CaptureSpec()
    bench: BenchSpec = BenchSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    threads: int | None = Field(None, ge=1)
    seed: int = 0

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class AnalyzeSpec(_Strict):
    """Options of `pruner analyze` / `pruner sinks` / `pruner.analyze` (they are flags, not a recipe)."""

    sinks: str | None = Field(None, description="first | bos | special | auto | ids:ID,... | positions:P,...")
    unit: Literal["windows", "lines"] | None = None
    max_length: int = Field(128, ge=4, le=131072)
    num_samples: int | None = Field(64, ge=1)
    metrics: list[str] = Field(["cosine", "js"], min_length=1)
    thresholds: dict[str, float] = {}
    clusters: int | None = Field(None, ge=2)
    seed: int = 0
    batch_size: int = Field(8, ge=1)
    chunk_size: int = Field(128, ge=1)
    bos: bool = True
    threads: int | None = Field(None, ge=1)
    trust_remote_code: bool = False
    memory_check: bool = True
    checkpoint_every_seconds: float | None = Field(600, ge=0)
    checkpoint_every_batches: int | None = Field(None, ge=1)

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        from pruner.stats import PAIR_METRICS

        bad = [m for m in v if m not in PAIR_METRICS]
        if bad:
            raise ValueError(f"unknown pair metrics {bad}; valid: {', '.join(PAIR_METRICS)}")
        return v

    @classmethod
    def validated(cls, values: dict[str, Any]) -> "AnalyzeSpec":
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise RecipeError(_message(e).replace("invalid recipe", "invalid option", 1)) from None


def _message(e: ValidationError, prefix: str | None = None) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in ([prefix] if prefix else []) + list(err["loc"])) or "(recipe)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{path}: {msg}")
    return "invalid recipe: " + "; ".join(lines)


def _set(tree: dict, dotted: str, raw: str) -> None:
    """Apply one `key.path=value` override (value parsed as YAML)."""
    keys = dotted.split(".")
    node = tree
    for i, k in enumerate(keys[:-1]):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise RecipeError(f"--set {dotted}: {'.'.join(keys[:i + 1])} is not a section")
    try:
        node[keys[-1]] = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:  # not YAML (e.g. `@name`): the text itself
        node[keys[-1]] = raw


def _check_key(dotted: str) -> None:
    """A dotted key must name a key the recipe schema has; the message lists the valid ones there."""
    cls: Any = Recipe
    for k in dotted.split("."):
        fields = getattr(cls, "model_fields", None)
        if fields is None or k not in fields:
            valid = ", ".join(fields) if fields else "(none: not a section)"
            raise RecipeError(f"{dotted}: no such key {k!r}; valid here: {valid}")
        cls = fields[k].annotation
        if hasattr(cls, "__args__"):  # Optional[...] etc.: the section type, if any
            cls = next((a for a in cls.__args__ if hasattr(a, "model_fields")), cls)


def _check_paths(overrides: list[str]) -> None:
    """Every `--set` override must name a key the recipe schema has."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set expects key=value, got {item!r}")
        try:
            _check_key(item.split("=", 1)[0])
        except RecipeError as e:
            raise RecipeError(f"--set {e}") from None


# Keyword arguments of the Python API (`pruner.plan(..., target=0.25)`) -> the recipe keys they set.
# Section names (`selection={...}`) and dotted key paths (`**{"selection.gqa": "group"}`) work too.
ALIASES = {
    "scorer": "scorer.name", "convention": "scorer.convention",
    "target": "selection.target", "budget": "selection.budget", "gqa": "selection.gqa",
    "min_heads_per_layer": "selection.min_heads_per_layer",
    "compensation": "surgery.compensation", "mode": "surgery.mode",
    "sinks": "sinks.mode", "dtype": "model.dtype", "device": "model.device", "device_map": "model.device_map",
    "threads": "threads", "seed": "seed", "trust_remote_code": "model.trust_remote_code",
    "tasks": "evaluation.tasks", "task_paths": "evaluation.task_paths", "task_limit": "evaluation.task_limit",
    "num_fewshot": "evaluation.num_fewshot",
}


def _resolve_key(key: str) -> str:
    """An API keyword, section name or dotted path -> a dotted recipe path; unknown names are refused."""
    if key in ALIASES:
        return ALIASES[key]
    if key.split(".")[0] in Recipe.model_fields:
        return key
    valid = sorted([*ALIASES, *Recipe.model_fields])
    near = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise RecipeError(f"unknown argument {key!r}{hint}; valid: {', '.join(valid)}, or a dotted recipe key "
                      "such as 'selection.gqa'")


def _apply_values(tree: dict, values: dict[str, Any]) -> None:
    """Set Python values at recipe paths (sections given as dicts are merged key by key)."""
    for key, value in values.items():
        path = _resolve_key(key)
        if isinstance(value, dict) and "." not in path:  # a whole section: merge
            for k, v in value.items():
                _apply_values(tree, {f"{path}.{k}": v})
            continue
        _check_key(path)
        keys = path.split(".")
        node = tree
        for i, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise RecipeError(f"{'.'.join(keys[:i + 1])} is not a section")
        node[keys[-1]] = value


def build_recipe(source: "str | Path | dict | Recipe | None" = None, values: dict[str, Any] | None = None,
                 overrides: list[str] = ()) -> Recipe:
    """A validated recipe from a YAML file, a dict or a Recipe (or nothing: every default), with Python
    `values` (API keywords, sections or dotted paths) and CLI-style `key=value` overrides on top."""
    if isinstance(source, Recipe):
        source = source.model_dump(mode="json")
    tree = yaml.safe_load(yaml.safe_dump(source)) if isinstance(source, dict) else \
        {} if source is None else _read_yaml(Path(source))
    _apply_values(tree, dict(values or {}))
    return load_recipe(tree, overrides)


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise RecipeError(f"recipe file {path} does not exist")
    try:
        return yaml.safe_load(path.read_text())  # plain data only: never constructs Python objects
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        why = " ".join(str(getattr(e, "problem", None) or e).split())
        if isinstance(e, yaml.constructor.ConstructorError) and "tag" in why:
            tag = why.split("tag", 1)[1].strip(" '").replace("tag:yaml.org,2002:", "!!")
            raise RecipeError(f"recipe {path}{where}: the tag {tag} is not allowed; a recipe is plain YAML "
                              "(mappings, lists, strings, numbers, booleans)") from None
        raise RecipeError(f"recipe {path} is not valid YAML{where}: {why}") from None


def validate_section(name: str, values: dict[str, Any]):
    """One recipe section validated alone (e.g. `surgery` for `pruner.apply`), with the recipe's messages."""
    try:
        return Recipe.model_fields[name].annotation.model_validate(values)
    except ValidationError as e:
        raise RecipeError(_message(e, prefix=name)) from None


def load_recipe(source: str | Path | dict, overrides: list[str] = ()) -> Recipe:
    """A validated recipe from a YAML path or a dict, with `key=value` overrides."""
    if isinstance(source, dict):
        tree = source
    else:
        tree = _read_yaml(Path(source))
    if not isinstance(tree, dict):
        raise RecipeError("a recipe must be a YAML mapping with at least a `model:` section")
    _check_paths(list(overrides))
    tree = yaml.safe_load(yaml.safe_dump(tree))  # deep copy
    for item in overrides:
        key, raw = item.split("=", 1)
        _set(tree, key, raw)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        raise RecipeError(_message(e)) from None
