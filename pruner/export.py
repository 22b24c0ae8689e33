"""Export: a pruning run as a shareable checkpoint (dense or compact), its model card, and the push.

The pruned model is rebuilt from the run folder alone -- the base model that
`recipe.yaml` names, the heads of `plan.json`, the compensation of
`compensation.safetensors` (folded biases `layer.<i>`, refitted weight deltas
`layer.<i>.weight`) -- with the surgery functions `prune` itself uses, so
either format is exact whatever surgery the run chose:

- `dense`   -- `surgery.mask_heads`: the pruned heads' output-projection columns
               are zero, every shape is kept; loads anywhere the base loads.
- `compact` -- `surgery.remove_heads`: physically smaller, in the best form that
               holds it (pruner.compact): a vanilla checkpoint when the family's own
               config can describe it, else the per-layer form (per-layer head
               counts + pruner's modeling file; `trust_remote_code=True` or
               `pruner.load`).

`mean` compensation is carried into both (the output-projection bias; Llama's
`attention_bias`; the per-layer form declares it where the config cannot);
`refit` compensation too, as plain weights (and the bias where the projection
has one), so it needs no config change anywhere. Checkpoints are stored in the
base checkpoint's own dtype unless the recipe's `export.dtype` says otherwise.
Nothing is published that does not load: the checkpoint is reloaded by every
route a user has and its logits (atol 1e-5) and greedy generations compared with
the in-memory model before the temporary folder is renamed into place. The
reload holds a second copy of the model in memory for that moment.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pruner import arch, assets, compact, modeling, models, provenance, report, surgery
from pruner.redact import redact
from pruner.recipe import Recipe, load_recipe

FORMATS = ("dense", "compact")
COMPENSATION_FILE = "compensation.safetensors"
RUN_FILES = ("recipe.yaml", "plan.json", "metrics.json")
ATOL = compact.ATOL
# shipped checkpoints derived from a Hub model; the from-scratch ones have no Hub base
HUB_BASE = {"minilm-causal": "sentence-transformers/all-MiniLM-L6-v2",
            "minilm": "sentence-transformers/all-MiniLM-L6-v2"}


ExportError = compact.CheckpointError  # a checkpoint that cannot be written (or would not reload)


class PushError(OSError):
    """The push failed; the local export is intact."""


def save_compensation(comp: "surgery.Compensation | dict | None", path: Path) -> None:
    """A compensation as `layer.<i>` biases (d_model,) and `layer.<i>.weight` deltas (d_model, heads * d_head),
    original head numbering (nothing is written for `zero`)."""
    from safetensors.torch import save_file

    comp = surgery.as_compensation(comp)
    tensors = {f"layer.{k}": v for k, v in comp.bias.items()} | {f"layer.{k}.weight": v for k, v in comp.weight.items()}
    if tensors:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(path),
                  metadata={"kind": comp.kind})


def load_compensation(path: Path, kind: str = "mean") -> "surgery.Compensation":
    """Read `save_compensation`'s file (files written before refit hold biases only)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        kind = (f.metadata() or {}).get("kind", kind)
    bias, weight = {}, {}
    for key, v in load_file(str(path)).items():
        parts = key.split(".")
        (weight if parts[-1] == "weight" else bias)[int(parts[1])] = v
    return surgery.Compensation(kind, bias, weight)


@dataclass(frozen=True)
class Run:
    """What a `pruner prune` output folder holds, read back."""

    folder: Path
    recipe: Recipe
    plan: dict                                # plan.json
    metrics: dict                             # metrics.json
    compensation: surgery.Compensation        # compensation.safetensors (empty for `zero`)
    base_note: str | None = None              # provenance: why the base was not (or could not be) checked

    @property
    def heads(self) -> dict[int, list[int]]:
        return {int(k): v for k, v in self.plan["heads"].items()}

    @property
    def bias(self) -> dict[int, torch.Tensor] | None:
        """The folded biases alone (what runs held before refit compensation)."""
        return self.compensation.bias or None


