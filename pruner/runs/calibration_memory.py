"""The memory a run will take, per device and for the host, stage by stage, from a config alone.

A run's memory is a sequence of stages, each with its own peak; the run's peak is the largest. `memory_plan`
gives the calibration's, `pruner.runs.prune_memory.run_plan` the whole `pruner prune`'s. Parts are the arithmetic
of the model's geometry and the recipe's sizes (`pruner.runs.resources`), by where they live:

- `all` (the whole model resident on the device): the device holds the weights, one layer's running sums and
  one batch's (added in place), and one batch's activations; the host holds every layer's finished sums (the
  later stages read them), one layer's W_O^T W_O and curve-building work at a time and, when the device is a
  GPU, the weights while `from_pretrained` loads them;
- `sequential` (one block at a time, `pruner.core.layerwise`, the next one read ahead unless capture.read_ahead
  is off), in two alternating moments per layer: *a batch through a block* -- the blocks, the layer's running
  sums and a batch's, one batch's activations -- and *a finished layer's curves* (`pruner.pruning.per_layer`)
  -- its whole sums, its W_O^T W_O and the work of its curves (the refit-aware scorer's system, the cross
  energy) and of a per-layer budget's refit; throughout, every window's hidden states and what is kept of the
  finished layers (first moments, pair matrices, curves: small). Nothing of a layer's second moments is kept
  once its curves are built, so host memory does not grow with depth (docs/design.md §8.4).

On a CPU the weights are memory-mapped from the checkpoint: the page cache, which the kernel can drop, not the
process's anonymous memory; so are the refit's new output-projection columns (`pruner.core.layerwise.
file_backed`). Those parts are named "(memory-mapped ...)" and `MemoryPlan.anonymous` leaves them out: it is
what `eval/bench/prune_layerwise.py` compares with the measured peak RssAnon. On a CPU device and host are one
memory: `total` is their sum.

The constants of the working sets (how many (H d_head)^2 float64 matrices a step holds at once) are read off
the code of each step (`pruner.pruning.refit`, `scoring.cross_energy`) and checked against measured peaks.
`pruner plan-memory RECIPE` prints the stages for any model from its config.json alone (built on the meta
device: no weight is read or downloaded) and says which `capture.onload: auto` picks on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pruner.core import arch
from pruner.core.tables import markdown_table
from pruner.runs.resources import (
    BACKWARD_PER_LAYER,
    Estimate,
    Sizes,
    available_memory,
    calibration_estimate,
    finished_bytes,
    gib,
    model_shape,
    statistics_bytes,
)

MAPPED = "(memory-mapped"  # parts whose name holds this are file-backed on a CPU (page cache, not anonymous)
# (H d_head)^2 float64 matrices a finished layer's step holds at once beside its sums (read off the code):
CROSS_SQUARES = 2      # the cross energy: the covariance and one outer product (`scoring.cross_energy`)
SYSTEM_SQUARES = 3     # the refit-aware scorer: S, S + lam I and its Cholesky factor while built, then the
#                        inverse and one candidate border at a time (`refit.system`, `marginal_costs`)
REFIT_SQUARES = 4      # a refit with ridge auto: a fold's training system and held-out moment, then their
#                        kept/pruned blocks and eigenvectors (`refit.heldout_energies`); then the fit: the
#                        covariance, its blocks and the new columns (float64, full width; `refit.fit_layer`).
#                        Measured 3.57 and 2.94 at the 8B width (eval/bench/refit_memory.py; 3.80 and 4.57
#                        before the blocks were indexed directly, the symmetrising done in place and the new
#                        columns written a run of kept channels at a time)
LOGIT_COPIES = 3       # a slice of logits: the head's output, its float32 copy and the log-softmax


@dataclass(frozen=True)
class Stage:
    """One moment of a run and what it holds, by part, on the device and on the host."""

    name: str
    device: Estimate
    host: Estimate


@dataclass(frozen=True)
class MemoryPlan:
    """A run's (or a calibration's) stages; its peaks are the largest stage's."""

    onload: str
    stages: tuple[Stage, ...]
    cpu: bool  # device and host are one memory
    spill: bool = False  # the hidden states in files (capture.hidden: disk)

    def of(self, stage: Stage, anonymous: bool = False) -> int:
        """A stage's bytes: device + host on a CPU (without the memory-mapped parts with `anonymous`), else the
        larger of the two."""
        if not self.cpu:
            return max(stage.device.total, stage.host.total)
        parts = [*stage.device.parts.items(), *stage.host.parts.items()]
        return sum(v for k, v in parts if not (anonymous and MAPPED in k))

    @property
    def peak_stage(self) -> Stage:
        return max(self.stages, key=self.of)

    @property
    def total(self) -> int:
        """Peak bytes: device + host in the largest stage on a CPU; the larger of the two peaks elsewhere."""
        return self.of(self.peak_stage) if self.cpu else max(self.device.total, self.host.total)

    @property
    def anonymous(self) -> int:
        """The peak without the memory-mapped parts (a CPU: the process's anonymous memory)."""
        return max(self.of(s, anonymous=True) for s in self.stages)

    @property
    def anonymous_stage(self) -> Stage:
        return max(self.stages, key=lambda s: self.of(s, anonymous=True))

    @property
    def device(self) -> Estimate:
        """The device's parts in the stage where the device peaks."""
        return max((s.device for s in self.stages), key=lambda e: e.total)

    @property
    def host(self) -> Estimate:
        """The host's parts in the stage where the host peaks."""
        return max((s.host for s in self.stages), key=lambda e: e.total)


