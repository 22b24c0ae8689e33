"""`scorer.name: auto` / `surgery.compensation: auto` (pruner.runs.autochoice) and the ablation-shortlist scorer."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import ragged_batch, tiny_model

import pruner
from pruner.attention.sinks import SinkSpec
from pruner.core.data import pad
from pruner.pruning import scoring, surgery
from pruner.pruning.ablation import AblationRequest
from pruner.pruning.calibrate import CalibrationOptions, calibrate

pytestmark = pytest.mark.integration
AUTO = {"calibration": {"num_samples": 12, "holdout": 4, "length": 64},
        "selection": {"shape": "any", "target": 0.25},
        "evaluation": {"num_samples": 4, "bootstrap": 20, "latency": False, "length": 64}, "bench": {"enabled": False},
        "scorer": {"name": "auto", "candidates": ["cosine", "fluctuation"]}, "surgery": {"compensation": "auto"}}


def _recipe(**extra):
    import copy

    r = copy.deepcopy(AUTO)
    r["model"] = {"path": "llama-shakespeare"}
    for section, values in extra.items():
        r[section] = {**r.get(section, {}), **values}
    return r


def test_auto_keeps_the_lowest_heldout_perplexity_and_runs_it_as_if_named():
    """Every pair is scored on the held-back samples (recomputed here by hand for the kept one), the best is
    kept, and the run is the named pair's run on the same calibration: the same plan."""
    from pruner.runs import compensating, context, pipeline
    from pruner.runs.recipe_io import build_recipe

    result = pruner.prune(recipe=_recipe(), progress=False)
    auto = result.metrics["auto"]
    table = auto["candidates"]
    assert len(table) == 4 and [r["perplexity"] for r in table] == sorted(r["perplexity"] for r in table)
    assert (auto["scorer"], auto["compensation"]) == (table[0]["scorer"], table[0]["compensation"])
    assert (result.metrics["scorer"], result.metrics["compensation"]) == (auto["scorer"], auto["compensation"])
    assert auto["line"].startswith(f"auto: {auto['scorer']} + {auto['compensation']}, the lowest held-back")
    assert "\n" not in auto["line"] and auto["samples"] == 4 and auto["passes"]["calibration"] == 1
    assert 2 <= auto["passes"]["held_back"] <= 5  # the unpruned model and each distinct pruned one

    from pruner.runs import report

    text = report.run_report(result.metrics, result.plan.to_json())
    assert "## How auto chose" in text and auto["line"] in text
    assert text.count(f"| `{table[-1]['scorer']}` | `{table[-1]['compensation']}` |") == 1

    named = _recipe(scorer={"name": auto["scorer"], "candidates": None},
                    surgery={"compensation": auto["compensation"]})
    session = context.prepare(build_recipe(named), progress=False, evaluation=False)
    _, held = context.calibration_samples(session.recipe, session.tokenizer)
    assert torch.equal(held.input_ids, session.heldout.input_ids) and len(held) == 4
    plan = pipeline.make_plan(session, progress=False)  # holdout 4 without auto: the same sums, the same plan
    assert plan.to_json() == result.plan.to_json()
    comp = compensating.compensation(session.model, plan.heads, session.recipe.surgery, plan.calibration)
    with surgery.masked(session.model, plan.heads, comp), torch.no_grad():
        logits = session.model(held.input_ids, attention_mask=held.attention_mask).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), held.input_ids[:, 1:])
    assert math.exp(float(nll)) == pytest.approx(table[0]["perplexity"], rel=1e-4)


@pytest.mark.slow
def test_auto_layer_by_layer_chooses_as_the_whole_model_does():
    """capture.onload: sequential -- the blocks read one at a time for the calibration, the held-back passes and
    the refits -- gives the same table as the whole model."""
    from pruner.runs import autochoice, context
    from pruner.runs.recipe_io import build_recipe

    seq = context.prepare(build_recipe(_recipe(capture={"onload": "sequential"})), progress=False, evaluation=False)
    assert seq.onloader is not None
    _, _, choice = autochoice.choose(seq, progress=False)
    full = context.prepare(build_recipe(_recipe()), progress=False, evaluation=False)
    _, _, ref = autochoice.choose(full, progress=False)
    assert [(r["scorer"], r["compensation"]) for r in choice.table] == \
        [(r["scorer"], r["compensation"]) for r in ref.table]
    for a, b in zip(choice.table, ref.table):
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-5)


def test_auto_bad_input_is_one_line_before_compute():
    from pruner.runs import autochoice, context
    from pruner.runs.recipe_io import build_recipe

    r = build_recipe(_recipe(scorer={"candidates": ["ablation", "ablation-shortlist"]},
                             surgery={"compensation": "refit"}, capture={"onload": "sequential"}))
    session = context.prepare(r, progress=False, evaluation=False)
    with pytest.raises(ValueError, match=r"^auto has a single candidate left by the other settings \(measured "
                                         r"scorers are refused layer by layer\)"):
        autochoice.choose(session, progress=False)
    big = build_recipe(_recipe(calibration={"num_samples": None, "holdout": 40}))
    text = " ".join(["the king is dead, long live the queen"] * 100)  # a few windows of 128 tokens
    with pytest.raises(ValueError, match=r"^calibration.holdout: 40 held-back samples from \(in memory\) leave "
                                         r"none of its \d+ for the calibration sums"):
        context.calibration_samples(big, session.tokenizer, [text])


