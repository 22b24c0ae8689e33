"""Layer scorers in a registry of their own: importance per attention layer, higher = keep. Pure tensor math.

`selection.unit: layer` removes the lowest-importance layers' whole attention. Each scorer reads the same
`ScoringInputs` as the head scorers and returns importance (layer,). A registry apart from `SCORERS`, so every
loop over the head scorers (compare's default, the studies) stays as it was; `pruner.pruning.scoring.get_scorer`
knows both.
"""

from __future__ import annotations

import torch

from pruner.pruning.scoring_types import Scorer, ScoringInputs

Tensor = torch.Tensor


def _layer_sink_aware(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """The sink-aware reading of a whole layer: what removing its attention changes after mean compensation,
    weighted by content share, relative to the residual stream. (layer,)

    sum_{h,g} (1 - s_h) K[h, g] / R_l, with K the cross energy (`pruner.pruning.scoring.cross_energy`):
    sum_{h,g} K[h, g] is exactly the energy of the perturbation E||W_O (o - E o)||^2 that removing every head of
    the layer leaves once their mean output -- mostly the sink channel's near-constant vector, which later layers
    expect -- is folded into the bias. A layer whose heads park their attention on the sink writes nearly a
    constant: mean compensation keeps it, and its content share (1 - s_h) discounts what little varies. It is the
    sink-aware head scorer with every head of the layer pruned at once.
    """
    if inputs.cross is None:
        raise ValueError("the layer-sink-aware scorer needs the cross energy (the joint output moments)")
    content = (1 - inputs.stats.sink_mass).to(inputs.cross.dtype)  # (layer, head)
    energy = torch.einsum("lhg,lh->l", inputs.cross, content)
    residual = inputs.stats.residual if inputs.stats.residual is not None else torch.ones(energy.shape[0])
    return energy / residual.to(energy.dtype)


def _layer_cosine(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """He et al. 2024 ("What Matters in Transformers? Not All Attention is Needed"): 1 - the mean cosine
    similarity between the residual stream entering the attention sub-block and leaving it. (layer,)

    A layer whose attention barely turns the stream (similarity near 1) is the most droppable. The cosine is
    averaged over every real calibration token (sums and a count from the capture, padding-free)."""
    if inputs.stats.attn_cosine is None:
        raise ValueError("the layer-cosine scorer needs the attention blocks' input/output cosines "
                         "(CaptureConfig(layer_cosine=True))")
    return 1 - inputs.stats.attn_cosine


def _layer_ablation(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """Measured: the calibration-loss increase when the layer's whole attention is removed (with the run's
    compensation), on a calibration subset: L + 1 passes (`pruner.pruning.ablation.layer_ablations`). (layer,)"""
    if inputs.layer_ablation is None:
        raise ValueError("the layer-ablation scorer needs measured layer ablations (calibrate with "
                         "AblationRequest(..., scorers=('layer-ablation',)))")
    return inputs.layer_ablation


LAYER_SCORERS: dict[str, Scorer] = {s.name: s for s in [
    Scorer("layer-sink-aware", _layer_sink_aware, reads_joint=True, unit="layer",
           doc="a layer's energy left after mean compensation (its heads jointly) x content share, relative to "
               "the residual stream", reads="sink and content channels separated (no convention)"),
    Scorer("layer-cosine", _layer_cosine, reads_layer_cosine=True, unit="layer",
           doc="He et al. 2024: cosine similarity of the attention block's input and output, highest removed "
               "first", reads="the residual stream around the attention block"),
    Scorer("layer-ablation", _layer_ablation, needs_ablation=True, unit="layer",
           doc="measured: calibration-loss increase when the layer's attention is removed with the run's "
               "compensation", reads="the loss (L extra passes)"),
]}
