"""The plans of every shipped model, scorer, target, budget, GQA mode, minimum and shape equal the ones the greedy
over every layer at once gave before selection curves (issue 33), whole model and layer by layer.

tests/data/plans-before-curves.json.gz was written by that greedy (`tests/greedy_reference.py` is its code) on
these calibrations: 16 windows x 64 tokens of the calibration plays, first-token sinks, ridge auto with 4 folds,
single-head ablations with refit on 4 windows. Whole model and layer by layer (the blocks read from disk,
curves built as each layer finishes): the same heads, order and twins exactly, scores to 5e-5 relative. The
scores are not compared digit for digit: a CPU with other vector units than the one that wrote the golden file
(AVX-512 against AVX2) rounds its matrix products differently, which moves them by up to ~3e-6 relative (the
refit-aware scorer's Schur complements amplify it; an entropy score of a few thousandths moved by 2.4e-5 on the CI
machine); the single-head ablations, measured perplexity differences
of a few hundredths, move by up to ~1.5e-6 absolute and are compared to 1e-5 absolute.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from pruner.attention.capture import CaptureConfig
from pruner.attention.sinks import SinkSpec
from pruner.checkpoints import layout, loading
from pruner.checkpoints.lazy import lazy_model
from pruner.core import arch, assets
from pruner.core.data import TextSource, load_texts, token_windows
from pruner.core.layerwise import PassOptions
from pruner.pruning.calibrate import CalibrationOptions, calibrate
from pruner.pruning.layerwise import LayerwiseScoring, calibrate_layerwise
from pruner.pruning.per_layer import CurveRequest
from pruner.pruning.scoring import SCORERS, get_scorer
from pruner.pruning.selection import SelectionConfig, SelectionError, curve_key, select

pytestmark = pytest.mark.integration
GOLDEN = json.loads(gzip.open(Path(__file__).parent / "data" / "plans-before-curves.json.gz", "rt").read())
CONFIG = CaptureConfig(metrics=("cosine",), outputs=True, folds=4)


def cases(name: str, model) -> dict:
    """Every golden case of `name`: key -> (scorer, selection config, convention)."""
    out = {}
    geom = arch.geometry(model)
    for key in GOLDEN:
        parts = key.split("|")
        if parts[0] != name:
            continue
        s, target, budget, gqa, min_heads, shape = parts[1:7]
        shapes = layout.servable_prunes(model, gqa) if shape == "servable" else None
        cfg = SelectionConfig(target=float(target), budget=budget, min_heads_per_layer=int(min_heads), gqa=gqa,
                              shapes=shapes)
        conv = None
        if parts[-1] == "other":
            conv = "content" if s == "cosine" else "full"
        out[key] = (get_scorer(s), cfg, conv)
    assert out and geom
    return out


def check(name: str, model, inputs, layerwise: bool) -> None:
    geom = arch.geometry(model)
    for key, (scorer, cfg, conv) in cases(name, model).items():
        if layerwise and scorer.needs_ablation:
            continue  # single-head ablations need the whole model
        want = GOLDEN[key]
        try:
            plan = json.loads(select(scorer, inputs, geom, cfg, convention=conv).to_json())
        except SelectionError as e:
            assert want == {"error": str(e)}, key
            continue
        assert "error" not in want, key
        assert (plan["scorer"], plan["convention"], plan["target"]) == (want["scorer"], want["convention"],
                                                                        want["target"]), key
        got = [[e["layer"], e["head"], e["score"], e["twin"], e["twin_similarity"], e["sink_mass"]]
               for e in plan["entries"]]
        assert [g[:2] + g[3:4] for g in got] == [w[:2] + w[3:4] for w in want["entries"]], key
        floats = [x for g in got for x in (g[2], g[4], g[5]) if x is not None]
        gold = [x for w in want["entries"] for x in (w[2], w[4], w[5]) if x is not None]
        assert floats == pytest.approx(gold, rel=5e-5, abs=1e-5 if scorer.needs_ablation else 1e-12), key


def requested(name: str, model) -> CurveRequest:
    geom = arch.geometry(model)
    return CurveRequest(tuple(dict.fromkeys(curve_key(s, geom, cfg, conv) for s, cfg, conv in cases(name, model).values()
                                            if not (s.needs_ablation and name == "layerwise"))))


@pytest.mark.parametrize("name", [  # minilm-causal's 72 single-head ablations are the slow tier's
    pytest.param("minilm-causal", marks=pytest.mark.slow), "llama-shakespeare", "gpt2-shakespeare"])
def test_the_plans_of_every_shipped_model_are_todays(name):
    torch.set_num_threads(1)
    tok = loading.load_tokenizer(name)
    batch = token_windows(tok, load_texts(TextSource("shakespeare:calibration")), 64, num_samples=16)
    model = loading.load_model(name)
    inputs = calibrate(model, batch, SinkSpec("first"), tok, config=CONFIG,
                       options=CalibrationOptions(gradient=True, batch_size=8, ridge="auto", ablation=("refit", 4),
                                                  curves=requested(name, model)))
    assert inputs.gram is None and inputs.layer_gram is None  # the curves were built; the matrices dropped
    check(name, model, inputs, layerwise=False)
    lazy = lazy_model(assets.resolve(name))
    keys = tuple(k for k in requested(name, model).keys if not get_scorer(k.scorer).needs_ablation)
    inputs = calibrate_layerwise(lazy.model, batch, SinkSpec("first"), tok, CONFIG, lazy,
                                 LayerwiseScoring(CurveRequest(keys), ridge="auto", gradient=True),
                                 PassOptions(batch_size=8))
    assert all(not m.has_joint for m in inputs.stats.outputs) and inputs.stats.folds is None  # dropped as they went
    check(name, lazy.model, inputs, layerwise=True)
    # ablation-shortlist came after the golden plans (issue 35): the ablation's on a shortlist (test_autochoice.py)
    assert set(SCORERS) - {"ablation-shortlist"} == {k.split("|")[1] for k in GOLDEN}
