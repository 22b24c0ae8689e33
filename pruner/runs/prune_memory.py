"""`pruner prune`'s memory layer by layer, stage by stage, from a recipe and its model's config alone.

The calibration's stages are `pruner.runs.calibration_memory.memory_plan`'s; after them come the compensation's own
pass (where the plan needs one: a global budget's one-shot refit, a sequential refit), the evaluations of the base and
pruned models, and the written model/ read back. What the calibration accumulates is decided as the pipeline
decides it (`pruner.runs.calibration_needs`). `pruner plan-memory` prints `run_plan`; eval/bench/prune_layerwise.py
compares its anonymous peak with the measured RssAnon.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pruner.core import arch
from pruner.runs import calibration_needs
from pruner.runs.calibration_memory import (
    LOGIT_COPIES,
    MAPPED,
    MemoryPlan,
    Stage,
    block_bytes,
    block_parts,
    hidden_bytes,
    kept_bytes,
    memory_plan,
    meta_model,
    outside_cpu_bytes,
)
from pruner.runs.resources import Estimate, Sizes, calibration_estimate, model_shape


def later_stages(model, sizes: Sizes, samples: int, device: str, after: "After") -> list[Stage]:
    """What `pruner prune` holds after the calibration, layer by layer (see `run_plan`)."""
    cpu = torch.device(device).type == "cpu"
    g, s = arch.geometry(model), model_shape(model)
    act = next(model.parameters()).element_size()
    blocks = block_parts(model, after.read_ahead, cpu)
    kept = {"what is kept of the finished layers (first moments, pairs, curves)": kept_bytes(model, sizes)}
    comp = {}
    if after.refit:  # the new output-projection columns of every pruned layer, in files
        name = f"refit's new output-projection columns {MAPPED} files)" if cpu else "refit's new output-projection columns"
        comp[name] = g.n_layers * s["d"] * g.n_heads * g.head_dim * act
    stages = []
    if after.refit_pass:  # the compensation's own pass: the output moments again, a fit per layer
        pass_sizes = replace(sizes, pair_metrics=0, joint=True, folds=after.folds, local=True, gradient=False)
        for stage in memory_plan(model, pass_sizes, samples, "sequential", device, False, after.spill,
                                 after.read_ahead).stages:
            stages.append(Stage(f"compensation pass: {stage.name.split(': ', 1)[1]}", stage.device,
                                Estimate({**stage.host.parts, **comp})))
    B, T = after.eval_batch, after.eval_length
    plain = calibration_estimate(model, replace(sizes, batch_size=B, length=T, outputs=False, joint=False,
                                                folds=0, gradient=False)).parts["activations"]
    hidden = {"hidden states of every evaluation window": hidden_bytes(model, (after.eval_windows + B) * T)}
    outside = {(f"weights outside the blocks {MAPPED}: the rows read, the LM head)" if cpu else
                "weights outside the blocks"): outside_cpu_bytes(model, after.eval_windows, T, True) if cpu else
               sum(p.numel() * p.element_size() for p in model.parameters()) - g.n_layers * block_bytes(model)}
    from pruner.evaluation.perplexity import LOGIT_BYTES

    logits = LOGIT_COPIES * min(LOGIT_BYTES, B * T * s["V"] * 4) + B * T * s["d"] * 4
    stages.append(Stage("evaluation (base and pruned)", Estimate({**outside, **blocks, "one batch through a block":
                                                                   plain, "a slice of the logits": logits}),
                        Estimate({**hidden, **kept, **comp})))
    attention = (g.n_heads + 2 * g.n_kv_heads) * g.head_dim * s["d"] * act + s["d"] * g.n_heads * g.head_dim * act
    check = 2 * 32 * s["V"] * 4 * 4  # the check tokens' logits: exact, rounded, cached, reloaded
    written = {(f"the written copy's weights outside the blocks {MAPPED}: the rows read)" if cpu else
                "the written copy's weights outside the blocks"): next(iter(outside.values())),
               (f"one written block, read back {MAPPED} from the new files)" if cpu else "one written block, read back"):
               block_bytes(model)}
    stages.append(Stage("writing model/ and reading it back", Estimate({
        **outside, **blocks, **written, "the written block's new attention weights": attention,
        "the check tokens' logits": check}), Estimate({**kept, **comp})))
    return stages


@dataclass(frozen=True)
class After:
    """What the stages after the calibration depend on (from the recipe)."""

    eval_windows: int
    eval_length: int
    eval_batch: int
    refit: bool          # refit's new columns are kept for every pruned layer
    refit_pass: bool     # a one-shot refit of a global budget, or a sequential refit: a pass of its own
    folds: int = 0       # that pass's fold moments (ridge auto)
    read_ahead: bool = True
    spill: bool = False


def run_plan(recipe, model, quota: list[int] | None) -> MemoryPlan:
    """`pruner prune`'s stages, layer by layer (capture.onload: sequential), for a recipe, from its model's config
    alone (`recipe_model`), `quota` its selection's per-layer counts (None: a global budget): the calibration's
    (`memory_plan`), then the compensation's own pass where it needs one, the evaluations and the written model/.
    What `pruner plan-memory` prints and the benchmarks check."""
    r = recipe
    scorer, s = scorer_of(r), r.surgery
    sizes = calibration_sizes(r, model, quota)
    samples = r.calibration.num_samples or 64
    spill = r.capture.hidden == "disk"
    plan = memory_plan(model, sizes, samples, "sequential", r.model.device, scorer.needs_systems, spill,
                       r.capture.read_ahead)
    ev = r.evaluation
    refit = "refit" in s.choices()  # surgery.compensation auto: refit among its candidates is planned
    refit_pass = refit and (s.refit_mode == "sequential" or not sizes.local)
    after = After(ev.num_samples or 64, ev.length, min(ev.batch_size, ev.num_samples or 64),
                  refit, refit_pass, s.folds if s.ridge == "auto" else 0, r.capture.read_ahead,
                  spill)
    return MemoryPlan("sequential", plan.stages + tuple(later_stages(model, sizes, samples, r.model.device, after)),
                      plan.cpu, spill)


def scorer_of(recipe):
    """The recipe's scorer; under `scorer.name: auto` one that needs whatever any of its candidates needs (one
    calibration pass builds every candidate's curves)."""
    from dataclasses import replace as with_flags

    from pruner.pruning.scoring import get_scorer

    scorers = [get_scorer(name) for name in recipe.scorer.choices()]
    flags = ("needs_systems", "needs_gradient", "needs_ablation", "reads_joint")
    return with_flags(scorers[0], **{f: any(getattr(x, f) for x in scorers) for f in flags})


