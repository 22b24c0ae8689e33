"""The compensation stage: what a plan's pruned heads leave in the output projections, from the calibration's
sums where they are still whole, and from one more pass over the blocks where they were dropped.

A layer-by-layer calibration keeps only each layer's first moments once its curves are built (docs/design.md
§8.4). So mean compensation (first moments) is computed from what is kept; a refit of a per-layer
budget was computed as each layer finished (`pruner.pruning.per_layer.LocalCompensation`); a one-shot refit
of a global budget, or of the plans `compare` makes, captures each layer's output moments again, fits and
drops them (`pruner.pruning.layerwise.refit_oneshot_pass`); a sequential refit runs its own pass as ever.
With the whole model in memory the calibration's sums are kept and every compensation reads them.
"""

from __future__ import annotations

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.checkpoints import layout
from pruner.core import distributed
from pruner.core.layerwise import PassOptions, Resident
from pruner.pruning import surgery
from pruner.pruning.compensation import compensate, refit_sequential
from pruner.pruning.layerwise import RefitOptions, refit_one_pass, refit_oneshot_pass
from pruner.pruning.scoring import ScoringInputs
from pruner.runs.context import Session
from pruner.runs.recipe import SurgerySpec


def default_line(model, heads: dict[int, list[int]], spec: SurgerySpec) -> str:
    """Which compensation a run whose recipe left `surgery.compensation` unset uses, and why, in one line: said
    before the surgery, from the unpruned `model` and the plan's `heads` (`spec` resolved)."""
    why = layout.mean_refusal(model, heads, spec.mode == "remove")
    return (f"compensation: {spec.compensation} (surgery.compensation unset): it adds no bias, so every form holds it"
            + (f"; mean's output-projection bias would not be vanilla here ({why})" if why else "")
            + "; refit was below mean on every shipped model (docs/results.md#refit-on-every-shipped-model)")


def precomputed(inputs: ScoringInputs | None, heads: dict[int, list[int]], spec: SurgerySpec
                ) -> surgery.Compensation | None:
    """The compensation the calibration computed as its layers finished, if it is this plan's (the same kind,
    ridge and heads in every layer); None otherwise."""
    if inputs is None:
        return None
    for local, comp in inputs.extra.get("compensations", {}).items():
        if (local.kind, local.ridge) != (spec.compensation, spec.ridge) or spec.refit_mode != "oneshot":
            continue
        curves = inputs.curves[local.key]
        if all(sorted(heads.get(layer, [])) == local.heads(curves[layer], layer) for layer in range(len(curves))):
            return comp
    return None


def has_joint(inputs: ScoringInputs | None) -> bool:
    """Whether the calibration kept its joint output moments (the whole model in memory, captured for refit)."""
    return inputs is not None and inputs.stats.outputs is not None and inputs.stats.outputs[0].has_joint


def needs_pass(inputs: ScoringInputs | None, heads: dict[int, list[int]] | None, spec: SurgerySpec) -> bool:
    """Whether a one-shot refit takes a pass of its own over the blocks (decided by rank 0, which alone may hold
    the sums, for every process): the calibration dropped its joint moments and did not compensate this plan as
    its layers finished."""
    if spec.compensation != "refit" or spec.refit_mode != "oneshot":
        return False
    return distributed.from_root(lambda: not has_joint(inputs) and
                                 (heads is None or precomputed(inputs, heads, spec) is None))


def shared_compensation(session: Session, heads: dict[int, list[int]], spec: SurgerySpec,
                        inputs: ScoringInputs | None) -> surgery.Compensation:
    """`compensation` on every process: computed by each where each can (zero; a refit pass of its own, which
    reduces each layer's sums as it goes), else by rank 0 from the sums it alone keeps and broadcast with
    tensor collectives."""
    everywhere = spec.compensation == "zero" or (spec.compensation == "refit" and spec.refit_mode == "sequential")
    if everywhere or needs_pass(inputs, heads, spec) or all(distributed.all_objects(inputs is not None)):
        return compensation(session.model, heads, spec, inputs, session)
    held = {}

    def compute() -> surgery.Compensation:  # rank 0: the whole of it kept here, its kind and fits sent
        held["comp"] = compensation(session.model, heads, spec, inputs, session)
        return surgery.Compensation(held["comp"].kind, fits=held["comp"].fits)
    comp = distributed.from_root(compute)
    mine = held.get("comp")
    bias = distributed.broadcast_tensors(None if mine is None else {str(k): v for k, v in mine.bias.items()})
    weight = distributed.broadcast_tensors(None if mine is None else {str(k): v for k, v in mine.weight.items()})
    return surgery.Compensation(comp.kind, {int(k): v for k, v in bias.items()},
                                {int(k): v for k, v in weight.items()}, comp.fits)


