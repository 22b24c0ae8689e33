"""A decoder layer whose attention lost every head (selection.unit: layer): no kernel, no KV cache.

`AttentionFree` takes the place of the layer's attention module once surgery has removed its last head. Its
q/k/v projections have 0 rows and its output projection 0 input columns (kept, so the state dict keeps the
family's names), so what it adds to the residual stream is the output projection's bias -- the compensation
-- or zeros. It never calls the attention kernel: a 0-head view of the queries has no shape to infer.

The KV cache still needs a word from it: transformers reads the sequence length (positions, mask sizes) from
a cache layer -- layer 0's, or the first full-attention one's -- so a layer that stored nothing would report
0 tokens and shift every position after the prompt. It updates its cache entry with 0-head keys (no memory),
and a plain full-attention entry is swapped for `TokenCount`, which counts the tokens instead of reading a
tensor that is empty (a sliding-window entry already counts them).

The per-layer modeling file (`pruner.checkpoints.modeling.llama`) carries a copy of both classes: it is
copied next to checkpoints and imports only transformers and torch.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer


class TokenCount(DynamicLayer):
    """A full-attention cache entry of a layer with no heads: keys and values of 0 heads, tokens counted."""

    def __init__(self, **kwargs):
        super().__init__()
        self.tokens = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.tokens += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.tokens

    def crop(self, max_length: int) -> None:
        self.tokens = max_length if max_length >= 0 else max(self.tokens + max_length, 0)
        super().crop(max_length)

    def reset(self) -> None:
        self.tokens = 0
        super().reset()


class AttentionFree(nn.Module):
    """The attention of a layer with no head left: adds its output projection's bias (or zeros)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        for name, child in attn.named_children():  # q/k/v/o (empty) and any q/k norms: the same state-dict names
            self.add_module(name, child)
        self.layer_idx, self.head_dim = attn.layer_idx, attn.head_dim
        self.config = attn.config
        self.num_key_value_groups = 1

    def forward(self, hidden_states: torch.Tensor, *args, cache=None, past_key_values=None, **kwargs):
        B, T = hidden_states.shape[:2]
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            _count_tokens(cache, self.layer_idx)
            empty = hidden_states.new_zeros(B, 0, T, self.head_dim)  # (B, kv_head=0, T, d_head): nothing kept
            cache.update(empty, empty, self.layer_idx)
        return self.o_proj(hidden_states.new_zeros(B, T, 0)), None  # (B, T, d_model): the bias, or zeros


def _count_tokens(cache, layer: int) -> None:
    """Swap the layer's plain full-attention cache entry for a `TokenCount` before its first update."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return
    if len(layers) <= layer and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        layers.extend(DynamicLayer() for _ in range(layer + 1 - len(layers)))
    if len(layers) > layer and type(layers[layer]) is DynamicLayer and not layers[layer].is_initialized:
        layers[layer] = TokenCount()
