"""Compact checkpoints for every plan: the vanilla form where a config can say it, the per-layer form otherwise.

Every family of tests/tiny.py is pruned unevenly (GQA families lose a whole KV group
in one layer and one head per group in the other), written, and reloaded by each
route a user has -- transformers with trust_remote_code=True, `loading.load` (pruner's
own packaged classes), plain transformers for vanilla checkpoints -- and compared
with the in-memory pruned model here, independently of the check `save` runs itself:
logits on a padded ragged batch within 1e-5, identical greedy generations with the
KV cache, the same parameter count, smaller KV caches.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from tiny import CAUSAL, FAMILIES, GQA, ragged_batch, tiny_model

from pruner.attention.capture import CaptureConfig, capture_stats
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import layout, loading, modeling, saving, storage
from pruner.core import arch, assets
from pruner.core.data import pad
from pruner.core.runtime import forward
from pruner.pruning import surgery
from pruner.pruning.compensation import compensation_bias

pytestmark = pytest.mark.integration


def uneven_heads(family) -> dict[int, list[int]]:
    """Different head counts per layer; GQA (4 query heads over 2 KV heads): a whole KV group in layer 0,
    one query head per group in layer 1."""
    return {0: [0, 1], 1: [1, 3]} if family in GQA else {0: [1, 3], 1: [0]}


def logits(model, batch):
    with torch.no_grad():
        out = forward(model, batch.input_ids, batch.attention_mask)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()


def pruned(family, heads=None, compensation=True):
    """A tiny model with `heads` removed and mean compensation folded in."""
    model = tiny_model(family)
    heads = heads or uneven_heads(family)
    bias = None
    if compensation:
        batch = pad(ragged_batch(seed=3), 0)
        spec = SinkSpec("first") if family in CAUSAL else SinkSpec("ids", ids=(1,))
        outputs = capture_stats(model, batch, spec, config=CaptureConfig(metrics=(), outputs=True)).outputs
        bias = compensation_bias(model, heads, outputs)
    surgery.remove_heads(model, heads, bias)
    if family in CAUSAL:  # a saved decoder names its head class (tiny configs leave architectures empty)
        model.config.architectures = [type(model).__name__]
    return model


def greedy(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              use_cache=True, pad_token_id=0)


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_every_family_writes_a_per_layer_checkpoint_that_reloads_exactly(family, tmp_path, word_tokenizer):
    model = pruned(family)
    saved = saving.save(model, word_tokenizer, tmp_path, removed=True)
    assert saved.layout == "per-layer" and saved.max_diff <= 1e-5 and saved.dtype == "float32"
    assert saved.generation is (True if family in CAUSAL else None)

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["pruner_format"] == modeling.FORMAT and config["model_type"] == f"pruned_{family}"
    q = [len(surgery.kept_heads(model)[layer]) for layer in range(2)]
    assert config["num_attention_heads_per_layer"] == q
    if family in GQA:  # 2 query heads in each layer, over 1 and 2 KV heads
        assert q == [2, 2] and config["num_key_value_heads_per_layer"] == [1, 2]
    else:
        assert q == [2, 3]
    # the file beside the weights is pruner's packaged copy, and the only module it imports is transformers/torch
    written = tmp_path / modeling.file_name(family)
    assert written.read_text() == modeling.source(family).read_text()
    assert all(v.startswith(written.stem + ".Pruned") for v in config["auto_map"].values())

    batch = pad(ragged_batch(seed=5), 0)
    ids = torch.tensor([[1, 5, 6, 7, 9]])
    want = logits(model, batch)
    auto = tf.AutoModelForCausalLM if family in CAUSAL else tf.AutoModel
    for reloaded in (auto.from_pretrained(tmp_path, trust_remote_code=True), loading.load(tmp_path)):
        assert type(reloaded).__name__.startswith("Pruned")
        torch.testing.assert_close(logits(reloaded.eval(), batch), want, rtol=0, atol=1e-5)
        assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in model.parameters())
        if family in CAUSAL:
            assert torch.equal(greedy(reloaded, ids), greedy(model, ids))
    assert type(loading.load(tmp_path)).__module__ == modeling.module(family).__name__  # pruner's own copy


@pytest.mark.parametrize("family", GQA)
def test_removed_kv_groups_shrink_the_projections_and_the_cache(family, tmp_path, word_tokenizer):
    model = pruned(family, {0: [0, 1]}, compensation=False)  # layer 0 keeps KV group 1 only
    saving.save(model, word_tokenizer, tmp_path, removed=True)
    reloaded = loading.load(tmp_path)
    attn = [block.self_attn for block in reloaded.model.layers]
    assert [a.k_proj.weight.shape[0] // a.head_dim for a in attn] == [1, 2]
    assert [a.num_key_value_groups for a in attn] == [2, 2]
    with torch.no_grad():
        out = reloaded(torch.tensor([[1, 5, 6, 7]]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert [layer.keys.shape[1] for layer in cache.layers] == [1, 2]  # (B, kv_heads, T, d_head)
    assert [layer.values.shape[1] for layer in cache.layers] == [1, 2]


@pytest.mark.parametrize("family", GQA)
def test_uniform_counts_give_a_vanilla_checkpoint(family, tmp_path, word_tokenizer):
    """One head per KV group in every layer: the family's own config says it (Qwen2 gets an explicit head_dim)."""
    model = pruned(family, {0: [1, 3], 1: [0, 2]}, compensation=False)
    if family == "qwen2":
        del model.config.head_dim  # as in real Qwen2 configs: head_dim derived from hidden_size / heads
    saved = saving.save(model, word_tokenizer, tmp_path, removed=True)
    assert saved.layout == "vanilla" and saved.why_per_layer is None
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == family and "auto_map" not in config and "pruner_format" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 2, 8)
    assert not list(tmp_path.glob("modeling_*.py"))
    batch = pad(ragged_batch(seed=5), 0)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no remote code
    torch.testing.assert_close(logits(plain, batch), logits(model, batch), rtol=0, atol=1e-5)
    assert type(loading.load(tmp_path)) is type(plain)


