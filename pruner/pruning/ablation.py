"""The measured reference every proxy is judged against: remove one head, measure the loss.

`single_head_ablations` removes each head alone -- under the scoped mask, with the
compensation the run uses -- and measures the calibration loss on a subset of the
calibration samples: L x H + 1 passes over that subset. It is what a scorer would
ideally predict for one head (the `ablation` scorer ranks heads by it), and what the
cheap proxies are compared with; it is not a search over sets (removing two heads is
not the sum of removing each).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from pruner.core import arch, distributed
from pruner.core.data import TokenBatch
from pruner.core.runtime import forward
from pruner.pruning import surgery


@dataclass(frozen=True)
class Ablations:
    """Loss increase per head removed alone (layer, head), float64, and what measuring it cost."""

    increase: torch.Tensor
    base_loss: float
    windows: int
    passes: int
    seconds: float

    def cost(self, only: torch.Tensor | None = None) -> dict:
        """Passes over the windows, and seconds: of every head measured here, or of the `only` heads alone
        (the shortlist's own cost when the whole ablation was measured in the same run: its share of the time)."""
        passes = self.passes if only is None else int(only.sum()) + 1
        return {"passes": passes, "windows": self.windows, "seconds": round(self.seconds * passes / self.passes, 1)}


def subset(batch: TokenBatch, n: int) -> TokenBatch:
    """The first `n` samples: the calibration samples are already a seeded random draw."""
    return TokenBatch(batch.input_ids[:n], batch.attention_mask[:n])


@torch.no_grad()
def token_nll(model, batch: TokenBatch, labels: torch.Tensor | None = None, batch_size: int = 8) -> tuple[float, int]:
    """(sum of NLL, target count) over a batch: next-token targets for decoders, or `labels`
    (-100 off-target) for a masked LM whose `batch.input_ids` are already masked."""
    total, count = 0.0, 0
    for i in range(0, len(batch), batch_size):
        ids, mask = batch.input_ids[i:i + batch_size], batch.attention_mask[i:i + batch_size]
        logits = forward(model, ids, mask).logits.float()
        if labels is None:
            logits, target = logits[:, :-1], ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        else:
            target = labels[i:i + batch_size]
        target = target.to(logits.device)
        total += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                         reduction="sum"))
        count += int((target != -100).sum())
    return total, count


@dataclass(frozen=True)
class AblationRequest:
    """What the measured scorers ask of calibration: each head removed alone with `compensation`, on the first
    `samples` samples -- every head for `ablation`, and for `ablation-shortlist` only the `shortlist` share of
    each layer's heads that the refit-aware proxy finds cheapest (`shortlist_of`)."""

    compensation: str
    samples: int
    shortlist: float = 0.5
    scorers: tuple[str, ...] = ("ablation",)


def shortlist_of(proxy: torch.Tensor, share: float) -> torch.Tensor:
    """The `share` of each layer's heads (at least one) with the lowest proxy importance: (layer, head) bool.

    The cheaper measured variant re-measures only what the best proxy would prune first: the
    measurement corrects the proxy's order where it matters, at `share` of the passes."""
    L, H = proxy.shape
    k = max(1, min(H, round(share * H)))
    order = torch.argsort(proxy.double() + torch.arange(H, dtype=torch.float64) * 1e-12, dim=1)  # ties by head
    out = torch.zeros(L, H, dtype=torch.bool)
    out.scatter_(1, order[:, :k], True)
    return out


def single_head_ablations(model, batch: TokenBatch, compensate: Callable[[surgery.HeadSet], surgery.Compensation],
                          labels: torch.Tensor | None = None, batch_size: int = 8,
                          progress: bool = False, only: torch.Tensor | None = None) -> Ablations:
    """Mean calibration NLL with each head removed alone, minus the unpruned model's. (layer, head)

    `compensate(heads)` gives the compensation of removing `heads` (zero, mean or refit, as the
    run applies it). `only` ((layer, head) bool): measure those heads alone, NaN elsewhere. With
    several processes each takes every world-th sample; the sums are added in rank order, so any
    process count gives the same numbers.
    """
    g = arch.geometry(model)
    heads = [(layer, h) for layer in range(g.n_layers) for h in range(g.n_heads) if only is None or only[layer, h]]
    out = torch.full((g.n_layers, g.n_heads), float("nan"), dtype=torch.float64)
    found = _measured(model, batch, [{layer: [h]} for layer, h in heads], compensate, labels, batch_size,
                      "ablation" if progress else None)
    for (layer, h), x in zip(heads, found.increase.tolist()):
        out[layer, h] = x
    return Ablations(out, found.base_loss, found.windows, found.passes, found.seconds)


def layer_ablations(model, batch: TokenBatch, compensate: Callable[[surgery.HeadSet], surgery.Compensation],
                    labels: torch.Tensor | None = None, batch_size: int = 8, progress: bool = False) -> Ablations:
    """Mean calibration NLL with each layer's whole attention removed alone (every head of it, with the run's
    compensation), minus the unpruned model's: (layer,), L + 1 passes. The layer-ablation scorer's reading."""
    g = arch.geometry(model)
    sets = [{layer: list(range(g.n_heads))} for layer in range(g.n_layers)]
    return _measured(model, batch, sets, compensate, labels, batch_size, "layer ablation" if progress else None)


def _measured(model, batch: TokenBatch, sets: list[surgery.HeadSet],
              compensate: Callable[[surgery.HeadSet], surgery.Compensation], labels: torch.Tensor | None,
              batch_size: int, desc: str | None) -> Ablations:
    """The loss increase of each head set removed alone under the scoped mask: (len(sets),), float64; each
    process scores every world-th sample, the sums added in rank order."""
    mine = distributed.shard_indices(len(batch))
    part = TokenBatch(batch.input_ids[mine], batch.attention_mask[mine])
    lab = None if labels is None else labels[mine]
    t0 = time.perf_counter()

    def loss() -> float:
        s, c = token_nll(model, part, lab, batch_size)
        s, c = distributed.sum_in_rank_order(torch.tensor([s, float(c)], dtype=torch.float64)).tolist()
        return s / max(c, 1.0)

    base = loss()
    out = torch.zeros(len(sets), dtype=torch.float64)
    for i, one in enumerate(tqdm(sets, desc=desc, unit="set") if desc else sets):
        with surgery.masked(model, one, compensate(one)):
            out[i] = loss() - base
    return Ablations(out, base, len(batch), len(sets) + 1, time.perf_counter() - t0)
