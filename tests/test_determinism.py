"""Same recipe and seed -> byte-identical plan.json and the same metrics (twice, and with another thread count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pruner.cli import main

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--set", "calibration.num_samples=16", "--set", "evaluation.num_samples=8",
         "--set", "evaluation.bootstrap=200", "--set", "evaluation.latency=false", "--set", "scorer.name=sink-aware",
         "--set", "bench.enabled=false"]  # timings differ run to run, like latency


def _run(tmp_path: Path, name: str, threads: int) -> tuple[bytes, dict]:
    out = tmp_path / name
    assert main(["prune", str(ROOT / "recipes" / "gpt2-shakespeare.yaml"), "--out", str(out),
                 "--set", f"threads={threads}", *QUICK]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    return (out / "plan.json").read_bytes(), metrics


def test_same_recipe_same_plan_and_metrics(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        plan_a, m_a = _run(tmp_path, "a", 2)
        plan_b, m_b = _run(tmp_path, "b", 2)
        plan_c, m_c = _run(tmp_path, "c", 1)
    finally:
        torch.set_num_threads(before)
    assert plan_a == plan_b == plan_c  # byte-identical, whatever the thread count
    assert json.loads(plan_a)["pruned"] == 8
    for key in ("seconds", "latency_ms_before", "latency_ms_after"):
        for m in (m_a, m_b, m_c):
            m.pop(key)
    assert m_a == m_b  # same threads: every number identical (bootstrap CI included)
    for k, v in m_a["evaluation"].items():  # other thread count: equal to float rounding
        assert m_c["evaluation"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
