"""The recipe: one validated, typed config, built the same way from YAML, CLI and Python.

Unknown keys, wrong types and out-of-range values are rejected before any
compute, with the key path in the message (`selection.target: ...`). The
resolved recipe is saved next to every result.
"""

from __future__ import annotations

import difflib
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_serializer, field_validator, model_serializer, model_validator

from pruner.core import mixture
from pruner.pruning.scoring import ALL_SCORERS, LAYER_SCORERS, SCORERS
from pruner.pruning.surgery import DEFAULT_COMPENSATION
from pruner.recovery.spec import RecoverySpec
from pruner.runs.recipe_sections import BenchSpec, CaptureSpec, CheckpointSpec, ExportSpec, _Strict


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the key path."""


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
                      description="shakespeare:<split>, python-docs:<dev|evaluation>, package-docs:<dev|evaluation>, "
                                  "local file/folder, or Hub dataset id")
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

    @field_validator("data")
    @classmethod
    def _sources(cls, v):
        return mixture.check_sources(v)  # a mixture's list too (CalibrationSpec)


class CalibrationSpec(DataSpec):
    """Calibration text: one source, or a mixture of sources (`pruner.core.mixture`), and a held-back slice."""

    data: str | list[str] = Field(
        "shakespeare:calibration", description="one source (shakespeare:<split>, python-docs:<dev|evaluation>, "
                                               "package-docs:<dev|evaluation>, local file/folder, or Hub dataset "
                                               "id), or a list of them: a mixture, each sample from one source")
    weights: list[float] | None = Field(None, description="a mixture's share of the samples per source (default: "
                                                          "equal shares)")
    holdout: int | None = Field(None, ge=0, description="samples held back from the calibration sums, from every "
                                                        "source by the weights: what scorer.name / "
                                                        "surgery.compensation auto score their candidates on "
                                                        "(default: a quarter of num_samples with auto, else 0)")

    @model_validator(mode="after")
    def _mixture(self):
        mixture.check_shares(len(self.sources()), self.weights, self.num_samples, self.holdout)
        return self

    def sources(self) -> list[str]:
        return [self.data] if isinstance(self.data, str) else list(self.data)

    def held_back(self, auto: bool) -> int:
        """The samples held back: `holdout`, else a quarter of num_samples (at least 1) for auto, else none."""
        if self.holdout is not None:
            return self.holdout
        return max(1, (self.num_samples or 64) // 4) if auto else 0


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
    # the refit-aware scorer: with refit, the best mean rank on the development splits of three
    # decoders and two kinds of text (eval/domain_dev_study.py; docs/scorers.md)
    name: str = Field("refit-energy", description="a registered scorer, or auto: each candidate's plan scored on "
                                                   "the held-back calibration samples, the best kept")
    convention: Literal["full", "content"] | None = None
    ablation_samples: int = Field(16, ge=1, description="ablation scorer: calibration samples each single-head "
                                                        "removal is measured on (layers x heads passes over them)")
    shortlist: float = Field(0.5, gt=0, le=1, description="ablation-shortlist scorer: the share of each layer's "
                                                          "heads, cheapest by refit-energy, that it measures")
    candidates: list[str] | None = Field(None, description="auto: the scorers it chooses among (default: every "
                                                           "proxy, `AUTO_SCORERS`)")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return v if v == "auto" else _scorer_name(v)

    @field_validator("candidates")
    @classmethod
    def _known_candidates(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for name in v:
                _scorer_name(name)
            if len(set(v)) < len(v):
                raise ValueError(f"a candidate is listed twice: {v}")
        return v

    def choices(self) -> list[str]:
        """The scorers a run may use: auto's candidates, else the one named."""
        return [self.name] if self.name != "auto" else list(self.candidates or AUTO_SCORERS)


# selection.unit: layer with no scorer named: the measured one, which did the least damage of the three layer
# scorers on Gemma 3 270M's development splits at 4 and 6 layers (the same 2 layers as layer-cosine at 2), for
# L + 1 passes over scorer.ablation_samples (docs/evidence/gemma.md#whole-attention-layers)
DEFAULT_LAYER_SCORER = "layer-ablation"


def layer_scorers() -> list[str]:
    """The registered scorers that rank whole attention layers (selection.unit: layer)."""
    return list(LAYER_SCORERS)