def test_the_shortlist_measures_the_proxys_cheapest_heads_and_keeps_the_rest_above():
    """ablation-shortlist: the shortlisted heads' increases are the full ablation's, the others are not
    measured and rank above every measured head; its cost is the shortlist's passes."""
    model = tiny_model("gpt2")
    batch = pad(ragged_batch(seed=3, n=12, min_len=20, max_len=30), 0)
    req = AblationRequest("mean", 4, 0.5, ("ablation", "ablation-shortlist"))
    inputs = calibrate(model, batch, SinkSpec("first"), options=CalibrationOptions(ablation=req, ridge=1e-3))
    short = inputs.shortlist
    assert short.shape == (2, 4) and short.sum(1).tolist() == [2, 2]
    scores = scoring.get_scorer("ablation-shortlist")(inputs, torch.ones(2, 4, dtype=torch.bool))
    assert torch.equal(scores[short], inputs.ablation[short])
    assert scores[~short].min() > scores[short].max()
    assert inputs.costs["ablation-shortlist"]["passes"] == 5 and inputs.costs["ablation"]["passes"] == 9
    alone = calibrate(model, batch, SinkSpec("first"),
                      options=CalibrationOptions(ridge=1e-3,
                                                 ablation=AblationRequest("mean", 4, 0.5, ("ablation-shortlist",))))
    assert torch.equal(alone.shortlist, short) and torch.isnan(alone.ablation[~short]).all()
    torch.testing.assert_close(alone.ablation[short], inputs.ablation[short], rtol=0, atol=1e-9)
    assert alone.costs["ablation-shortlist"]["passes"] == 5


@pytest.mark.unit
@pytest.mark.parametrize("samples,models,want", [(16, 20, (4, 5)), (16, 4, (16, 4)), (4, 20, (4, 20)),
                                                 (8, 6, (2, 2)), (9, 5, (3, 2))])
def test_rungs_score_every_candidate_on_a_quarter_and_the_best_quarter_on_the_rest(samples, models, want):
    from pruner.runs.autochoice import rungs

    assert rungs(samples, models) == want


def test_candidates_dropped_after_the_first_rung_are_listed_last_with_their_samples():
    """Six scorers x mean on 8 held-back samples: every pruned model on the first 2, the best 2 on all 8
    (pairs whose scorers chose the same heads share their model's rows); the kept pair is one scored on every sample, and a
    survivor's perplexity is its perplexity over all 8 samples, computed by hand."""
    from pruner.runs import compensating, context, pipeline
    from pruner.runs.recipe_io import build_recipe

    six = ["refit-energy", "cosine", "fluctuation", "magnitude", "entropy", "output-norm"]
    recipe = _recipe(calibration={"num_samples": 16, "holdout": 8}, scorer={"candidates": six},
                     surgery={"compensation": "auto", "candidates": ["mean"]})
    auto = pruner.prune(recipe=recipe, progress=False).metrics["auto"]
    table, passes = auto["candidates"], auto["passes"]
    distinct = passes["held_back"] - 1
    assert passes["first_rung_samples"] == 2 and distinct > 4
    full = [r for r in table if r["samples"] == 8]
    assert len({r["perplexity"] for r in full}) <= passes["scored_on_all"] <= len(full) and table[:len(full)] == full
    assert all(r["samples"] == 2 for r in table[len(full):])
    assert (auto["scorer"], auto["compensation"]) == (full[0]["scorer"], full[0]["compensation"])
    assert [r["perplexity"] for r in full] == sorted(r["perplexity"] for r in full)
    assert "on the first 2 held-back samples, the best" in auto["line"]

    row = full[-1]
    named = _recipe(calibration={"num_samples": 16, "holdout": 8}, scorer={"name": row["scorer"], "candidates": None},
                    surgery={"compensation": "mean"})
    session = context.prepare(build_recipe(named), progress=False, evaluation=False)
    plan = pipeline.make_plan(session, progress=False)
    comp = compensating.compensation(session.model, plan.heads, session.recipe.surgery, plan.calibration)
    held = session.heldout
    with surgery.masked(session.model, plan.heads, comp), torch.no_grad():
        logits = session.model(held.input_ids, attention_mask=held.attention_mask).logits
    labels = held.input_ids.masked_fill(held.attention_mask == 0, -100)[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100)
    assert math.exp(float(nll)) == pytest.approx(row["perplexity"], rel=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("compensation,kinds,want", [("mean", ["mean"], "mean"), ("auto", ["mean", "refit"], "refit"),
                                                     ("auto", ["zero", "mean"], "zero")])
def test_a_measured_scorer_under_compensation_auto_removes_heads_as_auto_measures(compensation, kinds, want):
    """`compare` / `prune` with compensation auto and a measured scorer: the ablations compensate with the refit
    when it is a candidate (was: the name "auto" handed to the ablation)."""
    from pruner.runs import pipeline

    assert pipeline.measured_compensation(compensation, kinds) == want
