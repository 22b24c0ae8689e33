"""Calibration plumbing: one capture pass (+ optional gradient pass) -> `ScoringInputs`.

This is the only place scoring touches the model: everything a scorer reads is
computed here once, so every attention-based scorer reuses one capture pass.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch
from tqdm.auto import tqdm

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.core import arch, distributed, resume
from pruner.core.data import TokenBatch, mask_tokens
from pruner.core.runtime import attends_causally, forward
from pruner.pruning.ablation import AblationRequest, Ablations, shortlist_of, single_head_ablations, subset
from pruner.pruning.compensation import compensate
from pruner.pruning.per_layer import (  # noqa: F401  (PRICING_RIDGE: re-exported)
    PRICING_RIDGE,
    CurveRequest,
    LayerFinisher,
    diagonal_blocks,
    layer_grams,
    pricing_ridge,
    weight_norms,
)
from pruner.pruning.scoring import ScoringInputs, cross_energy


def lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over real tokens (the first token of a window is never a target).

    Computed here in the model's own dtype (transformers' loss upcasts to float32,
    which would hide the gradient check's precision in float64).
    """
    logits = forward(model, input_ids, attention_mask).logits[:, :-1]  # (B, T-1, V)
    target = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100).to(logits.device)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100)


def mlm_loss(model, masked_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor):
    """Masked-LM loss of inputs already masked (`pruner.core.data.mask_tokens`): the encoders' gradient loss."""
    logits = forward(model, masked_ids, attention_mask).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.to(logits.device), ignore_index=-100)


