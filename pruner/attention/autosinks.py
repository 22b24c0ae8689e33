"""Data-driven sinks (Gu et al. 2025, Sink_eps): the keys whose mean received attention exceeds eps."""

from __future__ import annotations

from pruner.attention.sinks import SinkSpec, relative_positions
from pruner.core import distributed


def auto_sink_spec(received: list, eps: float) -> SinkSpec:
    """The sink spec of the received-attention sums a capture collected ([ids, mask, received, count] per
    batch, every process's in rank order): positions from the first real token, and token ids, whose mean
    received attention exceeds `eps`; positions when any, else ids."""
    by_pos: dict[int, list[float]] = {}
    by_id: dict[int, list[float]] = {}
    rows = [(rel, ids, mask2d, got, count) for ids, mask2d, got, count in
            ((i.cpu(), m.cpu(), r.cpu(), c.cpu()) for i, m, r, c in received)
            for rel in [relative_positions(mask2d)]]
    for part in distributed.all_objects(rows):  # every process's batches, in rank order
        for rel, ids, mask2d, got, count in part:
            for key, table in ((rel, by_pos), (ids, by_id)):
                for k, r, c in zip(key[mask2d.bool()].tolist(), got[mask2d.bool()].tolist(),
                                   count[mask2d.bool()].tolist()):
                    acc = table.setdefault(k, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + r, acc[1] + c

    def pick(t):
        return tuple(sorted(k for k, (r, c) in t.items() if c > 0 and r / c > eps))

    positions, ids = pick(by_pos), pick(by_id)
    if not positions and not ids:
        raise ValueError(f"no key receives more than eps={eps} of the attention on average: "
                         "no data-driven sink; choose a sink mode explicitly")
    if positions:
        return SinkSpec("positions", positions=positions, ids=ids, eps=eps)
    return SinkSpec("ids", ids=ids, eps=eps)
