"""Export: a pruning run as a shareable checkpoint (dense or compact) with its model card, and the push.

The pruned model is rebuilt from the run folder alone -- the base model that
`recipe.yaml` names, the heads of `plan.json`, the compensation of
`compensation.safetensors` (folded biases `layer.<i>`, refitted weight deltas
`layer.<i>.weight`) -- with the surgery functions `prune` itself uses, so
either format is exact whatever surgery the run chose:

- `dense`   -- `surgery.mask_heads`: the pruned heads' output-projection columns
               are zero, every shape is kept; loads anywhere the base loads.
- `compact` -- `surgery.remove_heads`: physically smaller, in the best form that
               holds it (pruner.checkpoints.layout): a vanilla checkpoint when the family's own
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
reload holds a second copy of the model in memory for that moment -- unless the
recipe reads the base a block at a time (`capture.onload: sequential`): then dense
and compact exports are written and checked a block at a time
(`pruner.checkpoints.streamed`).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pruner.checkpoints import gguf_file, layout, llamacpp, loading, onnx, saving, storage, streamed
from pruner.checkpoints.lazy import lazy_model
from pruner.core import distributed, outputs, runtime
from pruner.core.redact import redact
from pruner.pruning import surgery
from pruner.runs import provenance
from pruner.runs.card import model_card
from pruner.runs.context import evaluation_windows, sequential_folder
from pruner.runs.folders import Run, load_run, recipe_storage_dtype, save_checkpoint

FORMATS = ("dense", "compact", "onnx", "gguf")
QUANT_WINDOWS = 16  # evaluation windows a quantized GGUF is scored on, next to the float one
ATOL = saving.ATOL
ExportError = storage.CheckpointError  # a checkpoint that cannot be written (or would not reload)


class PushError(OSError):
    """The push failed; the local export is intact."""


def rebuild(run: Run, fmt: str):
    """The pruned model in `fmt` (and its tokenizer): base + plan heads + compensation (`onnx`, `gguf`: the
    compact one)."""
    fmt = "compact" if fmt in ("onnx", "gguf") else fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    if recovered(run):  # distilled weights: model/ itself, not base + plan
        return _recovered_model(run, fmt)
    model = loading.load_base(run.recipe.model)
    tokenizer = loading.load_tokenizer(run.recipe.model.path, trust_remote_code=run.recipe.model.trust_remote_code)
    heads = provenance.check_fits(run.folder, run.plan, run.compensation, model)  # an edited plan that no longer fits
    (surgery.remove_heads if fmt == "compact" else surgery.mask_heads)(model, heads, run.compensation)
    return model, tokenizer


def recovered(run: Run) -> bool:
    """Whether the run's model/ holds recovered (distilled) weights, which base + plan cannot rebuild."""
    return (run.metrics.get("recovery") or {}).get("kept") == "recovered"


def _recovered_model(run: Run, fmt: str):
    """A recovered run's model/ in `fmt`: a dense model/ gives the compact form by slicing its zero head columns
    out; a compact model/ has no dense form (its heads are gone)."""
    folder = run.folder / "model"
    if fmt == "dense" and run.metrics["surgery"] == "remove":
        raise ExportError(f"{run.folder} holds recovered compact weights (model/); they have no dense form: "
                          "export --format compact")
    model = loading.load(folder).float().eval()
    if fmt == "compact" and run.metrics["surgery"] == "mask":
        surgery.remove_heads(model, run.heads, surgery.Compensation())
    return model, loading.load_tokenizer(str(folder))


def storage_dtype(run: Run, dtype: str | None = None) -> str | None:
    """The dtype an export of `run` stores (see recipe_storage_dtype)."""
    return recipe_storage_dtype(run.recipe, dtype)


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
    note: str | None = None          # vanilla as another family's class (a Llama as MistralForCausalLM): why
    quantized: Quantized | None = None  # gguf --quantize: the quantized file beside model.gguf


@dataclass(frozen=True)
class Quantized:
    """A quantized GGUF beside the float one it came from, both scored in llama.cpp on the same windows."""

    name: str                        # llama.cpp's type: q4_k_m, q8_0, ...
    file: str                        # model-<name>.gguf
    bytes: int
    windows: int                     # perplexity windows of the run's evaluation text (0: none scored)
    perplexity: float | None         # the quantized file's
    float_perplexity: float | None   # model.gguf's, on the same windows
    top1_agreement: float | None     # share of scored positions where both files' argmax is the same token


