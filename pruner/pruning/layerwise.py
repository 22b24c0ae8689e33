"""Calibration one block at a time (`capture.onload: sequential`): the capture's sums and the weight-derived
quantities every scorer reads, each layer's computed while its block is in memory.

The result is the `ScoringInputs` of `pruner.pruning.calibrate.calibrate` -- equal to it, since the sums
are (`pruner.attention.sequential`) and W_O^T W_O and the weight norms are read off the same weights --
so selection, scorers and compensation run unchanged. Measured passes that need the whole model at once
(the gradient scorer's backward, single-head ablations) are refused in one line.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from pruner.attention.capture import CaptureConfig
from pruner.attention.sequential import capture_layerwise
from pruner.attention.sinks import SinkSpec
from pruner.core import arch, distributed
from pruner.core.data import TokenBatch
from pruner.core.layerwise import Onloader
from pruner.pruning.calibrate import PRICING_RIDGE, diagonal_blocks, layer_gram, weight_norm
from pruner.pruning.compensation import choose_layer_ridge, diagnostics, refit_layer
from pruner.pruning.scoring import ScoringInputs, cross_energy
from pruner.pruning.surgery import Compensation, masked


def calibrate_layerwise(model, batch: TokenBatch, sinks: SinkSpec, tokenizer, config: CaptureConfig,
                        onloader: Onloader, *, device="cpu", batch_size: int = 8, seed: int = 0,
                        progress: bool = False, ridge: float | str = 1e-3, gradient: bool = False,
                        ablation=None) -> ScoringInputs | None:
    """`calibrate` with one block resident at a time; see the module docstring. With several processes only
    rank 0 keeps the sums and what is built from them (`capture_layerwise`): the others get None."""
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
        if not distributed.is_main():  # what rank 0 alone keeps
            return
        grams, norms[layer] = layer_gram(model, layer, grams), weight_norm(model, layer)
        intercept[layer] = arch.o_bias(model, layer) is not None

    stats = capture_layerwise(model, batch, sinks, tokenizer, config, onloader, device, batch_size, progress,
                              on_layer=on_layer)
    if stats is None:
        return None
    return ScoringInputs(stats=stats, gram=diagonal_blocks(grams, g), weight_norm=torch.stack(norms), seed=seed,
                         cross=cross_energy(stats.outputs, grams), layer_gram=grams, intercept=tuple(intercept),
                         ridge=PRICING_RIDGE if ridge == "auto" else ridge)


def refit_one_pass(model, heads: dict[int, list[int]], batch: TokenBatch, sinks: SinkSpec, tokenizer,
                   onloader: Onloader, *, ridge: float | str = "auto", folds: int = 4, chunk_size: int | None = None,
                   device="cpu", batch_size: int = 8, progress: bool = False) -> Compensation:
    """Sequential refit in one layer-by-layer pass: each block refitted right after it is captured.

    Block l's output moments are captured on the inputs the blocks below, already pruned and refitted,
    give it; its refit is fitted from them (ridge "auto": chosen on its fold moments); then its batches
    run again through the pruned, refitted block (a scoped mask: nothing is written to the weights) and
    those outputs feed block l + 1. The same fits as `compensation.refit_sequential`, which re-captures
    the whole model once per pruned layer (L passes); here each block runs twice. The one difference: the
    forwarded hidden states come from the model's own attention, not from the capture's fused kernel
    (float32 rounding apart, the same; the tests hold the fits to 1e-4 of their scale).
    `onloader` may be `pruner.core.layerwise.Resident(model, device)` for a model held in memory.
    """
    if len(batch) < distributed.world_size():
        raise ValueError(f"sequential refit needs at least one calibration sample per process "
                         f"({len(batch)} samples, {distributed.world_size()} processes)")
    config = CaptureConfig(metrics=(), outputs=True, folds=folds if ridge == "auto" else 0,
                           **({} if chunk_size is None else {"chunk_size": chunk_size}))
    comp = Compensation("refit")

    def rerun(layer: int, sums) -> AbstractContextManager | None:
        nonlocal comp
        hs = heads.get(layer)
        if not hs:
            return None
        choice = None if ridge != "auto" else choose_layer_ridge(model, layer, hs, sums.folds)
        fit = refit_layer(model, layer, hs, sums.outputs.to("cpu"), ridge if choice is None else choice.ridge)
        cast = arch.o_weight_cols(model, layer).dtype  # the block is resident
        comp = Compensation("refit", comp.bias | ({} if fit.delta_b is None else {layer: fit.delta_b.to(cast)}),
                            comp.weight | {layer: fit.delta_w.to(cast)}, comp.fits | {layer: diagnostics(fit, choice)})
        return masked(model, {layer: hs}, comp)

    capture_layerwise(model, batch, sinks, tokenizer, config, onloader, device, batch_size, progress, rerun=rerun)
    return comp
