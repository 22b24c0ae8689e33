"""The fused attention kernel: one softmax per chunk of query rows gives both the layer's output and its sums.

Pure tensor math. `attend` computes one layer's attention chunk by chunk (GQA without
repeated keys, the sink columns gathered once per batch) and reduces every chunk to a
few per-row sums (`_Rows`); `_finish` turns them into the layer's `LayerStats` once.
`chunk_stats` does the same from given scores (the model-wide capture and the eager
reference). Because only sums and counts are kept, batch size, batch order, padding
and query chunking cannot change any statistic (`pruner.attention.sums`).
"""


from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pruner.attention import composition as cp
from pruner.attention.pairs import cosine_from_gram, head_gram, pair_sum, row_dot, row_pairs
from pruner.attention.sums import LayerStats
from pruner.core.precision import matmul_precision

Tensor = torch.Tensor
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
        for name, m in row_pairs(a, ck.valid, z, extra).items():
            _add_pairs(acc.pairs, f"{name}/{cp.FULL}", pair_sum(torch.nan_to_num(m).double(), keys.w[:, q0:q1]))
    a.index_copy_(-1, cols, a_s - a_sr)  # a -> its content part (zero on each sequence's sinks)
    acc.rest[:, :, q0:q1] = rest = a.sum(-1)  # (B, H, c) content mass, summed from the content parts
    acc.dot[:, :, q0:q1] = dot = row_dot(a, z)
    if acc.gram is not None:
        acc.gram[:, q0:q1] = head_gram(a)  # (B, c, H, H)
    if extra:  # the content compositions c = a_C / (1 - s)
        h_content = torch.where(rest > 0, torch.log(rest) + lse - dot / rest.clamp_min(torch.finfo(a.dtype).tiny),
                                torch.zeros((), dtype=a.dtype))
        a.div_(rest.clamp_min(torch.finfo(a.dtype).tiny).unsqueeze(-1))
        content_keys = ck.valid & ~sinks.mask[:, None, None, :a.shape[-1]]
        for name, m in row_pairs(a, content_keys, z, extra, h_content).items():
            _add_pairs(acc.pairs, f"{name}/{cp.CONTENT}", pair_sum(torch.nan_to_num(m).double(),
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
    """The layer's sums from its per-row sums: the entropy grouping terms per row (docs/design.md §4)
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
    if acc.gram is not None:  # each convention on its own: no stacked (2, B, T, H, H) copy
        full = acc.gram + head_gram(acc.sink)
        pairs[f"cosine/{cp.FULL}"] = pair_sum(cosine_from_gram(full).double(), w)
        pairs[f"cosine/{cp.CONTENT}"] = pair_sum(cosine_from_gram(acc.gram).double(), wc)
    order = [f"{m}/{conv}" for conv in (cp.FULL, cp.CONTENT) for m in metrics]
    return LayerStats(rows=w.sum(), content_rows=wc.sum(), sink_mass=sums[0], entropy_full=sums[1],
                      entropy_content=sums[6], g=sums[2], rest=sums[3], rest_h_content=sums[4], dormant=sums[5],
                      pairs={k: pairs[k] for k in order})


