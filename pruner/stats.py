"""Mergeable per-head attention statistics: sums and counts, reduced exactly.

Pure tensor math. `chunk_stats` turns one chunk of attention rows into a
`LayerStats` of sums; `LayerStats` add (batches, processes), and `finalize`
divides once at the end. Because only sums and counts are kept, batch size,
batch order, padding and query chunking cannot change any statistic.

Definitions (DESIGN section 5):

- head-level rows: non-pad query rows whose query token is not a sink;
- sink mass, full entropy, dormancy: means over head-level rows;
- content entropy and CONTENT pairwise metrics: means over head-level rows with
  >= 2 content keys (the others carry no content information; counted);
- FULL pairwise metrics: means over all head-level rows;
- pairwise head x head matrices are within a layer: the mean over the query rows
  the two heads share (all of them) of the per-row metric. Across layers
  (`unstack_layers`), every head of the model is compared with every other: the
  layers see the same query tokens, so stacking all layers' heads on one head
  axis and running the same `chunk_stats` gives the model-wide matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from pruner import composition as cp

Tensor = torch.Tensor
PAIR_METRICS = ("cosine", "js", "hellinger", "tv", "aitchison")


@dataclass
class LayerStats:
    """Sums and counts for one layer (float64). Per-head sums are (head,), pairs (head, head)."""

    rows: Tensor            # () head-level rows
    content_rows: Tensor    # () rows with >= 2 content keys
    sink_mass: Tensor       # sum s
    entropy_full: Tensor    # sum H(a)
    entropy_content: Tensor  # sum H(c) over content rows
    g: Tensor               # sum H_b(s) + s H(c_S)   (entropy attribution)
    rest: Tensor            # sum 1 - s
    rest_h_content: Tensor  # sum (1 - s) H(c)
    dormant: Tensor         # rows with s >= dormant threshold
    pairs: dict[str, Tensor] = field(default_factory=dict)  # "metric/convention" -> (head, head) sums
    outputs: "OutputMoments | None" = None

    def __add__(self, other: "LayerStats") -> "LayerStats":
        if self.pairs.keys() != other.pairs.keys():
            raise ValueError("cannot merge statistics with different pairwise metrics")
        if (self.outputs is None) != (other.outputs is None):
            raise ValueError("cannot merge statistics with and without output moments")
        skip = ("pairs", "outputs")
        kw = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name not in skip}
        outputs = None if self.outputs is None else self.outputs + other.outputs
        return LayerStats(**kw, pairs={k: v + other.pairs[k] for k, v in self.pairs.items()}, outputs=outputs)

    def to(self, device) -> "LayerStats":
        """The same sums on `device` (layers of a device_map model live on different devices)."""
        kw = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name not in ("pairs", "outputs")}
        return LayerStats(**kw, pairs={k: v.to(device) for k, v in self.pairs.items()},
                          outputs=None if self.outputs is None else self.outputs.to(device))


@dataclass
class OutputMoments:
    """First and second moments of each head's output, split by channel (sums, float64).

    Per query row a head writes o = u + w (before the output projection), with
    u = sum_{j in S} a_j v_j the sink channel and w = sum_{j in C} a_j v_j the
    content channel. Keeping sums of o, u, w and of their outer products lets any
    quadratic form through W_O (output norms, fluctuation around the mean, the
    part of it each channel carries) be computed later, exactly.
    `joint` is the second moment of all heads' outputs together, so the energy of
    pruning several heads of a layer at once (their cross terms) is exact too.
    Shapes: tokens (); o, u, w: (head, d_head); oo, uu, ww: (head, d_head, d_head);
    joint: (head * d_head, head * d_head).
    """

    tokens: Tensor
    o: Tensor
    u: Tensor
    w: Tensor
    oo: Tensor
    uu: Tensor
    ww: Tensor
    joint: Tensor

    def __add__(self, other: "OutputMoments") -> "OutputMoments":
        return OutputMoments(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def to(self, device) -> "OutputMoments":
        return OutputMoments(*(getattr(self, f.name).to(device) for f in fields(self)))


def output_moments(a: Tensor, v: Tensor, sink: Tensor, rows: Tensor) -> OutputMoments:
    """Moments of head outputs for one chunk.

    a, sink: (B, H, c, K); v: (B, H, K, d_head); rows: (B, c) rows to count.
    """
    v = v.to(a.dtype)
    a_sink = a * sink
    u = (a_sink @ v).double()  # (B, H, c, d_head)
    w = ((a - a_sink) @ v).double()
    o = u + w
    r = rows.double()[:, None, :, None]  # (B, 1, c, 1)
    first = lambda x: (x * r).sum(dim=(0, 2))  # noqa: E731  (H, d_head)
    second = lambda x: torch.einsum("bhqd,bhqe->hde", x * r, x)  # noqa: E731  (H, d_head, d_head)
    x = (o * r).permute(0, 2, 1, 3).reshape(-1, o.shape[1] * o.shape[3])  # (B * c, H * d_head)
    joint = x.t() @ x  # rows are weighted 0/1, so x^T x = sum over counted rows
    return OutputMoments(r.sum(), first(o), first(u), first(w), second(o), second(u), second(w), joint)


def _pair_sum(x: Tensor, w: Tensor) -> Tensor:
    """Sum over rows of a per-row (B, c, H, H) pair metric, rows weighted by w (B, c)."""
    return torch.einsum("bqij,bq->ij", x, w)


def _cosine_pairs(p: Tensor) -> Tensor:
    """p: (B, H, c, K) -> (B, c, H, H) cosine between heads, per row.

    One Gram matrix per row, normalised by its diagonal (no normalised copy of p).
    """
    p = p.transpose(1, 2)  # (B, c, H, K)
    gram = p @ p.transpose(-1, -2)  # (B, c, H, H)
    norm = torch.diagonal(gram, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # (B, c, H)
    return gram / (norm.unsqueeze(-1) * norm.unsqueeze(-2)).clamp_min(torch.finfo(p.dtype).tiny)


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


def pair_matrices(z: Tensor, a: Tensor, sink: Tensor, valid: Tensor, metrics: tuple[str, ...],
                  convention: str) -> dict[str, Tensor]:
    """Per-row head x head metrics under one convention. Each (B, c, H, H).

    z, a: (B, H, c, K) scores and weights; sink, valid: broadcastable (B, 1, c|1, K).
    """
    p, parts = cp.rows_for(a, sink, valid, convention)
    p = torch.where(parts, p, torch.zeros((), dtype=p.dtype))  # (B, H, c, K)
    return _pairs(p, parts, z, metrics)


def _pairs(p: Tensor, parts: Tensor, z: Tensor, metrics: tuple[str, ...],
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


def _channel_sums(x: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row sums of x (B, H, c, K) over the sink keys and over all other keys: (B, H, c) each.

    One batched matrix-vector product against [sink, not sink] (B, K, 2) instead of
    two masked copies of x.
    """
    B, H, c, K = x.shape
    sel = torch.stack([sink, ~sink], dim=-1).to(x.dtype)  # (B, K, 2)
    out = torch.bmm(x.reshape(B, H * c, K), sel).view(B, H, c, 2)
    return out[..., 0], out[..., 1]


