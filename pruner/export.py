"""Export: a pruning run as a shareable checkpoint (dense or compact), its model card, and the push.

The pruned model is rebuilt from the run folder alone -- the base model that
`recipe.yaml` names, the heads of `plan.json`, the folded biases of
`compensation.safetensors` -- with the surgery functions `prune` itself uses, so
either format is exact whatever surgery the run chose:

- `dense`   -- `surgery.mask_heads`: the pruned heads' output-projection columns
               are zero, every shape is kept; loads anywhere the base loads.
- `compact` -- `surgery.remove_heads`: physically smaller; written only when a
               vanilla config can describe it (uniform head counts with an
               explicit `head_dim`, accepted by transformers' own validation).

`mean` compensation is carried into both (the output-projection bias; Llama's
`attention_bias`). Nothing is published that does not load: the checkpoint is
reloaded with the vanilla Auto class and its logits compared with the in-memory
model (atol 1e-5) before the temporary folder is renamed into place. The reload
holds a second copy of the model in memory for that moment.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pruner import arch, assets, models, provenance, report, surgery
from pruner.redact import redact
from pruner.recipe import Recipe, load_recipe

FORMATS = ("dense", "compact")
COMPENSATION_FILE = "compensation.safetensors"
RUN_FILES = ("recipe.yaml", "plan.json", "metrics.json")
ATOL = 1e-5
# shipped checkpoints derived from a Hub model; the from-scratch ones have no Hub base
HUB_BASE = {"minilm-causal": "sentence-transformers/all-MiniLM-L6-v2",
            "minilm": "sentence-transformers/all-MiniLM-L6-v2"}


class ExportError(ValueError):
    """A checkpoint that cannot be written (or would not reload); the message says what to do instead."""


class PushError(OSError):
    """The push failed; the local export is intact."""


def save_compensation(bias: dict[int, torch.Tensor] | None, path: Path) -> None:
    """The folded mean-compensation biases, {layer: (d_model,)}, as `layer.<i>` tensors (nothing for `zero`)."""
    from safetensors.torch import save_file

    if bias:
        save_file({f"layer.{k}": v.detach().cpu().contiguous() for k, v in bias.items()}, str(path))


def load_compensation(path: Path) -> dict[int, torch.Tensor]:
    from safetensors.torch import load_file

    return {int(k.split(".")[1]): v for k, v in load_file(str(path)).items()}


@dataclass(frozen=True)
class Run:
    """What a `pruner prune` output folder holds, read back."""

    folder: Path
    recipe: Recipe
    plan: dict                                # plan.json
    metrics: dict                             # metrics.json
    bias: dict[int, torch.Tensor] | None      # compensation.safetensors (None for `zero`)
    base_note: str | None = None              # provenance: why the base was not (or could not be) checked

    @property
    def heads(self) -> dict[int, list[int]]:
        return {int(k): v for k, v in self.plan["heads"].items()}


def load_run(folder: Path) -> Run:
    folder = Path(folder)
    missing = [f for f in RUN_FILES if not (folder / f).exists()]
    if missing:
        raise FileNotFoundError(f"{folder} is not a pruner run folder (no {', '.join(missing)}); "
                                "make one with `pruner prune RECIPE --out DIR`")
    metrics = json.loads((folder / "metrics.json").read_text())
    bias = None
    if metrics["compensation"] == "mean":
        if not (folder / COMPENSATION_FILE).exists():
            raise FileNotFoundError(f"{folder} has mean compensation but no {COMPENSATION_FILE} (written by "
                                    "`pruner prune` since export exists); re-run `pruner prune` on its recipe.yaml")
        bias = load_compensation(folder / COMPENSATION_FILE)
    return Run(folder, load_recipe(folder / "recipe.yaml"), json.loads((folder / "plan.json").read_text()),
               metrics, bias)


def rebuild(run: Run, fmt: str):
    """The pruned model in `fmt` (and its tokenizer): base + plan heads + folded biases."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    model = models.load_base(run.recipe.model)
    tokenizer = models.load_tokenizer(run.recipe.model.path, trust_remote_code=run.recipe.model.trust_remote_code)
    heads = provenance.check_fits(run.folder, run.plan, run.bias, model)  # an edited plan that no longer fits
    (surgery.remove_heads if fmt == "compact" else surgery.mask_heads)(model, heads, run.bias)
    return model, tokenizer


