"""The batch a capture is forwarding, as its attention function sees it: real tokens, sinks, counted rows, and
what each chunk of query rows may attend to (built once per batch, shared by every layer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pruner.attention import kernel


def valid_keys(mask: torch.Tensor | None, attention_mask_2d: torch.Tensor, q0: int, q1: int,
               causal: bool) -> torch.Tensor:
    """Keys each query of rows [q0, q1) may see, as bool (B, 1, c, K).

    Uses the mask the model built (bool: True = attend; float: 0 = attend), or,
    when SDPA was allowed to skip it, rebuilds causal + padding from the 2-D mask.
    """
    keys = attention_mask_2d.bool()[:, None, None, :]  # (B, 1, 1, K)
    if mask is not None:
        m = mask[:, :, q0:q1, :]
        m = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        return m & keys
    K = attention_mask_2d.shape[1]
    if not causal:
        return keys.expand(-1, -1, q1 - q0, -1)
    q = torch.arange(q0, q1, device=keys.device)[:, None]
    return keys & (torch.arange(K, device=keys.device)[None, :] <= q)[None, None]


@dataclass
class ForwardBatch:
    """What the attention function needs to know about the batch being forwarded."""

    mask2d: torch.Tensor  # (B, T) real tokens
    sink: torch.Tensor    # (B, T) sink keys
    rows: torch.Tensor    # (B, T) head-level rows: real tokens that are not sinks
    layers: dict = dataclasses.field(default_factory=dict)  # see layer_keys
    residual: list = dataclasses.field(default_factory=list)  # per block: sum of ||h||^2 over real tokens
    entering: dict = dataclasses.field(default_factory=dict)  # layer_cosine: block -> the stream entering it
    cosine: list = dataclasses.field(default_factory=list)  # per block: sum of cos(h, h + attention) over real tokens
    folds: torch.Tensor | None = None  # (B,) each sample's calibration fold (ridge `auto`), else None

    def on(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mask2d, sink, rows on `device` (device_map: each layer's own)."""
        return tuple(x.to(device) for x in (self.mask2d, self.sink, self.rows))

    def layer_keys(self, mask: torch.Tensor | None, chunk: int, causal: bool, device) -> kernel.LayerKeys:
        """What each chunk of query rows sees, built once per batch: every layer has the same chunks and
        receives the same mask object (within one forward pass its storage identifies it)."""
        key = (chunk, causal, None if mask is None else (mask.data_ptr(), tuple(mask.shape)), str(device))
        if key not in self.layers:
            mask2d, sink, rows = self.on(device)

            def valid_of(q0, q1, k1):
                return valid_keys(None if mask is None else mask[..., :k1], mask2d[:, :k1], q0, q1, causal)

            self.layers[key] = kernel.layer_keys(valid_of, mask2d.shape[1], chunk, causal, sink, rows)
        return self.layers[key]
