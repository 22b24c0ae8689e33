"""Recipe validation: every rejection rule names the key path; overrides; shipped recipes load."""

from __future__ import annotations

from pathlib import Path

import pytest

from pruner.runs.recipe import Recipe, RecipeError
from pruner.runs.recipe_io import load_recipe

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
BASE = {"model": {"path": "minilm-causal"}}


def with_(**sections):
    tree = {**BASE}
    for k, v in sections.items():
        tree[k] = v
    return tree


@pytest.mark.parametrize("tree,match", [
    ({}, r"model: Field required"),
    (with_(bogus=1), r"bogus: unknown key"),
    (with_(selection={"tagret": 0.2}), r"selection.tagret: unknown key"),
    (with_(selection={"target": 0}), r"selection.target: Input should be greater than 0"),
    (with_(selection={"target": 1.5}), r"selection.target: .*fraction of heads must be in \(0, 1\)"),
    (with_(selection={"target": 1.0}), r"selection.target: .*a head count is a whole number \(got 1.0\)"),
    (with_(selection={"target": "a lot"}), r"selection.target: Input should be a valid number"),
    (with_(selection={"budget": "both"}), r"selection.budget: Input should be 'global' or 'layer'"),
    (with_(selection={"min_heads_per_layer": 0}), r"selection.min_heads_per_layer: .*greater than or equal to 1"),
    (with_(selection={"gqa": "some"}), r"selection.gqa"),
    (with_(scorer={"name": "sink-awre"}), r"scorer.name: unknown scorer 'sink-awre' \(did you mean 'sink-aware'\?\)"),
    (with_(scorer={"convention": "both"}), r"scorer.convention"),
    (with_(surgery={"mode": "delete"}), r"surgery.mode: Input should be 'mask' or 'remove'"),
    (with_(surgery={"compensation": "median"}), r"surgery.compensation: Input should be 'zero', 'mean', 'refit' or 'auto'"),
    (with_(surgery={"ridge": -1e-3}), r"surgery.ridge: a ridge is >= 0 \(relative to the mean diagonal\) or auto, got -0.001"),
    (with_(surgery={"ridge": "often"}), r"surgery.ridge: a ridge is >= 0 .* or auto, got 'often'"),
    (with_(surgery={"refit_mode": "greedy"}), r"surgery.refit_mode: Input should be 'oneshot' or 'sequential'"),
    (with_(sinks={"mode": "ids"}), r"sinks: .*needs at least one token id"),
    (with_(sinks={"mode": "positions"}), r"sinks: .*needs at least one position"),
    (with_(sinks={"mode": "positions", "positions": [-1]}), r"sinks: .*>= 0"),
    (with_(sinks={"mode": "cls"}), r"sinks.mode"),
    (with_(export={"format": "tflite"}), r"export.format: Input should be 'none', 'dense', 'compact', 'onnx' or 'gguf'"),
    (with_(export={"push_to_hub": "me/x"}), r"export: push_to_hub needs an export"),
    (with_(export={"format": "dense", "push_to_hub": "not a repo"}), r"export.push_to_hub: invalid Hub repo id"),
    (with_(export={"format": "dense", "private": True}), r"export: private applies only with export.push_to_hub"),
    (with_(sinks={"eps": 1.0}), r"sinks.eps: Input should be less than 1"),
    (with_(calibration={"data": "x", "length": 2}), r"calibration.length: .*greater than or equal to 4"),
    (with_(calibration={"data": "x", "unit": "pages"}), r"calibration.unit"),
    (with_(calibration={"data": ""}), r"calibration.data: must name a source \(it is empty\)"),
    (with_(evaluation={"data": "x", "stride": 0}), r"evaluation.stride: .*greater than or equal to 1"),
    (with_(evaluation={"data": "x", "bootstrap": -1}), r"evaluation.bootstrap"),
    (with_(model={"path": "x", "dtype": "int8"}), r"model.dtype"),
    (with_(export={"format": "zip"}), r"export.format"),
    (with_(capture={"metrics": ["kl"]}), r"capture.metrics.0"),
    (with_(threads=0), r"threads: .*greater than or equal to 1"),
    (with_(scorer={"name": "auto", "candidates": ["cosine"]}, surgery={"compensation": "refit"}),
     r"\(recipe\): auto has a single candidate left \(cosine \+ refit\): name it instead"),
    (with_(surgery={"compensation": "auto", "candidates": ["mean"]}), r"auto has a single candidate left"),
    (with_(scorer={"candidates": ["cosine", "entropy"]}), r"scorer.candidates applies only with auto"),
    (with_(scorer={"name": "auto", "candidates": ["cosin"]}), r"scorer.candidates: unknown scorer 'cosin'"),
    (with_(scorer={"name": "autoo"}), r"scorer.name: unknown scorer 'autoo' \(did you mean 'auto'\?\)"),
])
def test_rejections_name_the_key_path(tree, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe(tree)


def test_overrides_apply_and_reject_missing_keys():
    r = load_recipe(BASE, ["selection.target=0.4", "scorer.name=cosine", "surgery.compensation=zero"])
    assert (r.selection.target, r.scorer.name, r.surgery.compensation) == (0.4, "cosine", "zero")
    with pytest.raises(RecipeError, match=r"no such key 'tagret'; valid here: target"):
        load_recipe(BASE, ["selection.tagret=0.4"])
    with pytest.raises(RecipeError, match="key=value"):
        load_recipe(BASE, ["selection.target"])
    with pytest.raises(RecipeError, match=r"selection.target: Input should be greater than 0"):
        load_recipe(BASE, ["selection.target=-1"])


@pytest.mark.parametrize("target", ["0.25", "18"])
def test_saved_recipe_keeps_head_counts_whole(tmp_path, target):
    """The recipe.yaml saved next to a run reloads to the same recipe (a head count stays a whole number)."""
    r = load_recipe(BASE, [f"selection.target={target}"])
    path = tmp_path / "recipe.yaml"
    path.write_text(r.to_yaml())
    again = load_recipe(path)
    assert again == r
    assert ("target: 18\n" in r.to_yaml()) == (target == "18")


def test_yaml_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: x\nscorer: [")
    with pytest.raises(RecipeError, match=r"not valid YAML \(line"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="YAML mapping"):
        load_recipe(tmp_path / "list.yaml")


def test_resolved_recipe_round_trips():
    r = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    again = load_recipe(__import__("yaml").safe_load(r.to_yaml()))
    assert again == r and isinstance(r, Recipe)


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(path):
    load_recipe(path)


# --- fuzzing: any input is either a valid recipe or one clean RecipeError -------------------------------------

from hypothesis import given, settings
from hypothesis import strategies as st

_KEYS = ["model", "path", "dtype", "calibration", "evaluation", "data", "length", "num_samples", "sinks", "mode",
         "positions", "scorer", "name", "selection", "target", "budget", "surgery", "compensation", "export",
         "format", "capture", "metrics", "threads", "seed", "bogus"]
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                     st.text(max_size=12), st.sampled_from(["minilm-causal", "sink-aware", "mask", "first", "0.25"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5)),
                       max_leaves=20)


def _outcome(fn):
    try:
        return fn()
    except RecipeError as e:
        assert str(e) and "\n" not in str(e), str(e)  # one line, printed as `pruner: error: ...`
        return None


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=6))
def test_fuzz_recipe_trees_validate_or_fail_cleanly(tree):
    _outcome(lambda: load_recipe(tree))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_recipe_yaml_text_validates_or_fails_cleanly(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(text)
    _outcome(lambda: load_recipe(path))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=3), st.text(max_size=10)),
                max_size=3))
def test_fuzz_overrides_validate_or_fail_cleanly(sets):
    _outcome(lambda: load_recipe({"model": {"path": "minilm-causal"}}, [f"{'.'.join(k)}={v}" for k, v in sets]))
