"""Servable by default: every shipped recipe (recipes/*.yaml), at 10 / 25 / 40 / 50% of the heads, writes a model/
that plain transformers loads (trust_remote_code=False) with the pruned model's logits, and its compact form is a
vanilla checkpoint wherever the family's config can describe fewer heads -- or the run says in one line why not
(GPT-2, BERT: their configs derive the head width from hidden_size / heads). A target no vanilla config can hold
(10% of a Llama whose layers keep multiples of 2 or 8 KV heads) is refused before any compute, naming the servable
targets.

The Hub recipes run on a tiny random model of their family with the same head counts (nothing is downloaded;
head_dim scaled down with hidden_size, so the same counts are the ones Llama's config refuses), on the offline
plays instead of wikitext and without the downstream tasks. One calibration per recipe serves its four targets
(`pipeline.run(..., inputs=)`), so each recipe costs one calibration pass."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as tf

from pruner.checkpoints import layout, loading, saving
from pruner.core import arch
from pruner.pruning import surgery
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import get_scorer
from pruner.pruning.selection import SelectionError, curve_key
from pruner.runs import context, pipeline
from pruner.runs import folders as runs
from pruner.runs.recipe_io import build_recipe

pytestmark = [pytest.mark.integration,  # 4 calibration samples: refit's advice for more is expected here
              pytest.mark.filterwarnings("ignore:refit fits .* are recommended")]
ROOT = Path(__file__).resolve().parents[1]
# the real Gemma 3 270M (a 1 GB float32 checkpoint written and reloaded at four targets) is the slow tier's; the
# default suite's real-model test is tests/test_gemma.py, and the tiny Gemma 3 configs cover the same code paths
RECIPES = [pytest.param(p.stem, marks=pytest.mark.slow) if p.stem == "gemma3-270m" else p.stem
           for p in sorted((ROOT / "recipes").glob("*.yaml"))]
TARGETS = (0.1, 0.25, 0.4, 0.5)
SMALL = {"calibration.num_samples": 4, "evaluation.num_samples": 4, "evaluation.bootstrap": 10,
         "evaluation.latency": False, "bench.enabled": False, "export.dtype": "float32"}  # float32: atol 1e-4 below
# refit needs at least n_heads x head_dim calibration tokens: Gemma 3 270M's 4 x 256 = 1,024 is 8 windows of 128
REFIT_TOKENS = {"gemma3-270m": {"calibration.num_samples": 8, "calibration.length": 128}}
OFFLINE = {"model.dtype": "float32", "model.device_map": None, "calibration.data": "shakespeare:calibration",
           "calibration.name": None, "calibration.length": 128, "evaluation.data": "shakespeare:evaluation",
           "evaluation.name": None, "evaluation.length": 128, "evaluation.stride": None, "evaluation.tasks": [],
           "evaluation.num_fewshot": None}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def hub_stand_in(name: str):
    """(model, tokenizer) standing in for a Hub recipe's model: its family and head counts, 2 layers."""
    torch.manual_seed(0)
    if name == "hub-bert-base-uncased":  # 12 heads over hidden 768; with the masked-LM head
        return tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=96, num_attention_heads=12,
                                                intermediate_size=128, vocab_size=30522)).eval(), \
            loading.load_tokenizer("minilm")
    tok = loading.load_tokenizer("gpt2-shakespeare" if name == "hub-gpt2" else "llama-shakespeare")
    ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if name == "hub-gpt2":  # 12 heads over n_embd 768
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_head=12, n_embd=96, n_positions=256, **ids))
    elif name == "hub-llama-3.2-1b":  # 32 heads of 64 over 8 KV heads, hidden 2048, Llama 3's scaled rope, tied
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            num_hidden_layers=2, hidden_size=256, intermediate_size=128, num_attention_heads=32, num_key_value_heads=8,
            head_dim=8, max_position_embeddings=512, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True, **ids))
    elif name == "hub-qwen2.5-0.5b":  # 14 heads of 64 over 2 KV heads, hidden 896, q/k/v biases, tied
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(
            num_hidden_layers=2, hidden_size=112, intermediate_size=128, num_attention_heads=14, num_key_value_heads=2,
            max_position_embeddings=512, tie_word_embeddings=True, **ids))
    else:
        raise ValueError(name)
    return model.eval(), tok


