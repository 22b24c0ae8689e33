"""Head x head metrics per query row (cosine, Jensen-Shannon, Hellinger, total variation, Aitchison), on
rows of any convention: the per-row terms the capture sums into pair matrices."""

from __future__ import annotations

import math

import torch

from pruner.attention import composition as cp

Tensor = torch.Tensor


PAIR_METRICS = ("cosine", "js", "hellinger", "tv", "aitchison")


def pair_sum(x: Tensor, w: Tensor) -> Tensor:
    """Sum over rows of a per-row (B, c, H, H) pair metric, rows weighted by w (B, c)."""
    return torch.einsum("bqij,bq->ij", x, w)


def head_gram(x: Tensor) -> Tensor:
    """Per-row Gram matrices of the heads' rows: x (B, H, c, K) -> (B, c, H, H), sum_k x[b,h,q,k] x[b,g,q,k].

    One strided batched product per sample -- the (c, H, K) view of x[b] is a valid batched matrix as it
    lies, no copy -- where einsum's generic path first copies x twice into a (B, c, K, H) layout, about ten
    times the product's own cost on a CPU. The einsum's sums to float32 rounding, and the same bits at any
    thread count (`tests/test_capture.py`)."""
    B, H, c, _ = x.shape
    out = x.new_empty(B, c, H, H)
    for b in range(B):
        v = x[b].transpose(0, 1)  # (c, H, K)
        torch.bmm(v, v.transpose(1, 2), out=out[b])
    return out


def row_dot(x: Tensor, y: Tensor) -> Tensor:
    """sum_k x[..., k] y[..., k] for x, y (B, H, c, K): (B, H, c), as one batched product (no product tensor)."""
    return torch.matmul(x.unsqueeze(-2), y.unsqueeze(-1))[..., 0, 0]


def _cosine_pairs(p: Tensor) -> Tensor:
    """p: (B, H, c, K) -> (B, c, H, H) cosine between heads, per row."""
    return cosine_from_gram(head_gram(p))


def cosine_from_gram(gram: Tensor) -> Tensor:
    """Per-row Gram matrices (B, c, H, H) of heads' rows -> their cosines, normalised by the diagonal."""
    norm = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # (B, c, H)
    return gram / (norm.unsqueeze(-1) * norm.unsqueeze(-2)).clamp_min(torch.finfo(gram.dtype).tiny)


def _symmetric(row, B: int, c: int, H: int, like: Tensor) -> Tensor:
    """(B, c, H, H) zero-diagonal symmetric matrix from its upper triangle, one head at a time:
    `row(i)` is head i against heads i+1.. as (B, H-i-1, c). Memory stays (B, H, c, K)."""
    out = like.new_zeros(B, c, H, H)
    for i in range(H - 1):
        d = row(i).transpose(1, 2)  # (B, c, H-i-1)
        out[:, :, i, i + 1:] = d
        out[:, :, i + 1:, i] = d
    return out


def _loop_pairs(p: Tensor, fn) -> Tensor:
    """Symmetric elementwise pair metrics fn(p_i, p_j) (zero on the diagonal), upper triangle only."""
    B, H, c, K = p.shape
    return _symmetric(lambda i: fn(p[:, i:i + 1], p[:, i + 1:]), B, c, H, p)


def _js_pairs(p: Tensor, h: Tensor) -> Tensor:
    """Jensen-Shannon divergence between heads, per row: JS = H(m) - (H(p) + H(q)) / 2. (B, c, H, H)

    p: (B, H, c, K) rows (zero off their keys); h: (B, H, c) their entropies. A
    pair costs one add and one xlogy pass: with n = p + q = 2m,
    H(m) = -(1/2) sum n log n + (log 2 / 2) sum n, and sum n is the rows' masses.
    """
    B, H, c, K = p.shape
    mass = p.sum(-1)  # (B, H, c)

    def row(i: int) -> Tensor:
        n = p[:, i + 1:] + p[:, i:i + 1]  # (B, H-i-1, c, K)
        hm = (math.log(2) * (mass[:, i + 1:] + mass[:, i:i + 1]) - n.xlogy_(n).sum(-1)) / 2  # (B, H-i-1, c)
        return (hm - (h[:, i + 1:] + h[:, i:i + 1]) / 2).clamp_min(0)
    return _symmetric(row, B, c, H, p)


def _hellinger(p: Tensor, q: Tensor) -> Tensor:
    """Direct form: 1 - Bhattacharyya coefficient would cancel badly near p = q."""
    d = p.clamp_min(0).sqrt() - q.clamp_min(0).sqrt()
    return ((d * d).sum(-1) / 2).sqrt()


def _tv(p: Tensor, q: Tensor) -> Tensor:
    return (p - q).abs().sum(-1) / 2


def _aitchison_pairs(clr: Tensor) -> Tensor:
    """clr: (B, H, c, K) zero off parts -> (B, c, H, H) Aitchison distance."""
    x = clr.transpose(1, 2)  # (B, c, H, K)
    sq = (x * x).sum(-1)
    d2 = sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2 * (x @ x.transpose(-1, -2))
    return d2.clamp_min(0).sqrt()


def _entropy(p: Tensor) -> Tensor:
    return -torch.xlogy(p, p).sum(-1)


def row_pairs(p: Tensor, parts: Tensor, z: Tensor, metrics: tuple[str, ...],
           h: Tensor | None = None) -> dict[str, Tensor]:
    """The metrics between heads' rows p (B, H, c, K), zero off `parts`; h: their entropies if known."""
    out = {}
    for m in metrics:
        if m == "cosine":
            out[m] = _cosine_pairs(p)
        elif m == "hellinger":
            out[m] = _loop_pairs(p, _hellinger)
        elif m == "js":
            out[m] = _js_pairs(p, _entropy(p) if h is None else h)
        elif m == "tv":
            out[m] = _loop_pairs(p, _tv)
        elif m == "aitchison":
            zz = torch.where(parts, z, torch.zeros((), dtype=z.dtype))
            out[m] = _aitchison_pairs(cp.clr_log(zz, parts.expand_as(zz)))
        else:
            raise ValueError(f"unknown pair metric {m!r}; valid: {', '.join(PAIR_METRICS)}")
    return out
