"""The layer-cosine scorer's sums (He et al. 2024): per layer, cos(h, h + attention) over real tokens.

`Capture` keeps the stream entering each block (its residual pre-hook) in the batch; the pre-hooks here, on
each block's post-attention module (`arch.Adapter.post_attention`), read the stream after the attention
sub-block and append the sum over the batch's real tokens of its cosine with the stream that entered. Sums
and `Capture`'s token count rather than a mean per batch, so padding never counts and batches (and processes)
add up.
"""

from __future__ import annotations

from typing import Callable

import torch

from pruner.attention.batch import ForwardBatch
from pruner.core import arch


def cosine_hooks(model, current: Callable[[], ForwardBatch | None]) -> list:
    """Pre-hooks on each block's `post_attention` module, adding to `current()`'s `cosine` sums (nothing while
    no batch is set); a family whose adapter does not name that module is refused."""
    ad = arch.adapter_for(model)
    if ad.post_attention is None:
        raise ValueError(f"the layer-cosine scorer reads the residual stream after the attention sub-block, which "
                         f"pruner locates for llama-like, Gemma 3 and GPT-2 blocks, not {model.config.model_type}'s")

    def leave(layer: int, after: torch.Tensor) -> None:
        batch = current()
        if batch is not None:
            batch.cosine.append(token_sum(batch.entering.pop(layer), after, batch.mask2d))

    return [arch.get(b, ad.post_attention).register_forward_pre_hook(
        lambda m, args, layer=layer: leave(layer, args[0])) for layer, b in enumerate(arch.blocks(model))]


def token_sum(entering: torch.Tensor, after: torch.Tensor, mask2d: torch.Tensor) -> torch.Tensor:
    """Sum over the real tokens (`mask2d`, (B, T)) of cos(entering, after), both (B, T, d_model): a float64
    scalar on the CPU, compared in float32 whatever the model's dtype."""
    cos = torch.nn.functional.cosine_similarity(entering, after.float(), dim=-1)  # (B, T)
    return cos[mask2d.to(entering.device).bool()].double().sum().cpu()
