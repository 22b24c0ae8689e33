"""Evaluator: strided windows label every token once; paired bootstrap; perplexity by hand."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import tiny_model

from pruner.evaluation.perplexity import paired_delta, perplexity, sliding_windows, window_nll

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bos", [True, False])
@pytest.mark.parametrize("stride", [None, 3, 5])
def test_every_token_is_a_target_exactly_once(word_tokenizer, bos, stride):
    text = " ".join(["the king is good and the queen was my lord"] * 3)  # 30 tokens + EOS
    w = sliding_windows(word_tokenizer, [text], length=8, stride=stride, bos=bos)
    stream = word_tokenizer(text, add_special_tokens=False)["input_ids"] + [word_tokenizer.eos_token_id]
    targets = [t for row in w.labels.tolist() for t in row if t != -100]
    assert targets == stream[1:] if not bos else targets == stream
    if bos:
        assert (w.input_ids[:, 0] == word_tokenizer.bos_token_id).all() and (w.labels[:, 0] == -100).all()
    assert w.input_ids.shape[1] == 8
    # labels sit on the tokens they label
    on = w.labels != -100
    assert torch.equal(w.input_ids[on], w.labels[on])


@pytest.mark.parametrize("which", ["gpt2", "minilm-causal"])
def test_window_nll_matches_a_direct_computation(word_tokenizer, which):
    """The model's own logits, by hand; the shipped causal MiniLM's head transforms the hidden states before its
    output embedding (the head alone applied to them once gave a perplexity of 26,570 instead of 156)."""
    if which == "gpt2":
        model = tiny_model("gpt2")
    else:
        from transformers import AutoModelForCausalLM

        from pruner.core import assets

        model = AutoModelForCausalLM.from_pretrained(assets.resolve("minilm-causal")).eval()
    w = sliding_windows(word_tokenizer, ["the king is good and the queen was my lord " * 4], length=10)
    nll, count = window_nll(model, w, batch_size=3)
    total, n = 0.0, 0
    with torch.no_grad():
        for ids, mask, lab in zip(w.input_ids, w.attention_mask, w.labels):
            L = int(mask.sum())
            logp = torch.log_softmax(model(input_ids=ids[None, :L]).logits[0].double(), -1)
            for t in range(1, L):
                if lab[t] != -100:
                    total -= logp[t - 1, lab[t]].item()
                    n += 1
    assert int(count.sum()) == n
    assert perplexity(nll, count) == pytest.approx(math.exp(total / n), rel=1e-5)


def test_paired_delta_and_bootstrap():
    c = torch.full((50,), 10)
    base = (torch.full((50,), 20.0, dtype=torch.float64), c)
    worse = (torch.full((50,), 25.0, dtype=torch.float64), c)
    d = paired_delta(base, worse, n_boot=200)
    assert d.base == pytest.approx(math.exp(2.0)) and d.pruned == pytest.approx(math.exp(2.5))
    assert d.ci_low == pytest.approx(d.delta) and d.ci_high == pytest.approx(d.delta)  # no spread
    g = torch.Generator().manual_seed(0)
    noisy = (worse[0] + torch.randn(50, generator=g, dtype=torch.float64) * 3, c)
    n = paired_delta(base, noisy, n_boot=500)
    assert n.ci_low < n.delta < n.ci_high
    with pytest.raises(ValueError, match="same windows"):
        paired_delta(base, (worse[0], c + 1))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "qwen2", "gemma3_text"])
def test_next_token_nll_a_slice_at_a_time_is_the_whole_logits_loss(family, monkeypatch):
    """The NLL of each position from the head applied a slice of positions at a time (no (B, T, vocab) logits at
    once) equals the loss of the model's own forward, padding and ignored labels included."""
    from pruner.evaluation import perplexity as ppl

    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, 5] = -100
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    want = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:].clamp_min(0),
                                             reduction="none")
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    for budget in (1, 3 * 64 * 4 * 5, 1 << 30):  # one position, five, all at once
        monkeypatch.setattr(ppl, "LOGIT_BYTES", budget)
        got = ppl.next_token_nll(model.get_output_embeddings(), hidden, labels)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
