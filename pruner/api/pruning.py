"""`plan`, `apply`, `prune` and `compare` on a model you hold (or name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pruner.api.arguments import Call, check_choices, resolve_call, sparsity
from pruner.core import arch, outputs
from pruner.pruning import surgery
from pruner.pruning.selection import Plan
from pruner.runs import autochoice, comparison, compensating, folders, pipeline, provenance, recovery_stage, report
from pruner.runs.recipe import Recipe
from pruner.runs.recipe_io import validate_section


def plan(model=None, tokenizer=None, data=None, *, recipe=None, progress: bool = True, **overrides) -> Plan:
    """Calibrate and select: which heads to prune, and why. The model is not changed.

    `data`: calibration texts (a list of strings or a `datasets.Dataset`) or a data
    source (`"shakespeare:calibration"`, a local .txt file or folder, a Hub dataset
    id). The plan carries its calibration, so `apply` can compensate from it.
    """
    call = resolve_call(model, tokenizer, data, recipe, overrides)
    return autochoice.plan(call.session(progress, evaluation=False), progress=progress)


def apply(model, plan: Plan, compensation: str = "refit", mode: str = "mask", ridge: float | str = "auto"):
    """Prune `model` in place as `plan` says and return it.

    `mode`: `mask` zeroes the heads' output-projection columns (every shape kept),
    `remove` slices them out (smaller and faster). `compensation`: `mean` folds each
    pruned head's mean output over the plan's calibration into the output bias,
    `refit` refits the kept heads' output-projection columns to rebuild what the
    pruned ones wrote (ridge least squares, `ridge` relative, or "auto": cross-validated per
    layer over the calibration folds the plan carries; plain weights, no config
    change), `zero` does neither (the only choice for a plan read back from plan.json).
    """
    spec = validate_section("surgery", {"compensation": compensation, "mode": mode, "ridge": ridge})
    if plan.geometry is not None:
        geom = arch.geometry(model)
        if (geom.n_layers, geom.n_heads) != (plan.geometry.n_layers, plan.geometry.n_heads):
            raise ValueError(f"the plan is for {plan.geometry.n_layers} layers x {plan.geometry.n_heads} heads; "
                             f"this model has {geom.n_layers} x {geom.n_heads}")
    comp = compensating.compensation(model, plan.heads, spec, plan.calibration)
    pipeline.apply(model, plan.heads, comp, spec.mode)
    return model


@dataclass
class Result:
    """What `prune` did: the pruned model, its plan, and the metrics `pruner prune` writes to metrics.json."""

    model: Any = field(repr=False)
    tokenizer: Any = field(repr=False)
    plan: Plan
    metrics: dict = field(repr=False)
    recipe: Recipe = field(repr=False)
    compensation: Any = field(default=None, repr=False)  # surgery.Compensation: what the pruned heads left behind
    provenance: dict | None = field(default=None, repr=False)  # provenance.json: what the run was made from
    onloader: Any = field(default=None, repr=False)  # layer by layer (capture.onload: sequential): `model` is the base
    # with its blocks on disk, and `save` prunes them block by block as it writes model/

    @property
    def bias(self):
        """The folded biases {layer: (d_model,)} of the compensation, None when there are none."""
        return None if self.compensation is None else (self.compensation.bias or None)

    def save(self, folder, overwrite: bool = False) -> Path:
        """Write the run folder `pruner prune` writes (model/, plan.json, metrics.json, recipe.yaml, report.md,
        provenance.json)."""
        with outputs.atomic_dir(Path(folder), overwrite) as tmp:
            folders.save_run(self, tmp)
        return Path(folder)

    def __repr__(self) -> str:
        m, e = self.metrics, self.metrics["evaluation"]
        return (f"Result({m['model']}: {m['pruned_heads']}/{m['total_heads']} heads pruned by {m['scorer']}, "
                f"{m['compensation']} compensation, {m['surgery']}; perplexity {e['base']:.2f} -> {e['pruned']:.2f} "
                f"({e['delta']:+.2f} [{e['ci_low']:+.2f}, {e['ci_high']:+.2f}]))")


def prune(model=None, tokenizer=None, data=None, *, recipe=None, eval_data=None, progress: bool = True,
          checkpoint_dir=None, **overrides) -> Result:
    """`pruner prune` for a model object: plan, evaluate (paired with the unpruned model), apply in place.

    With a recipe whose model is read a block at a time (`capture.onload: sequential`, or `auto` on a model
    larger than memory) nothing is pruned in memory: `result.model` is the base with its blocks on disk, and
    `result.save(folder)` prunes them block by block as it writes model/.

    `eval_data`: evaluation texts or source (default: the recipe's, the shipped
    evaluation plays). `checkpoint_dir`: a folder where the calibration sums and
    finished evaluations are saved now and then (the recipe's `checkpoint` section);
    if it already holds those of an interrupted call with the same setup, this call
    continues from them and ends with the same result. Returns a `Result`;
    `result.save(folder)` writes the run folder.
    """
    call = resolve_call(model, tokenizer, data, recipe, overrides, eval_data)
    return _prune(call, progress, checkpoint_dir)


def _prune(call: Call, progress: bool, checkpoint_dir=None) -> Result:
    if call.recipe.recovery.enabled:  # budget, overlap, cache disk: refused before any compute
        recovery_stage.check(call.recipe.recovery, call.recipe.evaluation, checkpoint_dir)
    prov = call.provenance()
    checkpoints = call.checkpoints(checkpoint_dir, "prune", {}, prov)
    session = call.session(progress, checkpoints=checkpoints, whole_model=bool(call.recipe.evaluation.tasks))
    done = autochoice.prune(session, progress)  # session.recipe: call.recipe with its unset compensation resolved
    return Result(done.model, done.tokenizer, done.plan, done.metrics, session.recipe, done.compensation, prov,
                  done.onloader)


@dataclass
class Comparison:
    """Every scorer x sparsity x compensation (x budget x GQA mode) on the same evaluation windows."""

    records: list[dict] = field(repr=False)
    recipe: Recipe = field(repr=False)
    provenance: dict | None = field(default=None, repr=False)

    def table(self) -> str:
        """Markdown: perplexity change [95% CI] per scorer (rows) and sparsity x compensation (columns)."""
        return report.compare_table(self.records)

    def save(self, folder, overwrite: bool = False) -> Path:
        """compare.json, .csv, .md, .png and the resolved recipe."""
        with outputs.atomic_dir(Path(folder), overwrite) as tmp:
            self.write(tmp)
        return Path(folder)

    def write(self, folder: Path) -> str:
        """The files of `save` into an existing folder; returns the table."""
        if self.provenance:
            provenance.write(folder, self.provenance)
        return report.write_compare(self.records, self.recipe, folder)

    def __repr__(self) -> str:
        ok = [r for r in self.records if "error" not in r]
        if not ok:
            return f"Comparison({len(self.records)} plans, none feasible)"
        best = min(ok, key=lambda r: r["delta"])
        return (f"Comparison({len(ok)} plans on {ok[0]['windows']} windows, base perplexity {ok[0]['base']:.2f}; "
                f"smallest change {best['delta']:+.2f}: {best['scorer']} @ {best['sparsity']:g}, "
                f"{best['compensation']})")


COMPENSATIONS = surgery.COMPENSATIONS


def compare(model=None, tokenizer=None, data=None, *, recipe=None, scorers=None, sparsities=(0.1, 0.25, 0.4, 0.5),
            compensations=("zero", "mean", "refit"), budgets=None, gqa=None, eval_data=None, progress: bool = True,
            checkpoint_dir=None, **overrides) -> Comparison:
    """`pruner compare` for a model object: one calibration pass, every combination evaluated with a scoped mask.

    `scorers` default to all registered; `budgets` (`layer`, `global`) and `gqa`
    (`equal`, `group`) default to the recipe's single choice. `checkpoint_dir`: as
    for `prune`; each finished plan's evaluation is kept too, so a resumed compare
    evaluates only what is left.
    """
    call = resolve_call(model, tokenizer, data, recipe, overrides, eval_data)
    return _compare(call, scorers, sparsities, compensations, budgets, gqa, progress, checkpoint_dir)


def _compare(call: Call, scorers, sparsities, compensations, budgets, gqa, progress: bool,
             checkpoint_dir=None) -> Comparison:
    from pruner.pruning.scoring import SCORERS, get_scorer

    scorers = list(scorers or SCORERS)
    for name in scorers:
        if get_scorer(name).unit == "layer" or call.recipe.selection.unit == "layer":
            raise ValueError("compare ranks head scorers (selection.unit: head); the layer scorers run through "
                             "prune with selection.unit: layer (eval.studies.gemma_layers compares them)")
    check_choices("compensation", compensations, COMPENSATIONS)
    check_choices("budget", budgets or (), ("global", "layer"))
    check_choices("gqa", gqa or (), ("equal", "group"))
    targets = [sparsity(t) for t in sparsities]
    prov = call.provenance()
    options = {"scorers": scorers, "sparsities": targets, "compensations": list(compensations),
               "budgets": list(budgets or []), "gqa": list(gqa or [])}
    checkpoints = call.checkpoints(checkpoint_dir, "compare", options, prov)
    session = call.session(progress, checkpoints=checkpoints,  # only tasks need the whole model in memory
                           whole_model=bool(call.recipe.evaluation.tasks))
    records = comparison.compare(session, scorers, targets, list(compensations),
                               list(budgets) if budgets else None, list(gqa) if gqa else None, progress)
    return Comparison(records, session.recipe, prov)  # the recipe as run: its unset compensation resolved
