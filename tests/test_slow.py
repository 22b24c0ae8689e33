"""Slow tier: the README's headline numbers, reproduced in full (`python -m pytest -m slow`, ~3 minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pruner.cli import main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_reproduces_the_readme(tmp_path):
    """`pruner prune recipes/quickstart.yaml`: 18/72 heads, refit-energy + refit (ridge auto), perplexity 156.17 -> 156.47, 12 of 18
    flip."""
    out = tmp_path / "run"
    assert main(["prune", str(ROOT / "recipes" / "quickstart.yaml"), "--out", str(out)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    e = m["evaluation"]
    assert m["pruned_heads"] == 18 and m["total_heads"] == 72
    assert e["base"] == pytest.approx(156.17, abs=0.01) and e["pruned"] == pytest.approx(156.47, abs=0.01)
    assert e["ci_low"] == pytest.approx(0.01, abs=0.01) and e["ci_high"] == pytest.approx(0.60, abs=0.01)
    assert m["convention_sensitivity"]["changed"] == 12
    assert m["compensation"] == "refit" and m["refit"]["unexplained"] == pytest.approx(1.929, abs=1e-3)
    assert [v["ridge"] for _, v in sorted(m["refit"]["layers"].items())] == [0.1, 0.1, 1.0, 0.1, 1.0]


def test_causal_finetune_entropy_drop_is_mostly_sink(tmp_path):
    """eval/results/studies/analyze.md: minilm-causal-init -> minilm-causal, sink share 96%, cosine NN flip 71%."""
    out = tmp_path / "an"
    assert main(["analyze", "minilm-causal", "--compare-to", "minilm-causal-init", "--num-samples", "64",
                 "--max-length", "128", "--out", str(out)]) == 0
    res = json.loads((out / "analysis.json").read_text())
    overall = res["entropy_attribution"]["overall"]
    assert overall["delta"] == pytest.approx(-0.763, abs=1e-3)
    assert overall["sink_share"] == pytest.approx(0.96, abs=5e-3)
    assert res["audit"]["cosine"]["overall"]["nn_flip_rate"] == pytest.approx(0.71, abs=5e-3)
