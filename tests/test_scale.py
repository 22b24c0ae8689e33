"""Half-precision models and device maps: same statistics, accumulated in float32/float64."""

from __future__ import annotations

import pytest
import torch
from tiny import ragged_batch, tiny_model

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.core.data import pad

pytestmark = pytest.mark.integration
FIELDS = ("sink_mass", "entropy_full", "entropy_content", "g", "rest")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_half_precision_statistics_are_float_and_close_to_float32(family, dtype):
    """bf16/fp16 weights and activations; scores recomputed in float32, sums in float64.

    The tolerance is the precision of the model, not of the capture: bf16 rounds every
    weight and activation to 8 significant bits (relative 2^-9 ~ 2e-3), so attention
    weights of the half model differ from the float32 model's by ~1e-3 at most, and
    means of them by less (measured: <= 4e-5 on these tiny models); 1e-3 allows for it.
    """
    batch = pad(ragged_batch(seed=3, n=6), 0)
    cfg = CaptureConfig(outputs=True)
    ref = capture_stats(tiny_model(family), batch, SinkSpec("first"), config=cfg)
    half = capture_stats(tiny_model(family).to(dtype), batch, SinkSpec("first"), config=cfg)
    for f in FIELDS:
        assert getattr(half, f).dtype == torch.float64
        torch.testing.assert_close(getattr(half, f), getattr(ref, f), rtol=0, atol=1e-3, msg=f)
    for k in ref.pairs:
        assert half.pairs[k].dtype == torch.float64
        torch.testing.assert_close(half.pairs[k], ref.pairs[k], rtol=0, atol=1e-3, msg=k)
    assert half.outputs[0].oo.dtype == torch.float64 and torch.isfinite(half.outputs[0].joint).all()


def test_device_map_auto_gives_the_same_statistics_and_nll():
    """`device_map="auto"` (accelerate's dispatch; all on CPU here) is honoured end to end.

    On a CPU-only machine it maps every module to the CPU, so this checks the
    plumbing (inputs sent to the embedding's device, per-layer sums moved to the CPU
    before merging) rather than a real split; those paths are device-agnostic.
    """
    from pruner.checkpoints import loading
    from pruner.core import data
    from pruner.evaluation.perplexity import sliding_windows, window_nll

    tok = loading.load_tokenizer("gpt2-shakespeare")
    texts = data.load_texts(data.TextSource("shakespeare:evaluation"))
    batch = data.token_windows(tok, texts, 64, num_samples=4, seed=0)
    windows = sliding_windows(tok, texts, 64, max_windows=4)
    plain, mapped = loading.load_model("gpt2-shakespeare"), loading.load_model("gpt2-shakespeare", device_map="auto")
    a, b = (capture_stats(m, batch, SinkSpec("first")) for m in (plain, mapped))
    for f in FIELDS:
        torch.testing.assert_close(getattr(b, f), getattr(a, f), rtol=0, atol=1e-9, msg=f)
    torch.testing.assert_close(window_nll(mapped, windows)[0], window_nll(plain, windows)[0], rtol=0, atol=1e-6)