def write_export(run: Run, fmt: str, out: Path, overwrite: bool = False, repo_id: str | None = None,
                 dtype: str | None = None, quantize: str | None = None) -> Exported:
    """Rebuild, check, write to a temporary folder, reload-verify, add card + plan.json, rename to `out`
    (`quantize`, gguf only: also a llama.cpp-quantized file of that type)."""
    out = Path(out)
    if quantize is not None:  # an unknown type, or no quantizer, fails before anything is rebuilt
        why = "--quantize applies only with --format gguf" if fmt != "gguf" else llamacpp.quant_refusal(quantize)
        if why:
            raise ExportError(why)
    if fmt == "onnx":
        onnx.require()  # a missing extra fails before anything is rebuilt
    if fmt == "gguf":  # a missing extra, or a family llama.cpp cannot take, fails before anything is rebuilt
        gguf_file.require()
        m = run.recipe.model
        config = {"model_type": "bert"} if m.mlm_readout else loading.read_config(m.path)
        counts = {len(run.heads.get(i, [])) for i in range(config.get("num_hidden_layers") or len(run.heads))}
        why = gguf_file.family_refusal(config["model_type"], len(counts) == 1)
        if why:
            raise ExportError(f"cannot write a GGUF: {why}")
    folder = sequential_folder(run.recipe) if fmt in ("dense", "compact") else None
    with outputs.atomic_dir(out, overwrite) as tmp:  # an existing `out` is refused before the rebuild
        if folder is not None:  # the recipe reads the base a block at a time: so does the export
            return write_streamed(run, fmt, folder, tmp, out, repo_id, dtype)
        model, tokenizer = rebuild(run, fmt)
        if fmt == "onnx":
            return write_onnx(run, model, tokenizer, tmp, out, repo_id, dtype if dtype in onnx.PRECISIONS else "float32")
        if fmt == "gguf":
            return write_gguf(run, model, tokenizer, tmp, out, repo_id, storage_dtype(run, dtype), quantize)
        saved = save_checkpoint(model, tokenizer, tmp, fmt == "compact", storage_dtype(run, dtype))
        return _with_card(run, fmt, model, saved, tmp, out, repo_id)


def _with_card(run: Run, fmt: str, model, saved: saving.Saved, tmp: Path, out: Path,
               repo_id: str | None) -> Exported:
    """plan.json and the model card beside a written checkpoint; what was exported. `model`: the pruned model
    (its shapes; layer by layer its blocks are on the meta device)."""
    shutil.copyfile(run.folder / "plan.json", tmp / "plan.json")
    params = sum(p.numel() for p in model.parameters())
    model_card(run, fmt, model, params, repo_id, saved).save(tmp / "README.md")
    size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
    return Exported(out, fmt, params, size, saved.max_diff, saved.layout, saved.dtype, saved.storage_diff,
                    saved.why_per_layer, saved.generation, saved.note)


def write_streamed(run: Run, fmt: str, folder: Path, tmp: Path, out: Path, repo_id: str | None,
                   dtype: str | None) -> Exported:
    """`fmt` (dense or compact) written block by block from the base checkpoint in `folder`, never whole in
    memory (`pruner.checkpoints.streamed`), with its card and plan.json."""
    m = run.recipe.model
    lazy = lazy_model(folder, m.dtype, distributed.local_device(m.device))
    tokenizer = loading.load_tokenizer(m.path, trust_remote_code=m.trust_remote_code)
    heads = provenance.check_fits(run.folder, run.plan, run.compensation, lazy.model)
    saved = streamed.save_streamed(lazy, tokenizer, tmp, heads, run.compensation, fmt == "compact",
                                   streamed.StreamedWrite(storage_dtype(run, dtype), progress=True, label="the export"))
    return _with_card(run, fmt, lazy.model, saved, tmp, out, repo_id)


