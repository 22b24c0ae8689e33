"""Streaming capture: equal to the eager reference, invariant to batching, padding and chunking."""

from __future__ import annotations

import pytest
import torch
from eager_reference import eager_stats
from tiny import CAUSAL, FAMILIES, ragged_batch, tiny_model

from pruner.attention import sums
from pruner.attention.capture import Capture, CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.core.data import pad

pytestmark = pytest.mark.integration
FIELDS = ("sink_mass", "entropy_full", "entropy_content", "dormancy", "g", "rest", "h_content_weighted",
          "rows", "content_rows")
METRICS = ("cosine", "js", "hellinger", "tv")


def assert_stats_close(a: sums.HeadStats, b: sums.HeadStats, atol: float):
    for f in FIELDS:
        torch.testing.assert_close(getattr(a, f), getattr(b, f), rtol=0, atol=atol, msg=f)
    assert a.pairs.keys() == b.pairs.keys()
    for k in a.pairs:
        torch.testing.assert_close(a.pairs[k], b.pairs[k], rtol=0, atol=atol, msg=k)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def spec_for(family):
    return SinkSpec("first") if family in CAUSAL else SinkSpec("ids", ids=(1, 2))


def test_capture_equals_eager_maps(family):
    model = tiny_model(family)
    batch = pad(ragged_batch(), pad_id=0, side="right")
    spec = spec_for(family)
    cap = capture_stats(model, batch, spec, config=CaptureConfig(chunk_size=3, metrics=METRICS), batch_size=4)
    ref = eager_stats(model, batch, spec, metrics=METRICS, batch_size=4)
    assert_stats_close(cap, ref, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored


def _final_hidden_under_capture(model, batch, spec, config):
    """The model body's last hidden state (B, T, d_model) while `Capture.run` forwards `batch` (one batch)."""
    seen = []
    hook = model.base_model.register_forward_hook(lambda m, args, out: seen.append(out[0].detach()))
    try:
        with Capture(model, spec, config=config) as cap:
            cap.run(batch, batch_size=len(batch))
    finally:
        hook.remove()
    return seen[0], cap.result()


def test_fused_attention_keeps_the_models_outputs(family):
    """Capture computes each layer's output from the statistics' own softmax; the model continues
    with it, so its hidden states and logits must equal the plain (SDPA) model's at every real token."""
    from pruner.core.runtime import forward

    model = tiny_model(family)
    batch = pad(ragged_batch(seed=7), pad_id=0, side="left" if family in CAUSAL else "right")
    keep = batch.attention_mask.bool()
    hidden, stats = _final_hidden_under_capture(model, batch, spec_for(family),
                                                CaptureConfig(chunk_size=3, metrics=("cosine",), outputs=True))
    assert stats.outputs is not None  # the fused path ran (output moments come only from it)
    with torch.no_grad():
        plain = forward(model.base_model, batch.input_ids, batch.attention_mask)[0]
        torch.testing.assert_close(hidden[keep], plain[keep], rtol=0, atol=1e-5)
        head = model.get_output_embeddings()
        if head is not None:
            torch.testing.assert_close(head(hidden)[keep], forward(model, batch.input_ids,
                                                                   batch.attention_mask).logits[keep],
                                       rtol=0, atol=1e-5)


@pytest.mark.parametrize("fam", ["gpt2", "llama"])
def test_fused_attention_in_bfloat16_is_as_close_to_float32_as_sdpa(fam):
    """bfloat16 models: scores in float32, output back in bfloat16. The hidden states under capture
    differ from the float32 model's no more than bfloat16 SDPA's do (bfloat16 rounding, not capture)."""
    from pruner.core.runtime import forward

    batch = pad(ragged_batch(seed=8), pad_id=0)
    keep = batch.attention_mask.bool()
    ref = tiny_model(fam)
    half = tiny_model(fam).to(torch.bfloat16)
    hidden, _ = _final_hidden_under_capture(half, batch, SinkSpec("first"), CaptureConfig(outputs=True))
    assert hidden.dtype == torch.bfloat16
    with torch.no_grad():
        exact = forward(ref.base_model, batch.input_ids, batch.attention_mask)[0][keep]
        sdpa = forward(half.base_model, batch.input_ids, batch.attention_mask)[0][keep].float()
    err_capture = (hidden[keep].float() - exact).abs().max()
    err_sdpa = (sdpa - exact).abs().max()
    assert err_capture <= 1.5 * err_sdpa + 1e-3, (err_capture, err_sdpa)


def test_capture_restores_implementation_on_error():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"):
        with Capture(model, SinkSpec("first")):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_capture_does_not_change_outputs():
    model = tiny_model("gpt2")
    batch = pad(ragged_batch(), pad_id=0)
    from pruner.core.runtime import forward

    before = forward(model, batch.input_ids, batch.attention_mask).logits
    with Capture(model, SinkSpec("first")) as cap:
        during = forward(model, batch.input_ids, batch.attention_mask).logits
        cap.run(batch)
    torch.testing.assert_close(during, before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fam", ["gpt2", "llama", "bert"])
def test_invariant_to_batch_size_padding_order_and_chunks(fam):
    model = tiny_model(fam)
    samples = ragged_batch(seed=1, n=7)
    spec = spec_for(fam)

    def cfg(c):
        return CaptureConfig(chunk_size=c, metrics=METRICS)

    base = capture_stats(model, pad(samples, 0, "right"), spec, config=cfg(64), batch_size=7)
    variants = [
        capture_stats(model, pad(samples, 0, "left"), spec, config=cfg(64), batch_size=7),
        capture_stats(model, pad(samples, 0, "right"), spec, config=cfg(1), batch_size=1),
        capture_stats(model, pad(samples[::-1], 0, "left"), spec, config=cfg(5), batch_size=3),
        capture_stats(model, pad(samples, 0, "right"), spec, config=cfg(4), batch_size=2),
    ]
    for v in variants:
        assert_stats_close(v, base, atol=1e-6)


def test_merging_two_halves_equals_one_pass():
    model = tiny_model("llama")
    samples = ragged_batch(seed=2, n=8)
    spec = SinkSpec("first")
    with Capture(model, spec, config=CaptureConfig(metrics=METRICS)) as one:
        one.run(pad(samples, 0))
    halves = []
    for part in (samples[:3], samples[3:]):
        with Capture(model, spec, config=CaptureConfig(metrics=METRICS)) as c:
            c.run(pad(part, 0))
        halves.append(c.layers)
    merged = sums.finalize([halves[0][i] + halves[1][i] for i in sorted(halves[0])])
    assert_stats_close(merged, one.result(), atol=1e-9)


def test_rows_with_too_few_content_keys_are_excluded_and_counted():
    model = tiny_model("llama")
    batch = pad([[1, 5, 6, 7, 8]], 0)
    stats = capture_stats(model, batch, SinkSpec("first"))
    # query rows 1..4 (row 0 is the sink); rows 1 sees one content key -> excluded
    assert stats.rows.tolist() == [4.0, 4.0]
    assert stats.excluded_rows.tolist() == [1.0, 1.0]


def test_auto_sinks_find_the_pretrained_sink_tokens(minilm_tokenizer):
    """all-MiniLM-L6-v2 parks attention on [CLS] at position 0: auto mode (eps 0.3) finds exactly it."""
    from pruner.attention.capture import resolve_auto_sinks
    from pruner.checkpoints import loading
    from pruner.core.data import TextSource, line_samples, load_texts

    model = loading.load_model("minilm")
    batch = line_samples(minilm_tokenizer, load_texts(TextSource("shakespeare:calibration")), 32,
                         num_samples=48, seed=0, min_tokens=12)
    spec = resolve_auto_sinks(model, batch, minilm_tokenizer, eps=0.3)
    assert spec.positions == (0,) and spec.ids == (minilm_tokenizer.cls_token_id,)
    with pytest.raises(ValueError, match="no data-driven sink"):
        resolve_auto_sinks(model, batch, minilm_tokenizer, eps=0.95)


def test_output_moments_match_the_attention_output():
    """o = u + w is exactly what the head writes into the output projection (its input slice)."""
    from pruner.core import arch
    from pruner.core.runtime import forward

    model = tiny_model("llama")
    samples = ragged_batch(seed=5, n=4)
    batch = pad(samples, 0)
    inputs = []
    o_proj = arch.get(arch.blocks(model)[1], arch.adapter_for(model).o_proj)
    handle = o_proj.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
    stats = capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(chunk_size=3, outputs=True))
    forward(model, batch.input_ids, batch.attention_mask)
    handle.remove()
    x = inputs[-1].double()  # (B, T, H * d_head)
    keep = batch.attention_mask.bool()
    mom = stats.outputs[1]
    g = arch.geometry(model)
    assert mom.tokens.item() == keep.sum().item()
    torch.testing.assert_close(mom.o.flatten(), x[keep].sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mom.u + mom.w, mom.o, rtol=1e-12, atol=1e-12)
    xh = x[keep].view(-1, g.n_heads, g.head_dim)
    torch.testing.assert_close(mom.oo, torch.einsum("nhd,nhe->hde", xh, xh), rtol=1e-5, atol=1e-5)
    flat = x[keep]
    torch.testing.assert_close(mom.joint, flat.t() @ flat, rtol=1e-5, atol=1e-5)
    assert mom.uu.numel() == mom.ww.numel() == 0  # the channels' second moments only when asked for
    both = capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(chunk_size=3, outputs=True,
                                                                                 channels=True)).outputs[1]
    for k in ("tokens", "o", "u", "w", "oo", "joint"):
        assert torch.equal(getattr(both, k), getattr(mom, k)), k
    # uu, ww: each head's channel second moments, symmetric and positive semi-definite; the cross terms
    # they leave make up oo: oo - uu - ww = sum (u w^T + w u^T), symmetric
    for c in (both.uu, both.ww):
        assert c.shape == (g.n_heads, g.head_dim, g.head_dim)
        torch.testing.assert_close(c, c.transpose(1, 2), rtol=0, atol=1e-9)
        assert torch.linalg.eigvalsh(c).min() > -1e-6 * float(c.abs().max())
    cross = both.oo - both.uu - both.ww
    torch.testing.assert_close(cross, cross.transpose(1, 2), rtol=0, atol=1e-6)


