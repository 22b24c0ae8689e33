"""The recovery study's statistics (eval.studies.recovery.measure): R and its interval from per-window sums, resampled
in 64 contiguous blocks so that the whole split's neighbouring windows are not counted as independent draws."""

from __future__ import annotations

import numpy as np
import pytest

from eval.studies.recovery.measure import blocks, held_out


def _case(rng, n: int, gap: float):
    """Per-window NLL sums of n windows: base, pruned (base + gap) and recovered (half the gap back)."""
    count = [127] * n
    base = list(rng.normal(600, 20, n))
    pruned = [b + gap + rng.normal(0, 1) for b in base]
    after = [p - gap / 2 + rng.normal(0, 1) for p in pruned]
    zeros = [0.0] * n
    ref = {"count": count, "base": base, "pruned": pruned, "kl_pruned": [1.0] * n,
           "entropy_base": zeros, "entropy_pruned": zeros}
    return base, pruned, after, held_out(ref, after, {"kl": [0.5] * n, "entropy": zeros})


@pytest.mark.unit
def test_the_interval_resamples_64_contiguous_blocks_and_R_is_the_ratio_of_sums():
    rng = np.random.default_rng(3)
    got = {}
    for n in (64, 1235):
        base, pruned, after, h = _case(rng, n, 3.0)
        b = blocks(base)
        got[n] = {"units": len(b), "sums_kept": bool(np.isclose(b.sum(), sum(base))), "R": h["R"],
                  "R_exact": (sum(pruned) - sum(after)) / (sum(pruned) - sum(base)), "ci": h["R_ci"], "R_kl": h["R_kl"]}
    # 64 windows: the per-window bootstrap of the figures before --windows all
    assert np.array_equal(blocks(list(range(64))), np.arange(64.0))
    for n in (64, 1235):
        g = got[n]
        assert g["units"] == 64 and g["sums_kept"]
        assert abs(g["R"] - g["R_exact"]) < 1e-9 and abs(g["R"] - 0.5) < 0.1
        assert g["ci"][0] < g["R"] < g["ci"][1] and g["R_kl"] == pytest.approx(0.5)
    # more windows measure the same R more tightly
    assert got[1235]["ci"][1] - got[1235]["ci"][0] < got[64]["ci"][1] - got[64]["ci"][0]


def _folder(path, pruned_heads, spec=None, recipe=None):
    """A run folder's files `reused` reads: metrics.json (pruned heads, and a recovery's spec), recipe.yaml."""
    import json
    import shutil

    path.mkdir()
    metrics = {"pruned_heads": pruned_heads, **({"recovery": {"spec": spec}} if spec else {})}
    (path / "metrics.json").write_text(json.dumps(metrics))
    if recipe:
        shutil.copy(recipe, path / "recipe.yaml")
    return path


@pytest.mark.unit
def test_a_reused_recovery_must_be_the_configs_own(tmp_path):
    """`--recovered`: a folder recovered elsewhere (by dev.py) is scored only when it recovered this run with the
    spec `pruner recover` makes of the config's budget, data, method, teacher and settings; anything else is
    refused in one line."""
    from pruner.runs.recipe_io import load_recipe
    from pruner.runs.recovery_stage import run_spec

    from eval.common import ROOT
    from eval.studies.recovery.study import reused

    heads = [[0, 1], [3, 2]]
    recipe = ROOT / "recipes" / "gemma3-270m.yaml"
    run = _folder(tmp_path / "run", heads, recipe=recipe)
    mix = ["shakespeare:train", "python-docs:dev"]
    spec = run_spec(load_recipe(recipe), {"tokens": 131072, "data": mix, "method": "lora", "teacher": "resident",
                                          "lr": 1e-3}).model_dump(mode="json")  # what `pruner recover` records
    good = _folder(tmp_path / "good", heads, spec)
    config = "gemma-3-270m:0.5:shakespeare:train+python-docs:dev:131072:lora:resident"
    assert reused(good, run, config, ("lr=1e-3",)) == good
    with pytest.raises(SystemExit, match=r"tokens 131072 \(want 65536\)"):
        reused(good, run, config.replace("131072", "65536"), ("lr=1e-3",))
    with pytest.raises(SystemExit, match=r"data .*want 'shakespeare:train'"):
        reused(good, run, "gemma-3-270m:0.5:shakespeare:train:131072:lora:resident", ("lr=1e-3",))
    with pytest.raises(SystemExit, match=r"lr 0.001 \(want 0.0003\)"):
        reused(good, run, config, ("lr=3e-4",))
    with pytest.raises(SystemExit, match=r"lr 0.001 \(want None\)"):  # a setting the config leaves at its default
        reused(good, run, config, ())
    other = _folder(tmp_path / "other", [[0, 1]], spec)
    with pytest.raises(SystemExit, match="pruned heads differ"):
        reused(other, run, config, ("lr=1e-3",))
    with pytest.raises(SystemExit, match="not a recovered run folder"):
        reused(tmp_path / "missing", run, config, ())
