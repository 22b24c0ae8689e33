"""The convention audit: flip-rate math, model-wide pair matrices, clustering, entropy attribution."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny import CAUSAL, ragged_batch, tiny_model

from pruner.analysis import convention, flips
from pruner.attention import composition as cp
from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec, sink_mask
from pruner.core import runtime
from pruner.core.data import pad
from pruner.core.runtime import forward

# --------------------------------------------------------------------------- unit: flip rates

@pytest.mark.unit
def test_discordant_share_extremes_and_kendall():
    from scipy.stats import kendalltau

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, generator=g, dtype=torch.float64)
    assert flips.discordant_share(x, x).item() == 0
    assert flips.discordant_share(x, 3 * x + 1).item() == 0  # any increasing map keeps every order
    assert flips.discordant_share(x, -x).item() == 1
    y = x + torch.randn(40, generator=g, dtype=torch.float64)
    tau = kendalltau(x.numpy(), y.numpy()).statistic  # no ties: tau-b = tau-a
    assert flips.discordant_share(x, y, block=7).item() == pytest.approx((1 - tau) / 2, abs=1e-12)


@pytest.mark.unit
def test_discordant_share_counts_ties_as_no_reversal():
    # pairs: (0,1) x-tie; (0,2) concordant; (1,2) discordant -> 1 of 3
    x = torch.tensor([0.0, 0.0, 1.0])
    y = torch.tensor([0.0, 2.0, 1.0])
    assert flips.discordant_share(x, y).item() == pytest.approx(1 / 3)


@pytest.mark.unit
def test_pair_order_and_verdict_flip_on_hand_made_matrices():
    full = torch.tensor([[1.0, 0.9, 0.8, 0.1],
                         [0.9, 1.0, 0.7, 0.2],
                         [0.8, 0.7, 1.0, 0.3],
                         [0.1, 0.2, 0.3, 1.0]])
    assert flips.upper_pairs(full).tolist() == pytest.approx([0.9, 0.8, 0.1, 0.7, 0.2, 0.3])
    assert flips.pair_order_flip_rate(full, full).item() == 0
    assert flips.pair_order_flip_rate(full, 1 - full).item() == 1  # similarity vs its distance: all reversed
    content = full.clone()
    content[0, 1] = content[1, 0] = 0.05  # the top pair drops to the bottom: 5 of 15 pairs of pairs reverse
    assert flips.pair_order_flip_rate(full, content).item() == pytest.approx(5 / 15)
    # redundant if >= 0.5: full says 3 pairs (0-1, 0-2, 1-2), content 2 -> 1 of 6 verdicts flips
    assert flips.verdict_flip_rate(full, content, 0.5, similarity=True).item() == pytest.approx(1 / 6)
    # as distances (redundant if <= 0.5) the same cut gives the complementary sets, so again 1 of 6
    assert flips.verdict_flip_rate(full, content, 0.5, similarity=False).item() == pytest.approx(1 / 6)


@pytest.mark.unit
def test_audit_metric_overall_and_per_layer_blocks():
    g = torch.Generator().manual_seed(1)
    m = torch.rand(6, 6, generator=g, dtype=torch.float64)
    full = (m + m.T) / 2
    content = full.clone()
    content[0, 2] = content[2, 0] = 10.0  # layer 0 (heads 0-2): head 0 and 2 become each other's nearest
    out = convention.audit_metric(full, content, n_layers=2, similarity=True)
    assert out["threshold"] == pytest.approx(flips.upper_pairs(full).median().item())
    assert out["per_layer"]["pair_order_flip_rate"][1] == 0 and out["per_layer"]["nn_flip_rate"][1] == 0
    nn_full = flips.nearest_neighbours(full[None, :3, :3], True)[0]
    expected = ((nn_full != torch.tensor([2, nn_full[1], 0])).double().mean()).item()
    assert out["per_layer"]["nn_flip_rate"][0] == pytest.approx(expected)
    assert out["overall"]["pair_order_flip_rate"] == pytest.approx(flips.pair_order_flip_rate(full, content).item())
    given = convention.audit_metric(full, content, 2, True, threshold=0.5)
    assert given["threshold"] == 0.5 and given["threshold_rule"] == "given"


@pytest.mark.unit
def test_distance_is_symmetric_with_zero_diagonal():
    m = torch.tensor([[0.98, 0.2], [0.4, 1.0]])
    d = convention.distance(m, similarity=True)
    assert torch.equal(d, d.T) and d.diagonal().abs().sum() == 0
    assert d[0, 1].item() == pytest.approx(0.7)


# --------------------------------------------------------------------------- unit: clustering and MDS

def _two_groups(n: int = 12, seed: int = 0):
    """Distances of two well-separated groups of heads; sink mass high in the first group."""
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(n, 3, generator=g, dtype=torch.float64) * 0.1
    pts[: n // 2, 0] += 5
    d = torch.cdist(pts, pts)
    sink = torch.where(torch.arange(n) < n // 2, 0.9, 0.1).double() + 0.01 * torch.rand(n, generator=g)
    return d, sink.view(2, n // 2)


@pytest.mark.unit
def test_clustering_finds_groups_and_the_leading_axis_follows_them():
    d, sink = _two_groups()
    res = convention.cluster_convention(d, sink, k=2, linkage="complete", seed=0)
    labels = np.asarray(res["labels"]).flatten()
    assert len(set(labels[:6])) == 1 and len(set(labels[6:])) == 1 and labels[0] != labels[6]
    assert res["mds_axis1_vs_sink_mass"]["pearson"] > 0.99  # oriented positive, groups split on axis 1
    assert res["sink_mass_eta2"] > 0.99 and res["mds_plane_vs_sink_mass_r"] > 0.99
    xy = np.asarray(res["mds"]).reshape(-1, 2)
    assert xy[:, 0].var() >= xy[:, 1].var()  # rotated to principal axes
    same = convention.cluster_metric(1 - d, 1 - d, sink, True, convention.AnalysisConfig(clusters=2), 2)
    assert same["ari"] == 1.0


@pytest.mark.unit
def test_plane_correlation_is_rotation_invariant():
    g = np.random.default_rng(0)
    xy = g.normal(size=(30, 2))
    sink = 0.3 * xy[:, 1] + 0.5  # sink size along axis 2 only
    assert abs(np.corrcoef(xy[:, 0], sink)[0, 1]) < 0.5
    assert convention.plane_correlation(xy, sink) == pytest.approx(1.0)
    rot = np.array([[np.cos(1.0), -np.sin(1.0)], [np.sin(1.0), np.cos(1.0)]])
    noisy = sink + 0.1 * g.normal(size=30)
    assert convention.plane_correlation(xy @ rot, noisy) == pytest.approx(convention.plane_correlation(xy, noisy))


@pytest.mark.unit
def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="clusters"):
        convention.AnalysisConfig(clusters=1)
    with pytest.raises(ValueError, match="not analysed"):
        convention.AnalysisConfig(metrics=("cosine",), thresholds={"js": 0.1})
    with pytest.raises(ValueError, match="linkage"):
        convention.AnalysisConfig(linkage="ward")


# --------------------------------------------------------------------------- integration: model-wide capture

def eager_model_pairs(model, batch, spec, metrics):
    """Reference: every head pair of the model from eager maps, per row with composition.metric, float64."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            maps = forward(model, batch.input_ids, batch.attention_mask, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(impl)
    a = torch.cat(maps, dim=1).double()  # (B, L * H, T, T)
    B, _, T, _ = a.shape
    valid = batch.attention_mask.bool()[:, None, :].expand(B, T, T)  # (B, q, k)
    if any(getattr(m, "is_causal", False) for m in model.modules() if hasattr(m, "layer_idx")):
        valid = valid & torch.ones(T, T, dtype=torch.bool).tril()
    sink = sink_mask(batch.input_ids, batch.attention_mask, spec)  # (B, T)
    rows = (batch.attention_mask.bool() & ~sink).double()  # (B, q)
    crows = rows * (cp.content_count(sink[:, None, :], valid) >= 2)
    p, q = a[:, :, None], a[:, None, :]  # (B, n, 1, T, K), (B, 1, n, T, K)
    s5, v5 = sink[:, None, None, None, :], valid[:, None, None]
    out = {}
    for name in metrics:
        for conv, w in ((cp.FULL, rows), (cp.CONTENT, crows)):
            m = torch.nan_to_num(cp.metric(name, p, q, s5, v5, conv))  # (B, n, n, T)
            out[f"{name}/{conv}"] = torch.einsum("bijq,bq->ij", m, w) / w.sum()
    return out


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "gemma3_text"])
def test_model_wide_pairs_equal_eager_reference(family):
    model = tiny_model(family)
    window = getattr(model.config, "sliding_window", None)  # Gemma 3: every layer sees the same keys within it
    batch = pad(ragged_batch(seed=3, max_len=window or 20, min_len=min(5, window or 5)), pad_id=0, side="right")
    spec = SinkSpec("first") if family in CAUSAL else SinkSpec("ids", ids=(1, 2))
    metrics = ("cosine", "js")
    wide = capture_stats(model, batch, spec, config=CaptureConfig(chunk_size=3, metrics=metrics, across_layers=True),
                         batch_size=4)
    ref = eager_model_pairs(model, batch, spec, metrics)
    assert wide.model_pairs.keys() == ref.keys()
    for k in ref:
        assert wide.model_pairs[k].shape == (8, 8)  # 2 layers x 4 heads
        torch.testing.assert_close(wide.model_pairs[k], ref[k], rtol=0, atol=1e-5, msg=k)
    # the within-layer blocks and per-head statistics are exactly the per-layer capture's when the model
    # runs on the same (SDPA) attention output; the fused capture's model continues with its own output,
    # equal to SDPA's up to float32 rounding, so later layers' statistics agree to ~1e-8
    for fused, atol in ((False, 1e-12), (True, 1e-6)):
        per_layer = capture_stats(model, batch, spec, config=CaptureConfig(chunk_size=3, metrics=metrics, fused=fused),
                                  batch_size=4)
        for f in ("sink_mass", "entropy_full", "entropy_content", "g", "rest", "h_content_weighted", "rows"):
            torch.testing.assert_close(getattr(wide, f), getattr(per_layer, f), rtol=0, atol=atol, msg=f)
        for k in per_layer.pairs:  # per-row work is float32: a (L*H)-head Gram matmul blocks differently
            torch.testing.assert_close(wide.pairs[k], per_layer.pairs[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.integration
def test_model_wide_pairs_refuse_layers_that_see_different_keys():
    """Beyond Gemma 3's sliding window its local and global layers see different keys: one line, no statistic."""
    model = tiny_model("gemma3_text")  # window 8
    batch = pad(ragged_batch(seed=3, min_len=12), pad_id=0, side="right")
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=("cosine",), across_layers=True))


