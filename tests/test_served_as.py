"""Any uniform head count is vanilla for Llama: where transformers' Llama config refuses the count
(hidden_size % num_attention_heads), the compact model is written as `MistralForCausalLM` with an explicit
head_dim, no sliding window and the base's rope parameters -- the same function, loaded by plain transformers
with the pruned model's logits and greedy tokens; where Mistral cannot hold it (biases) the per-layer form stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf

from pruner.checkpoints import layout, loading, saving
from pruner.cli import main
from pruner.core import shapes
from pruner.pruning import surgery

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=8", "--set", "evaluation.bootstrap=20",
         "--set", "evaluation.latency=false", "--set", "bench.enabled=false"]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_every_multiple_of_the_kv_heads_is_servable_for_llama():
    """llama-shakespeare (hidden 256, 8 heads over 2 KV) keeps 6 too; Llama-3.2-1B keeps 24 (25%)."""
    shipped = loading.load_model("llama-shakespeare")
    assert layout.servable_prunes(shipped) == (0, 2, 4, 6) and layout.servable_prunes(shipped, "group") == (0, 4)
    with torch.device("meta"):
        big = tf.LlamaForCausalLM(shapes.config("llama-3.2-1b"))  # meta-llama/Llama-3.2-1B's public config
    assert layout.servable_prunes(big) == (0, 8, 16, 24)
    assert layout.servable_prunes(big, "group") == tuple(range(0, 32, 4))


def test_a_llama3_rope_llama_at_a_refused_count_is_a_vanilla_mistral(tmp_path):
    """6 of 8 heads at hidden 64 with Llama 3's scaled rope: MistralForCausalLM, rope type and scaling carried,
    the same logits past the original context (where the scaling matters) and the same greedy tokens."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, vocab_size=256, max_position_embeddings=512, rope_parameters=LLAMA3_ROPE,
        bos_token_id=1, eos_token_id=2)).eval()
    surgery.remove_heads(model, {0: [0, 4], 1: [3, 7]})
    form = layout.vanilla_form(model)
    assert form.architecture == "MistralForCausalLM" and "llama config refuses 6 heads with hidden size 64" in form.note
    saved = saving.save(model, loading.load_tokenizer("llama-shakespeare"), tmp_path, removed=True, dtype="float32")
    assert (saved.layout, saved.note, saved.max_diff) == ("vanilla", form.note, 0.0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["sliding_window"] is None and "attention_bias" not in config
    assert config["rope_parameters"] == LLAMA3_ROPE and (config["num_attention_heads"], config["head_dim"]) == (6, 16)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(plain) is tf.MistralForCausalLM
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert torch.equal(saving.greedy(plain, ids[:, :100], 16), saving.greedy(model, ids[:, :100], 16))


def test_the_shipped_llama_at_25_percent_prunes_and_exports_a_vanilla_mistral(tmp_path, capsys):
    """`pruner prune recipes/llama-shakespeare.yaml --set selection.target=0.25` (zero compensation): 6 heads per
    layer, model/ and the compact export are MistralForCausalLM, and both the output and the card say why."""
    out = tmp_path / "run"
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out),
                 "--set", "selection.target=0.25", "--set", "surgery.compensation=zero"] + QUICK) == 0
    printed = capsys.readouterr().out
    assert "model/: written as MistralForCausalLM: transformers' llama config refuses 6 heads" in printed
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and "pruner_format" not in config
    assert main(["export", str(out), "--format", "compact"]) == 0
    assert "vanilla, written as MistralForCausalLM" in capsys.readouterr().out
    card = (out / "export-compact" / "README.md").read_text()
    assert "6 attention heads over 2 key/value heads per layer. It is written as MistralForCausalLM" in card
    assert tf.AutoConfig.from_pretrained(out / "export-compact").num_attention_heads == 6