def test_cross_energy_is_the_exact_energy_of_pruning_sets():
    """sum_{h,g in P} K[h, g] equals E||sum_{h in P} W_h (o_h - E o_h)||^2 measured directly."""
    from pruner.core import arch
    from pruner.core.runtime import forward
    from pruner.pruning.calibrate import calibrate
    from pruner.pruning.scoring import fluctuation_exact

    model = tiny_model("gpt2")
    batch = pad(ragged_batch(seed=6, n=5), 0)
    inputs = calibrate(model, batch, SinkSpec("first"))
    k = inputs.cross
    torch.testing.assert_close(torch.diagonal(k, dim1=-2, dim2=-1), fluctuation_exact(inputs)["o"],
                               rtol=1e-6, atol=1e-9)
    inputs_seen = []
    o_proj = arch.get(arch.blocks(model)[0], arch.adapter_for(model).o_proj)
    handle = o_proj.register_forward_pre_hook(lambda m, args: inputs_seen.append(args[0].detach().double()))
    with torch.no_grad():
        forward(model, batch.input_ids, batch.attention_mask)
    handle.remove()
    x = inputs_seen[0][batch.attention_mask.bool()]  # (tokens, H * d_head)
    P = [0, 2]
    cols = torch.cat([torch.arange(h * 8, (h + 1) * 8) for h in P])
    W = arch.o_weight_cols(model, 0).double()[:, cols]
    dev = x[:, cols] - x[:, cols].mean(0)
    direct = (dev @ W.t()).pow(2).sum(-1).mean()
    assert k[0][P][:, P].sum().item() == pytest.approx(direct.item(), rel=1e-5)


