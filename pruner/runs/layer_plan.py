"""The plan of `selection.unit: layer`: which whole attention layers go (He et al. 2024, "What Matters in
Transformers? Not All Attention is Needed"), through the same calibration, registry and plan as heads.

With few KV heads per layer (Gemma 3 270M: 4 query heads over 1 KV head), pruning query heads saves compute
but no KV cache; removing a layer's whole attention frees that layer's cache. The plan lists every head of
the chosen layers, so compensation, the scoped mask, removal and export are the head path's.
"""

from __future__ import annotations

from dataclasses import replace

from pruner.core import arch
from pruner.pruning.ablation import layer_ablations, subset
from pruner.pruning.calibrate import CalibrationOptions, calibrate
from pruner.pruning.compensation import compensate
from pruner.pruning.scoring import Scorer, ScoringInputs, get_scorer
from pruner.pruning.selection import Plan, SelectionConfig, SelectionError, check_layer_target, select_layers
from pruner.runs import calibration_needs, resources
from pruner.runs.context import Session


def check(session: Session) -> SelectionConfig:
    """The layer selection of the recipe, refused in one line where it cannot run -- before any compute."""
    model, sel = session.model, session.recipe.selection
    if session.onloader is not None:
        raise SelectionError("selection.unit: layer runs with the whole model in memory (capture.onload: all)")
    if not arch.adapter_for(model).attention_free:
        raise SelectionError(f"selection.unit: layer removes whole attention layers of llama-like decoders and "
                             f"Gemma 3, not {model.config.model_type}'s")
    cfg = SelectionConfig(target=sel.target)
    check_layer_target(arch.geometry(model), cfg)
    return cfg


def layer_inputs(session: Session, scorer: Scorer, progress: bool = True) -> ScoringInputs:
    """One capture pass with what the layer scorer and the compensation read (the attention blocks' cosine sums
    only for the layer-cosine scorer), and for the layer-ablation scorer L + 1 measured passes."""
    r = session.recipe
    kind = r.surgery.compensation
    cfg, sizes = calibration_needs.capture_setup(r, [scorer], [kind], tuple(session.calibration.input_ids.shape),
                                                 layer_cosine=scorer.reads_layer_cosine)
    if r.capture.memory_check:
        resources.check_memory(session.model, sizes)
    inputs = calibrate(session.model, session.calibration, session.sinks, session.tokenizer, config=cfg,
                       options=CalibrationOptions(batch_size=r.calibration.batch_size, seed=r.selection.seed,
                                                  progress=progress, ridge=r.surgery.ridge,
                                                  checkpoints=session.checkpoints))
    if not scorer.needs_ablation:
        return inputs
    model, outputs = session.model, inputs.stats.outputs
    measured = layer_ablations(model, subset(session.calibration, r.scorer.ablation_samples),
                               lambda heads: compensate(model, heads, outputs, kind, r.surgery.ridge),
                               batch_size=r.calibration.batch_size, progress=progress)
    return replace(inputs, layer_ablation=measured.increase, costs={scorer.name: measured.cost()})


def make(session: Session, inputs: ScoringInputs | None = None, progress: bool = True) -> Plan:
    """Calibrate (unless `inputs` are given) and choose the layers; nothing is changed."""
    scorer = get_scorer(session.recipe.scorer.name)
    cfg = check(session)
    inputs = inputs if inputs is not None else layer_inputs(session, scorer, progress)
    geom = arch.geometry(session.model)
    plan = select_layers(scorer, inputs, geom, cfg)
    return replace(plan, geometry=geom, sink_mass=inputs.stats.sink_mass, calibration=inputs)
