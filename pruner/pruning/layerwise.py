"""Calibration one block at a time (`capture.onload: sequential`): the capture's sums and the weight-derived
quantities every scorer reads, each layer's computed while its block is in memory.

The result is the `ScoringInputs` of `pruner.pruning.calibrate.calibrate` -- equal to it, since the sums
are (`pruner.attention.sequential`) and W_O^T W_O and the weight norms are read off the same weights --
so selection, scorers and compensation run unchanged. The gradient scorer's backward pass runs a block at
a time too (`gradient_layerwise`); single-head ablations, which run the model once per head, are refused in
one line.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pruner.attention.capture import CaptureConfig
from pruner.attention.sequential import LayerEnd, capture_layerwise
from pruner.attention.sinks import SinkSpec
from pruner.core import arch, distributed
from pruner.core.data import TokenBatch
from pruner.core.layerwise import (
    BlockCall,
    BlockHooks,
    Onloader,
    PassOptions,
    call_block,
    file_backed,
    first_block_calls,
    replayed,
    run_blocks,
    spilled,
)
from pruner.core.runtime import attends_causally, forward
from pruner.pruning.calibrate import example_losses, for_mask_gradients, mlm_masks
from pruner.pruning.compensation import choose_layer_ridge, diagnostics, refit_layer
from pruner.pruning.per_layer import CurveRequest, LayerFinisher
from pruner.pruning.scoring import ScoringInputs
from pruner.pruning.surgery import Compensation, masked


@dataclass(frozen=True)
class LayerwiseScoring:
    """What a layer-by-layer calibration computes beyond the capture's sums."""

    request: CurveRequest       # the selection curves built as each layer finishes
    seed: int = 0               # selection's seed (the gradient scorer's MLM masks)
    ridge: float | str = 1e-3   # a per-layer budget's refit ridge ("auto": chosen on fold moments)
    gradient: bool = False      # also the gradient scorer's (layer, head) importance
    ablation: object = None     # single-head ablations: refused (they need the whole model at once)


@dataclass(frozen=True)
class RefitOptions:
    """How a layer-by-layer refit fits each layer."""

    ridge: float | str = "auto"    # relative ridge, or "auto": chosen per layer on `folds` fold moments
    folds: int = 4                 # calibration folds for ridge "auto"
    chunk_size: int | None = None  # capture's query chunk (tokens); None: CaptureConfig's default


def calibrate_layerwise(model, batch: TokenBatch, sinks: SinkSpec, tokenizer, config: CaptureConfig,
                        onloader: Onloader, scoring: LayerwiseScoring, options: PassOptions = PassOptions()
                        ) -> ScoringInputs | None:
    """`calibrate` with one block resident at a time; see the module docstring. Each layer's curves
    (`scoring.request`) are built, and a per-layer budget's layer compensated, the moment its sums are final
    (`pruner.pruning.per_layer`); what is kept of its sums is their first moments. With several processes only
    rank 0 keeps the sums and what is built from them (`capture_layerwise`): the others get None."""
    if scoring.ablation:
        raise ValueError("single-head ablations need the whole model at once: capture.onload: all, or a scorer "
                         "that reads the capture (sink-aware, refit-energy, fluctuation, output-norm, bos-sink, ...)")
    if not config.outputs:
        raise ValueError("calibration needs output moments (CaptureConfig(outputs=True))")
    finisher = LayerFinisher(model, scoring.request, seed=scoring.seed, ridge=scoring.ridge,
                             keep=lambda t: file_backed(t, getattr(onloader, "spill", None)))
    stats = capture_layerwise(model, batch, sinks, tokenizer, config, onloader, options,
                              LayerEnd(finish=finisher.finish))
    grad = None
    if scoring.gradient:
        grad = gradient_layerwise(model, batch, tokenizer, onloader, device=options.device,
                                  batch_size=options.batch_size, seed=scoring.seed, progress=options.progress)
    return None if stats is None else finisher.inputs(stats, grad)


def refit_one_pass(model, heads: dict[int, list[int]], batch: TokenBatch, sinks: SinkSpec, tokenizer,
                   onloader: Onloader, refit: RefitOptions = RefitOptions(), options: PassOptions = PassOptions()
                   ) -> Compensation:
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
    return _refit_pass(model, heads, batch, sinks, tokenizer, onloader, refit, options)[0]


