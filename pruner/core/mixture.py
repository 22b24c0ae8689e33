"""Calibration samples from more than one kind of text, and a held-back slice the sums never see.

A mixture gives each source a share of the samples by its weight (largest remainders, so the
shares add up exactly and ties go to the earlier source); each sample comes from one source,
drawn from that source alone exactly as a single source would draw it (`pruner.core.data.samples`),
and the sources' samples are then interleaved by a seeded permutation, so any prefix of the
calibration (the ablation scorer's subset, a batch) holds every kind of text. The held-back slice
is taken from every source by the same weights, chosen within each source by its own seeded draw:
a validation set of the same kinds of text that calibration never sums (`scorer.name: auto` scores
its candidates on it). Deterministic: the same sources, tokenizer, weights and seed give the same
samples in the same order; one source with nothing held back gives exactly `data.samples`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pruner.core import data
from pruner.core.data import DataError, TokenBatch


def shares(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`: whole numbers that sum to `total` (largest remainders)."""
    s = float(sum(weights))
    if not s > 0 or any(w < 0 for w in weights):
        raise ValueError(f"weights must be >= 0 and sum to a positive number, got {list(weights)}")
    exact = [total * w / s for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[:total - sum(out)]:
        out[i] += 1
    return out


def check_sources(v: str | list[str]) -> str | list[str]:
    """A source or a mixture's list of them, each one that can name text (`data.check_source`)."""
    if isinstance(v, str) and not v.strip():
        raise ValueError("must name a source (it is empty)")
    sources = [v] if isinstance(v, str) else v
    if not sources or any(not isinstance(x, str) or not x.strip() for x in sources):
        raise ValueError("a mixture lists one or more non-empty sources")
    if len(set(sources)) < len(sources):
        raise ValueError(f"a mixture lists a source twice ({sources}): give it a larger weight instead")
    for x in sources:
        data.check_source(x)
    return v


def check_shares(n_sources: int, weights: list[float] | None, num_samples: int | None, holdout: int | None) -> None:
    """A mixture's weights (one per source, >= 0, a positive finite sum, with a sample count to share out) and a
    held-back slice smaller than the calibration data; one-line errors before any text is read."""
    if weights is not None:
        if len(weights) != n_sources:
            raise ValueError(f"weights: {len(weights)} weights for {n_sources} sources")
        if any(not w >= 0 for w in weights) or not 0 < sum(weights) < float("inf"):
            raise ValueError(f"weights must be >= 0 and sum to a positive number, got {weights}")
        if num_samples is None:
            raise ValueError("weights share out calibration.num_samples: set it (null takes every sample of every "
                             "source)")
    if holdout and num_samples is not None and holdout >= num_samples:
        raise ValueError(f"holdout: {holdout} held-back samples is not smaller than the calibration data "
                         f"({num_samples} samples): nothing would be left for the sums")


def concat(batches: Sequence[TokenBatch], pad_id: int = 0) -> TokenBatch:
    """Samples of several batches in one, right-padded to the widest. input_ids: (sample, q_pos)."""
    width = max(b.input_ids.shape[1] for b in batches)

    def grow(t, v):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=v)

    return TokenBatch(torch.cat([grow(b.input_ids, pad_id) for b in batches]),
                      torch.cat([grow(b.attention_mask, 0) for b in batches]))


def take(batch: TokenBatch, index: Sequence[int] | torch.Tensor) -> TokenBatch:
    index = torch.as_tensor(index, dtype=torch.long)
    return TokenBatch(batch.input_ids[index], batch.attention_mask[index])


def hold_back(batch: TokenBatch, n: int, seed: int, name: str = "the text") -> tuple[TokenBatch, TokenBatch]:
    """(kept, held back): `n` samples chosen by a seeded draw held back; both keep the batch's order."""
    if n >= len(batch):
        raise DataError(f"calibration.holdout: {n} held-back samples from {name} leave none of its {len(batch)} "
                        "for the calibration sums; hold back fewer or raise calibration.num_samples")
    held = set(torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed))[:n].tolist())
    return (take(batch, [i for i in range(len(batch)) if i not in held]),
            take(batch, sorted(held)))


@dataclass(frozen=True)
class Draw:
    """How many samples `mixed_samples` draws, with which seed, and how many of them it holds back."""

    num_samples: int | None = None  # samples in all, None: every sample of every source
    seed: int = 0                   # which samples, their order, and which are held back
    holdout: int = 0                # samples held back (out of each source's share)


def mixed_samples(tokenizer, corpora: Sequence[Sequence[str]], unit: str, length: int, *, weights=None,
                  bos: bool = True, draw: Draw = Draw(), names: Sequence[str] | None = None
                  ) -> tuple[TokenBatch, TokenBatch | None]:
    """(calibration samples, held-back samples or None) from the documents of each source in `corpora`.

    `weights` (default: equal shares) divide `draw.num_samples` (None: every sample of every source) and
    `draw.holdout` between the sources; the held-back samples come out of each source's share.
    """
    num_samples, seed, holdout = draw.num_samples, draw.seed, draw.holdout
    names = list(names or [f"source {i + 1}" for i in range(len(corpora))])
    weights = list(weights) if weights is not None else [1.0] * len(corpora)
    counts = shares(num_samples, weights) if num_samples is not None else [None] * len(corpora)
    held_counts = shares(holdout, weights) if holdout else [0] * len(corpora)
    kept, held = [], []
    for i, texts in enumerate(corpora):
        if counts[i] == 0:
            continue
        try:
            b = data.samples(tokenizer, texts, unit, length, bos=bos, num_samples=counts[i], seed=seed)
        except DataError as e:
            raise DataError(f"{names[i]}: {e}") from None
        if held_counts[i]:
            b, h = hold_back(b, held_counts[i], seed + 1 + i, names[i])
            held.append(h)
        kept.append(b)
    pad_id = tokenizer.pad_token_id or 0
    if len(kept) == 1:
        return kept[0], (held[0] if held else None)

    def mix(bs):
        return take(concat(bs, pad_id), torch.randperm(sum(len(b) for b in bs),
                                                       generator=torch.Generator().manual_seed(seed)))

    return mix(kept), (mix(held) if held else None)