def load_run(folder: Path) -> Run:
    folder = Path(folder)
    missing = [f for f in RUN_FILES if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(f"{folder} is not a pruner run folder (no {', '.join(missing)}); "
                                "make one with `pruner prune RECIPE --out DIR`")
    metrics = json.loads((folder / "metrics.json").read_text())
    comp = surgery.Compensation()
    kind = metrics["compensation"]
    if kind != "zero":
        if not (folder / COMPENSATION_FILE).exists():
            raise FileNotFoundError(f"{folder} has {kind} compensation but no {COMPENSATION_FILE} (written by "
                                    "`pruner prune` since export exists); re-run `pruner prune` on its recipe.yaml")
        comp = load_compensation(folder / COMPENSATION_FILE, kind)
    return Run(folder, load_recipe(folder / "recipe.yaml"), json.loads((folder / "plan.json").read_text()),
               metrics, comp)


def rebuild(run: Run, fmt: str):
    """The pruned model in `fmt` (and its tokenizer): base + plan heads + compensation."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    model = models.load_base(run.recipe.model)
    tokenizer = models.load_tokenizer(run.recipe.model.path, trust_remote_code=run.recipe.model.trust_remote_code)
    heads = provenance.check_fits(run.folder, run.plan, run.compensation, model)  # an edited plan that no longer fits
    (surgery.remove_heads if fmt == "compact" else surgery.mask_heads)(model, heads, run.compensation)
    return model, tokenizer


def check_exportable(model, fmt: str) -> None:
    """Refuse, with what to do instead, a model no checkpoint of `fmt` can hold (only dense can refuse now)."""
    compact.layout(model, removed=fmt == "compact")


def recipe_storage_dtype(recipe: Recipe, dtype: str | None = None) -> str | None:
    """The dtype a checkpoint stores: `dtype`, else the recipe's `export.dtype`, where `auto` = the base
    checkpoint's own (None -- the in-memory model's -- when no base checkpoint can be found, e.g. a model
    pruned in memory)."""
    want = dtype or recipe.export.dtype
    return compact.storage_dtype(recipe.model) if want == "auto" else want


def storage_dtype(run: Run, dtype: str | None = None) -> str | None:
    """The dtype an export of `run` stores (see recipe_storage_dtype)."""
    return recipe_storage_dtype(run.recipe, dtype)


def save_checkpoint(model, tokenizer, folder: Path, removed: bool, dtype: str | None = None) -> compact.Saved:
    """Write a checkpoint (model + tokenizer) and prove it reloads; returns what was written and measured.

    `removed`: compact (heads physically removed) rather than dense; the compact layout
    is vanilla where the family's config can describe it, per-layer otherwise.
    `dtype`: storage dtype (None: the model's own). Raises ExportError when no layout
    holds the model or the reload does not reproduce its logits (atol 1e-5) and greedy
    generations. `pruner prune` saves its model/ through here too.
    """
    return compact.save(model, tokenizer, Path(folder), removed, dtype)


@dataclass(frozen=True)
class Exported:
    folder: Path
    format: str
    params: int
    bytes: int          # weights files on disk
    max_diff: float     # max |logit difference| after the reload (vs the model rounded to `dtype`)
    layout: str = "dense"            # dense | vanilla | per-layer
    dtype: str = "float32"           # storage dtype
    storage_diff: float = 0.0        # max |logit change| that storing in `dtype` itself makes
    why_per_layer: str | None = None
    generation: bool | None = None   # greedy generation with the KV cache identical (None: not a causal LM)


def write_export(run: Run, fmt: str, out: Path, overwrite: bool = False, repo_id: str | None = None,
                 dtype: str | None = None) -> Exported:
    """Rebuild, check, write to a temporary folder, reload-verify, add card + plan.json, rename to `out`."""
    out = Path(out)
    with report.atomic_dir(out, overwrite) as tmp:  # an existing `out` is refused before the rebuild
        model, tokenizer = rebuild(run, fmt)
        saved = save_checkpoint(model, tokenizer, tmp, fmt == "compact", storage_dtype(run, dtype))
        shutil.copyfile(run.folder / "plan.json", tmp / "plan.json")
        params = sum(p.numel() for p in model.parameters())
        model_card(run, fmt, model, params, repo_id, saved).save(tmp / "README.md")
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    return Exported(out, fmt, params, size, saved.max_diff, saved.layout, saved.dtype, saved.storage_diff,
                    saved.why_per_layer, saved.generation)


def commit_message(run: Run, fmt: str) -> str:
    m = run.metrics
    return (f"pruner: {m['scorer']} pruned {m['pruned_heads']}/{m['total_heads']} heads "
            f"({m['compensation']} compensation, {fmt})")


def hub_client():
    """The client `push` uses unless given one (tests inject a recording fake)."""
    from huggingface_hub import HfApi

    return HfApi()


def check_repo_id(repo_id: str) -> None:
    """A malformed repo id is an error before any compute."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"invalid Hub repo id {repo_id!r} (expected NAMESPACE/NAME): {e}") from None


def push(folder: Path, repo_id: str, private: bool, message: str, client=None) -> str:
    """Create the repo if needed and upload `folder`; any failure is a PushError naming what to check."""
    client = client or hub_client()
    try:
        client.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        client.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message=message)
    except Exception as e:  # noqa: BLE001 - network, auth and HTTP errors all mean "not pushed"
        first = redact((str(e).strip().splitlines() or [""])[0])  # HTTP errors may echo request headers
        raise PushError(f"push to {repo_id} failed ({type(e).__name__}: {first}). The local export at {folder} "
                        "is intact. Check the token (`hf auth login`, or HF_TOKEN with write access), the "
                        f"network (or HF_ENDPOINT), and the repo id; then retry with "
                        f"`hf upload {repo_id} {folder}{' --private' if private else ''}`") from None
    return f"{getattr(client, 'endpoint', None) or 'https://huggingface.co'}/{repo_id}"


