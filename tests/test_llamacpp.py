"""The llama_cpp tier: GGUF exports run in llama.cpp (llama-cpp-python) and generate PyTorch's greedy tokens.

Runs wherever llama-cpp-python is installed; elsewhere tests/conftest.py deselects it and the summary says so
in one line. The shipped Llama at a uniform plan (`llama`), at a global-budget plan whose layers differ
(`deci`), at a head count Llama's config refuses; real-width random Llama-3.2-1B and Mistral-7B layers
(`slow`). A GGUF whose q/k rows are not permuted for llama.cpp's rope is refused with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pruner.checkpoints import gguf_file, llamacpp, loading
from pruner.cli import main
from pruner.core import shapes
from pruner.pruning import surgery

pytestmark = [pytest.mark.llama_cpp, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=4", "--set", "evaluation.bootstrap=10",
         "--set", "evaluation.latency=false", "--set", "bench.enabled=false", "--set", "surgery.mode=mask"]
PLANS = {"uniform": [], "global": ["--set", "selection.shape=any", "--set", "selection.budget=global",
                                   "--set", "selection.target=0.25"],
         "six-heads": ["--set", "selection.target=0.25", "--set", "surgery.compensation=zero"],
         "groups": ["--set", "selection.gqa=group", "--set", "surgery.mode=remove", "--set", "surgery.compensation=zero"]}


def pruned_run(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out)] + QUICK
                + PLANS[name]) == 0
    return out


def pruned_model(run: Path):
    from pruner.runs import folders

    r = folders.load_run(run)
    model = loading.load_base(r.recipe.model).float()
    surgery.remove_heads(model, r.heads, r.compensation)
    return model


@pytest.mark.parametrize("name,arch", [("uniform", "llama"), ("global", "deci"), ("six-heads", "llama")])
def test_the_shipped_llama_generates_pytorchs_tokens_in_llama_cpp(tmp_path, capsys, name, arch):
    run = pruned_run(tmp_path, name)
    assert main(["export", str(run), "--format", "gguf", "--dtype", "float32"]) == 0
    assert "llama.cpp's greedy generations equal PyTorch's (float32)" in capsys.readouterr().out
    path = run / "export-gguf" / "model.gguf"
    assert gguf_file.structure(path)["arch"] == arch
    model = pruned_model(run)
    ids = torch.randint(3, 4096, (24,), generator=torch.Generator().manual_seed(7)).tolist()  # not the export's
    assert llamacpp.llamacpp_greedy(path, ids, 24) == llamacpp.torch_greedy(model, ids, 24)
    if name == "global":
        counts = json.loads((run / "metrics.json").read_text())
        assert len(set(gguf_file.structure(path)["q_heads"])) > 1, counts


def test_text_splits_into_transformers_tokens(tmp_path):
    """The shipped Llama's GPT-2-style pre-tokenizer is written as llama.cpp's `gpt-2`: text, not only ids,
    tokenizes as in transformers."""
    model, tok = loading.load_model("llama-shakespeare"), loading.load_tokenizer("llama-shakespeare")
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float16", gguf_file.plan(model, tok))
    text = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer 123 slings"
    llm = llamacpp.open_model(tmp_path / "m.gguf", n_ctx=64)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok(text)["input_ids"]
    finally:
        llm.close()


def test_a_gguf_llama_cpp_runs_differently_is_refused(tmp_path, capsys, monkeypatch):
    """Unpermuted q/k rows: the structure is right (names, shapes), the rope is not; llama.cpp's tokens differ
    and nothing is written."""
    run = pruned_run(tmp_path, "uniform")
    monkeypatch.setattr(gguf_file, "_permute", lambda t, heads: t)
    assert main(["export", str(run), "--format", "gguf", "--dtype", "float32"]) == 2
    assert "llama.cpp generates differently from PyTorch" in capsys.readouterr().err
    assert not any(p.name.startswith(("export-gguf", ".export-gguf")) for p in run.iterdir())


@pytest.mark.slow  # a benchmark: a fresh process per file and round (the exports are checked above)
def test_bench_in_llama_cpp_reports_each_figure_next_to_its_ideal(tmp_path, capsys):
    """Half the KV groups removed: llama.cpp's own KV cache report shrinks by exactly the ideal, the file by
    about the parameters' saving (the tokenizer is in both files), and the tables are written."""
    run = pruned_run(tmp_path, "groups")
    assert main(["bench", str(run), "--runtime", "llama.cpp", "--lengths", "64", "--decode", "1x16", "--new-tokens",
                 "8", "--repeats", "1"]) == 0
    assert "prefill T=64 (tokens/s)" in capsys.readouterr().out
    figs = {f["name"]: f for f in json.loads((run / "bench-llama.cpp.json").read_text())["figures"]}
    kv = figs["KV cache"]
    assert kv["ideal"] > 0 and kv["saving"] == pytest.approx(kv["ideal"], abs=1e-9)
    assert figs["GGUF file"]["saving"] == pytest.approx(figs["GGUF file"]["ideal"], abs=0.02)
    assert (run / "bench-llama.cpp.md").exists()


REAL = ("llama-3.2-1b", "mistral-7b-v0.3")  # public configs' real widths, few layers (pruner.core.shapes)


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL)
@pytest.mark.parametrize("heads", [{0: list(range(0, 32, 4)), 1: list(range(0, 32, 4))},  # 25%, uniform
                                   {0: list(range(16)), 1: list(range(0, 32, 2))}])        # 50% / 50%, groups differ
def test_real_width_random_models_generate_pytorchs_tokens(tmp_path, name, heads):
    import transformers as tf

    torch.manual_seed(0)
    cls = tf.LlamaForCausalLM if name.startswith("llama") else tf.MistralForCausalLM
    model = cls(shapes.config(name, num_hidden_layers=2)).eval()
    surgery.remove_heads(model, heads)
    tok = loading.load_tokenizer("llama-shakespeare")  # 4096 ids; the rest of the vocabulary is [PAD<i>]
    plan = gguf_file.plan(model, tok)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float32", plan)
    gguf_file.check_structure(tmp_path / "m.gguf", model, plan, "float32")
    assert llamacpp.check(tmp_path / "m.gguf", model)
