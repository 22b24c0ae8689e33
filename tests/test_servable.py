"""Servable shapes (selection.shape: servable, the default): decoders whose vanilla config can describe a pruned
model lose the same number of heads in every layer, a count the family's config accepts, so the compact
checkpoint loads with plain `from_pretrained` (and in serving engines); a target no servable shape meets is
moved to the nearest one with a note, or refused with the choices when it would leap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from pruner.checkpoints import layout
from pruner.cli import main
from pruner.core.arch import Geometry
from pruner.pruning.selection import SelectionConfig, SelectionError, check_target, servable_per_layer, shape_note

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=8", "--set", "evaluation.bootstrap=20",
         "--set", "evaluation.latency=false", "--set", "bench.enabled=false"]


@pytest.mark.unit
def test_the_nearest_servable_count_moves_a_rounding_and_refuses_a_leap():
    g = Geometry(n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32)
    shapes = (0, 2, 4, 6)  # kept 8, 6, 4, 2
    exact = SelectionConfig(target=0.25, shapes=shapes)
    assert check_target(g, exact) == (8, [2, 2, 2, 2]) and shape_note(g, exact) is None
    near = SelectionConfig(target=0.3, shapes=shapes)  # 2.4 heads per layer -> 2
    assert servable_per_layer(g, near) == 2
    assert "pruning 2 per layer instead: 8 heads (25.0%)" in shape_note(g, near)
    leap = SelectionConfig(target=0.25, shapes=(0, 4, 6))  # Llama at hidden 256: 6 kept is refused by the config
    with pytest.raises(SelectionError, match=r"0.25 \(2 of 8 heads per layer\) is not a servable shape: .* keep 4, 2 "
                                             r"query heads \(selection.target 0.5, 0.75\)"):
        check_target(g, leap)
    assert check_target(g, SelectionConfig(target=0.25, budget="global")) == (8, None)  # shapes: any


@pytest.mark.integration
@pytest.mark.parametrize("family,prunes", [("llama", (2,)), ("mistral", (2,)), ("qwen2", (2,)), ("qwen3", (2,)), ("gemma3_text", (2,)),
                                           ("gpt2", None), ("gpt_neox", None)])
def test_which_families_have_servable_shapes(family, prunes):
    """4 query / 2 KV heads: keeping every KV head, 2 per layer can go; GPT-2 and GPT-NeoX derive the head width
    from hidden_size / heads, so no pruned config of theirs is vanilla."""
    model = tiny_model(family)
    got = layout.servable_prunes(model)
    assert (None if got is None else tuple(x for x in got if x)) == prunes


@pytest.mark.integration
def test_the_default_llama_recipe_writes_a_vanilla_checkpoint(tmp_path, capsys):
    """`pruner prune recipes/llama-shakespeare.yaml --set selection.target=0.5`: a vanilla Llama with 4 heads,
    loaded by plain transformers without remote code, giving the pruned model's logits."""
    from transformers import AutoModelForCausalLM

    from pruner.checkpoints import loading
    from pruner.checkpoints.storage import rounded_to
    from pruner.pruning import surgery
    from pruner.runs import folders

    out = tmp_path / "run"
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out),
                 "--set", "selection.target=0.5"] + QUICK) == 0
    assert "vLLM" not in capsys.readouterr().out.split("model/:")[1].split("\n")[0]  # nothing it cannot load
    config = json.loads((out / "model" / "config.json").read_text())
    assert "pruner_format" not in config and "auto_map" not in config and config["num_attention_heads"] == 4
    vanilla = AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=False, dtype=torch.float32)
    run = folders.load_run(out)
    want = loading.load_base(run.recipe.model)
    surgery.mask_heads(want, run.heads, run.compensation)
    ids = torch.randint(3, 4000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), rounded_to(want, torch.float16):  # model/ is stored in the base's float16
        torch.testing.assert_close(vanilla(ids).logits, want(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.integration
def test_the_default_llama_recipe_at_25_percent_is_a_vanilla_mistral_and_says_why(tmp_path, capsys):
    """`pruner prune recipes/llama-shakespeare.yaml --set selection.target=0.25`: the recipe leaves
    surgery.compensation unset, so the run uses refit (no bias) and model/ is a MistralForCausalLM; one line says
    which compensation and why (mean's bias would have forced the per-layer form), and recipe.yaml names it."""
    import yaml

    out = tmp_path / "run"
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(out),
                 "--set", "selection.target=0.25"] + QUICK) == 0
    printed = capsys.readouterr().out
    lines = [x for x in printed.splitlines() if "surgery.compensation unset" in x]
    assert len(lines) == 1 and lines[0].startswith("compensation: refit (surgery.compensation unset)")
    assert "the MistralForCausalLM this llama is written as has no attention_bias: the per-layer form" in lines[0]
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and "auto_map" not in config
    assert yaml.safe_load((out / "recipe.yaml").read_text())["surgery"]["compensation"] == "refit"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["compensation"] == "refit" and metrics["compensation_note"] == lines[0]
    assert lines[0] in (out / "report.md").read_text()


@pytest.mark.integration
def test_refusals_name_the_way_out(tmp_path, capsys):
    recipe = str(ROOT / "recipes" / "llama-shakespeare.yaml")
    assert main(["prune", recipe, "--out", str(tmp_path / "a"), "--set", "selection.target=0.1"] + QUICK) == 2
    err = capsys.readouterr().err  # 0.8 of 8 heads per layer: every multiple of the 2 KV heads is servable, not 0.8
    assert "keep 6, 4, 2 query heads (selection.target 0.25, 0.5, 0.75)" in err
    assert "is not a servable shape" in err and "selection.shape: any" in err and not (tmp_path / "a").exists()
    assert main(["prune", recipe, "--out", str(tmp_path / "b"), "--set", "selection.budget=global"] + QUICK) == 2
    assert "no vanilla llama config holds" in capsys.readouterr().err


@pytest.mark.integration
def test_the_per_layer_form_says_which_runtimes_will_not_load_it(tmp_path, capsys):
    """6 heads per layer with mean compensation named: biases a MistralForCausalLM cannot declare."""
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(tmp_path / "run"),
                 "--set", "selection.target=0.25", "--set", "selection.shape=any", "--set", "selection.budget=layer",
                 "--set", "surgery.compensation=mean"] + QUICK) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("model/:"))
    assert "per-layer" in line and "vLLM, TGI, SGLang and ONNX Runtime GenAI load vanilla checkpoints only" in line
    assert "llama.cpp runs a Llama or Mistral one: pruner export RUN --format gguf" in line


@pytest.mark.integration
def test_gemma_serves_the_uniform_counts_its_config_refuses_through_llama_cpp():
    """Gemma 3 with one KV head: 3 of 4 heads (32 % 3 != 0) is refused by its config but every layer keeps the
    same count, which llama.cpp's gemma3 runs: a servable shape, written in the per-layer form, saying why."""
    import transformers as tf

    from pruner.pruning import surgery

    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                              hidden_size=32, intermediate_size=64, vocab_size=64, layer_types=["full_attention"] * 2)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    assert layout.servable_prunes(model) == (0, 1, 2, 3)
    surgery.remove_heads(model, {0: [1], 1: [2]})
    why = layout.vanilla_reason(model)
    assert "rejects a gemma3_text config with 3 heads" in why and "llama.cpp's gemma3 runs it from `pruner export RUN --format gguf`" in why
    assert layout.layout(model, removed=True)[0] == "per-layer"
