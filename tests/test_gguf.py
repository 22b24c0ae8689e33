"""`pruner export RUN --format gguf`: the structure of every written file, read back with the gguf reader alone
(architecture, per-layer head counts, head width, every tensor's shape and type, the tokenizer), and the
refusals, one line each, before anything is written. llama.cpp's own generation check is tests/test_llamacpp.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from pruner.checkpoints import gguf_file, loading
from pruner.cli import main
from pruner.pruning import surgery

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=4", "--set", "evaluation.bootstrap=10",
         "--set", "evaluation.latency=false", "--set", "bench.enabled=false", "--set", "surgery.mode=mask",
         "--set", "surgery.compensation=mean"]  # biases: the GGUF carries them too


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """llama-shakespeare pruned two ways (mean compensation, named): 4 of 8 heads in every layer (the
    recipe's servable default), and 8 of 32 heads under a global budget (layers differ)."""
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp("gguf") / name
            sets = {"uniform": [], "global": ["--set", "selection.shape=any", "--set", "selection.budget=global",
                                              "--set", "selection.target=0.25"]}[name]
            assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out)]
                        + QUICK + sets) == 0
            made[name] = out
        return made[name]

    return get


def expected_shapes(q: list[int], kv: list[int], d: int = 256, hd: int = 32, ff: int = 704) -> dict:
    """The llama/deci tensors of the shipped Llama (tied embeddings) with q / kv heads per layer, biases included
    (mean compensation turns on Llama's attention_bias). name -> (rows, cols) as in transformers."""
    out = {"token_embd.weight": (4096, d), "output_norm.weight": (d,)}
    for i, (a, b) in enumerate(zip(q, kv)):
        out.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.ffn_norm.weight": (d,),
                    f"blk.{i}.attn_q.weight": (a * hd, d), f"blk.{i}.attn_q.bias": (a * hd,),
                    f"blk.{i}.attn_k.weight": (b * hd, d), f"blk.{i}.attn_k.bias": (b * hd,),
                    f"blk.{i}.attn_v.weight": (b * hd, d), f"blk.{i}.attn_v.bias": (b * hd,),
                    f"blk.{i}.attn_output.weight": (d, a * hd), f"blk.{i}.attn_output.bias": (d,),
                    f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                    f"blk.{i}.ffn_down.weight": (d, ff)})
    return out


@pytest.mark.parametrize("name,dtype,arch", [("uniform", "float16", "llama"), ("global", "bfloat16", "deci")])
def test_the_written_gguf_holds_the_plan(runs, name, dtype, arch, capsys):
    run = runs(name)
    assert main(["export", str(run), "--format", "gguf", "--dtype", dtype]) == 0
    printed = capsys.readouterr().out
    assert f"exported a GGUF for llama.cpp (architecture {arch}, {dtype})" in printed
    out = run / "export-gguf"
    assert sorted(f.name for f in out.iterdir()) == ["README.md", "model.gguf", "plan.json"]
    heads = {int(k): v for k, v in json.loads((run / "plan.json").read_text())["heads"].items()}
    q = [8 - len(heads.get(i, [])) for i in range(4)]
    kv = [len({h // 4 for h in range(8) if h not in heads.get(i, [])}) for i in range(4)]
    s = gguf_file.structure(out / "model.gguf")
    assert (s["arch"], s["q_heads"], s["kv_heads"], s["key_length"], s["value_length"], s["rope_dim"]) == \
        (arch, q, kv, 32, 32, 32)
    assert (len(set(q)) == 1) == (arch == "llama")
    shapes = expected_shapes(q, kv)
    assert {k: v[0] for k, v in s["tensors"].items()} == shapes
    matrix = {"float16": "F16", "bfloat16": "BF16"}[dtype]
    assert all(t == (matrix if len(shapes[k]) == 2 else "F32") for k, (_, t) in s["tensors"].items())
    assert (s["tokens"], s["pre"], s["bos"], s["eos"]) == (4096, "gpt-2", 0, 1)
    card = (out / "README.md").read_text()
    assert f"architecture `{arch}`" in card and "library_name: gguf" in card
    assert (out / "plan.json").read_text() == (run / "plan.json").read_text()


def test_the_weights_are_the_pruned_models_with_the_rope_rows_permuted(tmp_path):
    """float32 file, tensor for tensor: q and k rows permuted within each head (transformers' rotate-half ->
    llama.cpp's adjacent pairs), everything else as it is in the pruned model."""
    import gguf

    model = loading.load_model("llama-shakespeare")
    surgery.remove_heads(model, {0: [0, 4], 2: [1, 2, 5, 6]})
    tok = loading.load_tokenizer("llama-shakespeare")
    plan = gguf_file.plan(model, tok)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float32", plan)
    got = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    q = model.model.layers[0].self_attn.q_proj.weight  # (6 heads x 32, 256)
    want = q.reshape(6, 2, 16, 256).transpose(1, 2).reshape(192, 256)
    assert torch.equal(got["blk.0.attn_q.weight"], want) and not torch.equal(want, q)
    assert torch.equal(got["blk.2.attn_v.weight"], model.model.layers[2].self_attn.v_proj.weight)
    assert torch.equal(got["blk.1.ffn_down.weight"], model.model.layers[1].mlp.down_proj.weight)
    assert plan.arch == "deci" and plan.q_heads == (6, 8, 4, 8)


def test_llama3_rope_goes_in_as_llama_cpps_frequency_divisors():
    """Llama 3's scaled rope: llama.cpp divides each frequency by its factor; transformers' inv_freq is the
    same frequencies already divided."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    torch.testing.assert_close(plain / gguf_file.llama3_rope_factors(rope, 64), scaled.float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("family,says", [("gpt2", "not the gpt2 family: prune a Llama, Mistral or Gemma 3 model"),
                                         ("gpt_neox", "not the gpt_neox family"),
                                         ("qwen2", "not Qwen2's q/k/v biases"), ("qwen3", "not Qwen3's q/k norms")])
def test_families_llama_cpp_cannot_take_are_refused_naming_what_would_work(family, says, tmp_path):
    model = tiny_model(family)
    surgery.remove_heads(model, {0: [1, 3] if family in ("qwen2", "qwen3") else [1]})  # layers differ
    with pytest.raises(gguf_file.GgufError, match=says) as e:
        gguf_file.plan(model, loading.load_tokenizer("llama-shakespeare"))
    assert "\n" not in str(e.value) and "export --format compact" in str(e.value)
    uniform = tiny_model("qwen2")
    surgery.remove_heads(uniform, {0: [1, 3], 1: [0, 2]})
    assert "convert_hf_to_gguf.py" in gguf_file.refusal(uniform)  # its uniform plan is a vanilla checkpoint


def test_a_refused_export_writes_nothing(tmp_path, capsys):
    """A GPT-2 run: one line naming what would work, exit status 2, before the base is even loaded; no folder
    (not even a partial one)."""
    run = tmp_path / "gpt2"
    assert main(["prune", str(ROOT / "recipes" / "gpt2-shakespeare.yaml"), "--out", str(run)] + QUICK) == 0
    capsys.readouterr()
    assert main(["export", str(run), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write a GGUF" in err[0] and "export --format compact" in err[0]
    assert not any(p.name.startswith(("export-gguf", ".export-gguf")) for p in run.iterdir())