# every proxy scorer: what auto chooses among unless scorer.candidates says otherwise (random is a yardstick;
# the measured ones cost passes per head: named in scorer.candidates, they are candidates too)
AUTO_SCORERS = tuple(n for n, s in SCORERS.items() if n != "random" and not s.needs_ablation)


def _scorer_name(v: str) -> str:
    if v not in ALL_SCORERS:
        near = difflib.get_close_matches(v, [*ALL_SCORERS, "auto"], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"unknown scorer {v!r}{hint}; valid: {', '.join(SCORERS)}, auto; layer scorers "
                         f"(selection.unit: layer): {', '.join(LAYER_SCORERS)}")
    return v


class SelectionSpec(_Strict):
    target: float = Field(0.25, gt=0, description="fraction of heads (0, 1) or a whole head count (>= 1); with "
                                                   "unit: layer, of the layers")
    budget: Literal["global", "layer"] | None = Field(
        None, description="global: heads from anywhere; layer: the same count from every layer; unset: layer where "
                          "selection.shape: servable applies, global elsewhere")
    min_heads_per_layer: int = Field(1, ge=1)
    gqa: Literal["equal", "group"] = "equal"
    shape: Literal["servable", "any"] = Field(
        "servable", description="servable: where a vanilla config can describe a pruned model (Llama, Mistral, "
                                "Qwen2, Qwen3), every layer loses the same number of heads, a multiple of the KV "
                                "heads (a Llama count its config refuses is written as MistralForCausalLM; the target "
                                "moves to the nearest, said in one line), so the compact checkpoint loads in "
                                "transformers, serving engines and llama.cpp without remote code; any: the target "
                                "exactly, layers may differ (the per-layer form; llama.cpp runs a Llama or Mistral "
                                "one through export --format gguf, and there the global budget is usually the lower perplexity: "
                                "docs/export.md#which-plan-to-pick)")
    seed: int = 0
    unit: Literal["head", "layer"] = Field(  # last, so every key before it lists as before ('valid here: ...')
        "head", description="head: prune attention heads; layer: remove whole attention layers (every head of the "
                            "layer, its KV cache with them; a layer scorer, docs/scorers.md#whole-attention-layers). "
                            "With layer, target is a fraction or a count of the layers, and the per-head "
                            "constraints (budget, min_heads_per_layer, gqa, shape) do not apply: they are ignored")

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

    @model_serializer(mode="wrap")
    def _head_unit_unsaid(self, handler):
        """`unit: head` (the default) is left out of a saved recipe, so every head recipe saves as before."""
        out = handler(self)
        if self.unit == "head":
            out.pop("unit", None)
        return out


class SurgerySpec(_Strict):
    """How heads go: masked or removed, and what is kept of them (see pruner.pruning.surgery)."""

    mode: Literal["mask", "remove"] = "mask"
    compensation: Literal["zero", "mean", "refit", "auto"] | None = Field(None, description="unset: refit, no bias "
        "(named in the run's recipe.yaml); auto: the best of surgery.candidates on the held-back calibration samples")
    candidates: list[Literal["zero", "mean", "refit"]] | None = Field(
        None, description="auto: the compensations it chooses among (default: mean, refit)")

    def resolved(self) -> SurgerySpec:
        """The spec as a run uses it: an unset compensation is `DEFAULT_COMPENSATION`."""
        return self.model_copy(update={"compensation": self.compensation or DEFAULT_COMPENSATION})

    def choices(self) -> list[str]:
        """The compensations a run may use: auto's candidates, else the one named (or resolved)."""
        kind = self.resolved().compensation
        return [kind] if kind != "auto" else list(self.candidates or ("mean", "refit"))
    ridge: float | Literal["auto"] = Field(
        "auto", description="refit: ridge relative to the mean diagonal of each layer's second moment, or auto: "
                            "chosen per layer by cross-validation over calibration folds (docs/compensation.md)")
    folds: int = Field(4, ge=2, le=16, description="ridge auto: folds of whole calibration samples")

    @field_validator("ridge", mode="before")
    @classmethod
    def _ridge(cls, v):
        if v == "auto":
            return v
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = float("nan")
        if isinstance(v, bool) or not x >= 0:
            raise ValueError(f"a ridge is >= 0 (relative to the mean diagonal) or auto, got {v!r}")
        return x
    refit_mode: Literal["oneshot", "sequential"] = Field(
        "oneshot", description="refit: from the unpruned model's moments, or layer by layer from moments "
                               "re-collected on the model already pruned below")


