"""Property tests for every identity of docs/design.md §4 (float64, 1e-9 relative)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pruner.attention import composition as cp

pytestmark = pytest.mark.unit
TOL = dict(rtol=1e-9, atol=1e-12)


@st.composite
def rows(draw, n_rows: int = 1):
    """Scores z, attention a = softmax over valid keys, sink and valid masks; (n_rows, K)."""
    k = draw(st.integers(2, 12))
    n_sink = draw(st.integers(1, k - 1))
    n_invalid = draw(st.integers(0, k - n_sink - 1))  # >= 1 content key always visible
    boost = draw(st.sampled_from([0.0, 3.0, 8.0, 20.0]))  # 20 -> s ~ 1 - 1e-9
    spread = draw(st.sampled_from([0.1, 1.0, 5.0, 15.0]))  # 15 -> tiny parts
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n_rows, k, generator=g, dtype=torch.float64) * spread
    perm = torch.randperm(k, generator=g)
    sink = torch.zeros(k, dtype=torch.bool)
    sink[perm[:n_sink]] = True
    valid = torch.ones(k, dtype=torch.bool)
    valid[perm[n_sink:n_sink + n_invalid]] = False
    z = z + boost * sink
    a = torch.softmax(z.masked_fill(~valid, -math.inf), dim=-1)
    return z, a, sink.expand(n_rows, k), valid.expand(n_rows, k)


@settings(max_examples=300, deadline=None)
@given(rows(n_rows=3))
def test_split_reconstructs_exactly(r):
    z, a, sink, valid = r
    ch = cp.split(a, sink, valid)
    torch.testing.assert_close(cp.reconstruct(ch, sink), a, **TOL)
    torch.testing.assert_close(ch.c.sum(-1), torch.ones(3, dtype=torch.float64), **TOL)
    torch.testing.assert_close(ch.c_sink.sum(-1), torch.ones(3, dtype=torch.float64), **TOL)
    torch.testing.assert_close(ch.rest, 1 - ch.s, rtol=0, atol=1e-15)
    moderate = ch.s < 1 - 1e-6
    torch.testing.assert_close(cp.sink_logit(ch.s)[moderate], ch.logit[moderate], rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(ch.logit, torch.log(ch.s) - torch.log(cp._masked_sum(a, cp.content_mask(sink, valid))),
                               **TOL)


@settings(max_examples=300, deadline=None)
@given(rows(n_rows=2))
def test_content_log_ratios_and_clr_come_from_scores(r):
    z, a, sink, valid = r
    content = cp.content_mask(sink, valid)
    ch = cp.split(a, sink, valid)
    clr_scores = cp.content_clr(z, sink, valid)
    # clr of c, computed on probabilities where they do not underflow
    if (ch.c[content] > 1e-300).all():
        clr_probs = cp.clr_log(torch.log(ch.c.clamp_min(1e-300)), content)
        torch.testing.assert_close(clr_probs, clr_scores, rtol=1e-9, atol=1e-9)
    # subcompositional coherence: log-ratios among content parts are the same in a and in c
    idx = content[0].nonzero().flatten()
    if len(idx) >= 2 and (a[:, idx] > 1e-300).all():
        i, j = idx[0], idx[-1]
        torch.testing.assert_close(torch.log(a[:, i] / a[:, j]), torch.log(ch.c[:, i] / ch.c[:, j]),
                                   rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(clr_scores[:, i] - clr_scores[:, j], z[:, i] - z[:, j], **TOL)


@settings(max_examples=300, deadline=None)
@given(rows(n_rows=4))
def test_entropy_grouping_property(r):
    _, a, sink, valid = r
    e = cp.entropy_parts(a, sink, valid)
    torch.testing.assert_close(e.binary + e.sink + e.content, e.full, **TOL)
    assert (e.full >= -1e-12).all()


@settings(max_examples=300, deadline=None)
@given(rows(n_rows=4), rows(n_rows=4))
def test_entropy_attribution_is_exact_and_symmetric(r1, r2):
    _, a1, sink1, valid1 = r1
    _, a2, sink2, valid2 = r2
    e1, e2 = cp.entropy_parts(a1, sink1, valid1), cp.entropy_parts(a2, sink2, valid2)
    fwd = cp.entropy_attribution(e1.g, e1.rest, e1.h_content, e2.g, e2.rest, e2.h_content)
    bwd = cp.entropy_attribution(e2.g, e2.rest, e2.h_content, e1.g, e1.rest, e1.h_content)
    torch.testing.assert_close(fwd.delta, e2.full - e1.full, **TOL)
    torch.testing.assert_close(fwd.sink_part + fwd.content_part, fwd.delta, **TOL)
    torch.testing.assert_close(bwd.sink_part, -fwd.sink_part, **TOL)
    torch.testing.assert_close(bwd.content_part, -fwd.content_part, **TOL)
    # head level: means over rows, with the content-weighted content entropy, stay exact
    g1, w1, g2, w2 = e1.g.mean(), e1.rest.mean(), e2.g.mean(), e2.rest.mean()
    hc1, hc2 = (e1.rest * e1.h_content).mean() / w1, (e2.rest * e2.h_content).mean() / w2
    head = cp.entropy_attribution(g1, w1, hc1, g2, w2, hc2)
    torch.testing.assert_close(head.delta, e2.full.mean() - e1.full.mean(), **TOL)


def test_entropy_attribution_pure_sink_growth_is_all_sink():
    s1, s2 = torch.tensor([0.5]), torch.tensor([0.9])
    h = torch.tensor([1.3])
    att = cp.entropy_attribution(cp.binary_entropy(s1), 1 - s1, h, cp.binary_entropy(s2), 1 - s2, h)
    assert att.content_part.item() == 0 and att.sink_share.item() == pytest.approx(1.0)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_dot_product_split(data):
    z, a, sink, valid = data.draw(rows(n_rows=2))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    b = torch.softmax((z + 3 * torch.randn(z.shape, generator=g, dtype=torch.float64))
                      .masked_fill(~valid, -math.inf), -1)
    parts = cp.dot_parts(a, b, sink, valid)
    torch.testing.assert_close(parts.sink + parts.content, (a * b).sum(-1), **TOL)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_aitchison_orthogonal_split(data):
    z, _, sink, valid = data.draw(rows(n_rows=2))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    z2 = z + 2 * torch.randn(z.shape, generator=g, dtype=torch.float64)
    parts = cp.aitchison_parts_log(z, z2, sink, valid)
    torch.testing.assert_close(parts.total, cp.aitchison_sq_log(z, z2, valid), **TOL)
    # the same from log-probabilities: log-partition constants cancel
    la, lb = torch.log_softmax(z.masked_fill(~valid, -1e300), -1), torch.log_softmax(z2.masked_fill(~valid, -1e300), -1)
    torch.testing.assert_close(cp.aitchison_parts_log(la, lb, sink, valid).content, parts.content,
                               rtol=1e-9, atol=1e-9)


def test_aitchison_balance_matches_formula_several_sinks():
    x = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]], dtype=torch.float64)
    sink = torch.tensor([[True, True, False, False, False]])
    valid = torch.ones_like(sink)

    def gm(v):
        return torch.exp(torch.log(v).mean())

    expected = math.sqrt(2 * 3 / 5) * math.log(gm(x[0, :2]) / gm(x[0, 2:]))
    assert cp.sc_balance_log(torch.log(x), sink, valid).item() == pytest.approx(expected, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_metrics_ranges_symmetry_and_conventions(data):
    z, a, sink, valid = data.draw(rows(n_rows=2))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    b = torch.softmax((z + torch.randn(z.shape, generator=g, dtype=torch.float64))
                      .masked_fill(~valid, -math.inf), -1)
    content = cp.content_mask(sink, valid)
    for name in cp.METRICS:
        for conv in cp.CONVENTIONS:
            ab, ba = cp.metric(name, a, b, sink, valid, conv), cp.metric(name, b, a, sink, valid, conv)
            torch.testing.assert_close(ab, ba, **TOL)
            assert torch.isfinite(ab).all()
            hi = math.log(2) if name == "js" else 1.0
            assert (ab >= -1e-12).all() and (ab <= hi + 1e-12).all()
        same = cp.metric(name, a, a, sink, valid, cp.CONTENT)
        torch.testing.assert_close(same, torch.full_like(same, 1.0 if name == "cosine" else 0.0),
                                   rtol=0, atol=1e-7)
    # CONTENT is the FULL metric of the renormalised content rows
    ca, cb = cp.split(a, sink, valid).c, cp.split(b, sink, valid).c
    torch.testing.assert_close(cp.metric("js", a, b, sink, valid, cp.CONTENT),
                               cp.js_divergence(ca, cb, content), **TOL)


def test_cosine_full_row_is_sink_dominated():
    """Two heads that sink a lot but disagree on content look alike with the sink included."""
    sink = torch.tensor([[True, False, False, False]])
    valid = torch.ones_like(sink)
    a = torch.tensor([[0.9, 0.1, 0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[0.9, 0.0, 0.0, 0.1]], dtype=torch.float64)
    assert cp.metric("cosine", a, b, sink, valid, cp.FULL).item() > 0.98
    assert cp.metric("cosine", a, b, sink, valid, cp.CONTENT).item() == 0.0


def test_single_content_key_and_degenerate_rows():
    sink = torch.tensor([[True, False]])
    valid = torch.ones_like(sink)
    a = torch.tensor([[0.7, 0.3]], dtype=torch.float64)
    e = cp.entropy_parts(a, sink, valid)
    assert e.h_content.item() == 0.0 and e.h_sink.item() == 0.0
    assert e.full.item() == pytest.approx(cp.binary_entropy(torch.tensor(0.7, dtype=torch.float64)).item(), rel=1e-12)
    assert cp.content_count(sink, valid).item() == 1
    with pytest.raises(ValueError, match="unknown metric"):
        cp.metric("kl", a, a, sink, valid, cp.FULL)
    with pytest.raises(ValueError, match="unknown convention"):
        cp.rows_for(a, sink, valid, "both")


def test_half_precision_is_computed_in_float32_and_float64_kept():
    sink = torch.tensor([[True, False, False]])
    for dtype, work in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)):
        a = torch.tensor([[0.6, 0.3, 0.1]], dtype=dtype)
        e = cp.entropy_parts(a, sink, torch.ones_like(sink))
        assert e.full.dtype == work
        assert e.full.item() == pytest.approx(0.8979, abs=2e-3)