def test_residual_energy_is_the_mean_squared_stream_norm():
    from pruner.core.runtime import forward

    model = tiny_model("llama")
    batch = pad(ragged_batch(seed=11, n=4), 0)
    stats = capture_stats(model, batch, SinkSpec("first"), config=CaptureConfig(metrics=(), outputs=True),
                          batch_size=3)
    with torch.no_grad():
        hs = forward(model, batch.input_ids, batch.attention_mask, output_hidden_states=True).hidden_states
    keep = batch.attention_mask.bool()
    expected = torch.stack([h[keep].double().pow(2).sum(-1).mean() for h in hs[:-1]])
    torch.testing.assert_close(stats.residual, expected, rtol=1e-6, atol=1e-9)


def test_head_gram_and_row_dot_are_the_einsums_and_do_not_depend_on_the_thread_count():
    """The capture's per-row products without einsum's layout copies: the einsums' sums to float32 rounding, and the
    same bits at 1 and 2 threads (a plan must not depend on the machine's thread count)."""
    from pruner.attention.pairs import head_gram, row_dot

    g = torch.Generator().manual_seed(0)
    runs = []
    for shape in ((3, 5, 7, 33), (2, 32, 16, 512)):
        x, y = torch.rand(*shape, generator=g), torch.rand(*shape, generator=g)
        torch.testing.assert_close(head_gram(x), torch.einsum("bhqk,bgqk->bqhg", x, x), rtol=1e-6, atol=0)
        torch.testing.assert_close(row_dot(x, y), torch.einsum("bhqk,bhqk->bhq", x, y), rtol=1e-6, atol=0)
        assert head_gram(x).shape == (*shape[:1], shape[2], shape[1], shape[1]) and row_dot(x, y).shape == shape[:3]
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                runs.append((head_gram(x), row_dot(x, y)))
        finally:
            torch.set_num_threads(threads)
        (a1, b1), (a2, b2) = runs[-2:]
        assert torch.equal(a1, a2) and torch.equal(b1, b2)