@pytest.mark.integration
def test_model_wide_pairs_do_not_depend_on_batching_or_padding():
    model = tiny_model("llama")
    samples = ragged_batch(seed=4, n=7)

    def cfg(c):
        return CaptureConfig(chunk_size=c, metrics=("cosine", "js"), across_layers=True)

    a = capture_stats(model, pad(samples, 0, "right"), SinkSpec("first"), config=cfg(64), batch_size=7)
    b = capture_stats(model, pad(samples[::-1], 0, "left"), SinkSpec("first"), config=cfg(5), batch_size=3)
    for k in a.model_pairs:
        torch.testing.assert_close(a.model_pairs[k], b.model_pairs[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.integration
def test_entropy_attribution_adds_up_between_paired_states():
    batch = pad(ragged_batch(seed=5), 0)
    spec = SinkSpec("first")
    cfg = CaptureConfig(metrics=())
    before = capture_stats(tiny_model("llama", seed=0), batch, spec, config=cfg)
    after = capture_stats(tiny_model("llama", seed=1), batch, spec, config=cfg)
    att = convention.entropy_attribution(before, after)
    for level in ("per_head", "per_layer"):
        d, s, c = (np.asarray(att[level][k]) for k in ("delta", "sink_part", "content_part"))
        np.testing.assert_allclose(s + c, d, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(att["per_head"]["delta"]),
                               (after.entropy_full - before.entropy_full).numpy(), rtol=0, atol=1e-5)
    ov = att["overall"]
    assert ov["sink_part"] + ov["content_part"] == pytest.approx(ov["delta"], abs=1e-12)
    assert ov["sink_share"] == pytest.approx(ov["sink_part"] / ov["delta"])
    with pytest.raises(ValueError, match="layers x heads"):
        convention.entropy_attribution(before, dataclasses.replace(after, sink_mass=torch.zeros(3, 4)))


@pytest.mark.integration
def test_minilm_causal_init_is_the_encoder_run_causally():
    """The `before` state of minilm-causal: all-MiniLM-L6-v2's own weights, causal attention, same tokenizer."""
    from pruner.checkpoints import loading

    init, enc = loading.load_model("minilm-causal-init"), loading.load_model("minilm")
    assert type(init).__name__ == "BertLMHeadModel" and runtime.attends_causally(init)
    assert not runtime.attends_causally(enc)
    enc_w = enc.state_dict()
    for name, w in init.bert.state_dict().items():
        torch.testing.assert_close(w, enc_w[name], rtol=0, atol=0, msg=name)
    again = loading.load_model("minilm-causal-init")  # the untrained LM-head transform is seeded
    assert torch.equal(again.cls.predictions.transform.dense.weight, init.cls.predictions.transform.dense.weight)
    vocab = loading.load_tokenizer("minilm-causal-init").get_vocab()
    assert vocab == loading.load_tokenizer("minilm-causal").get_vocab()
