"""`pruner compare`: every scorer x sparsity x compensation (x budget x GQA mode) on one calibration pass and the
same evaluation windows, each plan evaluated under a scoped mask."""

from __future__ import annotations

from tqdm.auto import tqdm

from pruner.core import arch, distributed
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import get_scorer
from pruner.pruning.selection import SelectionError, curve_key, select, shape_note
from pruner.runs import compensating
from pruner.runs.context import Session, resident
from pruner.runs.pipeline import (
    base_metrics,
    check_refit_tokens,
    evaluate_plan,
    root_keeps,
    scoring_inputs,
    selection_config,
    stage,
)


def compare(session: Session, scorers: list[str], sparsities: list[float], compensations: list[str],
            budgets: list[str] | None = None, gqa_modes: list[str] | None = None,
            progress: bool = True) -> list[dict]:
    """Every scorer x sparsity x budget x GQA mode x compensation on the same windows; one calibration pass, whose
    curves for every scorer, budget and GQA mode compared are built as its layers finish. One-shot refits whose
    calibration dropped its joint moments (layer by layer) share one more pass over the blocks."""
    for name in scorers:
        get_scorer(name)
    recipe = session.recipe
    budgets = budgets or [recipe.selection.budget]
    gqa_modes = gqa_modes or [recipe.selection.gqa]
    if "refit" in compensations:
        check_refit_tokens(session)
    geom = arch.geometry(session.model)
    configs = _configs(session, scorers, sparsities, budgets, gqa_modes)
    keys = tuple(dict.fromkeys(curve_key(get_scorer(n), geom, c) for (n, *_), c in configs.items()
                               if not isinstance(c, SelectionError)))
    inputs = scoring_inputs(session, [get_scorer(s) for s in scorers], CurveRequest(keys), compensations,
                            progress=progress)
    only_root = root_keeps(session)  # decided before `resident` loads the whole model for the tasks
    if session.downstream:  # tasks run the whole model; perplexity runs block by block when the blocks are on disk
        resident(session)
    base = base_metrics(session, progress)
    plans = _plans(configs, inputs, geom, only_root)
    made = [plan.heads for _, plan, _ in plans if not isinstance(plan, SelectionError)]
    refit = recipe.surgery.model_copy(update={"compensation": "refit"})
    passed = iter(compensating.oneshot_refits(session, made, refit)) \
        if "refit" in compensations and made and compensating.needs_pass(inputs, None, refit) else None
    records = []
    for key, plan, cfg in (tqdm(plans, desc="compare", unit="plan") if progress else plans):
        if isinstance(plan, SelectionError):
            records += [{**key, "compensation": c, "error": str(plan)} for c in compensations]
            continue
        refitted = None if passed is None else next(passed)
        for kind in compensations:  # each finished evaluation is a stage: a resumed compare does what is left
            spec = recipe.surgery.model_copy(update={"compensation": kind})
            comp = refitted if kind == "refit" and refitted is not None else \
                compensating.shared_compensation(session, plan.heads, spec, inputs)  # recomputed on resume
            m = stage(session, f"compare-{len(records)}",
                      lambda comp=comp, plan=plan: evaluate_plan(session, plan.heads, comp, base))
            fit = compensating.refit_record(comp, spec, inputs)
            records.append(_record({**key, "compensation": kind}, plan, shape_note(geom, cfg), m, inputs, fit))
    return records


def _configs(session: Session, scorers: list[str], sparsities: list[float], budgets: list[str],
             gqa_modes: list[str]) -> dict:
    """{(scorer, target, budget, GQA mode): its selection config, or the SelectionError saying why there is none},
    in job order."""
    jobs = [(s, p, b, g) for s in scorers for p in sparsities for b in budgets for g in gqa_modes]
    configs = {}
    for name, target, budget, gqa in jobs:
        try:
            configs[(name, target, budget, gqa)] = selection_config(session.recipe, session.model, target, budget,
                                                                    gqa)
        except SelectionError as e:  # said in the job's records below
            configs[(name, target, budget, gqa)] = e
    return configs


def _record(key: dict, plan, note: str | None, metrics: dict, inputs, fit: dict | None) -> dict:
    """One compared plan's record (`key`: its job and compensation), in the order of the keys written before."""
    return {**key, "pruned_heads": len(plan.entries), **({"note": note} if note else {}),
            "heads": {str(k): v for k, v in plan.heads.items()}, **metrics,
            **({"scorer_cost": inputs.costs[key["scorer"]]}
               if inputs is not None and key["scorer"] in inputs.costs else {}),
            **({} if fit is None else {"unexplained": fit["unexplained"], "unexplained_relative": fit["relative"]})}


def _plans(configs: dict, inputs, geom, only_root: bool) -> list[tuple[dict, object, object]]:
    """(record key, plan or the reason there is none, selection config) for every job, in job order; layer by
    layer with several processes rank 0 alone has the sums and selects."""
    plans = []
    for (name, target, budget, gqa), cfg in configs.items():
        key = {"scorer": name, "sparsity": target, "budget": budget, "gqa": gqa}
        scorer = get_scorer(name)
        try:
            if isinstance(cfg, SelectionError):
                raise cfg
            key["budget"] = cfg.budget
            plan = distributed.from_root(lambda: select(scorer, inputs, geom, cfg)) if only_root else \
                select(scorer, inputs, geom, cfg)
        except SelectionError as e:  # e.g. a per-layer budget too small for a GQA unit
            plan = e
        plans.append((key, plan, cfg))
    return plans
