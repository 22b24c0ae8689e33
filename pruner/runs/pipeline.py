"""The stages in order: prepare -> calibrate -> select -> compensate -> evaluate -> prune. No logic of its own.

A `Session` holds what every stage shares (the model, its tokenizer, the
calibration samples, the evaluation windows), built once from a validated
recipe and, for the Python API, from objects the caller already holds: a model
in memory, a tokenizer, texts. `run` is `pruner prune`, `compare` is
`pruner compare`; `pruner.api` and the command line both call these, so the two
cannot drift.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, replace

from pruner.checkpoints import layout, streamed
from pruner.core import arch, distributed
from pruner.core.layerwise import PassOptions
from pruner.evaluation import bench
from pruner.evaluation.perplexity import BlockwisePass, fidelity, latency_ms, paired_delta, window_scores
from pruner.pruning import refit, surgery
from pruner.pruning.ablation import AblationRequest
from pruner.pruning.calibrate import CalibrationOptions, calibrate
from pruner.pruning.compensation import whole_layer_note
from pruner.pruning.layerwise import LayerwiseScoring, calibrate_layerwise
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import Scorer, ScoringInputs, get_scorer
from pruner.pruning.selection import (
    Plan,
    SelectionConfig,
    SelectionError,
    check_target,
    convention_sensitivity,
    curve_key,
    select,
    shape_note,
)
from pruner.runs import calibration_needs, compensating, layer_plan, recovery_stage, resources
from pruner.runs.context import Session, check_layerwise, resident
from pruner.runs.recipe import Recipe


def scoring_inputs(session: Session, scorers: list[Scorer], request: CurveRequest, kinds: list[str],
                   progress: bool = True) -> ScoringInputs:
    """The calibration pass (capture, the gradient pass and the single-head ablations when a scorer needs
    them), after checking that its estimated peak memory fits (`pruner.runs.resources`), with the curves
    `request` asks for built layer by layer. It accumulates only what a stage will read
    (`calibration_needs.capture_reads`): the joint output moments and the fold moments only for `scorers` and the
    compensation `kinds` that read them. The ablations remove each head with the recipe's compensation
    (surgery.compensation), on scorer.ablation_samples."""
    r = session.recipe
    metrics = tuple(dict.fromkeys(["cosine", *r.capture.metrics]))  # redundancy scorers read cosine
    layerwise = session.onloader is not None
    cfg, sizes = calibration_needs.capture_setup(r, scorers, kinds, tuple(session.calibration.input_ids.shape),
                                                 metrics=metrics, layerwise=layerwise, local=bool(request.local))
    gradient, ablation = sizes.gradient, any(s.needs_ablation for s in scorers)
    if layerwise:  # one block resident at a time
        check_layerwise(session, sizes, any(s.needs_systems for s in scorers))
        return calibrate_layerwise(session.model, session.calibration, session.sinks, session.tokenizer, cfg,
                                   session.onloader, LayerwiseScoring(request, seed=r.selection.seed,
                                                                      ridge=r.surgery.ridge, gradient=gradient,
                                                                      ablation=ablation),
                                   PassOptions(session.onloader.device, r.calibration.batch_size, progress))
    if r.capture.memory_check:
        resources.check_memory(session.model, sizes)
    measured = AblationRequest(measured_compensation(r.surgery.compensation, kinds), r.scorer.ablation_samples,
                               r.scorer.shortlist, tuple(s.name for s in scorers if s.needs_ablation)) \
        if ablation else None
    return calibrate(session.model, session.calibration, session.sinks, session.tokenizer, config=cfg,
                     options=CalibrationOptions(gradient=gradient, batch_size=r.calibration.batch_size,
                                                seed=r.selection.seed, progress=progress, ridge=r.surgery.ridge,
                                                checkpoints=session.checkpoints,
                                                ablation=measured, curves=request))


def measured_compensation(compensation: str, kinds: list[str]) -> str:
    """The compensation a measured scorer removes each head with: the run's, or under `compensation: auto`
    the refit when refit is a candidate (else the first candidate) -- as `auto` itself measures."""
    if compensation != "auto":
        return compensation
    return "refit" if "refit" in kinds else kinds[0]


def stage(session: Session, name: str, compute):
    """`compute()`, saved as stage `name` of a resumable run; a resumed run reads it back instead.

    Only when every process has it: these stages end in a collective (gathered NLLs).
    """
    saved = session.checkpoints.load_all(name)
    if saved is not None:
        return saved["value"]
    value = compute()
    session.checkpoints.finish(name, lambda: {"value": value})
    return value


def check_refit_tokens(session: Session) -> None:
    """Refit needs at least as many calibration tokens as each layer has output-projection channels (an error,
    before any calibration compute), and should have `refit.TOKENS_PER_CHANNEL` times as many (a warning)."""
    g = arch.geometry(session.model)
    tokens = int(session.calibration.attention_mask.sum())
    refit.check_tokens(tokens, g.n_heads * g.head_dim, 0)
    advice = refit.token_advice(tokens, g.n_heads * g.head_dim)
    if advice:
        warnings.warn(advice, stacklevel=2)


def selection_config(recipe: Recipe, model=None, target: float | None = None, budget: str | None = None,
                     gqa: str | None = None) -> SelectionConfig:
    """The recipe's selection (with compare's target, budget and GQA mode), and with `selection.shape:
    servable` on a family whose vanilla config can describe a pruned model, the per-layer counts it holds."""
    s = recipe.selection
    gqa = gqa or s.gqa
    shapes = layout.servable_prunes(model, gqa) if model is not None and s.shape == "servable" else None
    budget = budget or s.budget
    if shapes is not None and budget == "global":
        raise SelectionError(f"selection.budget: global lets layers keep different head counts, which no vanilla "
                             f"{model.config.model_type} config holds; set selection.shape: any (the per-layer form, "
                             "which llama.cpp runs for Llama and Mistral: export --format gguf) "
                             "or leave the budget to the servable shape (the same count in every layer)")
    return SelectionConfig(target=s.target if target is None else target,
                           budget=budget or ("layer" if shapes is not None else "global"),
                           min_heads_per_layer=s.min_heads_per_layer, gqa=gqa, shapes=shapes)


def make_plan(session: Session, inputs: ScoringInputs | None = None, progress: bool = True) -> Plan:
    """Calibrate (unless `inputs` are given) and select the heads the recipe asks for; nothing is changed.

    The plan carries its calibration (for compensation) and its convention
    sensitivity: for a redundancy scorer, how many selected heads change under the
    other convention; for any other scorer, the same figure for the naive cosine
    plan at the same target, labelled as such (their curves read only the cosine pair matrices, which every
    calibration keeps). Layer by layer, a per-layer budget's refit is computed as each layer finishes.
    """
    recipe = session.recipe
    if recipe.selection.unit == "layer":  # whole attention layers: the same stages, a plan of their heads
        return layer_plan.make(session, inputs, progress)
    scorer = get_scorer(recipe.scorer.name)
    geom = arch.geometry(session.model)
    cfg = selection_config(recipe, session.model)
    _, quota = check_target(geom, cfg)  # an impossible target fails before any calibration compute
    if inputs is None:
        key = curve_key(scorer, geom, cfg, recipe.scorer.convention)
        local = calibration_needs.local_compensation(quota, key, recipe.surgery, session.onloader is not None)
        inputs = scoring_inputs(session, [scorer], CurveRequest((key,), local), [recipe.surgery.compensation],
                                progress=progress)

    def choose() -> Plan:
        plan = select(scorer, inputs, geom, cfg, convention=recipe.scorer.convention)
        sens = convention_sensitivity(scorer, inputs, geom, cfg, plan)
        if sens is None:  # not an attention-redundancy scorer: show how fragile the naive one is here
            naive = get_scorer("cosine")
            sens = convention_sensitivity(naive, inputs, geom, cfg, select(naive, inputs, geom, cfg))
        inputs.release()  # the refit-aware scorer's systems: kept while it selected, read by nothing after
        return replace(plan, geometry=geom, sensitivity=sens, sink_mass=inputs.stats.sink_mass,
                       note=shape_note(geom, cfg))
    if not root_keeps(session):
        return replace(choose(), calibration=inputs)
    plan = distributed.from_root(choose)  # rank 0 alone holds the sums: it selects, the others receive
    return replace(plan, calibration=inputs if distributed.is_main() else None)


def root_keeps(session: Session) -> bool:
    """Whether only rank 0 keeps the calibration's sums (several processes, layer by layer): it then selects
    and compensates alone, and hands the others the plan and the compensation."""
    return session.onloader is not None and distributed.world_size() > 1


def _block_scope(session: Session, plan_heads: dict[int, list[int]] | None, comp):
    """The per-block scoped mask of a plan for a layer-by-layer evaluation (None: the base model)."""
    if plan_heads is None:
        return None
    return lambda layer: surgery.masked(session.model, {layer: plan_heads[layer]} if plan_heads.get(layer) else {},
                                        comp)


def _window_scores(session: Session, plan_heads: dict[int, list[int]] | None = None, comp=None,
                   progress: bool = False):
    """Per-window NLLs (and pooled embeddings for encoders) of the base model, or of the plan under a scoped
    mask: the whole model at once, or one block at a time when the blocks stay on disk."""
    ev, onloader = session.recipe.evaluation, session.onloader
    if onloader is not None:
        return window_scores(session.model, session.evaluation, ev.batch_size, progress, session.causal,
                             pool=not session.causal,
                             blocks=BlockwisePass(onloader, onloader.device, _block_scope(session, plan_heads, comp)))
    with surgery.masked(session.model, plan_heads or {}, comp):
        return window_scores(session.model, session.evaluation, ev.batch_size, progress, session.causal,
                             pool=not session.causal)


def apply(model, heads: dict[int, list[int]], comp: surgery.Compensation, mode: str) -> None:
    """Permanent surgery: `mask` keeps every shape, `remove` slices the heads out."""
    (surgery.remove_heads if mode == "remove" else surgery.mask_heads)(model, heads, comp)


def evaluate_plan(session: Session, plan_heads: dict[int, list[int]], comp, base) -> dict:
    """Perplexity (and fidelity for encoders) of the scoped-masked model vs the base on the same windows;
    with evaluation.tasks, each task's accuracy change on the same documents."""
    ev = session.recipe.evaluation
    nll, count, emb = _window_scores(session, plan_heads, comp)
    scores = None
    if session.downstream:  # tasks run the whole model (resident: `compare` loads it for them)
        with surgery.masked(session.model, plan_heads, comp):
            scores = session.downstream.scores()
    d = paired_delta(base["nll"], (nll, count), n_boot=max(ev.bootstrap, 1), seed=ev.seed)
    out = asdict(d)
    if emb is not None:
        out["fidelity"] = fidelity(base["emb"], emb)
    if scores is not None:
        out["tasks"] = session.downstream.paired(base["tasks"], scores)
    return out


