"""Several processes give the statistics, gradients, NLLs, plans and refit compensation of one process.

Each test launches `torchrun --standalone --nproc_per_node 2` (gloo on CPU, no
network) and compares with the same computation in one process. Samples are
sharded rank::world and partial sums are added in rank order, so the only
difference left is float64 summation order (~1e-15) -- and, for second moments of
the head outputs, float32 products of differently composed batches (~1e-7 of
their scale); the plans are identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("torchrun")]  # one process group at a time
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROBE = HERE / "dist_probe.py"


def launch(args: list[str], procs: int, env: dict | None = None, ok: bool = True) -> None:
    """Run a probe in `procs` processes (torchrun beyond one); it must succeed (`ok`) or fail (a test's kill)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    cmd = [sys.executable, *args] if procs == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (out.returncode == 0) == ok, out.stderr[-3000:]


SECOND = ("/oo", "/uu", "/ww", "/joint")


def _second_moment_tol(x: torch.Tensor) -> float:
    """Second output moments are float32 products of each batch's centred rows, summed across batches in
    float64: another batch composition (each process batches its own shard) rounds them differently,
    by ~1e-7 of their scale."""
    return 1e-6 * float(x.abs().max()) if x.numel() else 0.0


def test_two_processes_give_the_statistics_and_plans_of_one(tmp_path):
    launch([str(PROBE), str(tmp_path / "one.pt")], 1)
    launch([str(PROBE), str(tmp_path / "two.pt")], 2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert (one["world"], two["world"]) == (1, 2)
    assert two["kept"] == {"gpt2": [True, False], "llama": [True, False]}  # layer by layer: rank 0 alone keeps sums
    for family in ("gpt2", "llama"):
        a, b = one[family], two[family]
        assert a["stats"].keys() == b["stats"].keys()
        for key in a["stats"]:
            torch.testing.assert_close(b["stats"][key], a["stats"][key], rtol=1e-12, msg=key,
                                       atol=_second_moment_tol(a["stats"][key]) if key.endswith(SECOND) else 1e-12)
        for key in ("gradient", "gradient_layerwise", "nll"):
            torch.testing.assert_close(b[key], a[key], rtol=1e-12, atol=1e-12, msg=key)
        torch.testing.assert_close(a["gradient_layerwise"], a["gradient"], rtol=1e-5, atol=0)  # float32 model
        torch.testing.assert_close(b["cross"], a["cross"], rtol=1e-12, atol=_second_moment_tol(a["cross"]))
        assert torch.equal(a["count"], b["count"])
        assert a["plans"] == b["plans"], family
        assert a["refit"].keys() == b["refit"].keys() and any("weight" in k for k in a["refit"])
        for key in a["refit"]:  # the ridge solve amplifies the second moments' ~1e-7 batching differences
            torch.testing.assert_close(b["refit"][key], a["refit"][key], rtol=0, msg=key,
                                       atol=1e-4 * float(a["refit"][key].abs().max()))


def test_prune_under_torchrun_writes_the_plan_of_one_process(tmp_path):
    quick = ["--set", "calibration.num_samples=6", "--set", "evaluation.num_samples=5",
             "--set", "evaluation.bootstrap=20", "--set", "capture.metrics=[cosine]",
             "--set", "scorer.name=gradient", "--set", "bench.enabled=false"]
    recipe = str(ROOT / "recipes" / "gpt2-shakespeare.yaml")
    launch(["-m", "pruner.cli", "prune", recipe, "--out", str(tmp_path / "one")] + quick, 1)
    launch(["-m", "pruner.cli", "prune", recipe, "--out", str(tmp_path / "two")] + quick, 2)

    def read(run, f):
        return json.loads((tmp_path / run / f).read_text())

    p1, p2 = read("one", "plan.json"), read("two", "plan.json")
    assert p1["heads"] == p2["heads"] and len(p1["entries"]) == len(p2["entries"])
    for a, b in zip(p1["entries"], p2["entries"]):  # same heads, same order; floats to summation order
        assert {k: v for k, v in a.items() if not isinstance(v, float)} == \
            {k: v for k, v in b.items() if not isinstance(v, float)}
        assert b == pytest.approx(a, rel=1e-12, abs=1e-15)
    e1, e2 = read("one", "metrics.json")["evaluation"], read("two", "metrics.json")["evaluation"]
    assert e1["windows"] == e2["windows"] == 5 and e1["tokens"] == e2["tokens"]
    for key in ("base", "pruned", "delta", "ci_low", "ci_high"):
        assert e2[key] == pytest.approx(e1[key], rel=1e-9, abs=1e-12), key


@pytest.mark.slow  # the whole-model run under torchrun is the default suite's (above); layer by layer in one process too
def test_prune_layer_by_layer_under_torchrun_writes_the_run_of_one_process(tmp_path):
    """Blocks read from disk in two processes: rank 0 alone keeps the sums, selects and compensates, and hands the
    plan and the compensation to the other; the run folder is the one process's (plan, perplexities, model/)."""
    from safetensors.torch import load_file

    quick = ["--set", "calibration.num_samples=8", "--set", "evaluation.num_samples=6", "--set", "evaluation.bootstrap=20",
             "--set", "capture.onload=sequential", "--set", "bench.enabled=false", "--set", "evaluation.latency=false",
             "--set", "surgery.compensation=refit", "--set", "surgery.ridge=0.1"]
    recipe = str(ROOT / "recipes" / "llama-shakespeare.yaml")
    launch(["-m", "pruner.cli", "prune", recipe, "--out", str(tmp_path / "one")] + quick, 1)
    launch(["-m", "pruner.cli", "prune", recipe, "--out", str(tmp_path / "two")] + quick, 2)

    def read(run, f):
        return json.loads((tmp_path / run / f).read_text())

    assert read("one", "plan.json")["heads"] == read("two", "plan.json")["heads"]
    e1, e2 = read("one", "metrics.json")["evaluation"], read("two", "metrics.json")["evaluation"]
    for key in ("base", "pruned", "delta"):
        assert e2[key] == pytest.approx(e1[key], rel=1e-6), key
    for f in ("compensation.safetensors", "model/model-00002-of-00005.safetensors"):
        a, b = load_file(str(tmp_path / "one" / f)), load_file(str(tmp_path / "two" / f))
        assert a.keys() == b.keys() and a
        for k in a:  # float32 products of other batch compositions, amplified by the ridge solve
            torch.testing.assert_close(b[k].float(), a[k].float(), rtol=0, atol=1e-3 * float(a[k].float().abs().max()))
