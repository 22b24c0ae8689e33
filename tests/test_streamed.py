"""A pruned checkpoint written one block at a time (`pruner.checkpoints.streamed`): the same files as the
in-memory save, on every family, layout and compensation, and a reload check that catches a wrong file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from pruner.checkpoints import loading, saving, streamed
from pruner.checkpoints.lazy import lazy_model
from pruner.checkpoints.storage import CheckpointError
from pruner.core import arch, assets
from pruner.pruning import surgery

pytestmark = pytest.mark.integration


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def compensation(model, heads: dict[int, list[int]], kind: str) -> surgery.Compensation:
    g = arch.geometry(model)
    d = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    if kind == "mean":
        return surgery.Compensation("mean", bias={k: 0.1 * torch.randn(d, generator=gen) for k in heads})
    if kind == "refit":
        return surgery.Compensation("refit", weight={k: 0.01 * torch.randn(d, g.n_heads * g.head_dim, generator=gen)
                                                     for k in heads})
    return surgery.Compensation()


SHIPPED = ("llama-shakespeare", "gpt2-shakespeare", "minilm-causal")


def base(name: str, tmp_path: Path):
    """(model in memory, its checkpoint folder, a tokenizer to write beside it): a shipped checkpoint, or a tiny
    random model of a family saved to disk."""
    if name in SHIPPED:
        return loading.load_model(name), Path(assets.resolve(name)), loading.load_tokenizer(name)
    model = tiny_model(name)
    model.save_pretrained(tmp_path / "base")
    return model, tmp_path / "base", loading.load_tokenizer("gpt2-shakespeare")


CASES = [  # (model, heads, compensation, removed, layout)
    ("llama-shakespeare", {k: [0, 1, 4, 5] for k in range(4)}, "refit", True, "vanilla"),
    ("llama-shakespeare", {k: [0, 4] for k in range(4)}, "zero", True, "vanilla"),  # 6 heads: MistralForCausalLM
    ("llama-shakespeare", {0: [0, 4], 2: [1, 5]}, "mean", True, "per-layer"),  # bias on every block, counts differ
    ("llama-shakespeare", {1: [2]}, "mean", False, "dense"),
    ("gpt2-shakespeare", {0: [1], 2: [0, 3]}, "mean", True, "per-layer"),
    ("minilm-causal", {0: [1], 5: [0, 2]}, "refit", True, "per-layer"),
    ("minilm-causal", {3: [4]}, "zero", False, "dense"),
    ("qwen2", {0: [0, 2], 1: [1, 3]}, "mean", True, "per-layer"),  # an o_proj bias the Qwen2 config cannot declare
    ("gpt_neox", {0: [1], 1: [0]}, "refit", True, "per-layer"),
]


@pytest.mark.parametrize("name,heads,kind,removed,layout", CASES)
def test_block_by_block_writes_what_the_in_memory_save_writes(name, heads, kind, removed, layout, tmp_path):
    model, folder, tok = base(name, tmp_path)
    comp = compensation(model, heads, kind)
    (surgery.remove_heads if removed else surgery.mask_heads)(model, heads, comp)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    parts.mkdir()
    a = saving.save(model, tok, whole, removed, "float16")
    lazy = lazy_model(folder)
    b = streamed.save_streamed(lazy, tok, parts, heads, comp, removed, streamed.StreamedWrite("float16"))
    assert (a.layout, a.why_per_layer, a.dtype, a.generation) == (b.layout, b.why_per_layer, b.dtype, b.generation)
    assert a.layout == layout and b.max_diff <= saving.ATOL and b.storage_diff == a.storage_diff and a.note == b.note
    wa, wb = weights(whole), weights(parts)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((whole / "config.json").read_text()) == json.loads((parts / "config.json").read_text())
    index = json.loads((parts / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(wb) and len(set(index["weight_map"].values())) == len(arch.blocks(model)) + 1
    assert all(p.device.type == "meta" for blk in arch.blocks(lazy.model) for p in blk.parameters())


def test_the_dry_run_refuses_before_anything_is_written(tmp_path):
    """A surgery that cannot be done (GQA groups left uneven) fails on the weightless skeleton: nothing written."""
    folder = Path(assets.resolve("llama-shakespeare"))
    lazy = lazy_model(folder)
    with pytest.raises(surgery.SurgeryError, match="GQA needs the same number in every kept group"):
        streamed.save_streamed(lazy, loading.load_tokenizer("llama-shakespeare"), tmp_path, {1: [0, 1]}, None, True)
    assert not any(tmp_path.iterdir())


def test_a_wrong_tensor_on_disk_fails_the_reload_check(tmp_path, monkeypatch):
    """The check reads the written files back, a block at a time: one perturbed weight is caught and named."""
    write = streamed._write

    def tampered(tensors, path, store, index, names=None):
        key = next((k for k in tensors if k.endswith("o_proj.weight")), None)
        if key is not None and path.name.startswith("model-00002"):
            tensors = {**tensors, key: tensors[key] + 0.05}
        write(tensors, path, store, index, names)

    monkeypatch.setattr(streamed, "_write", tampered)
    lazy = lazy_model(assets.resolve("llama-shakespeare"))
    with pytest.raises(CheckpointError, match=r"reloads \(pruner layer by layer .*\) with logits off by .* nothing was "
                                              "published"):
        streamed.save_streamed(lazy, loading.load_tokenizer("llama-shakespeare"), tmp_path, {0: [0, 4]}, None, True)
