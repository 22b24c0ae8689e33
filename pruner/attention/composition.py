"""Attention rows as compositional data: the exact sink / content split.

Pure functions of tensors (no modules, hooks or files). Every function works on
a batch of rows `(..., k_pos)` with boolean masks of the same (broadcastable)
shape:

- `valid` -- keys the query may see (causal prefix, non-pad keys);
- `sink`  -- keys in the sink set S (a subset of `valid` is used).

Content set C = valid & ~sink. Float64 inputs are computed in float64 (the
identities of docs/design.md §4 then hold to ~1e-12); float32 stays float32 (the
streaming capture's per-row work; its sums are float64); half precision is
upcast to float32.

Why log-parts: Aitchison geometry only needs log-ratios, and every log-ratio
among visible keys equals the difference of pre-softmax scores `z`. Functions
named `*_log` accept either `log(a)` or the scores `z` (any per-row constant
cancels), so the content channel is computed without softmax underflow and
without replacing zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor


def _f64(x: Tensor) -> Tensor:
    """The working precision: float64 and float32 as they are, anything else float32."""
    return x if x.dtype in (torch.float64, torch.float32) else x.to(torch.float32)


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def content_mask(sink: Tensor, valid: Tensor) -> Tensor:
    """C = valid keys that are not sinks. (..., k_pos) bool."""
    return valid & ~sink


# --------------------------------------------------------------------------- the two channels

class Channels(NamedTuple):
    """The exact two-channel split of attention rows `a = (s * c_S, (1 - s) * c)`.

    s: (...,) sink mass; rest: (...,) content mass 1 - s, summed from the content
    parts so it stays exact when s rounds to 1; c_sink: (..., k_pos) within-sink
    composition (zero off S); c: (..., k_pos) content composition (zero off C).
    c_sink is undefined (NaN) where s == 0 and c where rest == 0.
    """

    s: Tensor
    rest: Tensor
    c_sink: Tensor
    c: Tensor

    @property
    def logit(self) -> Tensor:
        """The sink coordinate log(s / (1 - s)), exact for s near 1."""
        return torch.log(self.s) - torch.log(self.rest)


def split(a: Tensor, sink: Tensor, valid: Tensor) -> Channels:
    """Split rows into sink mass, within-sink and content (closed) compositions."""
    a = _f64(a)
    sink = sink & valid
    content = content_mask(sink, valid)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    a_s = torch.where(sink, a, zero)
    a_c = torch.where(content, a, zero)
    s = a_s.sum(-1)
    m = a_c.sum(-1)  # = 1 - s, computed from the content parts to keep precision at s -> 1
    return Channels(s, m, a_s / s.unsqueeze(-1), a_c / m.unsqueeze(-1))


def reconstruct(ch: Channels, sink: Tensor) -> Tensor:
    """Inverse of `split`: a = s * c_S on S, (1 - s) * c on C. (..., k_pos)."""
    return torch.where(sink, ch.s.unsqueeze(-1) * torch.nan_to_num(ch.c_sink),
                       ch.rest.unsqueeze(-1) * torch.nan_to_num(ch.c))


def sink_logit(s: Tensor) -> Tensor:
    """The sink coordinate log(s / (1 - s)); see `Channels.logit` for s near 1."""
    s = _f64(s)
    return torch.log(s) - torch.log1p(-s)


def content_count(sink: Tensor, valid: Tensor) -> Tensor:
    """Number of content keys per row; rows with < 2 carry no content information."""
    return content_mask(sink, valid).sum(-1)


# --------------------------------------------------------------------------- entropy

def entropy(p: Tensor, mask: Tensor | None = None) -> Tensor:
    """Shannon entropy (nats) over the last axis, 0 log 0 = 0. (...,)"""
    p = _f64(p)
    terms = torch.xlogy(p, p)
    if mask is not None:
        terms = torch.where(mask, terms, torch.zeros((), dtype=p.dtype, device=p.device))
    return -terms.sum(-1)


def binary_entropy(s: Tensor) -> Tensor:
    """H_b(s) = -s log s - (1 - s) log(1 - s). (...,)"""
    s = _f64(s)
    return -(torch.xlogy(s, s) + torch.xlogy(1 - s, 1 - s))


class EntropyParts(NamedTuple):
    """Grouping property: H(a) = H_b(s) + s * H(c_S) + (1 - s) * H(c). Each (...,)."""

    full: Tensor        # H(a)
    binary: Tensor      # H_b(s)
    sink: Tensor        # s * H(c_S)
    content: Tensor     # (1 - s) * H(c)
    s: Tensor
    rest: Tensor        # 1 - s, from the content parts
    h_sink: Tensor      # H(c_S)
    h_content: Tensor   # H(c)

    @property
    def g(self) -> Tensor:
        """The sink-side entropy H_b(s) + s H(c_S)."""
        return self.binary + self.sink


def entropy_parts(a: Tensor, sink: Tensor, valid: Tensor) -> EntropyParts:
    """The exact entropy decomposition of each row into sink and content terms."""
    ch = split(a, sink, valid)
    sink = sink & valid
    h_s = torch.where(ch.s > 0, entropy(torch.nan_to_num(ch.c_sink), sink), torch.zeros_like(ch.s))
    h_c = torch.where(ch.rest > 0, entropy(torch.nan_to_num(ch.c), content_mask(sink, valid)),
                      torch.zeros_like(ch.s))
    h_b = -(torch.xlogy(ch.s, ch.s) + torch.xlogy(ch.rest, ch.rest))
    return EntropyParts(entropy(_f64(a), valid), h_b, ch.s * h_s, ch.rest * h_c, ch.s, ch.rest, h_s, h_c)


class EntropyAttribution(NamedTuple):
    """dH = sink_part + content_part, exact and symmetric in the two states."""

    delta: Tensor
    sink_part: Tensor
    content_part: Tensor

    @property
    def sink_share(self) -> Tensor:
        return self.sink_part / self.delta


def entropy_attribution(g1: Tensor, w1: Tensor, h_content1: Tensor,
                        g2: Tensor, w2: Tensor, h_content2: Tensor) -> EntropyAttribution:
    """Attribute H(state 2) - H(state 1) to the sink and content channels.

    Each state is H = g + w H(c) with g = H_b(s) + s H(c_S) and w = 1 - s (see
    `EntropyParts.g` / `.rest`). The midpoint product rule gives, exactly and
    symmetrically in the two states,
    dH = [dg + dw * mean H(c)]  (sink part)  +  [mean w * dH(c)]  (content part).
    It applies per row, and equally to head-level means when H(c) is the
    content-weighted mean sum(w H(c)) / sum(w), which keeps H = g + w H(c) exact.
    """
    g1, g2, w1, w2 = _f64(g1), _f64(g2), _f64(w1), _f64(w2)
    hc1, hc2 = _f64(h_content1), _f64(h_content2)
    sink_part = (g2 - g1) + (w2 - w1) * (hc1 + hc2) / 2
    content_part = (w1 + w2) / 2 * (hc2 - hc1)
    return EntropyAttribution(sink_part + content_part, sink_part, content_part)


# --------------------------------------------------------------------------- dot product / cosine

class DotParts(NamedTuple):
    """a . b = sink + content, sink = s_a s_b (c_Sa . c_Sb), content = (1-s_a)(1-s_b)(c_a . c_b)."""

    sink: Tensor
    content: Tensor


def dot_parts(a: Tensor, b: Tensor, sink: Tensor, valid: Tensor) -> DotParts:
    """The exact split of the dot product of two rows over the same keys. Each (...,)."""
    ca, cb = split(a, sink, valid), split(b, sink, valid)
    sink = sink & valid
    content = content_mask(sink, valid)
    dot_s = _masked_sum(torch.nan_to_num(ca.c_sink) * torch.nan_to_num(cb.c_sink), sink)
    dot_c = _masked_sum(torch.nan_to_num(ca.c) * torch.nan_to_num(cb.c), content)
    return DotParts(ca.s * cb.s * dot_s, ca.rest * cb.rest * dot_c)


# --------------------------------------------------------------------------- Aitchison geometry

def clr_log(logp: Tensor, parts: Tensor) -> Tensor:
    """Centred log-ratio over `parts` from log-parts (log a or scores z). Zero off parts."""
    logp = _f64(logp)
    n = parts.sum(-1, keepdim=True)
    mean = _masked_sum(logp, parts).unsqueeze(-1) / n
    return torch.where(parts, logp - mean, torch.zeros((), dtype=logp.dtype, device=logp.device))


def content_clr(z: Tensor, sink: Tensor, valid: Tensor) -> Tensor:
    """clr of the content channel from pre-softmax scores: z_j - mean_{k in C} z_k. (..., k_pos)"""
    return clr_log(z, content_mask(sink & valid, valid))


def aitchison_sq_log(logx: Tensor, logy: Tensor, parts: Tensor) -> Tensor:
    """Squared Aitchison distance over `parts` from log-parts. (...,)"""
    d = clr_log(logx, parts) - clr_log(logy, parts)
    return (d * d).sum(-1)


def sc_balance_log(logp: Tensor, sink: Tensor, valid: Tensor) -> Tensor:
    """The S-vs-C balance sqrt(|S||C|/(|S|+|C|)) log(gm(x_S)/gm(x_C)). (...,)"""
    logp = _f64(logp)
    sink = sink & valid
    content = content_mask(sink, valid)
    ns, nc = sink.sum(-1).to(logp.dtype), content.sum(-1).to(logp.dtype)
    mean_s = _masked_sum(logp, sink) / ns
    mean_c = _masked_sum(logp, content) / nc
    return torch.sqrt(ns * nc / (ns + nc)) * (mean_s - mean_c)


class AitchisonParts(NamedTuple):
    """d_A(a, b)^2 = balance + within_sink + content (an orthogonal split)."""

    balance: Tensor
    within_sink: Tensor
    content: Tensor

    @property
    def total(self) -> Tensor:
        return self.balance + self.within_sink + self.content


def aitchison_parts_log(logx: Tensor, logy: Tensor, sink: Tensor, valid: Tensor) -> AitchisonParts:
    """Split the squared Aitchison distance into S/C balance, within-sink and content terms."""
    sink = sink & valid
    db = sc_balance_log(logx, sink, valid) - sc_balance_log(logy, sink, valid)
    return AitchisonParts(db * db, aitchison_sq_log(logx, logy, sink),
                          aitchison_sq_log(logx, logy, content_mask(sink, valid)))


# --------------------------------------------------------------------------- probability-scale metrics

FULL, CONTENT = "full", "content"
CONVENTIONS = (FULL, CONTENT)


def js_divergence(p: Tensor, q: Tensor, mask: Tensor) -> Tensor:
    """Jensen-Shannon divergence (nats, in [0, log 2]). (...,)"""
    p, q = _f64(p), _f64(q)
    m = (p + q) / 2

    def kl(x):
        return _masked_sum(torch.xlogy(x, x) - torch.xlogy(x, m), mask)

    return ((kl(p) + kl(q)) / 2).clamp_min(0)


def hellinger(p: Tensor, q: Tensor, mask: Tensor) -> Tensor:
    """Hellinger distance sqrt(1/2 sum (sqrt p - sqrt q)^2), in [0, 1]. (...,)"""
    d = torch.sqrt(_f64(p).clamp_min(0)) - torch.sqrt(_f64(q).clamp_min(0))
    return torch.sqrt(_masked_sum(d * d, mask) / 2)


def total_variation(p: Tensor, q: Tensor, mask: Tensor) -> Tensor:
    """Total variation distance 1/2 sum |p - q|, in [0, 1]. (...,)"""
    return _masked_sum((_f64(p) - _f64(q)).abs(), mask) / 2


def cosine(p: Tensor, q: Tensor, mask: Tensor) -> Tensor:
    """Cosine similarity of two non-negative rows, in [0, 1]. (...,)"""
    p, q = _f64(p), _f64(q)
    dot = _masked_sum(p * q, mask)
    return dot / torch.sqrt(_masked_sum(p * p, mask) * _masked_sum(q * q, mask))


METRICS = {"js": js_divergence, "hellinger": hellinger, "tv": total_variation, "cosine": cosine}
SIMILARITIES = {"cosine"}  # larger = more alike; every other metric is a distance


def rows_for(a: Tensor, sink: Tensor, valid: Tensor, convention: str) -> tuple[Tensor, Tensor]:
    """The rows a metric sees under a convention, and the keys it runs over.

    FULL: the whole row `a` over the valid keys (sink included).
    CONTENT: the content composition `c` over C (sink removed, renormalised).
    """
    if convention == FULL:
        return _f64(a), valid
    if convention == CONTENT:
        return torch.nan_to_num(split(a, sink, valid).c), content_mask(sink & valid, valid)
    raise ValueError(f"unknown convention {convention!r}; valid: {', '.join(CONVENTIONS)}")


def metric(name: str, a: Tensor, b: Tensor, sink: Tensor, valid: Tensor, convention: str) -> Tensor:
    """A probability-scale metric between two rows under a labelled convention. (...,)"""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; valid: {', '.join(METRICS)}")
    p, mask = rows_for(a, sink, valid, convention)
    q, _ = rows_for(b, sink, valid, convention)
    return METRICS[name](p, q, mask)