def write_onnx(run: Run, model, tokenizer, tmp: Path, out: Path, repo_id: str | None, dtype: str) -> Exported:
    """The compact model as a vanilla checkpoint (it must be one), through the GenAI builder into `tmp`, checked
    by its generator against transformers on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    kind, why = layout.layout(model, removed=True)
    if kind != "vanilla" or not runtime.attends_causally(model):
        reason = why or "ONNX Runtime GenAI runs causal language models"
        raise ExportError(f"ONNX export needs a vanilla compact causal LM, and this run's is not: {reason}. Prune "
                          "with selection.shape: servable (the default for Llama, Mistral, Qwen2 and Qwen3) at a "
                          "servable target, or export --format compact for pruner.load / transformers")
    with tempfile.TemporaryDirectory(prefix="pruner-onnx-") as hf:
        saved = save_checkpoint(model, tokenizer, Path(hf), True, "float32")
        onnx.build(Path(hf), tmp, dtype)
        reference = AutoModelForCausalLM.from_pretrained(hf, dtype=getattr(torch, dtype)).eval()
        onnx.check(tmp, reference)
    shutil.copyfile(run.folder / "plan.json", tmp / "plan.json")
    params = sum(p.numel() for p in model.parameters())
    saved = dataclasses.replace(saved, layout="onnx", dtype=dtype, generation=True)
    model_card(run, "onnx", model, params, repo_id, saved).save(tmp / "README.md")
    size = sum(f.stat().st_size for f in tmp.iterdir() if f.name.startswith("model.onnx"))
    return Exported(out, "onnx", params, size, 0.0, "onnx", dtype, 0.0, None, True)


def write_gguf(run: Run, model, tokenizer, tmp: Path, out: Path, repo_id: str | None, dtype: str,
               quantize: str | None = None) -> Exported:
    """The compact model as one GGUF file for llama.cpp (`llama` when every layer keeps the same heads, `deci`
    otherwise, `gemma3` for Gemma 3), its structure read back, and -- with llama-cpp-python installed -- its
    greedy generation in llama.cpp checked against PyTorch's on a float32 GGUF of the same model. `quantize`:
    model.gguf quantized by llama.cpp into model-<type>.gguf beside it (in the temporary folder, so a failure
    leaves nothing), both scored in llama.cpp on the run's evaluation windows."""
    model = model.float().eval()  # the check compares float32 with float32
    gplan = gguf_file.plan(model, tokenizer)  # refused in one line before anything is written
    path = tmp / "model.gguf"
    gguf_file.write(model, tokenizer, path, dtype, gplan)
    gguf_file.check_structure(path, model, gplan, dtype)
    proved = None
    if llamacpp.available():
        with tempfile.TemporaryDirectory(prefix="pruner-gguf-") as twin:
            checked = path if dtype == "float32" else Path(twin) / "model-float32.gguf"
            if checked != path:
                gguf_file.write(model, tokenizer, checked, "float32", gplan)
            llamacpp.check(checked, model)
        proved = True
    shutil.copyfile(run.folder / "plan.json", tmp / "plan.json")
    params = sum(p.numel() for p in model.parameters())
    note = gguf_file.tokenizer_note(gplan.pre, gplan.family)
    saved = saving.Saved("gguf", None, dtype, 0.0, 0.0, proved, ("llama.cpp",) if proved else (), note)
    quantized = quantized_beside(run, model, tokenizer, path, quantize) if quantize else None
    model_card(run, "gguf", model, params, repo_id, saved, gplan).save(tmp / "README.md")
    return Exported(out, "gguf", params, path.stat().st_size, 0.0, f"gguf-{gplan.arch}", dtype, 0.0, None, proved,
                    note, quantized)


def quantized_beside(run: Run, model, tokenizer, path: Path, qtype: str, windows: int = QUANT_WINDOWS) -> Quantized:
    """`path` quantized to `qtype` by llama.cpp as model-<qtype>.gguf beside it; both files' perplexity and their
    top-1 agreement on the first `windows` windows of the run's evaluation text (llama.cpp on both)."""
    dst = path.with_name(f"model-{qtype}.gguf")
    llamacpp.quantize(path, dst, qtype)
    ev = evaluation_windows(run.recipe, model, tokenizer, causal=True)
    ids, labels = ev.input_ids[:windows], ev.labels[:windows]  # (window, q_pos)
    nll_f, count, top_f = llamacpp.window_scores(path, ids, labels)
    nll_q, _, top_q = llamacpp.window_scores(dst, ids, labels)
    if not count:
        return Quantized(qtype, dst.name, dst.stat().st_size, 0, None, None, None)
    return Quantized(qtype, dst.name, dst.stat().st_size, len(ids), math.exp(nll_q / count), math.exp(nll_f / count),
                     float((top_f == top_q).float().mean()))


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


@dataclass(frozen=True)
class Hub:
    """Where `export_run` pushes the export on the Hugging Face Hub (no `repo_id`: nowhere)."""

    repo_id: str | None = None  # NAMESPACE/NAME
    private: bool = False       # a private repository when it is created


def export_run(run_dir: Path, fmt: str, out: Path, overwrite: bool = False, hub: Hub = Hub(),
               allow_changed_base: bool = False, dtype: str | None = None,
               quantize: str | None = None) -> tuple[Exported, str | None]:
    """`pruner export`: write the export, then push it when `hub.repo_id` is given. Returns (export, url).

    A base model that is not the one the run was made from (provenance.json) is
    refused unless `allow_changed_base`, which the model card then records. `dtype`
    overrides the recipe's `export.dtype` (storage dtype; auto = the base checkpoint's own).
    """
    repo_id, private = hub.repo_id, hub.private
    if repo_id:
        check_repo_id(repo_id)
    run = load_run(run_dir)
    note = provenance.check_base(run.folder, run.recipe.model, allow_changed_base)
    run = dataclasses.replace(run, base_note=note)
    done = write_export(run, fmt, out, overwrite, repo_id, dtype, quantize)
    url = push(done.folder, repo_id, private, commit_message(run, fmt)) if repo_id else None
    return done, url