def base_metrics(session: Session, progress: bool = True) -> dict:
    """The unpruned model's per-window NLLs (and embeddings for encoders): stage `base`."""

    def compute():
        nll, count, emb = _window_scores(session, progress=progress)
        return {"nll": (nll, count), "emb": emb}
    out = stage(session, "base", compute)  # task scores are not saved (dataclasses): recomputed on resume
    return {**out, "tasks": session.downstream.scores() if session.downstream else None}


LAYERWISE_NOTE = ("the model was never whole in memory (capture.onload: sequential): perplexity ran a block at a "
                  "time and model/ was written a block at a time; latency and the bench section need the whole "
                  "model, so they were not measured (`pruner bench RUN` on a machine that holds it)")


@dataclass
class RunResult:
    plan: Plan
    metrics: dict
    model: object
    tokenizer: object
    compensation: surgery.Compensation  # what the pruned heads left in the output projections
    recipe: Recipe | None = None
    onloader: object | None = None  # layer by layer: `model`'s blocks are still the base's, on disk; the surgery
                                    # happens block by block as the run folder's model/ is written


def run(session: Session, progress: bool = True, inputs: ScoringInputs | None = None) -> RunResult:
    """`pruner prune`: calibrate (unless `inputs` are given), score, select, evaluate (scoped mask), then prune
    the model in place."""
    t0 = time.time()
    recipe, model = session.recipe, session.model
    _preflight(session)
    plan = make_plan(session, inputs, progress=progress)
    why = compensating.default_line(model, plan.heads, recipe.surgery) if "surgery.compensation" in session.unset \
        else None  # before the surgery: mean's bias read on the unpruned model
    layerwise = session.onloader is not None and not recipe.evaluation.tasks  # tasks run the whole model
    if not layerwise:
        resident(session)
    model = session.model
    comp = compensating.shared_compensation(session, plan.heads, recipe.surgery, plan.calibration)
    note = whole_layer_note(model, plan.heads, recipe.surgery.compensation)  # refit in a layer with no head left
    fit = compensating.refit_record(comp, recipe.surgery, plan.calibration)
    cost = None if plan.calibration is None else plan.calibration.costs.get(plan.scorer)  # a measured scorer's
    if layerwise:  # what the sums were kept for is done: the evaluations and model/ read none of them
        plan = replace(plan, calibration=None)
    base = base_metrics(session, progress)
    params_before = sum(p.numel() for p in model.parameters())
    timed = recipe.evaluation.latency and not layerwise
    latency_before = latency_ms(model, session.evaluation) if timed else None
    # scoped mask: the same numbers as the surgery below
    m = stage(session, "evaluation", lambda: evaluate_plan(session, plan.heads, comp, base))
    gains = None if layerwise else measure_gains(session, plan.heads, comp, progress)  # the model is still the base
    params_after = _prune(session, plan.heads, comp, layerwise)
    metrics = {
        **_plan_record(session, plan, why, note),
        "evaluation": m, "params_before": params_before, "params_after": params_after,
        "latency_ms_before": latency_before,
        "latency_ms_after": latency_ms(model, session.evaluation) if timed else None,
        **({"layer_by_layer": LAYERWISE_NOTE} if layerwise else {}),
        "convention_sensitivity": sensitivity_record(plan),
        **({"selection_note": plan.note} if plan.note else {}),
        **({"bench": gains} if gains is not None else {}),
        "seconds": round(time.time() - t0, 1),
    }
    if fit is not None:
        metrics["refit"] = fit
    if cost is not None:
        metrics["scorer_cost"] = cost
    result = RunResult(plan, metrics, model, session.tokenizer, comp, recipe, session.onloader if layerwise else None)
    recovery_stage.stage(session, result, progress)  # recovery.enabled: distil the base into the pruned model
    return result


