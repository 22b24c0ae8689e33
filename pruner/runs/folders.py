"""A run folder: what `pruner prune` writes, so that `export`, `evaluate` and people can read it back.

    RUN/model/                       the pruned model (dense, vanilla or per-layer compact; reload-checked)
    RUN/plan.json                    the heads, in selection order, with their scores and twins
    RUN/metrics.json                 perplexity change, parameters, latency, convention sensitivity
    RUN/recipe.yaml                  the resolved recipe
    RUN/report.md                    the same for a person
    RUN/compensation.safetensors     the compensation: folded biases `layer.<i>`, refitted weight deltas
                                     `layer.<i>.weight` (not with `zero`)
    RUN/refit.png                    with `refit`: per layer, the pruned heads' energy and what the refit left
    RUN/provenance.json              what it was made from: base model, tokenizer and data identities, versions

While a run is in progress it is written to `.RUN.partial` next to RUN (`run_folder`), where its
checkpoints are kept for `--resume` until it completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from pruner.checkpoints import loading, saving, storage, streamed
from pruner.core import distributed, outputs, resume
from pruner.evaluation.bench import BenchResult, bench, checkpoint_dtype, compact_copy
from pruner.evaluation.timing import BenchConfig
from pruner.pruning import surgery
from pruner.runs import provenance, report
from pruner.runs.recipe import Recipe
from pruner.runs.recipe_io import load_recipe

RUN_FILES = ("recipe.yaml", "plan.json", "metrics.json")
COMPENSATION_FILE = "compensation.safetensors"


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


def recipe_storage_dtype(recipe: Recipe, dtype: str | None = None) -> str | None:
    """The dtype a checkpoint stores: `dtype`, else the recipe's `export.dtype`, where `auto` = the base
    checkpoint's own (None -- the in-memory model's -- when no base checkpoint can be found, e.g. a model
    pruned in memory)."""
    want = dtype or recipe.export.dtype
    return storage.storage_dtype(recipe.model) if want == "auto" else want


def save_checkpoint(model, tokenizer, folder: Path, removed: bool, dtype: str | None = None) -> saving.Saved:
    """Write a checkpoint (model + tokenizer) and prove it reloads; returns what was written and measured.

    `removed`: compact (heads physically removed) rather than dense; the compact layout
    is vanilla where the family's config can describe it, per-layer otherwise.
    `dtype`: storage dtype (None: the model's own). Raises ExportError when no layout
    holds the model or the reload does not reproduce its logits (atol 1e-5) and greedy
    generations. `pruner prune` saves its model/ through here too.
    """
    return saving.save(model, tokenizer, Path(folder), removed, dtype)


def save_model(result, folder: Path) -> None:
    """Save the pruned model (dense for `mask`, compact for `remove`: vanilla where the family's config can say
    it, else per-layer) in the recipe's storage dtype, reload-checked; or say why not."""
    folder.mkdir(parents=True, exist_ok=True)
    removed, dtype = result.metrics["surgery"] == "remove", recipe_storage_dtype(result.recipe)
    try:
        if getattr(result, "onloader", None) is not None:  # layer by layer: pruned block by block as it is written
            saved = streamed.save_streamed(result.onloader, result.tokenizer, folder, result.plan.heads,
                                           result.compensation, removed,
                                           streamed.StreamedWrite(dtype, progress=distributed.is_main()))
        else:
            saved = save_checkpoint(result.model, result.tokenizer, folder, removed=removed, dtype=dtype)
    except storage.CheckpointError as e:
        for f in folder.iterdir():  # nothing half-written next to the note
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        (folder / "NOT_SAVED.txt").write_text(
            f"This pruned model was not saved as a vanilla transformers checkpoint. {e}\n")
        result.metrics["model_saved"] = False
        result.metrics["model_not_saved_because"] = str(e)
        return
    if saved.note or saved.why_per_layer:  # a class change, or why no vanilla config holds it: one line each
        result.metrics["model_note"] = saved.note or f"per-layer because {saved.why_per_layer}"
    result.metrics.update(model_saved=True, model_layout=saved.layout, model_dtype=saved.dtype,
                          model_bytes=sum(f.stat().st_size for f in folder.glob("*.safetensors")))


def save_run(result, folder: Path) -> None:
    """Write every file of a run into `folder` (an existing, empty folder: see outputs.atomic_dir)."""
    save_model(result, folder / "model")
    save_compensation(result.compensation, folder / COMPENSATION_FILE)
    plan_json = result.plan.to_json()
    (folder / "plan.json").write_text(plan_json + "\n")
    (folder / "metrics.json").write_text(report.metrics_json(result.metrics))
    (folder / "recipe.yaml").write_text(result.recipe.to_yaml())
    figure = "refit.png" if report.plot_refit(result.metrics, folder / "refit.png") else None
    (folder / "report.md").write_text(report.run_report(result.metrics, plan_json, figure))
    if getattr(result, "provenance", None):
        provenance.write(folder, result.provenance)


@contextlib.contextmanager
def run_folder(out: Path, overwrite: bool, resume_run: bool = False) -> Iterator[Path]:
    """`outputs.atomic_dir` for a run of one or several processes: yields the partial folder.

    The first process owns it (creates, locks, renames it); every process keeps its
    checkpoints in it, and all of them have finished before it is renamed. A refusal
    on entry (an existing output, a live run, checkpoints without --resume) reaches
    every process.
    """
    with contextlib.ExitStack() as stack:
        error = None
        if distributed.is_main():
            try:
                stack.enter_context(outputs.atomic_dir(out, overwrite, resume_run))
            except (ValueError, OSError) as e:
                error = e
        told = distributed.all_objects(None if error is None else (type(error).__name__, str(error)))[0]
        if error is not None:
            raise error
        if told is not None:
            raise (PermissionError if told[0] == "PermissionError" else ValueError)(told[1])
        yield outputs.partial_dir(out)
        distributed.all_objects(None)  # every process's checkpoints written before the folder is renamed
        resume.kill_point("save")


def bench_run(run_dir: str | Path, cfg: BenchConfig = BenchConfig(), dtype: str | None = None,
              progress: bool = True) -> BenchResult:
    """`pruner bench RUN_DIR`: the run's base model (its recipe) against its plan's compact form.

    `dtype` loads the base in another dtype than the recipe's (e.g. bfloat16 on a CPU with AMX);
    the checkpoint figure stays in the base checkpoint's own dtype.
    """
    run = load_run(Path(run_dir))
    spec = run.recipe.model
    if spec.path == "(in memory)":
        raise ValueError(f"{run_dir} was pruned from a model built in memory: bench needs its base, so call "
                         "pruner.evaluation.bench.bench(base, compact_copy(base, heads)) on the model you hold")
    base = loading.load_base(spec if dtype is None else spec.model_copy(update={"dtype": dtype}))
    if dtype is not None:
        base = base.to(getattr(torch, dtype))  # a no-op unless the loader has its own dtype (the MLM readout)
    pruned = compact_copy(base, run.heads, run.bias)
    return bench(base, pruned, cfg, checkpoint_dtype(run.recipe.model, base), progress)


RUNTIMES = ("pytorch", "onnxruntime-genai", "llama.cpp")


def bench_run_onnx(run_dir: str | Path, cfg: BenchConfig = BenchConfig(), progress: bool = True) -> BenchResult:
    """`pruner bench RUN_DIR --runtime onnxruntime-genai`: the base and the run's compact model, each written as a
    vanilla checkpoint and converted by ONNX Runtime GenAI's builder (float32, CPU), timed in that runtime.

    Lengths and prompts are capped to the model's context; the compact model must be vanilla (a servable shape).
    """
    import dataclasses
    import tempfile

    from pruner.checkpoints import layout, onnx
    from pruner.evaluation import onnx_timing

    onnx.require()
    run = load_run(Path(run_dir))
    if run.recipe.model.path == "(in memory)":
        raise ValueError(f"{run_dir} was pruned from a model built in memory: bench needs its base")
    base = loading.load_base(run.recipe.model.model_copy(update={"dtype": "float32"}))
    pruned = compact_copy(base, run.heads, run.bias)
    kind, why = layout.layout(pruned, removed=True)
    if kind != "vanilla":
        raise ValueError(f"ONNX Runtime GenAI needs a vanilla compact model, and this run's is not: {why}; prune "
                         "with selection.shape: servable at a servable target")
    context = base.config.max_position_embeddings
    cfg = dataclasses.replace(
        cfg, lengths=tuple(sorted({min(T, context - 1) for T in cfg.lengths})),
        decode=tuple(sorted({(b, min(p, context - cfg.new_tokens - 1)) for b, p in cfg.decode})))
    tokenizer = loading.load_tokenizer(run.recipe.model.path, trust_remote_code=run.recipe.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="pruner-bench-onnx-") as tmp:
        folders = {}
        for name, model in (("base", base), ("pruned", pruned)):
            hf = Path(tmp) / f"{name}-hf"
            save_checkpoint(model, tokenizer, hf, name == "pruned", "float32")
            onnx.build(hf, Path(tmp) / name, "float32")
            shutil.rmtree(hf)
            folders[name] = Path(tmp) / name
        load = [round(x, 2) for x in os.getloadavg()]
        runs = onnx_timing.measure(folders, cfg, base.config.vocab_size, progress)
        result = onnx_timing.compare(base, pruned, folders, cfg, runs, itemsize=4)
    result.conditions.update(load_average_before=load, load_average_after=[round(x, 2) for x in os.getloadavg()])
    return result


def bench_run_llamacpp(run_dir: str | Path, cfg: BenchConfig = BenchConfig(), dtype: str | None = None,
                       progress: bool = True) -> BenchResult:
    """`pruner bench RUN_DIR --runtime llama.cpp`: the base and the run's compact model, each written as a GGUF
    (`dtype`, default float16; the compact one `llama` or `deci`), timed in llama.cpp, decode at batch 1.

    Any plan of a Llama or Mistral model: llama.cpp's deci architecture runs layers with different head counts.
    """
    import dataclasses
    import tempfile

    from pruner.checkpoints import gguf_file, llamacpp
    from pruner.evaluation import llamacpp_timing

    gguf_file.require()
    if not llamacpp.available():
        raise ValueError(f"bench --runtime llama.cpp needs llama-cpp-python, which is not installed: {llamacpp.INSTALL}")
    run = load_run(Path(run_dir))
    if run.recipe.model.path == "(in memory)":
        raise ValueError(f"{run_dir} was pruned from a model built in memory: bench needs its base")
    dtype = dtype or "float16"
    base = loading.load_base(run.recipe.model.model_copy(update={"dtype": "float32"}))
    pruned = compact_copy(base, run.heads, run.bias)
    tokenizer = loading.load_tokenizer(run.recipe.model.path, trust_remote_code=run.recipe.model.trust_remote_code)
    plans = {"base": gguf_file.plan(base, tokenizer), "pruned": gguf_file.plan(pruned, tokenizer)}  # refusals first
    if not any(b == 1 for b, _ in cfg.decode):
        raise ValueError("bench --runtime llama.cpp decodes at batch 1: give --decode 1xPROMPT")
    context = base.config.max_position_embeddings
    cfg = dataclasses.replace(
        cfg, lengths=tuple(sorted({min(T, context - 1) for T in cfg.lengths})),
        decode=tuple(sorted({(1, min(p, context - cfg.new_tokens - 1)) for b, p in cfg.decode if b == 1})))
    with tempfile.TemporaryDirectory(prefix="pruner-bench-gguf-") as tmp:
        files = {name: Path(tmp) / f"{name}.gguf" for name in plans}
        for name, model in (("base", base), ("pruned", pruned)):
            gguf_file.write(model, tokenizer, files[name], dtype, plans[name])
        load = [round(x, 2) for x in os.getloadavg()]
        runs = llamacpp_timing.measure(files, cfg, base.config.vocab_size, progress)
        result = llamacpp_timing.compare(base, pruned, files, cfg, runs, itemsize=4 if dtype == "float32" else 2)
    result.conditions.update(dtype=dtype, gguf_arch={k: v.arch for k, v in plans.items()}, load_average_before=load,
                             load_average_after=[round(x, 2) for x in os.getloadavg()])
    return result
