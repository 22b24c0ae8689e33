"""`pruner compare`: every scorer x sparsity x compensation (x budget x GQA mode) on one calibration pass and the
same evaluation windows, each plan evaluated under a scoped mask."""

from __future__ import annotations

from tqdm.auto import tqdm

from pruner.core import arch, distributed
from pruner.pruning.scoring import get_scorer
from pruner.pruning.selection import SelectionError, select, shape_note
from pruner.runs.context import Session, resident
from pruner.runs.pipeline import (
    base_metrics,
    check_refit_tokens,
    evaluate_plan,
    refit_record,
    root_keeps,
    scoring_inputs,
    selection_config,
    shared_compensation,
    stage,
)


def compare(session: Session, scorers: list[str], sparsities: list[float], compensations: list[str],
            budgets: list[str] | None = None, gqa_modes: list[str] | None = None,
            progress: bool = True) -> list[dict]:
    """Every scorer x sparsity x budget x GQA mode x compensation on the same windows; one calibration pass."""
    for name in scorers:
        get_scorer(name)
    recipe = session.recipe
    budgets = budgets or [recipe.selection.budget]
    gqa_modes = gqa_modes or [recipe.selection.gqa]
    if "refit" in compensations:
        check_refit_tokens(session)
    inputs = scoring_inputs(session, gradient=any(get_scorer(s).needs_gradient for s in scorers), progress=progress,
                            ablation=any(get_scorer(s).needs_ablation for s in scorers),
                            systems=any(get_scorer(s).needs_systems for s in scorers))
    only_root = root_keeps(session)  # decided before `resident` loads the whole model for the tasks
    if session.downstream:  # tasks run the whole model; perplexity runs block by block when the blocks are on disk
        resident(session)
    base = base_metrics(session, progress)
    geom = arch.geometry(session.model)
    records = []
    jobs = [(s, p, b, g) for s in scorers for p in sparsities for b in budgets for g in gqa_modes]
    for name, target, budget, gqa in (tqdm(jobs, desc="compare", unit="plan") if progress else jobs):
        scorer = get_scorer(name)
        key = {"scorer": name, "sparsity": target, "budget": budget, "gqa": gqa}
        try:
            cfg = selection_config(recipe, session.model, target, budget, gqa)
            key["budget"] = cfg.budget
            plan = distributed.from_root(lambda: select(scorer, inputs, geom, cfg)) if only_root else \
                select(scorer, inputs, geom, cfg)  # layer by layer, several processes: rank 0 alone has the sums
        except SelectionError as e:  # e.g. a per-layer budget too small for a GQA unit
            records += [{**key, "compensation": c, "error": str(e)} for c in compensations]
            continue
        for kind in compensations:  # each finished evaluation is a stage: a resumed compare does what is left
            spec = recipe.surgery.model_copy(update={"compensation": kind})
            comp = shared_compensation(session, plan.heads, spec, inputs)  # recomputed on resume
            m = stage(session, f"compare-{len(records)}",
                      lambda comp=comp, plan=plan: evaluate_plan(session, plan.heads, comp, base))
            fit = refit_record(comp, spec, inputs)
            records.append({**key, "compensation": kind, "pruned_heads": len(plan.entries),
                            **({"note": note} if (note := shape_note(geom, cfg)) else {}),
                            "heads": {str(k): v for k, v in plan.heads.items()}, **m,
                            **({"scorer_cost": inputs.costs[name]} if inputs is not None and name in inputs.costs
                               else {}),
                            **({} if fit is None else {"unexplained": fit["unexplained"],
                                                       "unexplained_relative": fit["relative"]})})
    return records
