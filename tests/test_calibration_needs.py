"""Only what a stage reads is accumulated (issue 33): for every scorer x compensation x ridge x budget, the sums a
layer-by-layer calibration hands each finished layer to are the ones the memory model counts -- the joint moment
where a scorer or a refit computed from that pass reads it, fold moments only for such a refit with ridge auto --
and their bytes are the memory model's `a finished layer's whole sums`. The decision itself
(`runs.calibration_needs`) is tested case by case first, the measured ablation scorers included (the whole-run test
leaves them out: L x H passes). The whole-run test calibrates once per scorer and decision (the memory model's
sizes): settings that decide alike capture alike."""

from __future__ import annotations

import pytest

from pruner.core import arch, assets
from pruner.pruning import per_layer
from pruner.pruning.curves import CurveKey
from pruner.pruning.per_layer import LocalCompensation
from pruner.pruning.scoring import SCORERS, get_scorer
from pruner.pruning.selection import check_target
from pruner.runs import calibration_memory, calibration_needs, context, pipeline, prune_memory
from pruner.runs.recipe import SurgerySpec
from pruner.runs.recipe_io import load_recipe

ONESHOT = SurgerySpec()  # refit, one-shot, ridge auto over 4 folds


@pytest.mark.unit
@pytest.mark.parametrize("scorer, kinds, spec, layerwise, local, want", [
    ("output-norm", ["zero"], ONESHOT, False, False, (False, 0)),  # nothing reads the joint moment
    ("output-norm", ["mean", "refit"], ONESHOT, False, False, (True, 4)),  # a one-shot refit from this pass
    ("output-norm", ["refit"], SurgerySpec(folds=8), False, False, (True, 8)),
    ("output-norm", ["refit"], SurgerySpec(ridge=0.1), False, False, (True, 0)),  # a fixed ridge: no folds
    ("output-norm", ["refit"], SurgerySpec(refit_mode="sequential"), False, False, (False, 0)),  # its own pass
    ("output-norm", ["refit"], ONESHOT, True, False, (False, 0)),  # layer by layer, not compensated as it goes
    ("output-norm", ["refit"], ONESHOT, True, True, (True, 4)),  # ... compensated as each layer finishes
    ("sink-aware", ["zero"], ONESHOT, True, False, (True, 0)),  # the scorer reads the joint moment itself
    ("ablation", ["mean"], ONESHOT, False, False, (False, 0)),
    ("ablation", ["refit"], SurgerySpec(refit_mode="sequential"), True, False, (True, 4)),  # measured as run
    ("ablation-shortlist", ["refit"], SurgerySpec(ridge=0.1), True, False, (True, 0)),
])
def test_the_calibration_reads_the_joint_and_fold_moments_only_where_a_stage_does(scorer, kinds, spec, layerwise,
                                                                                   local, want):
    assert calibration_needs.capture_reads([get_scorer(scorer)], kinds, spec, layerwise, local) == want


@pytest.mark.unit
def test_a_layer_is_compensated_as_it_finishes_only_for_a_one_shot_refit_of_quotas_layer_by_layer():
    key = CurveKey("sink-aware", None, "group", 1)
    assert calibration_needs.local_compensation([2, 1], key, SurgerySpec(ridge=0.1), True) == \
        (LocalCompensation(key, (2, 1), "refit", 0.1),)
    assert calibration_needs.local_compensation([2, 1], key, ONESHOT, True)[0].ridge == "auto"
    assert calibration_needs.local_compensation([2, 1], key, ONESHOT, False) == ()  # whole model: one refit at the end
    assert calibration_needs.local_compensation(None, key, ONESHOT, True) == ()  # global budget: heads known at the end
    assert calibration_needs.local_compensation([2, 1], key, SurgerySpec(compensation="mean"), True) == ()
    assert calibration_needs.local_compensation([2, 1], key, SurgerySpec(refit_mode="sequential"), True) == ()
    for scorer in ("gradient", "ablation", "ablation-shortlist"):  # curves that exist only after the capture
        assert calibration_needs.local_compensation([2, 1], CurveKey(scorer, None, "group", 1), ONESHOT, True) == ()


def _bytes(sums) -> int:
    tensors = [v for v in vars(sums).values() if hasattr(v, "numel")]
    tensors += list(sums.pairs.values())
    for part in (sums.outputs, sums.folds):
        tensors += [] if part is None else [v for v in vars(part).values() if hasattr(v, "numel")]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.integration
def test_the_calibration_keeps_what_the_memory_model_counts(monkeypatch):
    base = load_recipe({"model": {"path": assets.resolve("llama-shakespeare")},
                        "calibration": {"num_samples": 8, "length": 64, "batch_size": 4},
                        "evaluation": {"num_samples": 2}, "sinks": {"mode": "first"},
                        "capture": {"onload": "sequential"}, "selection": {"target": 0.5}})
    session = context.prepare(base, progress=False, evaluation=False)
    seen = []
    finish = per_layer.LayerFinisher.finish

    def spy(self, layer, sums, residual):  # the whole sums of each finished layer, as the capture hands them on
        seen.append((sums.outputs.has_joint, None if sums.folds is None else len(sums.folds.tokens), _bytes(sums)))
        return finish(self, layer, sums, residual)
    monkeypatch.setattr(per_layer.LayerFinisher, "finish", spy)
    checked, run = set(), set()
    for name in [s for s in SCORERS if not get_scorer(s).needs_ablation]:
        for compensation in ("zero", "mean", "refit"):
            for ridge in ("auto", 0.1):
                for shape in ("servable", "any"):
                    recipe = base.model_copy(update={
                        "scorer": base.scorer.model_copy(update={"name": name}),
                        "surgery": base.surgery.model_copy(update={"compensation": compensation, "ridge": ridge}),
                        "selection": base.selection.model_copy(update={"shape": shape})})
                    model = session.model
                    quota = check_target(arch.geometry(model), pipeline.selection_config(recipe, model))[1]
                    sizes = prune_memory.calibration_sizes(recipe, model, quota)
                    if (name, sizes) in run:  # this scorer's capture with these sizes is already measured
                        continue
                    run.add((name, sizes))
                    session.recipe, seen[:] = recipe, []
                    pipeline.make_plan(session, progress=False)
                    case = (name, compensation, ridge, shape)
                    assert len(seen) == arch.geometry(model).n_layers, case
                    assert {(j, f) for j, f, _ in seen} == {(sizes.joint, sizes.folds or None)}, case
                    want = calibration_memory.whole_layer_bytes(model, sizes)
                    assert all(abs(b - want) <= 0.02 * want for *_, b in seen), (case, want, seen[0])
                    checked.add((sizes.joint, sizes.folds, sizes.local))
    # every combination the decision can make was seen: no joint; joint alone; joint with folds and a local refit
    assert checked >= {(False, 0, False), (True, 0, False), (True, 4, True), (True, 0, True)}, checked
    assert len(run) >= 2 * len([s for s in SCORERS if not get_scorer(s).needs_ablation])  # >= 2 decisions a scorer
    assert get_scorer("refit-energy").reads_joint and not get_scorer("output-norm").reads_joint