def chunk_stats(z: Tensor, sink: Tensor, valid: Tensor, rows: Tensor, metrics: tuple[str, ...] = (),
                dormant_threshold: float = 0.9, v: Tensor | None = None,
                out_rows: Tensor | None = None) -> LayerStats:
    """Statistics of one chunk of query rows of one layer, as sums.

    z: (B, H, c, K) pre-softmax scores (any value at invalid keys);
    sink: (B, K) sink keys; valid: (B, 1|H, c, K) keys each query may see;
    rows: (B, c) query rows that count (non-pad, not a sink).
    With values v: (B, H, K, d_head), also the output moments over `out_rows`
    (B, c): every non-pad query, sinks included, since all of them are written.

    This runs on every chunk of every layer, so it makes few passes over the
    (B, H, c, K) rows: softmax, one xlogy, and two matrix-vector products that
    split a and a log a into their sink and content sums. The entropy grouping
    terms then follow per row (DESIGN section 4) without forming the compositions:
    with T_S = sum_S a log a and T_C = sum_C a log a,
    s H(c_S) = s log s - T_S,  (1 - s) H(c) = (1 - s) log(1 - s) - T_C,  H(a) = -(T_S + T_C).
    Invalid keys are filled with the most negative finite score, not -inf: their
    weight is exactly 0, and a row with no visible key (padding, never counted)
    comes out uniform and finite, so no NaN needs cleaning.
    """
    z = z if z.dtype in (torch.float32, torch.float64) else z.float()  # per-row work; sums in float64
    a = torch.softmax(z.masked_fill(~valid, torch.finfo(z.dtype).min), dim=-1)  # (B, H, c, K)
    s, rest = _channel_sums(a, sink)  # (B, H, c): sink mass, content mass (summed from its parts)
    t_sink, t_content = _channel_sums(torch.xlogy(a, a), sink)
    xr = torch.xlogy(rest, rest)
    h_full = -(t_sink + t_content)
    content = xr - t_content  # (1 - s) H(c)
    h_content = torch.where(rest > 0, content / rest, torch.zeros((), dtype=a.dtype))
    n_content = (valid & ~sink[:, None, None, :]).sum(-1)  # (B, 1|H, c), same for every head
    w = rows.to(torch.float64)  # (B, c)
    wc = w * (n_content[:, 0] >= 2)
    per_head = lambda x, wt: torch.einsum("bhq,bq->h", x.double(), wt)  # noqa: E731
    pairs = {}
    if metrics:
        content_keys = valid & ~sink[:, None, None, :]
        c = a * (~sink)[:, None, None, :] / rest.unsqueeze(-1).clamp_min(torch.finfo(a.dtype).tiny)
        for conv, p, parts, h, wt in ((cp.FULL, a, valid, h_full, w), (cp.CONTENT, c, content_keys, None, wc)):
            for name, m in _pairs(p, parts, z, metrics, h).items():
                pairs[f"{name}/{conv}"] = _pair_sum(torch.nan_to_num(m).double(), wt)
    return LayerStats(
        rows=w.sum(), content_rows=wc.sum(),
        sink_mass=per_head(s, w), entropy_full=per_head(h_full, w),
        entropy_content=per_head(h_content, wc),
        g=per_head(-xr - t_sink, w), rest=per_head(rest, w), rest_h_content=per_head(content, w),
        dormant=per_head((s >= dormant_threshold).to(torch.float64), w), pairs=pairs,
        outputs=None if v is None else output_moments(a, v, sink[:, None, None, :], out_rows))