def refit_oneshot_pass(model, plans: list[dict[int, list[int]]], batch: TokenBatch, sinks: SinkSpec, tokenizer,
                       onloader: Onloader, refit: RefitOptions = RefitOptions(),
                       options: PassOptions = PassOptions()) -> list[Compensation]:
    """One-shot refit of every plan in one layer-by-layer pass over the unpruned model, each layer's output
    moments captured again, fitted for every plan that prunes it, and dropped (docs/design.md §8.4).

    What a layer-by-layer calibration does not keep -- each layer's joint second moments and fold moments --
    once the plan is known, at the cost of one more pass: the same fits as `compensation.compensate` on the
    calibration's own sums (the same windows through the same blocks and kernel; the tests hold them equal).
    Used where a plan is not known when a layer finishes (a global budget) and by `compare`.
    """
    return _refit_pass(model, plans, batch, sinks, tokenizer, onloader, refit, options)


def _refit_pass(model, plans: dict[int, list[int]] | list[dict[int, list[int]]], batch: TokenBatch, sinks: SinkSpec,
                tokenizer, onloader: Onloader, refit: RefitOptions, options: PassOptions) -> list[Compensation]:
    """Refits from one layer-by-layer capture of the output moments: each layer's fitted from its moments as
    captured, then -- one plan (a dict): sequential -- its calls run again through the pruned, refitted block for
    the next block to see, or -- a list of plans: one-shot -- the unpruned outputs passed on."""
    sequential = isinstance(plans, dict)
    plans = [plans] if sequential else plans
    if len(batch) < distributed.world_size():
        raise ValueError(f"a layer-by-layer refit needs at least one calibration sample per process "
                         f"({len(batch)} samples, {distributed.world_size()} processes)")
    ridge = refit.ridge
    config = CaptureConfig(metrics=(), outputs=True, folds=refit.folds if ridge == "auto" else 0,
                           **({} if refit.chunk_size is None else {"chunk_size": refit.chunk_size}))
    comps = [Compensation("refit") for _ in plans]

    def rerun(layer: int, sums) -> AbstractContextManager | None:
        cast = arch.o_weight_cols(model, layer).dtype  # the block is resident
        for i, heads in enumerate(plans):
            hs, comp = heads.get(layer), comps[i]
            if not hs:
                continue
            choice = None if ridge != "auto" else choose_layer_ridge(model, layer, hs, sums.folds)
            fit = refit_layer(model, layer, hs, sums.outputs.to("cpu"), ridge if choice is None else choice.ridge)
            weight = file_backed(fit.delta_w.to(cast), getattr(onloader, "spill", None))  # not in memory: a file's
            comps[i] = Compensation("refit", comp.bias | ({} if fit.delta_b is None else {layer: fit.delta_b.to(cast)}),
                                    comp.weight | {layer: weight}, comp.fits | {layer: diagnostics(fit, choice)})
        if not sequential or not plans[0].get(layer):
            return None
        return masked(model, {layer: plans[0][layer]}, comps[0])

    capture_layerwise(model, batch, sinks, tokenizer, config, onloader, options, LayerEnd(rerun=rerun))
    return comps


def gradient_layerwise(model, batch: TokenBatch, tokenizer, onloader: Onloader, *, device="cpu", batch_size: int = 8,
                       seed: int = 0, progress: bool = False) -> torch.Tensor:
    """`pruner.pruning.calibrate.gradient_importance` with one block resident at a time: (layer, head), the
    per-example |dL(x)/d xi_h| summed over examples and normalised per layer, as there.

    Backpropagation a block at a time (activation checkpointing at block granularity): a forward pass
    keeps every block's input on the host (layer x windows x T x d_model in the model's dtype); the model's
    code after the blocks turns the last hidden states into each example's loss (causal LM: mean
    next-token NLL; masked LM: the seeded masks of `mlm_masks`) and its gradient; then from the last block
    down each block is onloaded, run again on its stored inputs with gradients on, and given the gradient
    of its output: what comes back is the head masks' gradient and the gradient of its input, handed to
    the block below. Each example of a batch has its own mask, so the absolute value is still taken per
    example. Weights get no gradient. With several processes each takes its share of the windows and the
    sums are added in rank order.
    """
    causal = _lm_kind(model)
    g = arch.geometry(model)
    inputs, attn, labels = _loss_batches(batch, tokenizer, causal, seed, batch_size)
    total = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64)
    bar = tqdm(total=2 * g.n_layers, desc="gradient (layer by layer)", unit="layer") if progress else None
    try:
        with for_mask_gradients(model), spilled(onloader, keep_every_layer=True) as spill:
            calls, kept = _forward_keeping_inputs(model, onloader, list(zip(inputs, attn)), device, bar, spill)

            def keep(slot, i, x):
                return x if spill is None or x is None else spill.put(slot, i, x)

            grads = [keep(-1, i, _head_gradient(model, call.hidden, ids, mask, lab, causal, device))
                     for i, (call, ids, mask, lab) in enumerate(zip(calls, inputs, attn, labels))]
            for layer in reversed(range(g.n_layers)):
                block = onloader.onload(layer)
                for i, call in enumerate(calls):
                    mask_grad, grad = _block_backward(model, block, kept[layer][i], call, grads[i], device, layer > 0)
                    total[layer] += mask_grad
                    grads[i] = keep(-1, i, grad)  # in place of the gradient just used (call i's alone)
                    kept[layer][i] = None  # released as it is used
                onloader.offload(layer)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    total = distributed.sum_in_rank_order(total)
    return total / total.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def _lm_kind(model) -> bool:
    """Whether the model is a causal LM (else a masked LM); refused without a language-model head."""
    causal = attends_causally(model)
    if not causal and not (hasattr(model, "cls") or hasattr(model, "lm_head")):
        raise ValueError("the gradient scorer needs a language-model head (causal LM or masked LM)")
    return causal