def block_bytes(model) -> int:
    """Bytes of one block's weights (every block is the same size)."""
    return sum(p.numel() * p.element_size() for p in arch.blocks(model)[0].parameters())


def hidden_bytes(model, tokens: int) -> int:
    """Bytes of `tokens` hidden states (d_model each) in the model's dtype: what a layer-by-layer pass keeps
    between blocks, per window token."""
    return tokens * arch.o_weight_cols(model, 0).shape[0] * next(model.parameters()).element_size()


def _square(model) -> int:
    """One (H d_head)^2 float64 matrix: the unit of a layer's second moments and of the work built on them."""
    g = arch.geometry(model)
    return (g.n_heads * g.head_dim) ** 2 * 8


def kept_bytes(model, sizes: Sizes) -> int:
    """What is kept of every finished layer: first moments, per-head sums and the pair matrices (float64), and its
    curves (a few numbers per head)."""
    s = model_shape(model)
    H, D = s["H"], s["D"]
    per_layer = 2 * sizes.pair_metrics * H * H + 16 * H + (3 * H * D + 1 if sizes.outputs else 0) + 8 * H
    return s["L"] * per_layer * 8


def whole_layer_bytes(model, sizes: Sizes) -> int:
    """One layer's finished sums, float64: pair matrices, per-head sums, output moments, the joint moment and the
    fold moments (what a finished layer holds while its curves are built)."""
    return statistics_bytes(model, sizes) // 2 // model_shape(model)["L"]