@dataclass(frozen=True)
class HeadStats:
    """Finalised per-head means. Per-head fields: (layer, head); pairs: (layer, head, head)."""

    sink_mass: Tensor
    entropy_full: Tensor
    entropy_content: Tensor
    dormancy: Tensor
    g: Tensor                 # mean H_b(s) + s H(c_S)
    rest: Tensor              # mean 1 - s
    h_content_weighted: Tensor  # sum (1-s) H(c) / sum (1-s): keeps H = g + rest * H(c) exact
    rows: Tensor              # (layer,) head-level rows
    content_rows: Tensor      # (layer,)
    excluded_rows: Tensor     # (layer,) rows with < 2 content keys
    pairs: dict[str, Tensor]
    outputs: list[OutputMoments] | None = None  # per layer, sums (see OutputMoments)
    residual: Tensor | None = None  # (layer,) mean squared norm of the residual stream entering the layer
    model_pairs: dict[str, Tensor] | None = None  # (layer * head, layer * head), layer-major; see unstack_layers


def finalize(layers: list[LayerStats]) -> HeadStats:
    """Divide the sums by their counts once, after every merge."""
    if any(float(s.rows) == 0 for s in layers):
        raise ValueError("no query rows were captured (all padding or sinks?)")
    bad = [i for i, s in enumerate(layers) if not torch.isfinite(s.sink_mass + s.entropy_full).all()]
    if bad:
        raise ValueError(f"attention statistics of layer {bad[0]} are NaN/inf: the model produced non-finite "
                         "attention logits (half-precision overflow? load it with model.dtype: float32)")
    st = lambda name: torch.stack([getattr(s, name) for s in layers])  # noqa: E731
    rows, crows = st("rows"), st("content_rows")
    safe_c = crows.clamp_min(1)
    pairs = {}
    for key in layers[0].pairs:
        denom = rows if key.endswith(cp.FULL) else safe_c
        pairs[key] = torch.stack([s.pairs[key] for s in layers]) / denom[:, None, None]
    per_head = lambda name, d: st(name) / d[:, None]  # noqa: E731
    return HeadStats(
        sink_mass=per_head("sink_mass", rows), entropy_full=per_head("entropy_full", rows),
        entropy_content=per_head("entropy_content", safe_c), dormancy=per_head("dormant", rows),
        g=per_head("g", rows), rest=per_head("rest", rows),
        h_content_weighted=st("rest_h_content") / st("rest").clamp_min(1e-300),
        rows=rows, content_rows=crows, excluded_rows=rows - crows, pairs=pairs,
        outputs=None if layers[0].outputs is None else [s.outputs for s in layers])


def unstack_layers(stacked: HeadStats, n_layers: int) -> HeadStats:
    """Per-layer statistics from one capture whose "layer" held every head of the model.

    `stacked` is `finalize` of a single `LayerStats` over the layer-major stacked
    head axis (layer * head). Per-head fields become (layer, head); the within-layer
    pairs are the diagonal blocks (layer, head, head), exactly what a per-layer
    capture gives; the whole matrices are kept as `model_pairs`.
    """
    n = stacked.sink_mass.shape[-1]
    if stacked.sink_mass.shape[0] != 1 or n % n_layers:
        raise ValueError(f"expected one stacked layer of layer * head heads, got {tuple(stacked.sink_mass.shape)}")
    H = n // n_layers
    per_head = lambda x: x.reshape(n_layers, H)  # noqa: E731
    per_layer = lambda x: x.expand(n_layers).clone()  # noqa: E731  the same query rows in every layer
    model_pairs = {k: v[0] for k, v in stacked.pairs.items()}  # (L*H, L*H)
    blocks = {k: torch.stack([m[i * H:(i + 1) * H, i * H:(i + 1) * H] for i in range(n_layers)])
              for k, m in model_pairs.items()}
    return HeadStats(
        sink_mass=per_head(stacked.sink_mass), entropy_full=per_head(stacked.entropy_full),
        entropy_content=per_head(stacked.entropy_content), dormancy=per_head(stacked.dormancy),
        g=per_head(stacked.g), rest=per_head(stacked.rest),
        h_content_weighted=per_head(stacked.h_content_weighted),
        rows=per_layer(stacked.rows), content_rows=per_layer(stacked.content_rows),
        excluded_rows=per_layer(stacked.excluded_rows), pairs=blocks, model_pairs=model_pairs)