class EvaluationSpec(DataSpec):
    data: str = Field("shakespeare:evaluation", min_length=1,
                      description="shakespeare:<split>, python-docs:<dev|evaluation>, package-docs:<dev|evaluation>, "
                                  "local file/folder, or Hub dataset id")
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


class Recipe(_Strict):
    model: ModelSpec
    calibration: CalibrationSpec = CalibrationSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    sinks: SinkSection = SinkSection()
    scorer: ScorerSpec = ScorerSpec()
    selection: SelectionSpec = SelectionSpec()
    surgery: SurgerySpec = SurgerySpec()
    export: ExportSpec = ExportSpec()
    capture: CaptureSpec = CaptureSpec()
    bench: BenchSpec = BenchSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    recovery: RecoverySpec = RecoverySpec()
    threads: int | None = Field(None, ge=1)
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _layer_scorer_by_default(cls, data):
        """`selection.unit: layer` with no scorer named ranks layers with DEFAULT_LAYER_SCORER: the head default
        cannot rank layers, and a user who asks for layers should not have to name a scorer as well."""
        if not isinstance(data, dict):
            return data
        sel, scorer = data.get("selection"), data.get("scorer")
        unit = sel.get("unit") if isinstance(sel, dict) else getattr(sel, "unit", None)
        if unit != "layer":
            return data
        if scorer is None or (isinstance(scorer, dict) and "name" not in scorer):
            return {**data, "scorer": {**(scorer or {}), "name": DEFAULT_LAYER_SCORER}}
        if isinstance(scorer, ScorerSpec) and "name" not in scorer.model_fields_set:
            return {**data, "scorer": scorer.model_copy(update={"name": DEFAULT_LAYER_SCORER})}
        return data

    @model_validator(mode="after")
    def _auto(self):
        """auto's candidates: given only with auto, and more than one pair of scorer and compensation left."""
        for key, auto, given in (("scorer.candidates", self.scorer.name == "auto", self.scorer.candidates),
                                 ("surgery.candidates", self.surgery.compensation == "auto", self.surgery.candidates)):
            if given is not None and not auto:
                raise ValueError(f"{key} applies only with auto ({key.split('.')[0]} "
                                 f"{'name' if key.startswith('scorer') else 'compensation'}: auto)")
        if self.auto():
            pairs = len(self.scorer.choices()) * len(set(self.surgery.choices()))
            if pairs < 2:
                raise ValueError(f"auto has a single candidate left ({self.scorer.choices()[0]} + "
                                 f"{self.surgery.choices()[0]}): name it instead, or give auto more candidates")
        return self

    @model_validator(mode="after")
    def _unit_matches_scorer(self):
        """A head scorer cannot rank layers, nor a layer scorer heads: refused before any compute."""
        unit = self.selection.unit
        if self.scorer.name == "auto" and unit == "layer":
            raise ValueError("scorer.name: auto chooses among head scorers; selection.unit: layer takes a layer "
                             f"scorer: {', '.join(layer_scorers())}")
        wrong = [n for n in self.scorer.choices() if ALL_SCORERS[n].unit != unit]
        if wrong:
            unset = "" if "name" in self.scorer.model_fields_set else " (unset: the default)"
            valid = layer_scorers() if unit == "layer" else list(SCORERS)
            raise ValueError(f"scorer.name: {wrong[0]!r}{unset} scores {ALL_SCORERS[wrong[0]].unit}s and "
                             f"selection.unit is {unit}: use one of {', '.join(valid)}")
        return self

    def auto(self) -> bool:
        """Whether the scorer or the compensation is chosen on the held-back samples (`pruner.runs.autochoice`)."""
        return self.scorer.name == "auto" or self.surgery.compensation == "auto"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def error_message(e: ValidationError, prefix: str | None = None) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in ([prefix] if prefix else []) + list(err["loc"])) or "(recipe)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{path}: {msg}")
    return "invalid recipe: " + "; ".join(lines)