def session_of(name: str):
    """The recipe's session, made small (and offline for the Hub recipes)."""
    if not name.startswith("hub-"):
        small = {**SMALL, **REFIT_TOKENS.get(name, {})}
        return context.prepare(build_recipe(ROOT / "recipes" / f"{name}.yaml", small), progress=False)
    model, tok = hub_stand_in(name)
    return context.prepare(build_recipe(ROOT / "recipes" / f"{name}.yaml", {**OFFLINE, **SMALL}), progress=False,
                           given=context.Given(model=model, tokenizer=tok))


def calibrate(session):
    """One calibration pass whose sums every target's plan and compensation are made from."""
    r = session.recipe
    scorer = get_scorer(r.scorer.name)
    key = curve_key(scorer, arch.geometry(session.model), pipeline.selection_config(r, session.model),
                    r.scorer.convention)
    return pipeline.scoring_inputs(session, [scorer], CurveRequest((key,)), [r.surgery.compensation], progress=False)


def outputs(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_loads_plainly(folder: Path, pruned):
    """`folder` is a checkpoint transformers loads without remote code, giving `pruned`'s outputs (fp32)."""
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and "pruner_format" not in config
    plain = getattr(tf, config["architectures"][0]).from_pretrained(folder, trust_remote_code=False,
                                                                      dtype=torch.float32).eval()
    ids = saving.check_ids(pruned)
    torch.testing.assert_close(outputs(plain, ids), outputs(pruned, ids), rtol=0, atol=1e-4)
    return config


@pytest.mark.parametrize("name", RECIPES)
def test_every_shipped_recipe_writes_a_servable_model_at_every_target(name, tmp_path):
    session = session_of(name)
    base, inputs = session.model, calibrate(session)
    explicit = layout.servable_prunes(base) is not None  # a vanilla config can describe fewer heads
    for target in TARGETS:
        recipe = session.recipe.model_copy(update={"selection": session.recipe.selection.model_copy(
            update={"target": target})})
        run = replace(session, recipe=recipe, model=copy.deepcopy(base))
        try:
            done = pipeline.run(run, progress=False, inputs=inputs)
        except SelectionError as e:  # no vanilla config holds this share: refused, the servable targets named
            assert explicit and target == 0.1, f"{name} at {target}: {e}"
            assert "is not a servable shape" in str(e) and "selection.shape: any" in str(e) and "\n" not in str(e)
            continue
        folder = tmp_path / f"{name}-{target}"
        runs.save_run(done, folder)
        m = done.metrics
        assert m["model_saved"] and m["pruned_heads"] > 0, (name, target, m.get("model_not_saved_because"))
        saved = runs.load_run(folder).recipe.surgery.compensation
        assert saved == m["compensation"] != "auto"  # recipe.yaml names the compensation used
        unset = "surgery.compensation" in session.unset
        assert unset == ("compensation_note" in m)
        if unset:
            assert m["compensation"] == "refit" and m["compensation_note"].startswith(
                "compensation: refit (surgery.compensation unset)")
        gguf_route = base.config.model_type in layout.GGUF_UNIFORM and m["model_layout"] == "per-layer"
        if m["surgery"] == "remove" and not explicit:  # model/ per-layer: the one-line reason
            assert m["model_layout"] == "per-layer"
            assert "config derives the head width from hidden_size / heads" in m["model_note"]
        elif gguf_route:  # a uniform count the config refuses (Gemma 3's 3 of 4): per-layer, served from GGUF
            assert m["pruned_heads"] % base.config.num_hidden_layers == 0, (name, target)
            assert "transformers rejects" in m["model_note"] and "--format gguf" in m["model_note"], m["model_note"]
            assert "\n" not in m["model_note"]
        else:
            assert m["model_layout"] in ("dense", "vanilla"), (name, target, m.get("model_note"))
            assert_loads_plainly(folder / "model", done.model)
        # the compact form (what `surgery.mode: remove` / `pruner export RUN --format compact` write)
        compact = copy.deepcopy(base)
        surgery.remove_heads(compact, done.plan.heads, done.compensation)
        written = saving.save(compact, session.tokenizer, tmp_path / f"{name}-{target}-compact", removed=True,
                              dtype="float32")
        if gguf_route:
            assert written.layout == "per-layer"
        elif explicit:
            assert written.layout == "vanilla", (name, target, written.why_per_layer)
            assert_loads_plainly(tmp_path / f"{name}-{target}-compact", compact)
        else:
            assert written.layout == "per-layer" and "derives the head width" in written.why_per_layer
