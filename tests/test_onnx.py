"""ONNX Runtime GenAI export (`pruner export RUN --format onnx`): every vanilla family's compact model goes through
the GenAI model builder and generates PyTorch's greedy tokens; the refusals are one line each."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import onnxruntime_genai  # noqa: F401 - the onnx extra is part of the test extra: its absence fails, never skips
import pytest
import torch
from transformers import AutoModelForCausalLM

from pruner.checkpoints import onnx
from pruner.cli import main
from pruner.core import assets

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=8", "--set", "calibration.length=32", "--set", "evaluation.num_samples=4",
         "--set", "evaluation.length=32", "--set", "evaluation.bootstrap=10", "--set", "evaluation.latency=false",
         "--set", "bench.enabled=false", "--set", "capture.metrics=[cosine]"]


def tiny_run(tmp_path: Path, family: str, *sets: str) -> Path:
    """A random 2-layer `family` model (4 query / 2 KV heads) with the shipped Llama's tokenizer, pruned."""
    import transformers as tf

    torch.manual_seed(0)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM)}[family]
    config = cls[0](vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                    bos_token_id=0, eos_token_id=1)
    base = tmp_path / family
    cls[1](config).save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(assets.resolve("llama-shakespeare")) / f, base / f)
    (tmp_path / "recipe.yaml").write_text(f"model: {{path: {base}}}\nsinks: {{mode: first}}\n")
    run = tmp_path / "run"
    assert main(["prune", str(tmp_path / "recipe.yaml"), "--out", str(run), *QUICK,
                 *(x for s in sets for x in ("--set", s))]) == 0
    return run


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_vanilla_family_exports_and_generates_pytorchs_tokens(family, tmp_path, capsys):
    run = tiny_run(tmp_path, family, "selection.target=0.5")
    assert main(["export", str(run), "--format", "compact"]) == 0
    assert main(["export", str(run), "--format", "onnx"]) == 0
    out = run / "export-onnx"
    assert {"model.onnx", "genai_config.json", "README.md", "plan.json"} <= {f.name for f in out.iterdir()}
    assert "ONNX Runtime GenAI" in (out / "README.md").read_text()
    vanilla = AutoModelForCausalLM.from_pretrained(run / "export-compact", dtype=torch.float32).eval()
    assert vanilla.config.num_attention_heads == 2  # half of the 4 heads gone in every layer
    ids = onnx.prompt(vanilla.config.vocab_size)
    assert onnx.genai_greedy(out, ids, 12) == onnx.torch_greedy(vanilla, ids, 12)
    assert "its greedy generations equal PyTorch's" in capsys.readouterr().out


def test_a_llama_count_llamas_config_refuses_goes_through_the_builder_as_vanilla_mistral(tmp_path):
    """6 of 8 heads at hidden 64 (not a multiple): the checkpoint is MistralForCausalLM with Llama 3's scaled
    rope, which the builder's Mistral path refuses; the build still converts it and generates its tokens."""
    import transformers as tf

    from pruner.checkpoints import loading, saving
    from pruner.pruning import surgery

    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                               head_dim=16, max_position_embeddings=128, rope_parameters=rope)).eval()
    surgery.remove_heads(model, {0: [0, 4], 1: [1, 5]})
    saving.save(model, loading.load_tokenizer("llama-shakespeare"), tmp_path / "hf", True, "float32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_attention_heads"], config["head_dim"],
            config["rope_parameters"]["rope_type"]) == (["MistralForCausalLM"], 6, 16, "llama3")
    onnx.build(tmp_path / "hf", tmp_path / "onnx", "float32")
    vanilla = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert onnx.check(tmp_path / "onnx", vanilla)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == config  # the checkpoint itself untouched


def test_a_per_layer_model_is_refused_with_the_servable_alternative(tmp_path, capsys):
    run = tiny_run(tmp_path, "llama", "selection.target=2", "selection.shape=any")  # from one layer: layers differ
    assert main(["export", str(run), "--format", "onnx"]) == 2
    err = capsys.readouterr().err
    assert "ONNX export needs a vanilla compact causal LM" in err and "selection.shape: servable" in err
    assert not (run / "export-onnx").exists()


def test_a_missing_extra_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    run = tiny_run(tmp_path, "llama", "selection.target=0.5")
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as when it is not installed
    assert main(["export", str(run), "--format", "onnx"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "pruner[onnx]"' in err and not (run / "export-onnx").exists()


def test_a_generation_that_differs_is_refused(tmp_path, monkeypatch, capsys):
    run = tiny_run(tmp_path, "llama", "selection.target=0.5")
    real = onnx.genai_greedy
    monkeypatch.setattr(onnx, "genai_greedy", lambda folder, ids, n=onnx.NEW_TOKENS: real(folder, ids, n)[:-1] + [7])
    assert main(["export", str(run), "--format", "onnx"]) == 2
    assert "generates differently from PyTorch (greedy, token 16 of 16 differs); nothing was published" in \
        capsys.readouterr().err
    assert not (run / "export-onnx").exists() and json.loads((run / "metrics.json").read_text())["pruned_heads"] == 4


@pytest.mark.slow  # a benchmark: a fresh process per model and round (the exports are checked above)
def test_bench_in_onnxruntime_genai_measures_both_models(tmp_path, capsys):
    """`pruner bench RUN --runtime onnxruntime-genai`: both models built and timed in that runtime; the files
    shrink by the removed heads' share of the parameters; a per-layer run is refused."""
    run = tiny_run(tmp_path, "llama", "selection.target=0.5")
    assert main(["bench", str(run), "--runtime", "onnxruntime-genai", "--lengths", "16,32", "--decode", "1x8,2x8",
                 "--new-tokens", "4", "--repeats", "1"]) == 0
    result = json.loads((run / "bench-onnxruntime-genai.json").read_text())
    figures = {f["name"]: f for f in result["figures"]}
    assert {"model files", "prefill T=16", "prefill T=32", "decode batch 1, prompt 8", "decode batch 2, prompt 8",
            "peak memory (batch 2, prompt 8)"} == set(figures)
    files = figures["model files"]
    assert files["pruned"] < files["base"] and abs(files["saving"] - files["ideal"]) < 0.02
    assert result["conditions"]["runtime"] == "onnxruntime-genai" and result["heads"]["pruned"] == 4
    assert "ONNX Runtime GenAI" in (run / "bench-onnxruntime-genai.md").read_text()
    per_layer = tiny_run(tmp_path / "b", "llama", "selection.target=2", "selection.shape=any")
    capsys.readouterr()
    assert main(["bench", str(per_layer), "--runtime", "onnxruntime-genai", "--repeats", "1"]) == 2
    assert "needs a vanilla compact model" in capsys.readouterr().err
