"""The shipped checkpoints: vanilla loading, float32, and capture == eager on real weights."""

from __future__ import annotations

import json

import pytest
import torch
from eager_reference import eager_stats
from test_capture import assert_stats_close

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import loading
from pruner.core import assets
from pruner.core.data import TextSource, line_samples, load_texts, token_windows

pytestmark = pytest.mark.integration
DECODERS = ("gpt2-shakespeare", "llama-shakespeare", "llama-shakespeare-early", "llama-shakespeare-middle",
            "minilm-causal")


@pytest.mark.parametrize("name", DECODERS)
def test_vanilla_loading_as_float32(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.float32
    assert tok.bos_token_id is not None or tok.cls_token_id is not None
    report = json.loads((path / "reference.json").read_text())
    assert "sink_mass" in report


def test_llama_uses_grouped_query_attention_and_explicit_head_dim():
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(assets.checkpoint("llama-shakespeare"))
    assert cfg.num_attention_heads == 8 and cfg.num_key_value_heads == 2 and cfg.head_dim == 32


@pytest.mark.parametrize("name", ["gpt2-shakespeare", "llama-shakespeare", "minilm-causal"])
def test_capture_equals_eager_on_reference_decoders(name):
    model = loading.load_model(name)
    tok = loading.load_tokenizer(name)
    batch = token_windows(tok, load_texts(TextSource("shakespeare:evaluation")), 64, num_samples=4, seed=0)
    cfg = CaptureConfig(chunk_size=24, metrics=("cosine", "js"))
    cap = capture_stats(model, batch, SinkSpec("first"), tok, cfg, batch_size=2)
    ref = eager_stats(model, batch, SinkSpec("first"), tok, metrics=cfg.metrics, batch_size=2)
    assert_stats_close(cap, ref, atol=1e-5)


def test_capture_equals_eager_on_minilm_encoder(minilm_tokenizer):
    model = loading.load_model("minilm")
    batch = line_samples(minilm_tokenizer, load_texts(TextSource("shakespeare:calibration")), 48,
                         num_samples=12, seed=0)
    cfg = CaptureConfig(chunk_size=16, metrics=("cosine", "js"))
    spec = SinkSpec("special")
    cap = capture_stats(model, batch, spec, minilm_tokenizer, cfg, batch_size=5)
    ref = eager_stats(model, batch, spec, minilm_tokenizer, metrics=cfg.metrics, batch_size=5)
    assert_stats_close(cap, ref, atol=1e-5)
    assert cap.sink_mass[1:].mean() > 0.3  # real pretrained sinks


def test_minilm_causal_has_real_sinks():
    """The fine-tuned causal all-MiniLM-L6-v2 keeps (and strengthens) its pretrained sinks."""
    report = json.loads((assets.checkpoint("minilm-causal") / "reference.json").read_text())
    summary = report["sink_summary"]
    assert summary["criterion_met"], summary


def test_minilm_readout_gives_a_real_masked_lm(minilm_tokenizer):
    """The shipped readout turns the frozen encoder into a masked LM far better than chance or
    than an untrained readout (its reference.json reports the full evaluation number)."""
    from pruner.evaluation.perplexity import masked_lines, perplexity, window_nll

    lines = masked_lines(minilm_tokenizer, load_texts(TextSource("shakespeare:evaluation")), 48,
                         num_samples=64, seed=0)
    trained = perplexity(*window_nll(loading.load_minilm_mlm(), lines, causal=False))
    torch.manual_seed(0)
    fresh = perplexity(*window_nll(loading.load_minilm_mlm(readout=None), lines, causal=False))
    assert trained < 1500 and trained < fresh / 10, (trained, fresh)