def export_run(run_dir: Path, fmt: str, out: Path, overwrite: bool = False, repo_id: str | None = None,
               private: bool = False, allow_changed_base: bool = False,
               dtype: str | None = None) -> tuple[Exported, str | None]:
    """`pruner export`: write the export, then push it when `repo_id` is given. Returns (export, url).

    A base model that is not the one the run was made from (provenance.json) is
    refused unless `allow_changed_base`, which the model card then records. `dtype`
    overrides the recipe's `export.dtype` (storage dtype; auto = the base checkpoint's own).
    """
    if repo_id:
        check_repo_id(repo_id)
    run = load_run(run_dir)
    note = provenance.check_base(run.folder, run.recipe.model, allow_changed_base)
    run = dataclasses.replace(run, base_note=note)
    done = write_export(run, fmt, out, overwrite, repo_id, dtype)
    url = push(done.folder, repo_id, private, commit_message(run, fmt)) if repo_id else None
    return done, url


# --- the model card ---------------------------------------------------------------------------


def _hub_base(path: str) -> str | None:
    """The Hub id of the base model, or None for a from-scratch shipped checkpoint or a local folder."""
    if path in HUB_BASE:
        return HUB_BASE[path]
    if path in assets.CHECKPOINTS or Path(path).expanduser().exists():
        return None
    return path


def _pipeline_tag(config) -> str:
    if models.is_causal(config):
        return "text-generation"
    return "fill-mask" if models.is_masked_lm(config) else "feature-extraction"


def _format_text(fmt: str, model, saved: compact.Saved) -> str:
    if fmt == "dense":
        return ("**dense**: the pruned heads' output-projection columns are zero and every shape is the "
                "base model's, so it loads wherever the base loads (no memory or speed gain by itself).")
    if saved.layout == "vanilla":
        return ("**compact**: the pruned heads are physically removed (q/k/v rows and output-projection "
                f"columns); the config says {model.config.num_attention_heads} attention heads"
                + (f" over {model.config.num_key_value_heads} key/value heads"
                   if getattr(model.config, "num_key_value_heads", None) else "") + " per layer.")
    q, kv = compact.head_counts(model)
    counts = ", ".join(f"{a}" + (f"/{b}" if getattr(model.config, "num_key_value_heads", None) else "")
                       for a, b in zip(q, kv))
    return ("**compact, per-layer**: the pruned heads are physically removed (q/k/v rows and output-projection "
            f"columns), and no vanilla `{model.config.model_type}` config can describe the result: "
            f"{saved.why_per_layer}. `config.json` lists the heads kept in each layer "
            "(`num_attention_heads_per_layer`"
            + (", `num_key_value_heads_per_layer`" if getattr(model.config, "num_key_value_heads", None) else "")
            + f"; here {counts}) and `{modeling.file_name(model.config.model_type)}` builds each layer's "
            "attention with its own count (see How to load).")


def _load_lines(cls: str, where: str, saved: compact.Saved, model) -> list[str]:
    if saved.layout != "per-layer":
        return ["```python", f"from transformers import {cls}, AutoTokenizer", "",
                f'model = {cls}.from_pretrained("{where}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{where}")', "```", "",
                "Plain transformers: no pruner code is needed to load or run it."]
    file = modeling.file_name(model.config.model_type)
    lines = len(modeling.source(model.config.model_type).read_text().splitlines())
    return ["```python", f"from transformers import {cls}, AutoTokenizer", "",
            f'model = {cls}.from_pretrained("{where}", trust_remote_code=True)',
            f'tokenizer = AutoTokenizer.from_pretrained("{where}", trust_remote_code=True)  # reads the config too',
            "```", "",
            "Why `trust_remote_code=True`: this model's layers keep different numbers of attention heads (or "
            "heads the vanilla config cannot describe), so transformers needs the model code in "
            f"`{file}` ({lines} lines, next to the weights; it imports only transformers and torch). It "
            f"subclasses transformers' own {model.config.model_type} classes and changes nothing but the size of "
            "each layer's attention projections. Read it before you trust it.", "",
            "Or, with pruner installed, without running any code from this folder (pruner uses its own copy "
            "of that file):", "",
            "```python", "import pruner", "", f'model = pruner.load("{where}")', "```"]