def _preflight(session: Session) -> None:
    """Refusals before any compute: disk for the pruned checkpoint next to the checkpoints, tokens for a refit."""
    if session.checkpoints.active:  # the pruned model is saved next to the checkpoints: room for it first
        resources.check_disk(session.checkpoints.folder, resources.checkpoint_bytes(session.model),
                             "the pruned checkpoint (model/)")
    if session.recipe.surgery.compensation == "refit" and session.recipe.selection.unit == "head":
        check_refit_tokens(session)  # a layer plan's emptied layers take mean, not refit


def _prune(session: Session, heads: dict[int, list[int]], comp, layerwise: bool) -> int:
    """The surgery on the model in memory, or -- layer by layer -- its skeleton's size only (the surgery runs block
    by block as model/ is written). Returns the parameters after."""
    mode = session.recipe.surgery.mode
    if layerwise:
        return streamed.dry_run(session.onloader, heads, comp, mode == "remove").params
    apply(session.model, heads, comp, mode)
    return sum(p.numel() for p in session.model.parameters())


def _plan_record(session: Session, plan: Plan, why: str | None, note: str | None) -> dict:
    """The metrics' first keys: what was pruned, with which scorer, compensation and surgery (in this order); a
    layer plan names its layers, so a reader sees whole attention layers went, not heads spread over the model."""
    recipe, geom = session.recipe, plan.geometry
    return {
        "model": recipe.model.path, "scorer": plan.scorer,
        "convention": plan.convention or get_scorer(plan.scorer).reads,
        "sparsity": recipe.selection.target, "pruned_heads": len(plan.entries),
        **({"unit": "layer", "removed_layers": list(plan.layers)} if plan.unit == "layer" else {}),
        "total_heads": geom.n_layers * geom.n_heads, "compensation": recipe.surgery.compensation,
        **({"compensation_note": why} if why else {}),
        **({"layer_note": note} if note else {}),
        "surgery": recipe.surgery.mode, "sinks": asdict(session.sinks),
    }


def measure_gains(session: Session, heads: dict[int, list[int]], compensation, progress: bool = True) -> dict | None:
    """What the compact form of this plan buys against the base (the recipe's `bench` section): the
    metrics' `bench` block. Not measured when disabled, on other processes than the first (they would
    time each other), or for a model spread over devices."""
    spec = session.recipe.bench
    if not spec.enabled or not distributed.is_main() or getattr(session.model, "hf_device_map", None):
        return None
    dtype = bench.checkpoint_dtype(session.recipe.model, session.model)
    pruned = bench.compact_copy(session.model, heads, compensation)
    return bench.bench(session.model, pruned, bench.config_of(spec), dtype, progress).to_dict()


def sensitivity_record(plan: Plan) -> dict | None:
    """metrics.json's convention sensitivity, saying whose plan it is (this one, or the naive cosine one)."""
    sens = plan.sensitivity
    if sens is None:
        return None
    own = plan.convention is not None
    return {**asdict(sens), "scorer": plan.scorer if own else "cosine", "of_this_plan": own}
