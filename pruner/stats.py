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
from contextlib import contextmanager
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


def output_moments(o: Tensor, u: Tensor, rows: Tensor, bf16: bool = False) -> OutputMoments:
    """Moments of one layer's head outputs over the counted rows of a batch.

    o: (B, T, H, d_head) what the output projection receives (any float dtype);
    u: (B, T, H, d_head) float32, its sink channel; rows: (B, T) rows to count.
    The products run in float32 on values centred on their batch mean and are
    uncentred in float64: the sink channel writes nearly the same vector on every
    row, so raw second moments are dominated by mean x mean^T and a float32 product
    of raw values would lose the fluctuation that scoring and refit read. `joint`
    costs (B * T) x (H * d_head)^2, as much as the output projection itself, so it is
    computed on the upper block triangle only (`gram`); with `bf16` (a bfloat16 model)
    its products run in reduced precision (`matmul_precision`), rounding the centred
    values by at most 2^-9, no more than the model rounded o itself.
    """
    B, T, H, D = o.shape
    N = B * T
    r = rows.reshape(N, 1).to(torch.float32)  # 0/1 row weights: pad rows are zeroed, not selected out
    every = bool(r.all())
    x = o.reshape(N, H * D)
    uf = u.reshape(N, H * D)
    n = r.sum(dtype=torch.float64)
    # float64 sums (their rounding does not depend on the thread count); the means centre the products
    o_sum, u_sum = ((y if every else y * r).sum(0, dtype=torch.float64) for y in (x, uf))
    ref_o, ref_u = (o_sum / n).float(), (u_sum / n).float()
    xc = x.float() - ref_o  # (N, H * d_head)
    uc = uf - ref_u
    if not every:
        xc.mul_(r)
        uc.mul_(r)
    wc = (xc - uc).view(N, H, D)  # w = o - u, centred on ref_o - ref_u
    uc = uc.view(N, H, D)
    ref_w = (ref_o - ref_u).view(H, D)
    with matmul_precision(bf16):
        joint_c = gram(xc, H)
    per_head = lambda y: torch.bmm(y.permute(1, 2, 0), y.transpose(0, 1))  # noqa: E731  (H, d_head, d_head)
    o_sum, u_sum = o_sum.view(H, D), u_sum.view(H, D)
    w_sum = o_sum - u_sum

    def uncentre(c: Tensor, total: Tensor, ref: Tensor) -> Tensor:
        """sum x x^T from the centred sum: with s = sum (x - r) and t = s + n r / 2,
        sum xc xc^T + r s^T + s r^T + n r r^T = sum xc xc^T + r t^T + t r^T."""
        r = ref.double()
        t = total - (n / 2) * r
        out = c.double()
        if out.dim() == 2:
            return out.addr_(r, t).addr_(t, r)
        return out.baddbmm_(r.unsqueeze(-1), t.unsqueeze(-2)).baddbmm_(t.unsqueeze(-1), r.unsqueeze(-2))

    joint = uncentre(joint_c, o_sum.view(-1), ref_o)  # (H * d_head, H * d_head)
    oo = torch.diagonal(joint.view(H, D, H, D), dim1=0, dim2=2).permute(2, 0, 1).contiguous()  # (H, d, d)
    return OutputMoments(n, o_sum, u_sum, w_sum, oo, uncentre(per_head(uc), u_sum, ref_u.view(H, D)),
                         uncentre(per_head(wc), w_sum, ref_w), joint)