def model_card(run: Run, fmt: str, model, params: int, repo_id: str | None = None,
               saved: compact.Saved | None = None):
    """A huggingface_hub ModelCard: YAML metadata, what was pruned and how, results, recipe, loading."""
    from huggingface_hub import ModelCard, ModelCardData

    m, r = run.metrics, run.recipe
    base = _hub_base(r.model.path)
    saved = saved or compact.Saved("dense" if fmt == "dense" else "vanilla", None, "float32", 0.0, 0.0, None, ())
    tags = ["pruned", "attention-head-pruning", "pruner", model.config.model_type]
    data = ModelCardData(base_model=base, library_name="transformers", pipeline_tag=_pipeline_tag(model.config),
                         tags=tags + (["custom_code"] if saved.layout == "per-layer" else []))
    where = repo_id or "path/to/this/folder"
    cls = models.auto_class(model.config).__name__
    base_text = f"[`{base}`](https://huggingface.co/{base})" if base else \
        f"`{r.model.path}` (pruner's shipped checkpoint, not on the Hub)" if r.model.path in assets.CHECKPOINTS \
        else f"`{r.model.path}`"
    conv = f", {report.convention_phrase(m)}" if m["convention"] else ""
    fmt_text = _format_text(fmt, model, saved)
    title_fmt = "compact, per-layer" if saved.layout == "per-layer" else fmt
    storage_text = (f"- stored in {saved.dtype}" + (" (the base checkpoint's own dtype)"
                                                    if r.export.dtype == "auto" else "")
                    + (f"; rounding to {saved.dtype} moves the logits by at most {saved.storage_diff:.1e} from "
                       "the model pruner evaluated" if saved.storage_diff > 0 else ""))
    comp_text = {
        "mean": "`mean`: each pruned head's mean output over the calibration tokens is folded into the "
                "output-projection bias (kept in this checkpoint"
                + (", through `attention_bias: true`, which adds zero q/k/v biases" if
                   getattr(model.config, "attention_bias", False) else "") + ")",
        "refit": "`refit`: the kept heads' output-projection columns were refitted by ridge least squares on the "
                 "calibration tokens to rebuild what the pruned heads wrote"
                 + (" (the constant into the existing bias)" if run.compensation.bias else
                    " (no bias: plain weights, the architecture unchanged)"),
    }.get(m["compensation"], "`zero`: pruned heads are simply removed")
    g = arch.geometry(model)
    per_layer = ", ".join(f"{k}: {v}" for k, v in run.plan["heads"].items())
    cal = r.calibration
    lines = [
        f"# {r.model.path}, {m['pruned_heads']} of {m['total_heads']} attention heads pruned ({title_fmt})", "",
        f"Attention heads of {base_text} pruned with pruner (sink-aware attention-head pruning: heads "
        "are scored with the attention sink and the content channel separated).", "",
        "## What was pruned and how", "",
        f"- scorer: `{m['scorer']}`{conv}; target `{r.selection.target:g}` "
        f"({r.selection.budget} budget, GQA `{r.selection.gqa}`, >= {r.selection.min_heads_per_layer} head per layer)",
        f"- pruned: {m['pruned_heads']} of {m['total_heads']} heads ({g.n_layers} layers x {g.n_heads} heads); "
        f"per layer: {per_layer} (full list in `plan.json`)",
        f"- compensation: {comp_text}",
        f"- format: {fmt_text}",
        storage_text,
        f"- parameters: {m['params_before']:,} (base) -> {params:,} (this checkpoint)",
        f"- calibration: {cal.num_samples} {cal.unit} of {cal.length} tokens from `{cal.data}`; "
        f"sinks `{m['sinks']['mode']}`", "",
    ]
    sens = report.sensitivity_text(m)
    if sens:
        lines += [sens, ""]
    if run.base_note:
        lines += [f"**Base model check.** {run.base_note}", ""]
    refit_text = report.refit_text(m)
    if refit_text:
        lines += [refit_text, ""]
    e = r.evaluation
    lines += [
        "## Results", "",
        f"Perplexity on {e.num_samples} {e.unit} of `{e.data}` ({e.length} tokens), paired with the unpruned "
        "model on the same windows; 95% bootstrap CI over windows. Measured with the pruned heads masked in "
        "memory; this checkpoint reproduces those logits: reloaded and compared with that model (rounded to the "
        "storage dtype) to 1e-5" + (", and greedy generation with the KV cache gives the same tokens"
                                    if saved.generation else "") + ".", "",
        report.result_table(m, params), "",
        "## How to load", "",
        *_load_lines(cls, where, saved, model), "",
        "## Recipe", "",
        "The resolved pruner recipe of the run:", "",
        "```yaml", r.to_yaml().rstrip(), "```", "",
        "## Pruned heads", "", report.plan_table(run.plan), "",
    ]
    return ModelCard(redact(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