def inexpressible(model, removed: bool) -> str | None:
    """Why a vanilla config cannot describe this pruned model, or None when it can."""
    if getattr(model, "_pruner_bias_not_in_config", False):
        return (f"its output projection needs a bias (mean compensation) that the {model.config.model_type} "
                "config cannot declare")
    if not removed:
        return None
    if getattr(model.config, "head_dim", None) is None:
        return (f"the {model.config.model_type} config has no explicit head_dim (it is hidden_size / heads), "
                "so it cannot describe fewer heads of the same width")
    counts = {len(v) for v in surgery.kept_heads(model).values()}
    if len(counts) != 1:
        return f"its head counts differ between layers ({_head_counts(model)})"
    try:  # transformers validates configs on save (e.g. hidden_size % num_attention_heads)
        type(model.config).from_dict(model.config.to_dict())
    except Exception as e:  # noqa: BLE001 - any validation failure means "not expressible"
        return f"transformers rejects its config: {str(e).splitlines()[-1].strip().rstrip('.')}"
    return None


def _head_counts(model) -> str:
    return ", ".join(f"layer {k}: {len(v)}" for k, v in surgery.kept_heads(model).items())


def check_exportable(model, fmt: str) -> None:
    """Refuse, with what to do instead, a model no vanilla checkpoint of `fmt` can hold."""
    reason = inexpressible(model, fmt == "compact")
    if reason is None:
        return
    if getattr(model, "_pruner_bias_not_in_config", False):
        raise ExportError(f"cannot export this model in any format: {reason}; re-run `pruner prune` with "
                          "`--set surgery.compensation=zero` to export it without compensation")
    hint = (" (a compact one needs `selection.budget: layer` and a head count the config accepts)"
            if getattr(model.config, "head_dim", None) is not None else "")
    raise ExportError(f"cannot write a compact checkpoint: {reason}. Use the dense form instead "
                      "(`pruner export RUN_DIR --format dense`, or `surgery.mode: mask`): pruned heads zeroed, "
                      f"original shapes, loads anywhere{hint}")


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = models.forward(model, input_ids, torch.ones_like(input_ids))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float().cpu()


def reload_diff(model, folder: Path) -> float:
    """Max |logit difference| between `model` and `folder` reloaded with the vanilla Auto class."""
    device = next(model.parameters()).device
    ids = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    kw = {"device_map": model.hf_device_map} if getattr(model, "hf_device_map", None) else {}
    reloaded = models.auto_class(model.config).from_pretrained(folder, dtype=next(model.parameters()).dtype,
                                                               trust_remote_code=False, **kw)
    if not kw:
        reloaded = reloaded.to(device)
    reloaded.eval()
    ids = ids.to(device)
    return (_logits(reloaded, ids) - _logits(model, ids)).abs().max().item()


def save_checkpoint(model, tokenizer, folder: Path, removed: bool) -> float:
    """Write a vanilla checkpoint (model + tokenizer) and prove it reloads; returns the max logit diff.

    Raises ExportError when no vanilla config describes the model or the reload
    does not reproduce its logits (atol 1e-5). `pruner prune` saves its model/
    through here too.
    """
    check_exportable(model, "compact" if removed else "dense")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    diff = reload_diff(model, folder)
    if not diff <= ATOL:
        raise ExportError(f"the written checkpoint reloads with logits off by {diff:.2e} (more than {ATOL:g}); "
                          "nothing was published")
    return diff


@dataclass(frozen=True)
class Exported:
    folder: Path
    format: str
    params: int
    bytes: int          # weights files on disk
    max_diff: float     # max |logit difference| after the vanilla reload


def write_export(run: Run, fmt: str, out: Path, overwrite: bool = False, repo_id: str | None = None) -> Exported:
    """Rebuild, check, write to a temporary folder, reload-verify, add card + plan.json, rename to `out`."""
    out = Path(out)
    with report.atomic_dir(out, overwrite) as tmp:  # an existing `out` is refused before the rebuild
        model, tokenizer = rebuild(run, fmt)
        diff = save_checkpoint(model, tokenizer, tmp, removed=fmt == "compact")  # refuses before writing
        shutil.copyfile(run.folder / "plan.json", tmp / "plan.json")
        params = sum(p.numel() for p in model.parameters())
        model_card(run, fmt, model, params, repo_id).save(tmp / "README.md")
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    return Exported(out, fmt, params, size, diff)


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
               private: bool = False, allow_changed_base: bool = False) -> tuple[Exported, str | None]:
    """`pruner export`: write the export, then push it when `repo_id` is given. Returns (export, url).

    A base model that is not the one the run was made from (provenance.json) is
    refused unless `allow_changed_base`, which the model card then records.
    """
    if repo_id:
        check_repo_id(repo_id)
    run = load_run(run_dir)
    note = provenance.check_base(run.folder, run.recipe.model, allow_changed_base)
    run = dataclasses.replace(run, base_note=note)
    done = write_export(run, fmt, out, overwrite, repo_id)
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


