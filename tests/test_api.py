"""The Python API (`import pruner`): the same plans and metrics as the command line, on models in memory."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import pruner
from pruner.cli import main
from pruner.pruning.compensation import compensate

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
# shape any: these tests prune the shipped Llama at targets no vanilla Llama config holds (25%: 6 of 8 heads)
QUICK = {"calibration": {"num_samples": 8}, "evaluation": {"num_samples": 8, "bootstrap": 50, "latency": False},
         "bench": {"enabled": False}, "selection": {"shape": "any"}}
QUICK_SET = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=8", "--set", "selection.shape=any",
             "--set", "evaluation.bootstrap=50", "--set", "evaluation.latency=false", "--set", "bench.enabled=false"]


def llama_in_memory():
    """The shipped Llama built from its config and weights in memory: no folder behind the object."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from pruner.core import assets

    folder = assets.checkpoint("llama-shakespeare")
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    model.tie_weights()
    model.eval()
    model.name_or_path = ""  # nothing on disk to fall back to
    return model, AutoTokenizer.from_pretrained(folder)


def test_public_names_are_exactly_all():
    names = {n for n in dir(pruner) if not n.startswith("_")}
    assert set(pruner.__all__) <= names
    for name in pruner.__all__:
        assert getattr(pruner, name) is not None
    page = (ROOT / "docs" / "python.md").read_text()
    table = page.split("The public names are those in `pruner.__all__`:", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"`pruner\.(\w+)", table))
    assert documented == set(pruner.__all__)  # the Python page's table documents exactly the public names


def test_api_on_a_model_in_memory_equals_the_cli(tmp_path):
    """Same recipe, same plan and same perplexities whether the model is a folder (CLI) or an object."""
    out = tmp_path / "cli"
    recipe = ROOT / "recipes" / "llama-shakespeare.yaml"
    assert main(["prune", str(recipe), "--out", str(out)] + QUICK_SET) == 0
    model, tok = llama_in_memory()
    result = pruner.prune(model, tok, recipe=str(recipe), **QUICK)
    assert result.plan.to_json() + "\n" == (out / "plan.json").read_text()
    cli = json.loads((out / "metrics.json").read_text())
    for key in ("base", "pruned", "delta", "ci_low", "ci_high", "windows", "tokens"):
        assert result.metrics["evaluation"][key] == pytest.approx(cli["evaluation"][key], rel=1e-9, abs=1e-9), key
    assert result.metrics["params_after"] == cli["params_after"] < cli["params_before"]
    assert "perplexity" in repr(result) and "llama-shakespeare" in repr(result)


def test_plan_then_apply_equals_prune():
    model, tok = llama_in_memory()
    plan = pruner.plan(model, tok, "shakespeare:calibration", target=0.25, **QUICK)
    assert plan.calibration is not None and plan.geometry.n_heads == 8
    assert sum(len(v) for v in plan.heads.values()) == 8 and "8/32 heads" in repr(plan)
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    before = model(ids).logits
    pruner.apply(model, plan, mode="mask")  # the defaults: refit compensation, as prune
    assert not torch.allclose(model(ids).logits, before)

    other, tok2 = llama_in_memory()
    result = pruner.prune(other, tok2, "shakespeare:calibration", target=0.25, **QUICK)
    assert result.plan.to_json() == plan.to_json()
    torch.testing.assert_close(other(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_apply_refit_keeps_a_vanilla_llama():
    """Refit compensation from the plan's calibration: plain weights, no attention_bias, mask == remove."""
    from pruner.pruning import surgery

    model, tok = llama_in_memory()
    plan = pruner.plan(model, tok, "shakespeare:calibration", target=0.5, budget="layer", **QUICK)
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    stats = plan.calibration.stats
    comp = compensate(model, plan.heads, stats.outputs, "refit", "auto", stats.folds)  # the default ridge: auto
    with surgery.masked(model, plan.heads, comp), torch.no_grad():
        scoped = model(ids).logits
    with surgery.masked(model, plan.heads), torch.no_grad():
        assert not torch.allclose(model(ids).logits, scoped, atol=1e-3)
    pruner.apply(model, plan, compensation="refit", mode="remove")
    assert not model.config.attention_bias and model.model.layers[0].self_attn.o_proj.bias is None
    assert model.config.num_attention_heads == 4
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, scoped, rtol=0, atol=1e-5)


def test_texts_in_memory_are_calibration_data():
    """A list of strings is the calibration text; the same text as a source gives the same plan."""
    from pruner.core import data

    model, tok = llama_in_memory()
    texts = data.load_texts(data.TextSource("shakespeare:calibration"))
    a = pruner.plan(model, tok, texts, target=4, progress=False, **QUICK)
    b = pruner.plan(model, tok, "shakespeare:calibration", target=4, progress=False, **QUICK)
    assert a.to_json() == b.to_json()


def test_remove_then_save_then_load_round_trips(tmp_path):
    model, tok = llama_in_memory()
    result = pruner.prune(model, tok, "shakespeare:calibration", target=0.5, budget="layer", mode="remove", **QUICK)
    folder = result.save(tmp_path / "run")
    assert json.loads((folder / "metrics.json").read_text())["model_saved"]
    loaded = pruner.load(folder / "model")
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(ids).logits, result.model(ids).logits, rtol=0, atol=1e-5)
    assert sum(p.numel() for p in loaded.parameters()) == result.metrics["params_after"]
    with pytest.raises(ValueError, match="built in memory"):  # no base to rebuild from
        pruner.export_run(folder, "compact")