def calibration_sizes(recipe, model, quota: list[int] | None) -> Sizes:
    """What the recipe's layer-by-layer calibration accumulates and builds per layer, as the pipeline decides it
    (`pruner.runs.calibration_needs`): the joint moments for the scorers and a refit computed from the pass, fold
    moments for that refit with ridge auto, a per-layer budget's refit (`quota`: the selection's per-layer counts,
    or None for a global budget) as each layer finishes."""
    from pruner.pruning.curves import CurveKey

    r = recipe
    scorer, s = scorer_of(r), r.surgery.resolved()
    key = CurveKey(scorer.name, None, r.selection.gqa, 1)
    local = bool(calibration_needs.local_compensation(quota, key, s, True))
    cal = r.calibration
    metrics = tuple(dict.fromkeys(["cosine", *r.capture.metrics]))
    return calibration_needs.capture_setup(r, [scorer], s.choices(), (cal.num_samples or 64, cal.length),
                                           metrics=metrics, layerwise=True, local=local)[1]


def recipe_model(recipe):
    """The recipe's model on the meta device, in its dtype, from its config.json alone."""
    from transformers import AutoConfig

    from pruner.core import assets

    m = recipe.model
    config = AutoConfig.from_pretrained(assets.resolve(m.path), trust_remote_code=m.trust_remote_code)
    config.dtype = getattr(torch, m.dtype)
    return meta_model(config).to(getattr(torch, m.dtype))
