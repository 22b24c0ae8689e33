"""Calibration one block at a time (`capture.onload: sequential`): the capture's sums and the weight-derived
quantities every scorer reads, each layer's computed while its block is in memory.

The result is the `ScoringInputs` of `pruner.pruning.calibrate.calibrate` -- equal to it, since the sums
are (`pruner.attention.sequential`) and W_O^T W_O and the weight norms are read off the same weights --
so selection, scorers and compensation run unchanged. Measured passes that need the whole model at once
(the gradient scorer's backward, single-head ablations) are refused in one line.
"""

from __future__ import annotations

import torch

from pruner.attention.capture import CaptureConfig
from pruner.attention.sequential import capture_layerwise
from pruner.attention.sinks import SinkSpec
from pruner.core import arch
from pruner.core.data import TokenBatch
from pruner.core.layerwise import Onloader
from pruner.pruning.calibrate import PRICING_RIDGE, diagonal_blocks, layer_gram, weight_norm
from pruner.pruning.scoring import ScoringInputs, cross_energy


def calibrate_layerwise(model, batch: TokenBatch, sinks: SinkSpec, tokenizer, config: CaptureConfig,
                        onloader: Onloader, *, device="cpu", batch_size: int = 8, seed: int = 0,
                        progress: bool = False, ridge: float | str = 1e-3, gradient: bool = False,
                        ablation=None) -> ScoringInputs:
    """`calibrate` with one block resident at a time; see the module docstring."""
    if gradient or ablation:
        what = "the gradient scorer's backward pass" if gradient else "single-head ablations"
        raise ValueError(f"{what} needs the whole model at once: capture.onload: all, or a scorer that reads "
                         "the capture (sink-aware, refit-energy, fluctuation, output-norm, bos-sink, ...)")
    if not config.outputs:
        raise ValueError("calibration needs output moments (CaptureConfig(outputs=True))")
    g = arch.geometry(model)
    grams, norms = None, [None] * g.n_layers  # grams: (layer, H*d_head, H*d_head) float32, filled in place
    intercept = [False] * g.n_layers

    def on_layer(layer: int) -> None:
        nonlocal grams
        grams, norms[layer] = layer_gram(model, layer, grams), weight_norm(model, layer)
        intercept[layer] = arch.o_bias(model, layer) is not None

    stats = capture_layerwise(model, batch, sinks, tokenizer, config, onloader, device, batch_size, progress,
                              on_layer=on_layer)
    return ScoringInputs(stats=stats, gram=diagonal_blocks(grams, g), weight_norm=torch.stack(norms), seed=seed,
                         cross=cross_energy(stats.outputs, grams), layer_gram=grams, intercept=tuple(intercept),
                         ridge=PRICING_RIDGE if ridge == "auto" else ridge)