def model_card(run: Run, fmt: str, model, params: int, repo_id: str | None = None):
    """A huggingface_hub ModelCard: YAML metadata, what was pruned and how, results, recipe, loading."""
    from huggingface_hub import ModelCard, ModelCardData

    m, r = run.metrics, run.recipe
    base = _hub_base(r.model.path)
    data = ModelCardData(base_model=base, library_name="transformers", pipeline_tag=_pipeline_tag(model.config),
                         tags=["pruned", "attention-head-pruning", "pruner", model.config.model_type])
    where = repo_id or "path/to/this/folder"
    cls = models.auto_class(model.config).__name__
    base_text = f"[`{base}`](https://huggingface.co/{base})" if base else \
        f"`{r.model.path}` (pruner's shipped checkpoint, not on the Hub)" if r.model.path in assets.CHECKPOINTS \
        else f"`{r.model.path}`"
    conv = f", {report.convention_phrase(m)}" if m["convention"] else ""
    fmt_text = {
        "dense": "**dense**: the pruned heads' output-projection columns are zero and every shape is the "
                 "base model's, so it loads wherever the base loads (no memory or speed gain by itself).",
        "compact": "**compact**: the pruned heads are physically removed (q/k/v rows and output-projection "
                   f"columns); the config says {model.config.num_attention_heads} attention heads"
                   + (f" over {model.config.num_key_value_heads} key/value heads"
                      if getattr(model.config, "num_key_value_heads", None) else "") + " per layer.",
    }[fmt]
    comp_text = ("`mean`: each pruned head's mean output over the calibration tokens is folded into the "
                 "output-projection bias (kept in this checkpoint"
                 + (", through `attention_bias: true`, which adds zero q/k/v biases" if
                    getattr(model.config, "attention_bias", False) else "") + ")"
                 if m["compensation"] == "mean" else "`zero`: pruned heads are simply removed")
    g = arch.geometry(model)
    per_layer = ", ".join(f"{k}: {v}" for k, v in run.plan["heads"].items())
    cal = r.calibration
    lines = [
        f"# {r.model.path}, {m['pruned_heads']} of {m['total_heads']} attention heads pruned ({fmt})", "",
        f"Attention heads of {base_text} pruned with pruner (sink-aware attention-head pruning: heads "
        "are scored with the attention sink and the content channel separated).", "",
        "## What was pruned and how", "",
        f"- scorer: `{m['scorer']}`{conv}; target `{r.selection.target:g}` "
        f"({r.selection.budget} budget, GQA `{r.selection.gqa}`, >= {r.selection.min_heads_per_layer} head per layer)",
        f"- pruned: {m['pruned_heads']} of {m['total_heads']} heads ({g.n_layers} layers x {g.n_heads} heads); "
        f"per layer: {per_layer} (full list in `plan.json`)",
        f"- compensation: {comp_text}",
        f"- format: {fmt_text}",
        f"- parameters: {m['params_before']:,} (base) -> {params:,} (this checkpoint)",
        f"- calibration: {cal.num_samples} {cal.unit} of {cal.length} tokens from `{cal.data}`; "
        f"sinks `{m['sinks']['mode']}`", "",
    ]
    sens = report.sensitivity_text(m)
    if sens:
        lines += [sens, ""]
    if run.base_note:
        lines += [f"**Base model check.** {run.base_note}", ""]
    e = r.evaluation
    lines += [
        "## Results", "",
        f"Perplexity on {e.num_samples} {e.unit} of `{e.data}` ({e.length} tokens), paired with the unpruned "
        "model on the same windows; 95% bootstrap CI over windows. Measured with the pruned heads masked in "
        "memory; both export formats reproduce those logits (checked on reload to 1e-5).", "",
        report.result_table(m, params), "",
        "## How to load", "",
        "```python",
        f"from transformers import {cls}, AutoTokenizer",
        "",
        f'model = {cls}.from_pretrained("{where}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
        "```", "",
        "Plain transformers: no pruner code is needed to load or run it.", "",
        "## Recipe", "",
        "The resolved pruner recipe of the run:", "",
        "```yaml", r.to_yaml().rstrip(), "```", "",
        "## Pruned heads", "", report.plan_table(run.plan), "",
    ]
    return ModelCard(redact(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))
