"""selection.unit: layer -- whole attention layers removed (He et al. 2024), through the head path.

Recipe validation; the layer scorers (one score per layer; the cosine criterion against the residual stream
hooked by hand); selection; mask == remove == reload of the per-layer form; generate() with layer 0 (and the
last layer) removed; GGUF: llama.cpp's deci with a 0-head layer, Gemma 3's refusal. Tiny random Llama and
Gemma 3 (tests/tiny.py) and the shipped from-scratch Llama for GGUF.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from tiny import ragged_batch, tiny_model

from pruner.attention.capture import CaptureConfig
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import gguf_file, loading, saving
from pruner.core import arch
from pruner.core.data import pad
from pruner.core.runtime import forward
from pruner.pruning import surgery
from pruner.pruning.ablation import layer_ablations, token_nll
from pruner.pruning.calibrate import CalibrationOptions, calibrate
from pruner.pruning.compensation import compensate, whole_layer_note
from pruner.pruning.scoring import LAYER_SCORERS, SCORERS, Scorer, get_scorer
from pruner.pruning.selection import Plan, SelectionConfig, SelectionError, check_layer_target, select_layers
from pruner.runs.recipe import RecipeError
from pruner.runs.recipe_io import load_recipe

pytestmark = pytest.mark.integration
FAMILIES = ("llama", "gemma3_text")
ALL = [0, 1, 2, 3]  # every head of a tiny model's layer


def recipe(*sets: str):
    return load_recipe({"model": {"path": "x"}}, list(sets))


# --------------------------------------------------------------------------- recipe

def test_unit_defaults_to_head_and_head_recipes_save_without_it():
    r = recipe()
    assert r.selection.unit == "head" and "unit" not in r.model_dump(mode="json")["selection"]
    layer = recipe("selection.unit=layer", "scorer.name=layer-cosine", "selection.target=2")
    saved = layer.model_dump(mode="json")
    assert saved["selection"]["unit"] == "layer" and load_recipe(saved).selection == layer.selection


def test_layers_without_a_scorer_named_take_the_default_layer_scorer_and_a_named_one_is_kept():
    from pruner.runs.recipe import DEFAULT_LAYER_SCORER

    assert DEFAULT_LAYER_SCORER in LAYER_SCORERS
    assert recipe("selection.unit=layer").scorer.name == DEFAULT_LAYER_SCORER
    assert recipe("selection.unit=layer", "scorer.ablation_samples=4").scorer.ablation_samples == 4
    assert recipe("selection.unit=layer", "scorer.name=layer-ablation").scorer.name == "layer-ablation"
    assert recipe().scorer.name == "refit-energy"  # heads keep theirs
    saved = recipe("selection.unit=layer").model_dump(mode="json")
    assert load_recipe(saved).scorer.name == DEFAULT_LAYER_SCORER  # written out, read back the same


@pytest.mark.parametrize("sets,says", [
    (["selection.unit=layers"], "selection.unit: Input should be 'head' or 'layer'"),
    (["selection.unit=layer", "scorer.name=layer-cosine", "selection.target=0"], "selection.target"),
    (["selection.unit=layer", "scorer.name=layer-cosine", "selection.target=2.5"], "a head count is a whole number"),
    (["selection.unit=layer", "scorer.name=sink-aware"], "use one of layer-sink-aware, layer-cosine, layer-ablation"),
    (["scorer.name=layer-cosine"], "'layer-cosine' scores layers and selection.unit is head"),
    (["selection.unit=layer", "scorer.name=auto"], "auto chooses among head scorers"),
    (["selection.unit=layer", "scorer.name=layer-cosin"], "did you mean 'layer-cosine'"),
])
def test_bad_layer_recipes_are_refused_in_one_line_with_the_key(sets, says):
    with pytest.raises(RecipeError) as e:
        recipe(*sets)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_layer_targets_against_the_model():
    g = arch.Geometry(18, 4, 1, 256)
    assert check_layer_target(g, SelectionConfig(target=0.25)) == 4 and check_layer_target(g, SelectionConfig(6)) == 6
    with pytest.raises(SelectionError, match="at most 17"):
        check_layer_target(g, SelectionConfig(target=18))
    with pytest.raises(SelectionError, match="selects 0 of 18"):
        check_layer_target(g, SelectionConfig(target=0.01))


def test_compare_refuses_layer_scorers_before_any_compute():
    import pruner

    with pytest.raises(ValueError, match="compare ranks head scorers"):
        pruner.compare("llama-shakespeare", scorers=["layer-cosine"], progress=False)


def test_layer_scorers_have_their_own_registry():
    assert set(LAYER_SCORERS) == {"layer-sink-aware", "layer-cosine", "layer-ablation"}
    assert not set(LAYER_SCORERS) & set(SCORERS) and all(s.unit == "layer" for s in LAYER_SCORERS.values())
    with pytest.raises(ValueError, match="layer scorers \\(selection.unit: layer\\): layer-sink-aware"):
        get_scorer("layer-nope")


# --------------------------------------------------------------------------- scorers

def calibrated(model, batch):
    cfg = CaptureConfig(metrics=("cosine",), outputs=True, joint=True, layer_cosine=True)
    return calibrate(model, batch, SinkSpec("first"), config=cfg, options=CalibrationOptions(batch_size=2))


def by_hand_cosine(model, family: str, batch) -> torch.Tensor:
    """Mean over real tokens of cos(h, h + attention's contribution), hooked here independently of the capture:
    the block's input and the attention module's output (Gemma 3: after its post-attention norm). (layer,)"""
    entering, added, hooks = {}, {}, []
    for i, block in enumerate(arch.blocks(model)):
        hooks.append(block.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: entering.__setitem__(i, (args[0] if args else kwargs["hidden_states"])),
            with_kwargs=True))
        out = block.post_attention_layernorm if family == "gemma3_text" else block.self_attn
        hooks.append(out.register_forward_hook(
            lambda m, args, o, i=i: added.__setitem__(i, o[0] if isinstance(o, tuple) else o)))
    try:
        with torch.no_grad():
            forward(model.base_model, batch.input_ids, batch.attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    real = batch.attention_mask.bool()
    return torch.stack([torch.nn.functional.cosine_similarity(entering[i], entering[i] + added[i], dim=-1)[real].double()
                        .mean() for i in sorted(entering)])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_scorer_gives_one_score_per_layer_and_the_cosine_is_he_et_al(family):
    model = tiny_model(family)
    batch = pad(ragged_batch(seed=3), 0)
    inputs = calibrated(model, batch)
    alive = torch.ones(2, 4, dtype=torch.bool)
    want = by_hand_cosine(model, family, batch)
    torch.testing.assert_close(inputs.stats.attn_cosine, want, rtol=0, atol=1e-6)
    assert (want < 0.9999).all()  # the attention turns the stream: the check is not 1 == 1
    torch.testing.assert_close(get_scorer("layer-cosine")(inputs, alive), 1 - want, rtol=0, atol=1e-6)
    energy = get_scorer("layer-sink-aware")(inputs, alive)
    assert energy.shape == (2,) and (energy > 0).all()
    k = inputs.cross.sum(-1)  # (layer, head): each head's row of the cross energy
    torch.testing.assert_close(energy, (k * (1 - inputs.stats.sink_mass)).sum(-1) / inputs.stats.residual)


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_ablation_measures_each_layer_removed_with_its_compensation(family):
    model = tiny_model(family)
    batch = pad(ragged_batch(seed=3), 0)
    outputs = calibrated(model, batch).stats.outputs
    measured = layer_ablations(model, batch, lambda heads: compensate(model, heads, outputs, "mean"))
    assert measured.increase.shape == (2,) and measured.passes == 3
    base = measured.base_loss
    with surgery.masked(model, {1: ALL}, compensate(model, {1: ALL}, outputs, "mean")):
        s, c = token_nll(model, batch)
    assert measured.increase[1].item() == pytest.approx(s / c - base, abs=1e-9)
    inputs = replace(calibrated(model, batch), layer_ablation=measured.increase)
    assert torch.equal(get_scorer("layer-ablation")(inputs, None), measured.increase)


def test_selection_takes_the_lowest_layers_ties_by_layer_as_a_plan_of_their_heads():
    g = arch.Geometry(3, 2, 2, 4)
    fake = Scorer("fixed", lambda inputs, alive, conv: torch.tensor([0.5, 0.1, 0.1]), unit="layer")
    inputs = type("I", (), {"stats": type("S", (), {"sink_mass": torch.full((3, 2), 0.5)})()})()
    plan = select_layers(fake, inputs, g, SelectionConfig(target=2))
    assert plan.layers == (1, 2) and plan.heads == {1: [0, 1], 2: [0, 1]}  # a tie breaks by layer
    d = json.loads(plan.to_json())
    assert (d["unit"], d["layers"], d["pruned"]) == ("layer", [1, 2], 4)
    assert Plan.from_dict(d).layers == (1, 2) and Plan.from_dict(d).unit == "layer"
    head = Plan("x", None, 1, plan.entries[:1])
    assert "unit" not in json.loads(head.to_json()) and "layers" not in json.loads(head.to_json())


# --------------------------------------------------------------------------- surgery

def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return forward(model, batch.input_ids, batch.attention_mask).logits.float() * batch.attention_mask[..., None]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [0, 1])
def test_removed_layer_equals_the_masked_one_and_reloads(family, layer, tmp_path, word_tokenizer):
    model = tiny_model(family)
    batch = pad(ragged_batch(seed=5), 0)
    outputs = calibrated(model, batch).stats.outputs
    comp = compensate(model, {layer: ALL}, outputs, "mean")
    assert comp.bias[layer].abs().max() > 0
    with surgery.masked(model, {layer: ALL}, comp):
        want = logits(model, batch)
    surgery.remove_heads(model, {layer: ALL}, comp)
    attn = arch.blocks(model)[layer].self_attn
    assert attn.q_proj.weight.shape[0] == attn.k_proj.weight.shape[0] == attn.o_proj.weight.shape[1] == 0
    torch.testing.assert_close(logits(model, batch), want, rtol=0, atol=1e-5)
    saved = saving.save(model, word_tokenizer, tmp_path, removed=True)
    assert saved.layout == "per-layer" and f"layers [{layer}] have no attention" in saved.why_per_layer
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_attention_heads_per_layer"][layer] == 0
    reloaded = loading.load(tmp_path)
    torch.testing.assert_close(logits(reloaded, batch), want, rtol=0, atol=1e-5)


def greedy(model, batch, tokens: int = 12) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask, do_sample=False,
                              max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [0, 1])
def test_generate_with_the_kv_cache_when_the_first_or_last_layer_is_removed(family, layer):
    """transformers reads the sequence length from layer 0's cache entry (positions) and the mask sizes from
    the first full-attention layer's: a layer with no heads must still count its tokens (left padding makes
    a wrong count change the tokens)."""
    model = tiny_model(family)
    batch = pad(ragged_batch(seed=7), 0, side="left")
    with surgery.masked(model, {layer: ALL}):
        want = greedy(model, batch)
    removed = copy.deepcopy(model)
    surgery.remove_heads(removed, {layer: ALL})
    assert torch.equal(greedy(removed, batch), want)


def test_refit_of_an_emptied_layer_is_its_mean_and_says_so():
    model = tiny_model("llama")
    batch = pad(ragged_batch(seed=5), 0)
    outputs = calibrated(model, batch).stats.outputs
    refit = compensate(model, {0: ALL, 1: [1]}, outputs, "refit", 1e-3)
    mean = compensate(model, {0: ALL}, outputs, "mean")
    torch.testing.assert_close(refit.bias[0], mean.bias[0])
    assert 0 not in refit.weight and 1 in refit.weight  # the partly pruned layer is refitted as ever
    note = whole_layer_note(model, {0: ALL, 1: [1]}, "refit")
    assert "mean (its mean output in the bias) for layers [0]" in note and "\n" not in note
    assert whole_layer_note(model, {1: [1]}, "refit") is None


# --------------------------------------------------------------------------- GGUF

def shipped_without(layer: int, compensation=None):
    model = loading.load_model("llama-shakespeare")  # 4 layers, 8 query heads over 2 KV heads
    surgery.remove_heads(model, {layer: list(range(8))}, compensation)
    return model, loading.load_tokenizer("llama-shakespeare")


def test_a_llama_without_its_last_layers_attention_is_deci_with_a_zero_head_layer(tmp_path):
    model, tok = shipped_without(3)
    assert gguf_file.refusal(model) is None
    plan = gguf_file.plan(model, tok)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float32", plan)
    s = gguf_file.check_structure(tmp_path / "m.gguf", model, plan, "float32")
    assert (s["arch"], s["q_heads"], s["kv_heads"]) == ("deci", [8, 8, 8, 0], [2, 2, 2, 0])
    assert not [n for n in s["tensors"] if n.startswith("blk.3.attn")] and "blk.3.ffn_down.weight" in s["tensors"]
    assert "blk.2.attn_q.weight" in s["tensors"]


def test_gguf_refuses_a_removed_layer_zero_and_a_zero_head_layer_carrying_a_bias():
    model, _ = shipped_without(0)
    assert "layer 0 must keep its attention" in gguf_file.refusal(model)  # llama.cpp's head width comes from it
    model, _ = shipped_without(2, {2: torch.ones(256)})
    assert "deci runs a layer without heads as attention-free, with no output bias" in gguf_file.refusal(model)


def test_gemma_without_a_layers_attention_is_refused_for_gguf():
    model = tiny_model("gemma3_text")
    surgery.remove_heads(model, {1: ALL})
    why = gguf_file.refusal(model)
    assert "llama.cpp's gemma3 architecture sizes every layer from layer 0's head count" in why
    assert "layers without attention ([1])" in why and "\n" not in why


@pytest.mark.llama_cpp
def test_llama_cpp_generates_the_pruned_models_tokens_without_the_last_layers_attention(tmp_path):
    from pruner.checkpoints import llamacpp

    model, tok = shipped_without(3)
    plan = gguf_file.plan(model, tok)
    gguf_file.write(model, tok, tmp_path / "m.gguf", "float32", plan)
    assert len(llamacpp.check(tmp_path / "m.gguf", model)) > len(llamacpp.prompt(model.config.vocab_size))


def test_a_run_folders_layer_plan_fits_its_base_and_a_head_plan_emptying_a_layer_does_not(tmp_path):
    from pruner.runs import provenance

    model = tiny_model("llama")
    layer_plan = {"unit": "layer", "layers": [1], "heads": {"1": ALL}, "entries": []}
    assert provenance.check_fits(tmp_path, layer_plan, None, model) == {1: ALL}  # export rebuilds it
    with pytest.raises(provenance.ProvenanceError, match="emptying it"):
        provenance.check_fits(tmp_path, {"heads": {"1": ALL}, "entries": []}, None, model)


# --------------------------------------------------------------------------- the command

def test_pruner_prune_removes_a_layer_with_the_default_refit_and_its_bench_frees_that_layers_kv_cache(tmp_path,
                                                                                                       capsys):
    """`pruner prune --set selection.unit=layer` end to end: refit resolved to the mean in the emptied layer (no
    kept head to refit from, so no refit line to print), the per-layer checkpoint, and a bench whose KV cache
    saving is exactly the removed layer's share."""
    from pathlib import Path

    from pruner.cli import main

    out = tmp_path / "run"
    sets = ["selection.unit=layer", "scorer.name=layer-cosine", "selection.target=1", "calibration.num_samples=8",
            "evaluation.num_samples=4", "bench.repeats=1", "bench.lengths=[32]", "bench.decode=[[1,8]]",
            "bench.new_tokens=4"]
    argv = ["prune", str(Path(__file__).resolve().parents[1] / "recipes" / "llama-shakespeare.yaml"), "--out", str(out)]
    assert main(argv + [x for s in sets for x in ("--set", s)]) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    assert "has no kept head to refit from" in printed and "the whole attention of layers" in printed
    plan, metrics = (json.loads((out / f).read_text()) for f in ("plan.json", "metrics.json"))
    assert plan["unit"] == "layer" and len(plan["layers"]) == 1 and metrics["pruned_heads"] == 8
    kv = next(f for f in metrics["bench"]["figures"] if f["name"] == "KV cache")
    assert kv["saving"] == kv["ideal"] == 0.25  # 1 of the 4 layers' KV cache
    assert json.loads((out / "model" / "config.json").read_text())["auto_map"]  # the per-layer form