def compensation(model, plan_heads: dict[int, list[int]], spec: SurgerySpec, inputs: ScoringInputs | None,
                 session: Session | None = None) -> surgery.Compensation:
    """The `spec.compensation` of pruning `plan_heads`, from the calibration's output moments (see the module
    docstring for where each comes from). A sequential refit, and a one-shot refit whose calibration dropped
    its joint moments, re-collect moments on the calibration samples, so they need the `session` they belong to."""
    kind = spec.compensation
    if kind == "zero":
        return surgery.Compensation()
    done = precomputed(inputs, plan_heads, spec)
    if done is not None:
        return done
    if kind == "refit" and session is not None and (spec.refit_mode == "sequential" or not has_joint(inputs)):
        if spec.refit_mode == "sequential":
            return _sequential(model, plan_heads, spec, session)
        return oneshot_refits(session, [plan_heads], spec)[0]
    if inputs is None:
        raise ValueError(f"{kind} compensation needs the calibration statistics the plan was made from; this "
                         "plan carries none (e.g. it was read from plan.json): make it with pruner.plan(...) on "
                         "this model, or use compensation='zero'")
    if kind == "refit" and spec.refit_mode == "sequential":
        raise ValueError("sequential refit re-collects calibration moments: use pruner.prune, or "
                         "refit_mode='oneshot' with pruner.apply")
    if kind == "refit" and not has_joint(inputs):
        raise ValueError("refit compensation needs the joint second moments of the head outputs, which this plan's "
                         "calibration did not keep (it was made for another compensation): make the plan with "
                         "compensation='refit'")
    if session is not None and session.onloader is not None:  # mean: first moments, a block in memory at a time
        return _mean_layerwise(model, plan_heads, inputs, session.onloader)
    return compensate(model, plan_heads, inputs.stats.outputs, kind, spec.ridge, inputs.stats.folds)


def _sequential(model, plan_heads: dict[int, list[int]], spec: SurgerySpec, session: Session) -> surgery.Compensation:
    """Sequential refit: in one layer-by-layer pass (blocks read from disk, or held in memory), or, for a model
    spread over devices (device_map), a whole-model capture per pruned layer."""
    r = session.recipe
    if session.onloader is not None or not getattr(model, "hf_device_map", None):
        onloader = session.onloader or Resident(model, next(model.parameters()).device)
        return refit_one_pass(model, plan_heads, session.calibration, session.sinks, session.tokenizer,
                              onloader, RefitOptions(spec.ridge, spec.folds, r.capture.chunk_size),
                              PassOptions(device=onloader.device, batch_size=r.calibration.batch_size))
    cfg = CaptureConfig(chunk_size=r.capture.chunk_size, metrics=(), outputs=True,
                        folds=spec.folds if spec.ridge == "auto" else 0)
    last = {}

    def collect():
        last["stats"] = capture_stats(model, session.calibration, session.sinks, session.tokenizer, cfg,
                                      batch_size=r.calibration.batch_size)
        return last["stats"].outputs
    return refit_sequential(model, plan_heads, collect, spec.ridge, lambda: last["stats"].folds)


def _mean_layerwise(model, plan_heads: dict[int, list[int]], inputs: ScoringInputs, onloader) -> surgery.Compensation:
    """Mean compensation with one block in memory at a time: each layer's from its own weights while its block is
    onloaded and the calibration's first moments (the same function on the same numbers as with the whole model)."""
    out = surgery.Compensation("mean")
    for layer in sorted(k for k, v in plan_heads.items() if v):
        onloader.onload(layer)
        try:
            part = compensate(model, {layer: plan_heads[layer]}, inputs.stats.outputs, "mean")
        finally:
            onloader.offload(layer)
        out = surgery.Compensation("mean", out.bias | part.bias, out.weight, out.fits)
    return out


def oneshot_refits(session: Session, plans: list[dict[int, list[int]]], spec: SurgerySpec) -> list[surgery.Compensation]:
    """One-shot refits of several plans (`compare`) whose calibration dropped its joint moments: one pass over the
    blocks for all of them, on every process (the blocks read from disk, or held in memory)."""
    r = session.recipe
    onloader = session.onloader or Resident(session.model, next(session.model.parameters()).device)
    return refit_oneshot_pass(session.model, plans, session.calibration, session.sinks, session.tokenizer,
                              onloader, RefitOptions(spec.ridge, spec.folds, r.capture.chunk_size),
                              PassOptions(device=onloader.device, batch_size=r.calibration.batch_size))


def refit_record(comp: surgery.Compensation, spec: SurgerySpec, inputs: ScoringInputs | None) -> dict | None:
    """metrics.json's refit section: ridge, mode and per layer the pruned and unexplained energy
    (absolute, and relative to the residual stream's mean squared norm R_l)."""
    if comp.kind != "refit":
        return None
    resid = None if inputs is None or inputs.stats.residual is None else inputs.stats.residual
    layers = {}
    for layer, fit in sorted(comp.fits.items()):
        r = None if resid is None else float(resid[layer])
        layers[str(layer)] = {**fit, "residual": r, "relative": None if r is None else fit["unexplained"] / r}
    return {"ridge": spec.ridge, "mode": spec.refit_mode, "layers": layers,
            **({"folds": spec.folds} if spec.ridge == "auto" else {}),
            "unexplained": sum(v["unexplained"] for v in layers.values()),
            "relative": None if resid is None else sum(v["relative"] for v in layers.values())}
