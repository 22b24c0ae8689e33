"""A run folder: what `pruner prune` writes, so that `export`, `evaluate` and people can read it back.

    RUN/model/                       the pruned model (dense, vanilla or per-layer compact; reload-checked)
    RUN/plan.json                    the heads, in selection order, with their scores and twins
    RUN/metrics.json                 perplexity change, parameters, latency, convention sensitivity
    RUN/recipe.yaml                  the resolved recipe
    RUN/report.md                    the same for a person
    RUN/compensation.safetensors     the compensation: folded biases `layer.<i>`, refitted weight deltas
                                     `layer.<i>.weight` (not with `zero`)
    RUN/refit.png                    with `refit`: per layer, the pruned heads' energy and what the refit left
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pruner import export, report


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