def gram(x: Tensor, heads: int, rows: int = 512) -> Tensor:
    """x^T x for x (N, F), float32: the upper block triangle only (F split into <= 4 blocks at head
    boundaries: 10/16 of the multiply-adds), mirrored.

    Summed over blocks of `rows` rows in order: BLAS libraries split a long inner
    dimension across threads (MKL here: from 1024 rows for a 64-column block, never at
    512 for 32 to 2048 columns), which
    would make the result, and the plans scored from it, depend on the thread count.
    """
    F = x.shape[1]
    nb = min(4, heads)
    edges = [F * (heads * i // nb) // heads for i in range(nb + 1)]
    out = x.new_zeros(F, F)
    for r0 in range(0, x.shape[0], rows):
        xr = x[r0:r0 + rows]
        for a, b in zip(edges[:-1], edges[1:]):
            out[a:b, a:].addmm_(xr[:, a:b].t(), xr[:, a:])
    for a, b in zip(edges[:-1], edges[1:]):
        out[b:, a:b] = out[a:b, b:].t()
    return out


@contextmanager
def matmul_precision(half: bool):
    """Inside, float32 matrix products may round their inputs to the model's precision (`half`):
    bfloat16 with float32 accumulation on the CPU (oneDNN: AMX / avx512_bf16), TF32 on CUDA.

    Exact for products of bfloat16 values (q k^T of a bfloat16 model: every product of
    two 8-bit mantissas fits float32, and bfloat16 fits TF32's 10 bits), and several
    times faster than IEEE float32. Only products of the model's own values, or of
    values whose rounding matters no more than the model's (see `output_moments`),
    run here. (The CUDA setting is untested here: no GPU was available.)
    """
    if not half:
        yield
        return
    cpu, cuda = torch.backends.mkldnn.matmul, torch.backends.cuda.matmul
    prev = cpu.fp32_precision, cuda.fp32_precision
    cpu.fp32_precision, cuda.fp32_precision = "bf16", "tf32"
    try:
        yield
    finally:
        cpu.fp32_precision, cuda.fp32_precision = prev


def _pair_sum(x: Tensor, w: Tensor) -> Tensor:
    """Sum over rows of a per-row (B, c, H, H) pair metric, rows weighted by w (B, c)."""
    return torch.einsum("bqij,bq->ij", x, w)


def _cosine_pairs(p: Tensor) -> Tensor:
    """p: (B, H, c, K) -> (B, c, H, H) cosine between heads, per row."""
    return _cosine_from_gram(torch.einsum("bhqk,bgqk->bqhg", p, p))


def _cosine_from_gram(gram: Tensor) -> Tensor:
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


@dataclass(frozen=True)
class SinkCols:
    """The sink keys of a batch as columns: sinks are few, so gathering their columns replaces
    passes over every key.

    cols: (P,) long, ascending: the key positions that are a sink of some sequence;
    member: (B, P) 1.0 where cols[p] is a sink of sequence b, else 0.0; mask: (B, K) bool.
    """

    cols: Tensor
    member: Tensor
    mask: Tensor

    def before(self, k1: int) -> int:
        """How many of the columns lie among the first k1 keys."""
        return int(torch.searchsorted(self.cols, k1))


def sink_cols(sink: Tensor) -> SinkCols:
    """`SinkCols` of a (B, K) bool sink mask."""
    cols = sink.any(0).nonzero().flatten()  # (P,) ascending
    return SinkCols(cols, sink[:, cols].to(torch.float32), sink)


@dataclass(frozen=True)
class ChunkKeys:
    """Query rows [q0, q1) of a layer and the keys they see: valid (B, 1|H, c, K) bool, K the keys
    up to the chunk's last visible one; masked_from: the first key column any row masks (None: none)."""

    q0: int
    q1: int
    valid: Tensor
    masked_from: int | None


@dataclass(frozen=True)
class LayerKeys:
    """What the query rows of a batch see, chunk by chunk, and which rows count. The same for every
    layer with the same mask, so the capture builds it once per batch.

    chunks: cover the rows [0, T) in order; sinks: of all T keys; w: (B, T) float64
    head-level rows; wc: (B, T) float64 those with >= 2 content keys.
    """

    chunks: tuple[ChunkKeys, ...]
    sinks: SinkCols
    w: Tensor
    wc: Tensor


def layer_keys(valid_of, T: int, chunk: int, causal: bool, sink: Tensor, rows: Tensor) -> LayerKeys:
    """`LayerKeys` of T query rows in chunks of `chunk` rows.

    valid_of(q0, q1, k1): the valid keys (B, 1|H, q1 - q0, k1) of rows [q0, q1) among the
    first k1 keys; causal: keys after a chunk's last row are never visible (k1 = q1);
    sink: (B, T) sink keys; rows: (B, T) head-level rows.
    """
    sinks = sink_cols(sink)
    chunks, n_content = [], []
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        valid = valid_of(q0, q1, q1 if causal else T)
        bad = (~valid).flatten(0, -2).any(0)  # (K,)
        chunks.append(ChunkKeys(q0, q1, valid, int(bad.to(torch.uint8).argmax()) if bool(bad.any()) else None))
        n_content.append(valid.sum(-1)[:, 0] - (valid[:, 0] & sink[:, None, :valid.shape[-1]]).sum(-1))  # (B, c)
    w = rows.to(torch.float64)
    return LayerKeys(tuple(chunks), sinks, w, w * (torch.cat(n_content, dim=1) >= 2))


@dataclass(frozen=True)
class AttentionInputs:
    """One layer's attention call: q (B, H, T, d_head); k, v (B, H_kv, T, d_head), float32 or
    float64 (H = H_kv x group, heads kv-major, as `repeat_kv` orders them); scale: the score
    scaling; dtype: the model's, for the output (bfloat16: reduced-precision products, see
    `matmul_precision`)."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    dtype: torch.dtype


class Workspace:
    """Reusable buffers for a chunk's scores and weights, the largest tensors capture makes
    (B x H x c x K): allocated afresh for every chunk of every layer, large ones are mapped and
    zeroed by the kernel each time."""

    def __init__(self):
        self._buffers: dict[tuple, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A contiguous (uninitialised) tensor of `shape` with `like`'s dtype and device."""
        n = math.prod(shape)
        key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)


class _Rows:
    """Per-row sums of one layer, filled chunk by chunk: the passes over each chunk reduce it to
    these; everything else is arithmetic on them, once per layer (`_finish`)."""

    def __init__(self, like: Tensor, B: int, H: int, T: int, P: int, gram: bool):
        self.sink = like.new_zeros(B, H, T, P)  # weights on the sink columns (0 where not a sink)
        self.lse = like.new_empty(B, H, T)      # log sum_j exp z_j
        self.rest = like.new_empty(B, H, T)     # content mass
        self.dot = like.new_empty(B, H, T)      # sum_{j in C} a_j z_j
        self.gram = like.new_empty(B, T, H, H) if gram else None  # content rows' Gram matrices
        self.pairs: dict[str, Tensor] = {}      # other metrics, summed per chunk


def attend(inputs: AttentionInputs, keys: LayerKeys, metrics: tuple[str, ...] = (),
           dormant_threshold: float = 0.9, work: Workspace | None = None) -> tuple[Tensor, Tensor, LayerStats]:
    """Attention output and statistics of one layer from one softmax per chunk of query rows.

    Returns the output (B, T, H, d_head) in `inputs.dtype` (what transformers expects from
    an attention function), its sink channel u = sum_{j in S} a_j v_j (B, T, H, d_head)
    float32, and the layer's `LayerStats` (without output moments: `output_moments`).
    Per chunk: the scores once (GQA by grouping the queries of each KV head, no repeated
    keys), one softmax, the output, then the statistics' passes (`_fold_chunk`).
    """
    q, k, v = inputs.q, inputs.k, inputs.v
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    half = inputs.dtype == torch.bfloat16
    work = work or Workspace()
    sinks = keys.sinks
    out = q.new_empty(B, T, H, D, dtype=inputs.dtype)
    rows = _Rows(q, B, H, T, len(sinks.cols), "cosine" in metrics)
    extra = tuple(m for m in metrics if m != "cosine")
    for ck in keys.chunks:
        c, K = ck.q1 - ck.q0, ck.valid.shape[-1]
        z = scores(q[:, :, ck.q0:ck.q1], k[:, :, :K], inputs.scale, work.get("scores", (B, H, c, K), q), half)
        if ck.masked_from is not None:
            j0 = ck.masked_from
            z[..., j0:].masked_fill_(~ck.valid[..., j0:], _masked(z.dtype))
        a = work.get("weights", (B, H, c, K), q)
        torch.ops.aten._softmax.out(z, -1, False, out=a)
        with matmul_precision(half):
            o = torch.bmm(a.view(B * Hkv, G * c, K), v[:, :, :K].reshape(B * Hkv, K, D))  # (B*Hkv, G*c, D)
        out[:, ck.q0:ck.q1] = o.view(B, H, c, D).transpose(1, 2)
        _fold_chunk(z, a, ck, keys, rows, extra)
    S = len(sinks.cols)
    v_s = v.index_select(2, sinks.cols)  # (B, H_kv, S, d_head)
    u = torch.bmm(rows.sink.view(B * Hkv, G * T, S), v_s.reshape(B * Hkv, S, D)).view(B, H, T, D)
    return out, u.transpose(1, 2), _finish(rows, keys, metrics, dormant_threshold)


def scores(q: Tensor, k: Tensor, scale: float, out: Tensor | None = None, bf16: bool = False) -> Tensor:
    """Pre-softmax scores q k^T x scale: (B, H, c, K) for q (B, H, c, d_head), k (B, H_kv, K, d_head).

    GQA without repeating the keys: the queries of each KV head are stacked into one
    matrix product. `out`: a (B, H, c, K) contiguous tensor to write into.
    """
    B, H, c, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    out = q.new_empty(B, H, c, K) if out is None else out
    with matmul_precision(bf16):
        torch.baddbmm(out.view(B * Hkv, H // Hkv * c, K), q.reshape(B * Hkv, H // Hkv * c, D),
                      k.reshape(B * Hkv, K, D).transpose(1, 2), beta=0, alpha=scale, out=out.view(B * Hkv, -1, K))
    return out


def chunk_stats(z: Tensor, sink: Tensor, valid: Tensor, rows: Tensor, metrics: tuple[str, ...] = (),
                dormant_threshold: float = 0.9) -> LayerStats:
    """Statistics of one chunk of query rows from its scores, as sums.

    z: (B, H, c, K) pre-softmax scores (any value at invalid keys; -inf where a weight
    underflowed, as log of eager maps gives); sink: (B, K) sink keys; valid: (B, 1|H, c, K)
    keys each query may see; rows: (B, c) query rows that count (non-pad, not a sink).
    The model-wide capture (scores of every layer stacked on the head axis) and the eager
    reference use this; a model's own layers go through `attend`. Both share the
    statistics (`_fold_chunk`, `_finish`).
    """
    z = z if z.dtype in (torch.float32, torch.float64) else z.float()
    z = z.masked_fill(~valid, _masked(z.dtype)).clamp_min(_masked(z.dtype))
    a = torch.softmax(z, dim=-1)  # (B, H, c, K)
    B, H, c, K = z.shape
    sinks = sink_cols(sink)
    w = rows.to(torch.float64)
    n_content = (valid & ~sink[:, None, None, :]).sum(-1)[:, 0]
    keys = LayerKeys((ChunkKeys(0, c, valid, None),), sinks, w, w * (n_content >= 2))
    acc = _Rows(z, B, H, c, len(sinks.cols), "cosine" in metrics)
    _fold_chunk(z, a, keys.chunks[0], keys, acc, tuple(m for m in metrics if m != "cosine"))
    return _finish(acc, keys, metrics, dormant_threshold)


def _masked(dtype) -> float:
    """The score of an invalid key: half the most negative finite value.

    Not -inf: an invalid key's weight is then exactly 0, and a row with no visible key
    (padding, never counted) comes out uniform and finite, so no NaN needs cleaning;
    half, so that sum_j a_j z_j over such a row (weights summing to 1) cannot round
    past the finite range.
    """
    return torch.finfo(dtype).min / 2


def _fold_chunk(z: Tensor, a: Tensor, ck: ChunkKeys, keys: LayerKeys, acc: _Rows, extra: tuple[str, ...]) -> None:
    """The passes over one chunk's rows: z, a (B, H, c, K) scores (invalid keys at `_masked`)
    and weights. Overwrites `a` (its sink columns are zeroed).

    Evaluates no logarithm on the rows. With L = log sum_j exp z_j, log a_j = z_j - L,
    so T_C = sum_{j in C} a_j log a_j = sum_{j in C} a_j z_j - L (1 - s): one dot product
    per row once the sink columns of a are zeroed; L itself comes from one column,
    L = z_j - log a_j (`_log_normaliser`). Cosine is scale-invariant, so the content
    rows' cosines come from the Gram matrix of the zeroed rows directly, and the full
    rows' from it plus the sink columns' part (`_finish`).
    """
    sinks, (q0, q1) = keys.sinks, (ck.q0, ck.q1)
    P = sinks.before(z.shape[-1])
    cols, member = sinks.cols[:P], sinks.member[:, None, None, :P]
    a_s = a.index_select(-1, cols)  # (B, H, c, P)
    a_sr = a_s * member
    acc.sink[:, :, q0:q1, :P] = a_sr
    acc.lse[:, :, q0:q1] = lse = _log_normaliser(z, a, z.index_select(-1, cols), a_sr, keys.w[:, q0:q1])
    if extra:  # the full rows, before their sink columns are zeroed
        for name, m in _pairs(a, ck.valid, z, extra).items():
            _add_pairs(acc.pairs, f"{name}/{cp.FULL}", _pair_sum(torch.nan_to_num(m).double(), keys.w[:, q0:q1]))
    a.index_copy_(-1, cols, a_s - a_sr)  # a -> its content part (zero on each sequence's sinks)
    acc.rest[:, :, q0:q1] = rest = a.sum(-1)  # (B, H, c) content mass, summed from the content parts
    acc.dot[:, :, q0:q1] = dot = torch.einsum("bhqk,bhqk->bhq", a, z)
    if acc.gram is not None:
        acc.gram[:, q0:q1] = torch.einsum("bhqk,bgqk->bqhg", a, a)  # (B, c, H, H)
    if extra:  # the content compositions c = a_C / (1 - s)
        h_content = torch.where(rest > 0, torch.log(rest) + lse - dot / rest.clamp_min(torch.finfo(a.dtype).tiny),
                                torch.zeros((), dtype=a.dtype))
        a.div_(rest.clamp_min(torch.finfo(a.dtype).tiny).unsqueeze(-1))
        content_keys = ck.valid & ~sinks.mask[:, None, None, :a.shape[-1]]
        for name, m in _pairs(a, content_keys, z, extra, h_content).items():
            _add_pairs(acc.pairs, f"{name}/{cp.CONTENT}", _pair_sum(torch.nan_to_num(m).double(),
                                                                    keys.wc[:, q0:q1]))


def _add_pairs(pairs: dict[str, Tensor], key: str, x: Tensor) -> None:
    pairs[key] = x if key not in pairs else pairs[key] + x


def _log_normaliser(z: Tensor, a: Tensor, z_s: Tensor, a_sr: Tensor, w: Tensor) -> Tensor:
    """L = log sum_j exp z_j per row, (B, H, c).

    a_j = e^(z_j - L) for every visible key, so L = z_j - log a_j from any one column
    whose weight did not underflow: the row's heaviest sink column (z_s, a_sr: z and
    a there, (B, H, c, P)). Counted rows (w > 0) where that weight is below 1e-30
    (subnormal weights lose precision), or that have no sink, fall back to the row
    maxima, a_max = e^(z_max - L): two more passes over the chunk.
    """
    if a_sr.shape[-1]:
        a_0, j = a_sr.max(-1, keepdim=True)
        z_0 = z_s.gather(-1, j)
        a_0, z_0 = a_0[..., 0], z_0[..., 0]
    else:
        a_0 = z_0 = torch.zeros(a.shape[:-1], dtype=a.dtype, device=a.device)
    ok = a_0 > 1e-30
    lse = z_0 - torch.log(a_0.clamp_min(1e-30))
    if bool((ok | (w == 0)[:, None, :]).all()):
        return lse
    return torch.where(ok, lse, z.amax(-1) - torch.log(a.amax(-1)))


def _finish(acc: _Rows, keys: LayerKeys, metrics: tuple[str, ...], dormant_threshold: float) -> LayerStats:
    """The layer's sums from its per-row sums: the entropy grouping terms per row (DESIGN section 4)
    without forming the compositions, with T_S = sum_{j in S} a_j log a_j and T_C from `_fold_chunk`:
    s H(c_S) = s log s - T_S, (1 - s) H(c) = (1 - s) log(1 - s) - T_C, H(a) = -(T_S + T_C)."""
    w, wc = keys.w, keys.wc  # (B, T)
    s = acc.sink.sum(-1)  # (B, H, T) sink mass
    t_sink = torch.xlogy(acc.sink, acc.sink).sum(-1)
    rest = acc.rest
    t_content = acc.dot - acc.lse * rest
    xr = torch.xlogy(rest, rest)
    content = xr - t_content  # (1 - s) H(c)
    h_content = torch.where(rest > 0, content / rest, torch.zeros((), dtype=rest.dtype))
    per_row = torch.stack([s, -(t_sink + t_content), -xr - t_sink, rest, content,
                           (s >= dormant_threshold).to(s.dtype), h_content])  # (7, B, H, T)
    sums = torch.einsum("nbhq,nbq->nh", per_row.double(), torch.stack([w] * 6 + [wc]))
    pairs = dict(acc.pairs)
    if acc.gram is not None:
        full = acc.gram + torch.einsum("bhqs,bgqs->bqhg", acc.sink, acc.sink)
        cos = torch.einsum("nbqij,nbq->nij", _cosine_from_gram(torch.stack([full, acc.gram])).double(),
                           torch.stack([w, wc]))
        pairs[f"cosine/{cp.FULL}"], pairs[f"cosine/{cp.CONTENT}"] = cos
    order = [f"{m}/{conv}" for conv in (cp.FULL, cp.CONTENT) for m in metrics]
    return LayerStats(rows=w.sum(), content_rows=wc.sum(), sink_mass=sums[0], entropy_full=sums[1],
                      entropy_content=sums[6], g=sums[2], rest=sums[3], rest_h_content=sums[4], dormant=sums[5],
                      pairs={k: pairs[k] for k in order})


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
