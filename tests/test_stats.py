"""chunk_stats / finalize against a naive per-row loop over the composition functions."""

from __future__ import annotations

import math

import pytest
import torch

from pruner.attention import composition as cp
from pruner.attention import kernel, pairs, sums

pytestmark = pytest.mark.unit


def random_chunk(seed=0, B=2, H=3, T=7, sink_shift=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, H, T, T, generator=g, dtype=torch.float64) * 2
    z[..., 0] += sink_shift  # a sink at key 0
    lengths = [T, T - 2]
    keys = torch.zeros(B, T, dtype=torch.bool)
    for b, L in enumerate(lengths):
        keys[b, :L] = True
    valid = keys[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()
    sink = torch.zeros(B, T, dtype=torch.bool)
    sink[:, 0] = True
    sink[0, 3] = True  # a second sink token in one sequence
    rows = keys & ~sink
    return z, sink, valid, rows


@pytest.mark.parametrize("sink_shift", [3.0, -100.0])
def test_chunk_stats_match_naive_rows(sink_shift):
    """-100: the first sink's weight underflows (e^-100), so the log-normaliser falls back to the row maxima."""
    z, sink, valid, rows = random_chunk(sink_shift=sink_shift)
    B, H, T, _ = z.shape
    s = sums.finalize([kernel.chunk_stats(z, sink, valid, rows, metrics=("cosine", "js", "tv", "hellinger"))])
    n, nc = 0, 0
    acc = {k: torch.zeros(H, dtype=torch.float64) for k in ("s", "hf", "hc")}
    pair = {k: torch.zeros(H, H, dtype=torch.float64) for k in ("cosine/full", "js/content", "tv/full",
                                                                 "hellinger/content")}
    for b in range(B):
        for q in range(T):
            if not rows[b, q]:
                continue
            v, sk = valid[b, 0, q], sink[b]
            a = torch.softmax(z[b, :, q].masked_fill(~v, -math.inf), -1)  # (H, K)
            e = cp.entropy_parts(a, sk.expand(H, -1), v.expand(H, -1))
            n += 1
            acc["s"] += e.s
            acc["hf"] += e.full
            ok = int(cp.content_count(sk, v)) >= 2
            if ok:
                nc += 1
                acc["hc"] += e.h_content
            for i in range(H):
                for j in range(H):
                    args = (a[i], a[j], sk, v)
                    pair["cosine/full"][i, j] += cp.metric("cosine", *args, cp.FULL)
                    pair["tv/full"][i, j] += cp.metric("tv", *args, cp.FULL)
                    if ok:
                        pair["js/content"][i, j] += cp.metric("js", *args, cp.CONTENT)
                        pair["hellinger/content"][i, j] += cp.metric("hellinger", *args, cp.CONTENT)
    tol = dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s.sink_mass[0], acc["s"] / n, **tol)
    torch.testing.assert_close(s.entropy_full[0], acc["hf"] / n, **tol)
    torch.testing.assert_close(s.entropy_content[0], acc["hc"] / nc, **tol)
    assert s.rows.item() == n and s.content_rows.item() == nc and s.excluded_rows.item() == n - nc
    for k, v in pair.items():
        torch.testing.assert_close(s.pairs[k][0], v / (n if k.endswith("full") else nc), rtol=1e-7, atol=1e-7)


def test_head_level_entropy_identity_holds_for_means():
    z, sink, valid, rows = random_chunk(seed=3)
    s = sums.finalize([kernel.chunk_stats(z, sink, valid, rows)])
    torch.testing.assert_close(s.g + s.rest * s.h_content_weighted, s.entropy_full, rtol=1e-12, atol=1e-12)


def test_aitchison_pairs_from_scores():
    """`pairs.row_pairs` on the content rows of a chunk: the Aitchison distance of two heads' scores."""
    z, sink, valid, rows = random_chunk(seed=4)
    a = torch.softmax(z.masked_fill(~valid, -math.inf), -1)  # (B, H, c, K)
    p, parts = cp.rows_for(a, sink[:, None, None, :], valid, cp.CONTENT)
    p = torch.where(parts, p, torch.zeros((), dtype=p.dtype))
    out = pairs.row_pairs(p, parts, z, ("aitchison",))["aitchison"]  # (B, c, H, H)
    b, q = 0, 6  # row with several content keys
    v, parts = valid[b, 0, q], cp.content_mask(sink[b], valid[b, 0, q])
    d01 = cp.aitchison_sq_log(z[b, 0, q], z[b, 1, q], parts).sqrt()
    assert out[b, q, 0, 1].item() == pytest.approx(d01.item(), rel=1e-9)
    assert v.all()


def test_merge_refuses_different_metrics():
    z, sink, valid, rows = random_chunk()
    with pytest.raises(ValueError, match="different pairwise metrics"):
        kernel.chunk_stats(z, sink, valid, rows, ("cosine",)) + kernel.chunk_stats(z, sink, valid, rows, ("js",))
