"""The naive path: eager attention maps with `output_attentions=True`, for quick looks at small models.

It materialises layers x heads x T x T, which is exactly what pruner's streaming
capture avoids; the tests hold the capture against the same maps (tests/eager_reference.py).
"""

from __future__ import annotations

import torch

from pruner.core.data import TokenBatch
from pruner.core.runtime import forward


def sink_positions(input_ids: torch.Tensor, sink_ids: list[int] | None) -> torch.Tensor:
    """Boolean (batch, k_pos): position 0 when `sink_ids` is None, else tokens in `sink_ids`."""
    if sink_ids is None:
        mask = torch.zeros_like(input_ids, dtype=torch.bool)
        mask[:, 0] = True
        return mask
    return torch.isin(input_ids, torch.tensor(sink_ids, dtype=input_ids.dtype))


@torch.no_grad()
def eager_sink_mass(model, batch: TokenBatch, sink_ids: list[int] | None = None, from_query: int = 0,
                    batch_size: int = 8) -> torch.Tensor:
    """Mean attention on the sink tokens per head. Returns (layer, head), float64.

    Averaged over all non-pad query rows at positions >= `from_query` whose query
    token is not itself a sink.
    """
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    total, rows = None, 0
    try:
        for b in batch.batches(batch_size):
            maps = forward(model, b.input_ids, b.attention_mask,
                           output_attentions=True).attentions  # layer x (B, H, T, T)
            sink = sink_positions(b.input_ids, sink_ids)  # (B, T)
            q_ok = b.attention_mask.bool() & ~sink
            q_ok[:, :from_query] = False
            w = q_ok.double()  # (B, T)
            part = torch.stack([(a.double() * sink[:, None, None, :]).sum(-1).mul(w[:, None]).sum((0, 2))
                                for a in maps])  # (layer, head)
            total = part if total is None else total + part
            rows += int(q_ok.sum())
    finally:
        model.set_attn_implementation(impl)
    if rows == 0:
        raise ValueError("no query rows to average over (all padding, sinks or before from_query)")
    return total / rows


def format_table(table: torch.Tensor, fmt: str = "{:.2f}") -> str:
    """A (layer, head) table as aligned text."""
    n_heads = table.shape[1]
    lines = ["layer | " + " ".join(f"h{h:<3d}" for h in range(n_heads))]
    for layer, row in enumerate(table.tolist()):
        lines.append(f"{layer:5d} | " + " ".join(fmt.format(v).rjust(4) for v in row))
    return "\n".join(lines)
