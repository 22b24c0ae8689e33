"""What a calibration accumulates and computes per layer, decided from the recipe -- by the pipeline that runs it
and by the memory model that predicts it alike (`pruner.runs.calibration_memory`), so the two cannot disagree."""

from __future__ import annotations

from pruner.attention.config import CaptureConfig
from pruner.pruning.per_layer import LocalCompensation
from pruner.pruning.scoring import Scorer, get_scorer
from pruner.runs.recipe import Recipe, SurgerySpec
from pruner.runs.resources import Sizes


def capture_reads(scorers: list[Scorer], kinds: list[str], spec: SurgerySpec, layerwise: bool,
                  local: bool) -> tuple[bool, int]:
    """(joint, folds): whether the calibration pass accumulates the joint second moments of the head outputs,
    and for how many folds -- only where a stage reads them (docs/design.md §8.4).

    The joint moments: for the scorers that price heads with them (refit-aware, sink-aware) and for a one-shot
    refit computed from this pass (the whole model in memory, or a per-layer budget compensated as each layer
    finishes: `local`); the fold moments: for that refit with a cross-validated ridge. A measured ablation
    compensates each head as the run will, so it reads what the compensation reads. A sequential refit, and a
    one-shot refit after a layer-by-layer calibration that could not compensate as it went, capture their
    own moments in a pass of their own.
    """
    refit_here = "refit" in kinds and spec.refit_mode == "oneshot" and (not layerwise or local)
    measured = any(s.needs_ablation for s in scorers) and "refit" in kinds
    refit_here = refit_here or measured
    joint = any(s.reads_joint for s in scorers) or refit_here
    folds = spec.folds if refit_here and spec.ridge == "auto" else 0
    return joint, folds


def capture_setup(recipe: Recipe, scorers: list[Scorer], kinds: list[str], windows: tuple[int, int], *,
                  metrics: tuple[str, ...] = ("cosine",), layerwise: bool = False, local: bool = False,
                  layer_cosine: bool = False) -> tuple[CaptureConfig, Sizes]:
    """The capture's config for one calibration pass over `windows` (samples, length) and the memory model's sizes
    of that same pass, both from `capture_reads`, so the memory check prices exactly what the pass accumulates."""
    r, (samples, length) = recipe, windows
    joint, folds = capture_reads(scorers, kinds, r.surgery, layerwise, local)
    cfg = CaptureConfig(chunk_size=r.capture.chunk_size, metrics=metrics, outputs=True, joint=joint, folds=folds,
                        moments=r.capture.moments, layer_cosine=layer_cosine)
    sizes = Sizes(batch_size=min(r.calibration.batch_size, samples), length=length,
                  chunk_size=r.capture.chunk_size, pair_metrics=len(metrics), outputs=True, joint=joint, folds=folds,
                  moments=r.capture.moments, gradient=any(s.needs_gradient for s in scorers), local=local)
    return cfg, sizes


def local_compensation(quota: list[int] | None, key, spec: SurgerySpec,
                       layerwise: bool) -> tuple[LocalCompensation, ...]:
    """The compensation a layer-by-layer calibration computes as each layer finishes: a one-shot refit of a
    per-layer budget (quotas), whose heads in a layer are known the moment that layer's curve is -- unless the
    scorer reads what exists only after the capture (the gradient pass, the ablations)."""
    scorer = get_scorer(key.scorer)
    if not layerwise or quota is None or spec.resolved().compensation != "refit" or spec.refit_mode != "oneshot":
        return ()
    if scorer.needs_gradient or scorer.needs_ablation:  # its curves exist only after the capture: a pass of its own
        return ()
    return (LocalCompensation(key, tuple(quota), "refit", spec.ridge),)
