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
import shutil
from pathlib import Path
from typing import Iterator

from pruner import distributed, export, provenance, report, resume


def save_model(result, folder: Path) -> None:
    """Save the pruned model (dense for `mask`, compact for `remove`: vanilla where the family's config can say
    it, else per-layer) in the recipe's storage dtype, reload-checked; or say why not."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        saved = export.save_checkpoint(result.model, result.tokenizer, folder,
                                       removed=result.metrics["surgery"] == "remove",
                                       dtype=export.recipe_storage_dtype(result.recipe))
    except export.ExportError as e:
        for f in folder.iterdir():  # nothing half-written next to the note
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        (folder / "NOT_SAVED.txt").write_text(
            f"This pruned model was not saved as a vanilla transformers checkpoint. {e}\n")
        result.metrics["model_saved"] = False
        result.metrics["model_not_saved_because"] = str(e)
        return
    result.metrics.update(model_saved=True, model_layout=saved.layout, model_dtype=saved.dtype,
                          model_bytes=sum(f.stat().st_size for f in folder.glob("*.safetensors")))


def save_run(result, folder: Path) -> None:
    """Write every file of a run into `folder` (an existing, empty folder: see report.atomic_dir)."""
    from pruner.pipeline import to_jsonable

    save_model(result, folder / "model")
    export.save_compensation(result.compensation, folder / export.COMPENSATION_FILE)
    plan_json = result.plan.to_json()
    (folder / "plan.json").write_text(plan_json + "\n")
    (folder / "metrics.json").write_text(json.dumps(to_jsonable(result.metrics), indent=1) + "\n")
    (folder / "recipe.yaml").write_text(result.recipe.to_yaml())
    figure = "refit.png" if report.plot_refit(result.metrics, folder / "refit.png") else None
    (folder / "report.md").write_text(report.run_report(result.metrics, plan_json, figure))
    if getattr(result, "provenance", None):
        provenance.write(folder, result.provenance)


@contextlib.contextmanager
def run_folder(out: Path, overwrite: bool, resume_run: bool = False) -> Iterator[Path]:
    """`report.atomic_dir` for a run of one or several processes: yields the partial folder.

    The first process owns it (creates, locks, renames it); every process keeps its
    checkpoints in it, and all of them have finished before it is renamed. A refusal
    on entry (an existing output, a live run, checkpoints without --resume) reaches
    every process.
    """
    with contextlib.ExitStack() as stack:
        error = None
        if distributed.is_main():
            try:
                stack.enter_context(report.atomic_dir(out, overwrite, resume_run))
            except (ValueError, OSError) as e:
                error = e
        told = distributed.all_objects(None if error is None else (type(error).__name__, str(error)))[0]
        if error is not None:
            raise error
        if told is not None:
            raise (PermissionError if told[0] == "PermissionError" else ValueError)(told[1])
        yield report.partial_dir(out)
        distributed.all_objects(None)  # every process's checkpoints written before the folder is renamed
        resume.kill_point("save")