def mlm_masks(batch: TokenBatch, tokenizer, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example's (masked input ids, labels), each (1, T), for the masked-LM gradient loss: one seeded
    stream over the examples, drawn up front, so that an example gets the same masks whichever process
    scores it and whether the model runs whole or a block at a time."""
    g = torch.Generator().manual_seed(seed)
    return [mask_tokens(batch.input_ids[i:i + 1], batch.attention_mask[i:i + 1], tokenizer, 0.15, g)
            for i in range(len(batch))]


def example_losses(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """Each example's mean NLL over its targets (-100: none), in the logits' dtype: (B,) from logits (B, T, V)
    and labels (B, T) -- `lm_loss` / `mlm_loss` of each example alone, for a batch at once. Causal: position
    t predicts label t + 1."""
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    labels = labels.to(logits.device)
    tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return tok.sum(-1) / (labels != -100).sum(-1).clamp_min(1).to(tok)


def _lm_example_loss(model, batch: TokenBatch, i: int) -> torch.Tensor:
    return lm_loss(model, batch.input_ids[i:i + 1], batch.attention_mask[i:i + 1])


@contextmanager
def for_mask_gradients(module: torch.nn.Module) -> Iterator[None]:
    """`module` in eval mode with its weights' gradients off, both restored after: a head-mask gradient pass
    needs only the masks' gradients -- weight gradients would cost a model-sized .grad and a third of each
    backward."""
    was_training = module.training
    frozen = [w for w in module.parameters() if w.requires_grad]
    module.eval()
    for w in frozen:
        w.requires_grad_(False)
    try:
        yield
    finally:
        module.train(was_training)
        for w in frozen:
            w.requires_grad_(True)


def gradient_importance(model, batch: TokenBatch, progress: bool = False, loss_fn=_lm_example_loss,
                        checkpoints: resume.Checkpoints = resume.NONE) -> torch.Tensor:
    """Michel et al. 2019: sum over examples of |dL(x)/d mask_h|, normalised per layer. (layer, head)

    One example (window) per backward pass, so the absolute value is taken per
    example, and the mask gradient is zeroed every time (the old bertology script
    accumulated signed gradients across a batch). A mask xi_h multiplies each
    head's slice at the output projection's input; its gradient at xi = 1 is the
    importance. Michel et al. normalise each layer's scores by their l2 norm.
    `loss_fn(model, batch, i)` is example i's loss. With several processes each
    takes every world-th example and the sums are added in rank order. With
    `checkpoints`, the sum and the example cursor are saved as stage `gradient`.
    """
    ad, g = arch.adapter_for(model), arch.geometry(model)
    xi = torch.ones(g.n_layers, g.n_heads, requires_grad=True)
    hooks = [arch.get(block, ad.o_proj).register_forward_pre_hook(
        lambda m, args, layer=layer: (args[0] * xi[layer].repeat_interleave(g.head_dim).to(args[0])[None, None],)
        + tuple(args[1:])) for layer, block in enumerate(arch.blocks(model))]
    total = torch.zeros(g.n_layers, g.n_heads, dtype=torch.float64)
    mine = distributed.shard_indices(len(batch))
    saved = checkpoints.load("gradient")
    done = 0 if saved is None else saved["cursor"]
    if saved is not None:
        total = saved["total"]
    try:
        it = mine[done:]
        it = tqdm(it, total=len(mine), initial=done, desc="gradient", unit="window") if progress else it
        with for_mask_gradients(model):
            for k, i in enumerate(it, start=done + 1):
                xi.grad = None
                loss = loss_fn(model, batch, i)
                loss.backward()
                total += xi.grad.detach().abs().double()
                checkpoints.step("gradient", k, lambda: {"cursor": k, "total": total.clone()})
            model.zero_grad(set_to_none=True)
        checkpoints.finish("gradient", lambda: {"cursor": len(mine), "total": total.clone()})
    finally:
        for h in hooks:
            h.remove()
    total = distributed.sum_in_rank_order(total)
    return total / total.norm(dim=-1, keepdim=True).clamp_min(1e-30)


@dataclass(frozen=True)
class CalibrationOptions:
    """What `calibrate` measures beyond the capture, and how its passes run."""

    gradient: bool = False                  # also the gradient scorer's importance: one backward pass per window
    batch_size: int = 8                     # calibration windows per capture forward
    seed: int = 0                           # masked LM's masks; the per-layer inputs' seed
    progress: bool = False                  # progress bars
    ridge: float | str = 1e-3               # refit compensation's (surgery.ridge): what the refit-aware scorer prices
    checkpoints: resume.Checkpoints = resume.NONE  # both passes save their sums now and then, and resume from them
    ablation: AblationRequest | tuple | None = None  # also single-head ablations (or its (compensation, samples))
    curves: CurveRequest | None = None      # the selection curves to build a layer at a time (see `calibrate`)


def calibrate(model, batch: TokenBatch, sinks: SinkSpec, tokenizer=None, *,
              config: CaptureConfig = CaptureConfig(metrics=("cosine", "js"), outputs=True),
              options: CalibrationOptions = CalibrationOptions()) -> ScoringInputs:
    """Everything the scorers need, from one capture pass (and one gradient pass if asked).

    `options.ridge` is refit compensation's (surgery.ridge): the refit-aware scorer prices heads with it
    (with "auto", chosen per pruned set only once the set is known, it prices them at `PRICING_RIDGE`).
    `options.ablation` = `AblationRequest` (or its (compensation, samples)): also measure heads removed alone on
    the first `samples` calibration samples (`pruner.pruning.ablation`, the measured scorers).
    With `options.checkpoints` both passes save their sums now and then and resume from them.

    With `options.curves`, the selection curves asked for are built a layer at a time (each layer's W_O^T W_O
    formed, used and dropped: `pruner.pruning.per_layer`) and the inputs keep the captured statistics, not the
    weight-derived matrices; without, every layer's W_O^T W_O and cross energy are kept, so that any scorer
    can select from the inputs later (the studies').
    """
    o = options
    if not config.outputs:
        raise ValueError("calibration needs output moments (CaptureConfig(outputs=True))")
    stats = capture_stats(model, batch, sinks, tokenizer, config, batch_size=o.batch_size, progress=o.progress,
                          checkpoints=o.checkpoints)
    grad = _gradient(model, batch, tokenizer, o) if o.gradient else None
    increase, costs, short = None, {}, None
    if o.ablation is not None:
        increase, costs, short = _measured(model, batch, tokenizer, stats, o)
    if o.curves is not None:
        finisher = LayerFinisher(model, o.curves, seed=o.seed, ridge=o.ridge)
        for layer in range(arch.geometry(model).n_layers):
            finisher.add(layer, stats.layer(layer))
        return replace(finisher.inputs(stats, grad, increase, costs), shortlist=short)
    grams = layer_grams(model)
    intercept = tuple(arch.o_bias(model, layer) is not None for layer in range(len(grams)))
    joint = stats.outputs[0].has_joint
    return ScoringInputs(stats=stats, gram=diagonal_blocks(grams, arch.geometry(model)),
                         weight_norm=weight_norms(model), gradient=grad, seed=o.seed,
                         cross=cross_energy(stats.outputs, grams) if joint else None,
                         layer_gram=grams if joint else None, intercept=intercept, ridge=pricing_ridge(o.ridge),
                         ablation=increase, costs=costs, shortlist=short)


def _gradient(model, batch: TokenBatch, tokenizer, o: CalibrationOptions) -> torch.Tensor:
    """The gradient scorer's (layer, head) importance with the model's own loss: next-token NLL, or masked LM's
    on seeded masks."""
    if attends_causally(model):
        loss_fn = _lm_example_loss
    elif hasattr(model, "cls") or hasattr(model, "lm_head"):
        masked = mlm_masks(batch, tokenizer, o.seed)

        def loss_fn(m, b, i):
            return mlm_loss(m, *masked[i], b.attention_mask[i:i + 1])
    else:
        raise ValueError("the gradient scorer needs a language-model head (causal LM or masked LM)")
    return gradient_importance(model, batch, progress=o.progress, loss_fn=loss_fn, checkpoints=o.checkpoints)


def _measured(model, batch: TokenBatch, tokenizer, stats, o: CalibrationOptions
              ) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """The single-head ablations asked for: (perplexity increases, each measured scorer's cost, the shortlist
    the refit-aware proxy draws, or None when no scorer asks for one)."""
    ablation = o.ablation if isinstance(o.ablation, AblationRequest) else AblationRequest(*o.ablation)
    short = None if "ablation-shortlist" not in ablation.scorers else \
        shortlist_of(_proxy(model, stats, o.ridge, o.seed), ablation.shortlist)
    measured = _ablations(model, batch, tokenizer, stats, ablation, o,
                          None if "ablation" in ablation.scorers else short)
    costs = {name: measured.cost(None if name == "ablation" else short) for name in ablation.scorers}
    return measured.increase, costs, short


def _proxy(model, stats, ridge, seed: int) -> torch.Tensor:
    """The refit-aware proxy's importances with every head alive (layer, head): what the shortlist is drawn by."""
    from pruner.pruning.per_layer import one_layer_inputs
    from pruner.pruning.scoring import get_scorer

    g, scorer = arch.geometry(model), get_scorer("refit-energy")
    rows = [scorer(one_layer_inputs(model, layer, stats.layer(layer), seed=seed, ridge=ridge),
                   torch.ones(1, g.n_heads, dtype=torch.bool))[0] for layer in range(g.n_layers)]
    return torch.stack(rows)


def _ablations(model, batch: TokenBatch, tokenizer, stats, ablation: AblationRequest, o: CalibrationOptions,
               only: torch.Tensor | None) -> Ablations:
    """Single-head ablations on the first samples (`only`: those heads), compensated as the run compensates
    (masked LM: seeded masks); `o`: its ridge, seed and progress."""
    ridge, seed, progress = o.ridge, o.seed, o.progress
    kind, n = ablation.compensation, ablation.samples
    sub, labels = subset(batch, n), None
    if not attends_causally(model):
        if not (hasattr(model, "cls") or hasattr(model, "lm_head")):
            raise ValueError("the ablation scorer needs a language-model head (causal LM or masked LM)")
        masked, labels = mask_tokens(sub.input_ids, sub.attention_mask, tokenizer, 0.15,
                                     torch.Generator().manual_seed(seed))
        sub = TokenBatch(masked, sub.attention_mask)
    return single_head_ablations(model, sub, lambda heads: compensate(model, heads, stats.outputs, kind, ridge, stats.folds),
                                 labels, progress=progress, only=only)