def test_a_head_count_the_llama_config_rejects_is_a_vanilla_mistral(tmp_path, word_tokenizer):
    """Llama validates hidden_size % num_attention_heads: 3 heads of width 8 in a 32-wide model is written as
    MistralForCausalLM (explicit head_dim, no sliding window), which plain transformers loads with the same logits."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                               head_dim=8, hidden_size=32, intermediate_size=64, vocab_size=64,
                                               architectures=["LlamaForCausalLM"])).eval()
    surgery.remove_heads(model, {0: [1], 1: [2]})
    saved = saving.save(model, word_tokenizer, tmp_path, removed=True)
    assert saved.layout == "vanilla" and "llama config refuses 3 heads" in saved.note
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["architectures"], config["num_attention_heads"], config["head_dim"], config["sliding_window"]) == \
        (["MistralForCausalLM"], 3, 8, None)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no remote code
    batch = pad(ragged_batch(seed=5), 0)
    assert type(plain) is tf.MistralForCausalLM
    torch.testing.assert_close(logits(plain, batch), logits(model, batch), rtol=0, atol=1e-5)


def test_a_count_llama_refuses_with_a_bias_mistral_cannot_hold_is_per_layer(tmp_path, word_tokenizer):
    """Mistral has no attention_bias: a Llama with biases at a count its config refuses keeps the per-layer form,
    and the reason names both refusals in one line."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                               head_dim=8, hidden_size=32, intermediate_size=64, vocab_size=64,
                                               attention_bias=True)).eval()
    surgery.remove_heads(model, {0: [1], 1: [2]})
    saved = saving.save(model, word_tokenizer, tmp_path, removed=True)
    assert saved.layout == "per-layer" and "\n" not in saved.why_per_layer
    assert "transformers rejects a llama config with 3 heads" in saved.why_per_layer
    assert "MistralForCausalLM, which takes any head count, has no attention_bias" in saved.why_per_layer
    assert json.loads((tmp_path / "config.json").read_text())["num_attention_heads"] == 4  # the base's, valid


def test_a_bias_the_config_cannot_declare_is_per_layer_and_dense_is_refused(tmp_path, word_tokenizer):
    """Mistral has no attention_bias switch: mean compensation's o_proj bias lives in the per-layer form."""
    model = pruned("mistral", {0: [0, 2], 1: [1, 3]})  # uniform counts, but a bias on both o_projs
    with pytest.raises(storage.CheckpointError, match="cannot write a dense checkpoint.*--format compact"):
        layout.layout(model, removed=False)
    saved = saving.save(model, word_tokenizer, tmp_path, removed=True)
    assert saved.layout == "per-layer" and "mistral config cannot declare" in saved.why_per_layer
    assert json.loads((tmp_path / "config.json").read_text())["o_proj_bias_per_layer"] == [True, True]
    reloaded = loading.load(tmp_path)
    batch = pad(ragged_batch(seed=5), 0)
    torch.testing.assert_close(logits(reloaded, batch), logits(model, batch), rtol=0, atol=1e-5)