def _running_bytes(model, sizes: Sizes) -> tuple[int, int]:
    """(the layer's running sums, one batch's sums while they are added): a batch's joint product is the float32
    product and, while it is uncentred, its float64 copy (`moments.output_moments`: 1.5 squares), then the copy
    alone until it is added; the batch's other sums are small. With fold moments the joint moment is not
    accumulated (it is their sum, derived once the layer is complete) and the folds take each batch's in place,
    so a batch adds the product of one fold the same way."""
    square = _square(model)
    whole = whole_layer_bytes(model, sizes)
    derived = (square + square // model_shape(model)["H"]) if sizes.folds else 0  # joint and oo, from the folds
    running = whole - derived
    folds = sizes.folds * (square + square // model_shape(model)["H"] // model_shape(model)["D"])
    joint = square if sizes.joint and not sizes.folds else 0  # the batch's own joint: the float64 copy below
    batch = running - folds - joint + (square * 3 // 2 if (sizes.joint or sizes.folds) else 0)
    return running, batch


def finish_work(model, sizes: Sizes, systems: bool) -> int:
    """The work beside a finished layer's sums while its curves (and a per-layer budget's refit) are built: its
    W_O^T W_O (float32) and the larger of the cross energy and the refit-aware scorer's system; then, once the
    curves are built and their inputs released, a per-layer budget's refit."""
    square = _square(model)
    curves = square // 2 + int(max(CROSS_SQUARES if sizes.joint else 0, SYSTEM_SQUARES if systems else 0) * square)
    return max(curves, int(REFIT_SQUARES * square) if sizes.local else 0)  # W_O^T W_O is gone before the refit


def outside_cpu_bytes(model, samples: int, length: int, head: bool) -> int:
    """The weights outside the blocks resident on a CPU: memory-mapped, only what is read -- the embedding rows of
    the tokens, norms, and with `head` the LM head (read whole by evaluation; not by calibration)."""
    act = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    outside = weights - arch.geometry(model).n_layers * block_bytes(model)
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = out is not None and out.weight is emb
    mapped = emb.numel() * act + (0 if out is None or tied else out.weight.numel() * act)
    rows = min(emb.shape[0], samples * length) * emb.shape[1] * act
    return outside - mapped + rows + (out.weight.numel() * act if head and out is not None and not tied else 0)


def block_parts(model, read_ahead: bool, cpu: bool) -> dict[str, int]:
    one = block_bytes(model)
    tag = f" {MAPPED} from the checkpoint)" if cpu else ""
    return {f"one block{tag}": one, **({f"the next block, read ahead{tag}": one} if read_ahead else {})}


def memory_plan(model, sizes: Sizes, samples: int, onload: str, device: str = "cpu",
                systems: bool = False, spill: bool = False, read_ahead: bool = True) -> MemoryPlan:
    """The calibration's stages for `samples` windows (see the module docstring); with `systems` the refit-aware
    scorer builds a refit system per layer, with `sizes.local` a per-layer budget's refit is computed as each
    layer finishes."""
    cpu = torch.device(device).type == "cpu"
    est = calibration_estimate(model, sizes if onload == "all" else replace(sizes, gradient=False))
    parts, g = est.parts, arch.geometry(model)
    work = parts.get("activations", 0) + parts.get("capture", 0) + parts.get("gradient pass", 0)
    running, batch = _running_bytes(model, sizes)
    curves = {"a finished layer's curves being built (W_O^T W_O and their work)": finish_work(model, sizes, systems)}
    if onload == "all":
        whole = finished_bytes(model, sizes)  # kept for the stages after it, in capture.moments
        dev = Estimate({"weights": parts["model"], "one layer's running sums": running, "one batch's sums": batch,
                        "one batch": work})
        host = Estimate({"finished sums of every layer": whole, **curves,
                         **({} if cpu else {"weights while loading": parts["model"]})})
        return MemoryPlan(onload, (Stage("calibration", dev, host),), cpu)
    hidden = {"hidden states: one batch (every window's in files: capture.hidden disk)":
              hidden_bytes(model, sizes.batch_size * sizes.length)} if spill else \
        {"hidden states of every window": hidden_bytes(model, (samples + sizes.batch_size) * sizes.length)}
    outside = {(f"weights outside the blocks {MAPPED}: the rows read)" if cpu else "weights outside the blocks"):
               outside_cpu_bytes(model, samples, sizes.length, False) if cpu else
               parts["model"] - g.n_layers * block_bytes(model)}
    blocks = block_parts(model, read_ahead, cpu)
    kept = {"what is kept of the finished layers (first moments, pairs, curves)": kept_bytes(model, sizes)}
    through = Stage("calibration: a batch through a block",
                    Estimate({**outside, **blocks, "the layer's running sums": running, "one batch's sums": batch,
                              "one batch": work}),
                    Estimate({**hidden, **kept}))
    whole = {"a finished layer's whole sums": whole_layer_bytes(model, sizes)}
    finished = Stage("calibration: a finished layer's curves", Estimate({**outside, **blocks}),
                     Estimate({**hidden, **kept, **whole, **curves}))
    stages = [through, finished]
    if sizes.gradient:
        stages.append(_gradient_stage(model, sizes, samples, outside, blocks, kept, spill))
    return MemoryPlan(onload, tuple(stages), cpu, spill)


def _gradient_stage(model, sizes: Sizes, samples: int, outside: dict, blocks: dict, kept: dict,
                    spill: bool) -> Stage:
    """The layer-by-layer gradient pass (`pruner.pruning.layerwise.gradient_layerwise`): on the host every block's
    input for every window (layer x windows x T x d_model, the model's dtype) and the gradients being handed
    down; on the device one batch backpropagated through one block (its activations, attention weights and
    MLP) or through the LM head (the logits, float32). With `spill` the inputs and gradients are in files."""
    s = model_shape(model)
    a = next(model.parameters()).element_size()
    B, T = sizes.batch_size, sizes.length
    inputs = hidden_bytes(model, (s["L"] + 1) * samples * T)
    name = "every block's inputs (gradient pass)"
    if spill:  # in files: the batch being written
        inputs, name = hidden_bytes(model, B * T), "every block's inputs (gradient pass): one batch (the rest in files)"
    backward = max(B * (BACKWARD_PER_LAYER * T * s["d"] * a + s["H"] * T * T * 4 + 3 * T * s["ffn"] * a),
                   3 * B * T * s["V"] * 4)
    return Stage("gradient pass", Estimate({**outside, **blocks, "one batch backpropagated": backward}),
                 Estimate({**kept, name: inputs}))


def check_sequential(model, sizes: Sizes, samples: int, device: str = "cpu", systems: bool = False,
                     hidden: str = "memory", read_ahead: bool = True) -> MemoryPlan:
    """Refuse, before any compute, a layer-by-layer calibration whose peak exceeds what is free -- on the
    device and on the host (one memory on a CPU) -- naming the settings that would fit. The weights outside
    the blocks are already loaded. `hidden` (capture.hidden): "disk" plans the hidden states in files; "auto"
    plans them in memory where that fits and in files where only that does. Returns the plan (`spill`:
    whether its hidden states go to files)."""
    from pruner.runs.resources import ResourceError

    def short(z: Sizes, n: int, sys: bool, spill: bool) -> list[str]:  # where it does not fit: "host needs X, Y free"
        plan = memory_plan(model, z, n, "sequential", device, sys, spill, read_ahead)
        outside = next(v for k, v in plan.device.parts.items() if k.startswith("weights outside the blocks"))
        checks = [("memory", plan.total - outside, available_memory("cpu"))] if plan.cpu else \
            [(str(device), plan.device.total - outside, available_memory(device)),
             ("host", plan.host.total, available_memory("cpu"))]
        return [f"{where} needs about {gib(need)} more and has {gib(free)} free" for where, need, free in checks
                if free is not None and need > free]

    spill = hidden == "disk"
    missing = short(sizes, samples, systems, spill)
    if missing and hidden == "auto" and not short(sizes, samples, systems, True):
        missing, spill = [], True  # the hidden states to files: that alone makes it fit
    if not missing:
        return memory_plan(model, sizes, samples, "sequential", device, systems, spill, read_ahead)
    options, n = _alternatives(sizes, samples, systems, spill, short)
    fits = [name for name, *option in options if not short(*option)]
    if not fits and options:  # none alone: all of them together?
        if not short(replace(sizes, folds=0, local=False), max(n, 1), False, True):
            fits = [" and ".join(name for name, *_ in options)]
    raise ResourceError(f"not enough memory for the layer-by-layer calibration: the {'; the '.join(missing)}; "
                        + ("set " + ", or ".join(fits) if fits else "no setting here fits this machine: use one "
                           "with more memory (`pruner plan-memory RECIPE` shows the parts)"))


def _alternatives(sizes: Sizes, samples: int, systems: bool, spill: bool, short) -> tuple[list[tuple], int]:
    """The settings a refused layer-by-layer calibration could change, each as (what to set, and `short`'s
    arguments with it set), and the largest halved sample count that fits (0 when none does)."""
    options = [] if spill else [("capture.hidden: disk (every window's hidden states in files under "
                                 "capture.spill_dir)", sizes, samples, systems, True)]
    if sizes.folds:
        options.append(("surgery.ridge: a number such as 0.1 instead of auto (no fold moments)",
                        replace(sizes, folds=0), samples, systems, spill))
    if sizes.local:
        options.append(("surgery.compensation: mean (no refit per layer)", replace(sizes, folds=0, local=False,
                                                                               joint=systems), samples, systems, spill))
    if systems:
        options.append(("scorer.name: sink-aware (no refit system per layer)", sizes, samples, False, spill))
    n = samples // 2
    while n >= 1 and short(sizes, n, systems, spill):
        n //= 2
    if n >= 1:
        options.append((f"calibration.num_samples: {n} (fewer hidden states kept)", sizes, n, systems, spill))
    return options, n


def meta_model(config):
    """A model of `config` on the meta device: every shape, no memory, no weights read."""
    from accelerate import init_empty_weights

    from pruner.core.runtime import auto_class

    with init_empty_weights():
        return auto_class(config).from_config(config, attn_implementation="sdpa")


def render(plans: list[MemoryPlan], device: str, chosen: str) -> str:
    """The plans as tables (GiB by stage and part, each stage's peak), the peaks, and what `auto` chooses here."""
    out = []
    for p in plans:
        rows = []
        for s in p.stages:
            for where, est in (("device", s.device), ("host", s.host)):
                rows += [[s.name, where, part, gib(n)] for part, n in est.parts.items()]
            rows.append([s.name, "device + host" if p.cpu else "device / host", "**peak**",
                         f"**{gib(p.of(s))}**" if p.cpu else f"**{gib(s.device.total)} / {gib(s.host.total)}**"])
        peak = p.peak_stage
        line = (f"capture.onload: {p.onload}: peak {gib(p.total)} ({peak.name})" if p.cpu else
                f"capture.onload: {p.onload}: device peak {gib(p.device.total)}, host peak {gib(p.host.total)}")
        if p.cpu and p.anonymous != p.total:
            line += (f"; without the memory-mapped parts (page cache: the weights, refit's new columns) "
                     f"{gib(p.anonymous)} ({p.anonymous_stage.name})")
        out.append(markdown_table(["stage", "where", "part", "bytes"], rows) + "\n\n" + line)
    free = available_memory(device)
    note = (f"free now on {device}: {gib(free)}; capture.onload: auto picks `{chosen}` here" if free is not None
            else f"{device} is not on this machine: capture.onload: auto decides on the machine that runs it"
            + (f" (`{chosen}` is set)" if chosen in ("all", "sequential") else ""))
    return "\n\n".join(out) + "\n\n" + note
