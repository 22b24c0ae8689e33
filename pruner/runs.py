"""A run folder: what `pruner prune` writes, so that `export`, `evaluate` and people can read it back.

    RUN/model/                       the pruned model (vanilla checkpoint; reload-checked) or NOT_SAVED.txt
    RUN/plan.json                    the heads, in selection order, with their scores and twins
    RUN/metrics.json                 perplexity change, parameters, latency, convention sensitivity
    RUN/recipe.yaml                  the resolved recipe
    RUN/report.md                    the same for a person
    RUN/compensation.safetensors     the folded mean-compensation biases (not with `zero`)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pruner import export, report


def save_model(result, folder: Path) -> None:
    """Save the pruned model where vanilla `from_pretrained` can load it (reload-checked), or say why not."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        export.save_checkpoint(result.model, result.tokenizer, folder, removed=result.metrics["surgery"] == "remove")
    except export.ExportError as e:
        for f in folder.iterdir():  # nothing half-written next to the note
            shutil.rmtree(f) if f.is_dir() else f.unlink()
        (folder / "NOT_SAVED.txt").write_text(
            f"This pruned model was not saved as a vanilla transformers checkpoint. {e}\n")
        result.metrics["model_saved"] = False
        result.metrics["model_not_saved_because"] = str(e)
        return
    result.metrics["model_saved"] = True


def save_run(result, folder: Path) -> None:
    """Write every file of a run into `folder` (an existing, empty folder: see report.atomic_dir)."""
    from pruner.pipeline import to_jsonable

    save_model(result, folder / "model")
    export.save_compensation(result.bias, folder / export.COMPENSATION_FILE)
    plan_json = result.plan.to_json()
    (folder / "plan.json").write_text(plan_json + "\n")
    (folder / "metrics.json").write_text(json.dumps(to_jsonable(result.metrics), indent=1) + "\n")
    (folder / "recipe.yaml").write_text(result.recipe.to_yaml())
    (folder / "report.md").write_text(report.run_report(result.metrics, plan_json))