def test_float16_storage_is_checked_against_the_rounded_model(tmp_path, word_tokenizer):
    """A float16 file holds the float32 model rounded: the reload matches that exactly, and the rounding
    itself is measured and reported (storage_diff), never hidden in a loose tolerance."""
    model = pruned("llama")
    full, half = tmp_path / "full", tmp_path / "half"
    saving.save(model, word_tokenizer, full, removed=True)
    saved = saving.save(model, word_tokenizer, half, removed=True, dtype="float16")
    assert saved.dtype == "float16" and 0 < saved.storage_diff < 1e-2 and saved.max_diff <= 1e-5
    assert json.loads((half / "config.json").read_text())["dtype"] == "float16"
    assert storage._safetensors_dtypes(storage.weight_files(half)).keys() == {"float16"}
    assert (half / "model.safetensors").stat().st_size < 0.6 * (full / "model.safetensors").stat().st_size
    assert next(model.parameters()).dtype == torch.float32  # the in-memory model is left as it was
    batch = pad(ragged_batch(seed=5), 0)
    reloaded = loading.load(half, dtype="float32")
    with storage.rounded_to(model, torch.float16):
        torch.testing.assert_close(logits(reloaded, batch), logits(model, batch), rtol=0, atol=1e-5)
    assert (logits(reloaded, batch) - logits(model, batch)).abs().max() > 0  # rounding is real


def test_storage_dtype_reads_the_weights_not_the_config(tmp_path):
    """The shipped checkpoints' config.json says float32; their weights are float16."""
    from pruner.runs.recipe import ModelSpec

    assert json.loads((Path(assets.resolve("llama-shakespeare")) / "config.json").read_text())["dtype"] == "float32"
    assert storage.storage_dtype(ModelSpec(path="llama-shakespeare")) == "float16"
    tiny_model("gpt2").to(torch.bfloat16).save_pretrained(tmp_path)
    assert storage.storage_dtype(ModelSpec(path=str(tmp_path))) == "bfloat16"


def test_plain_transformers_without_trust_remote_code_is_refused_clearly(tmp_path, word_tokenizer):
    saving.save(pruned("gpt2", compensation=False), word_tokenizer, tmp_path, removed=True)
    with pytest.raises(ValueError, match="(?s)contains custom code.*pass the argument `trust_remote_code=True`"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_pruner_loads_per_layer_checkpoints_without_running_the_folder_file(tmp_path, word_tokenizer):
    model = pruned("llama", compensation=False)
    saving.save(model, word_tokenizer, tmp_path, removed=True)
    file = tmp_path / modeling.file_name("llama")
    file.write_text('raise RuntimeError("the folder file was executed")\n' + file.read_text())
    batch = pad(ragged_batch(seed=5), 0)
    for reloaded in (loading.load(tmp_path), loading.load_model(str(tmp_path))):  # pruner's loader dispatches too
        torch.testing.assert_close(logits(reloaded, batch), logits(model, batch), rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match="the folder file was executed"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)


def test_an_edited_config_is_one_clear_line(tmp_path, word_tokenizer):
    saving.save(pruned("llama", compensation=False), word_tokenizer, tmp_path, removed=True)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "num_attention_heads_per_layer": [4, 2]}))
    with pytest.raises(storage.CheckpointError, match=r"config.json does not match the weights: "
                       r"model.layers.0.self_attn.o_proj.weight is \[32, 16\] in the checkpoint but \[32, 32\]"):
        loading.load(tmp_path)
    path.write_text(json.dumps({**config, "num_key_value_heads_per_layer": [2, 2], "num_attention_heads_per_layer":
                                [3, 2]}))
    with pytest.raises(ValueError, match="layer 0 has 3 query heads over 2 key/value heads"):
        loading.load(tmp_path)
    path.write_text(json.dumps({**config, "pruner_format": "per-layer-heads/9"}))
    with pytest.raises(modeling.FormatError, match="'per-layer-heads/9' is not one this pruner reads"):
        loading.load(tmp_path)

    vanilla = tmp_path / "vanilla"  # the same check guards vanilla compact checkpoints
    saving.save(pruned("llama", {0: [0, 1], 1: [2, 3]}, compensation=False), word_tokenizer, vanilla, True)
    config = json.loads((vanilla / "config.json").read_text())
    (vanilla / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4, "num_key_value_heads": 2}))
    with pytest.raises(storage.CheckpointError, match="config.json does not match the weights"):
        loading.load(vanilla)


def test_foreign_remote_code_is_not_loaded(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "modeling_x.X"}}))
    with pytest.raises(storage.CheckpointError, match="not a pruner per-layer checkpoint"):
        loading.load(tmp_path)


def test_pruner_does_not_score_a_per_layer_model(tmp_path, word_tokenizer):
    saving.save(pruned("gpt2", compensation=False), word_tokenizer, tmp_path, removed=True)
    with pytest.raises(arch.UnsupportedArchitecture, match="per-layer checkpoint.*use its base model"):
        arch.adapter_for(loading.load(tmp_path))


@pytest.mark.unit
@pytest.mark.parametrize("file", sorted(set(modeling.FILES.values())))
def test_packaged_modeling_files_import_only_transformers_and_torch(file):
    tree = ast.parse((Path(modeling.__file__).parent / f"{file}.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"torch", "transformers"}, roots
