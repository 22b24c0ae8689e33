"""Surgery on every adapter family: mask == remove (zero, mean, refit), exact parameter counts, generation."""

from __future__ import annotations

import pytest
import torch
from tiny import CAUSAL, FAMILIES, GQA, ragged_batch, tiny_model

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.core import arch
from pruner.core.data import pad
from pruner.core.runtime import forward
from pruner.pruning import surgery
from pruner.pruning.compensation import compensate

pytestmark = pytest.mark.integration


def logits(model, batch):
    with torch.no_grad():
        out = forward(model, batch.input_ids, batch.attention_mask)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


def heads_for(family) -> dict[int, list[int]]:
    # GQA families (4 query heads over 2 KV heads): one head per group, or a whole group
    return {0: [1, 3], 1: [2, 3]} if family in GQA else {0: [1, 3], 1: [0]}


def outputs_of(model, batch, family):
    spec = SinkSpec("first") if family in CAUSAL else SinkSpec("ids", ids=(1,))
    return capture_stats(model, batch, spec, config=CaptureConfig(metrics=(), outputs=True)).outputs


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_empty_mask_is_bit_identical(family):
    model = tiny_model(family)
    batch = pad(ragged_batch(), 0)
    before = logits(model, batch)
    with surgery.masked(model, {}):
        same = logits(model, batch)
    assert torch.equal(before, same)
    surgery.mask_heads(model, {})
    assert torch.equal(before, logits(model, batch))


@pytest.mark.parametrize("compensation", surgery.COMPENSATIONS)
def test_mask_equals_remove(family, compensation):
    batch = pad(ragged_batch(seed=3), 0)
    heads = heads_for(family)
    ref = tiny_model(family)
    outputs = outputs_of(ref, batch, family)
    bias = compensate(ref, heads, outputs, compensation)
    with surgery.masked(ref, heads, bias):
        scoped = logits(ref, batch)
    full = logits(ref, batch)
    assert not torch.allclose(scoped, full, atol=1e-4)  # the heads mattered

    permanent = tiny_model(family)
    surgery.mask_heads(permanent, heads, bias)
    removed = tiny_model(family)
    n_before = sum(p.numel() for p in removed.parameters())
    surgery.remove_heads(removed, heads, bias)
    torch.testing.assert_close(logits(permanent, batch), scoped, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(removed, batch), scoped, rtol=0, atol=1e-5)
    expected = expected_removed_params(tiny_model(family), heads, family)
    added_bias = 0
    if compensation == "mean":
        ad = arch.adapter_for(removed)
        if family in ("llama", "qwen3", "gemma3_text"):  # attention_bias turned on: zero q/k/v/o biases everywhere
            added_bias = sum(arch.get(b, p).bias.numel() for b in arch.blocks(removed)
                             for p in (ad.q, ad.k, ad.v, ad.o_proj))
        elif family in ("mistral", "qwen2"):  # o_proj bias added where pruned
            added_bias = sum(arch.get(arch.blocks(removed)[layer], ad.o_proj).bias.numel() for layer in heads)
    assert n_before - sum(p.numel() for p in removed.parameters()) + added_bias == expected


def expected_removed_params(model, heads, family) -> int:
    """q and o slices per head, k/v slices per fully removed KV group; biases included."""
    g = arch.geometry(model)
    d = model.config.hidden_size
    hd = g.head_dim
    qkv_bias = family in ("gpt2", "gpt_neox", "bert", "roberta", "qwen2")
    total = 0
    for layer, hs in heads.items():
        q_rows = len(hs) * hd
        if g.group_size == 1:
            kv_rows = q_rows
        else:
            left = [h for h in range(g.n_heads) if h not in hs]
            kv_rows = (g.n_kv_heads - len({h // g.group_size for h in left})) * hd
        total += q_rows * d + 2 * kv_rows * d + q_rows * d  # q, k, v rows and o columns
        if qkv_bias:
            total += q_rows + 2 * kv_rows
    return total


def test_decoders_generate_with_kv_cache_after_removal():
    for family in sorted(CAUSAL):
        model = tiny_model(family)
        surgery.remove_heads(model, heads_for(family))
        ids = torch.tensor([[1, 5, 6, 7]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
            no_cache = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=0)
        assert out.shape == (1, 9)
        assert torch.equal(out, no_cache), family


def test_gqa_constraint_is_a_clear_error():
    model = tiny_model("llama")  # 4 query heads, 2 KV groups: {0, 1} and {2, 3}
    with pytest.raises(surgery.SurgeryError, match="same number in every kept group"):
        surgery.remove_heads(model, {0: [0]})
    surgery.remove_heads(model, {0: [0, 1]})  # a whole group is fine
    assert surgery.kept_heads(model)[0] == [2, 3]


def test_cannot_empty_a_layer_or_remove_twice():
    model = tiny_model("gpt2")
    with pytest.raises(surgery.SurgeryError, match="no head"):
        surgery.remove_heads(model, {0: [0, 1, 2, 3]})
    surgery.remove_heads(model, {0: [1]})
    with pytest.raises(surgery.SurgeryError, match="already removed"):
        surgery.remove_heads(model, {0: [1]})


def test_successive_removals_compose():
    batch = pad(ragged_batch(seed=4), 0)
    once, twice = tiny_model("llama"), tiny_model("llama")
    surgery.remove_heads(once, {0: [0, 2], 1: [0, 1]})
    surgery.remove_heads(twice, {0: [0, 2]})
    surgery.remove_heads(twice, {1: [0, 1]})
    torch.testing.assert_close(logits(twice, batch), logits(once, batch), rtol=0, atol=1e-6)


def test_unsupported_architecture_names_the_supported_ones():
    import transformers as tf

    model = tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                           ffn_dim=32, vocab_size=32, word_embed_proj_dim=16))
    with pytest.raises(arch.UnsupportedArchitecture, match="supported: bert, gemma3_text, gpt2"):
        arch.adapter_for(model)