def _forward_keeping_inputs(model, onloader: Onloader, batches: list, device, bar, spill
                            ) -> tuple[list[BlockCall], list[list[torch.Tensor]]]:
    """The forward pass a block at a time, keeping every block's input for every batch (for the backward pass):
    (the calls, with the last block's outputs; [layer][batch] inputs)."""
    n_layers = arch.geometry(model).n_layers
    calls = first_block_calls(model, batches, device)
    kept: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]  # each block's inputs, per batch
    run_blocks(onloader, calls, n_layers, device,
               BlockHooks(before_call=lambda layer, i: kept[layer].append(calls[i].hidden)),
               progress=bar, spill=spill)
    return calls, kept


def _loss_batches(batch: TokenBatch, tokenizer, causal: bool, seed: int, batch_size: int
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """This process's share of the windows in batches: input ids, attention masks and labels (B, T) each --
    causal: the ids, padding off-target; masked LM: `mlm_masks`' inputs and labels."""
    mine = torch.tensor(distributed.shard_indices(len(batch)), dtype=torch.long)
    parts = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    attn = [batch.attention_mask[idx] for idx in parts]
    if causal:
        return ([batch.input_ids[idx] for idx in parts], attn,
                [batch.input_ids[idx].masked_fill(batch.attention_mask[idx] == 0, -100) for idx in parts])
    masks = mlm_masks(batch, tokenizer, seed)
    return ([torch.cat([masks[i][0] for i in idx.tolist()]) for idx in parts], attn,
            [torch.cat([masks[i][1] for i in idx.tolist()]) for idx in parts])


def _head_gradient(model, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor,
                   causal: bool, device) -> torch.Tensor:
    """d(sum of the examples' losses) / d(last hidden states) (B, T, d_model), through the model's own code
    after the blocks (final norm, LM head); on the host, where `hidden` was."""
    h = hidden.to(device).detach().requires_grad_(True)
    with replayed(model) as replay, torch.enable_grad():
        replay.hidden = h
        logits = forward(model, ids.to(device), mask.to(device)).logits  # (B, T, V)
        example_losses(logits, labels, causal).sum().backward()
    return h.grad.to(hidden.device)


def _block_backward(model, block, x: torch.Tensor, call: BlockCall, grad_out: torch.Tensor, device,
                    need_input: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block call again with gradients: the heads' |d loss / d xi| summed over the batch's examples
    (head,) float64, and the gradient of the block's input (B, T, d_model; None when not `need_input`)."""
    g, ad = arch.geometry(model), arch.adapter_for(model)
    xi = torch.ones(x.shape[0], g.n_heads, requires_grad=True)  # (B, head): one mask per example
    hook = arch.get(block, ad.o_proj).register_forward_pre_hook(
        lambda m, args: (args[0] * xi.repeat_interleave(g.head_dim, -1).to(args[0])[:, None], *args[1:]))
    h = x.to(device).detach().requires_grad_(need_input)
    try:
        with for_mask_gradients(block), torch.enable_grad():  # an onloaded block's weights come back trainable
            out = call_block(block, h, call, device)
            out.backward(grad_out.to(out))
    finally:
        hook.remove()
    return xi.grad.abs().double().sum(0), h.grad.to(x.device) if need_input else None