def test_a_plan_from_plan_json_applies_without_compensation(tmp_path):
    model, tok = llama_in_memory()
    plan = pruner.plan(model, tok, target=0.25, **QUICK)
    back = pruner.Plan.from_dict(json.loads(plan.to_json()))
    assert back.heads == plan.heads and back.calibration is None
    with pytest.raises(ValueError, match="carries none"):
        pruner.apply(model, back, compensation="mean")
    pruner.apply(model, back, compensation="zero")


@pytest.mark.parametrize("kwargs, cli, message", [
    ({"target": 1.5}, ["--set", "selection.target=1.5"],
     "invalid recipe: selection.target: a fraction of heads must be in (0, 1)"),
    ({"scorer": "sink-awre"}, ["--set", "scorer.name=sink-awre"],
     "invalid recipe: scorer.name: unknown scorer 'sink-awre' (did you mean 'sink-aware'?)"),
    ({"selection": {"colour": 1}}, ["--set", "selection.colour=1"],
     "selection.colour: no such key 'colour'; valid here: target, budget"),
])
def test_bad_arguments_raise_the_cli_errors(tmp_path, capsys, kwargs, cli, message):
    model, tok = llama_in_memory()
    with pytest.raises(ValueError) as e:
        pruner.plan(model, tok, recipe=str(ROOT / "recipes" / "llama-shakespeare.yaml"), **kwargs)
    assert main(["prune", str(ROOT / "recipes" / "llama-shakespeare.yaml"), "--out", str(tmp_path / "x")] + cli) == 2
    err = capsys.readouterr().err.strip()
    assert str(e.value).startswith(message)
    assert err in (f"pruner: error: {e.value}", f"pruner: error: --set {e.value}")  # --set names its flag


def test_unknown_keyword_and_bad_apply_arguments_are_one_line_errors():
    model, tok = llama_in_memory()
    with pytest.raises(ValueError, match=r"unknown argument 'targt' \(did you mean 'target'\?\)"):
        pruner.plan(model, tok, targt=0.25)
    plan = pruner.plan(model, tok, target=0.25, progress=False, **QUICK)
    with pytest.raises(ValueError, match="invalid recipe: surgery.mode: Input should be 'mask' or 'remove'"):
        pruner.apply(model, plan, mode="delete")
    with pytest.raises(ValueError, match="pass the tokenizer"):
        pruner.plan(model, None)


def test_analyze_returns_the_analysis_json_content(tmp_path):
    analysis = pruner.analyze("llama-shakespeare", num_samples=4, metrics=["cosine"], progress=False)
    assert analysis.data["n_layers"] == 4 and set(analysis.audit) == {"cosine"}
    assert 0 <= analysis.audit["cosine"]["overall"]["nn_flip_rate"] <= 1
    assert json.loads(analysis.to_json()) == analysis.to_dict()
    assert "cosine NN flip" in repr(analysis)
    analysis.save(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "analysis.json").read_text()) == analysis.data
    with pytest.raises(ValueError, match="invalid option: max_length"):
        pruner.analyze("llama-shakespeare", max_length=2)


def test_compare_and_evaluate_from_python(tmp_path):
    model, tok = llama_in_memory()
    cmp = pruner.compare(model, tok, scorers=["sink-aware", "random"], sparsities=[0.25], budgets=["layer", "global"],
                         compensations=["zero"], progress=False, **QUICK)
    assert len(cmp.records) == 4 and {r["budget"] for r in cmp.records} == {"layer", "global"}
    assert "sink-aware" in cmp.table() and "Comparison(4 plans" in repr(cmp)
    ev = pruner.evaluate(model, tok, evaluation={"num_samples": 8}, progress=False)
    ppl = {r["base"] for r in cmp.records}
    assert ev.metrics["perplexity"] == pytest.approx(ppl.pop(), rel=1e-9)


def test_the_python_page_example_runs(tmp_path, monkeypatch):
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "python.md").read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/python.md", "exec"), {})
    assert (tmp_path / "runs" / "python-quickstart" / "plan.json").exists()


def test_the_readme_python_example_runs():
    section = (ROOT / "README.md").read_text().split("\n## Python\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    from pruner.core import arch
    from pruner.pruning import surgery

    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    g = arch.geometry(scope["model"])
    kept = sum(len(h) for h in surgery.kept_heads(scope["model"]).values())
    assert kept == g.n_layers * g.n_heads - len(scope["plan"].entries) == 54  # the quarter it printed is gone
