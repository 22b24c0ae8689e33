"""The memory a calibration will take, per device and for the host, in each onload mode, from a config alone.

`memory_plan` adds up the peaks of `pruner.runs.resources` by where they live:

- `all` (the whole model resident on the device): the device holds the weights, every layer's sums
  (twice: the total and the batch being added) and one batch's activations; the host holds the
  finished sums (float64), every layer's W_O^T W_O (float32, `pruner.pruning.calibrate.layer_grams`) and,
  when the device is a GPU, the weights while `from_pretrained` loads them;
- `sequential` (one block at a time, `pruner.core.layerwise`, and the next one read ahead unless
  capture.read_ahead is off): the device holds the weights outside the blocks (embeddings, final norm, LM head; on a CPU they stay memory-mapped from the checkpoint and
  only what is read is resident: the embedding rows of the calibration tokens, no LM head), one block, one layer's sums (on a CPU only the batch's
  copy: the total is already one of the host's finished sums) and one batch's activations; the host holds every calibration window's hidden states (plus the batch being
  replaced), the finished layers' sums and their W_O^T W_O.

With the gradient scorer the sequential host also keeps every block's input for every window while the
backward pass runs a block at a time (`pruner.pruning.layerwise.gradient_layerwise`).

The refit-aware scorer (`refit-energy`, the decoder default) then keeps every layer's float64 refit
precision while it selects: as much again as the joint second moments (`--set scorer.name=sink-aware`
does without).

On a CPU run device and host are one memory: `total` is their sum. `pruner plan-memory RECIPE` prints
both modes for any model from its config.json alone (built on the meta device: no weight is read or
downloaded) and says which `capture.onload: auto` picks on this machine.
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


@dataclass(frozen=True)
class MemoryPlan:
    onload: str
    device: Estimate
    host: Estimate
    cpu: bool  # device and host are one memory
    spill: bool = False  # the hidden states in files (capture.hidden: disk)

    @property
    def total(self) -> int:
        return self.device.total + self.host.total if self.cpu else max(self.device.total, self.host.total)


def block_bytes(model) -> int:
    """Bytes of one block's weights (every block is the same size)."""
    return sum(p.numel() * p.element_size() for p in arch.blocks(model)[0].parameters())


def hidden_bytes(model, tokens: int) -> int:
    """Bytes of `tokens` hidden states (d_model each) in the model's dtype: what a layer-by-layer pass keeps
    between blocks, per window token."""
    return tokens * arch.o_weight_cols(model, 0).shape[0] * next(model.parameters()).element_size()


def memory_plan(model, sizes: Sizes, samples: int, onload: str, device: str = "cpu",
                systems: bool = False, spill: bool = False, read_ahead: bool = True) -> MemoryPlan:
    """Peak bytes by part on the device and on the host for a calibration of `samples` windows (see above),
    and with `systems` (the refit-aware scorer) the selection after it: every layer's float64 refit precision
    (S + lam I)^-1 beside the sums, and one layer's second moment and Cholesky factor while it is built."""
    cpu = torch.device(device).type == "cpu"
    est = calibration_estimate(model, sizes if onload == "all" else replace(sizes, gradient=False))
    parts, g = est.parts, arch.geometry(model)
    work = parts.get("activations", 0) + parts.get("capture", 0) + parts.get("gradient pass", 0)  # the larger
    sums = finished_bytes(model, sizes)  # the finished sums (the estimate counts them twice, float64)
    layer = statistics_bytes(model, sizes) // 2 // g.n_layers  # one layer's sums while they accumulate (float64)
    grams = g.n_layers * (g.n_heads * g.head_dim) ** 2 * 4  # W_O^T W_O per layer, float32
    square = (g.n_heads * g.head_dim) ** 2 * 8  # one layer's (H d_head)^2 float64 matrix
    scoring = {"refit-aware scorer's systems (every layer + one being built)": (g.n_layers + 3) * square} \
        if systems else {}
    if onload == "all":
        dev = Estimate({"weights": parts["model"], "sums (total + batch)": parts["statistics"], "one batch": work})
        host = Estimate({"finished sums": sums, "W_O^T W_O of every layer": grams, **scoring,
                         **({} if cpu else {"weights while loading": parts["model"]})})
        return MemoryPlan(onload, dev, host, cpu)
    one = block_bytes(model)
    act = next(model.parameters()).element_size()
    batch_hidden = hidden_bytes(model, sizes.batch_size * sizes.length)
    hidden = {"hidden states: one batch (every window's in files: capture.hidden disk)": batch_hidden} if spill \
        else {"hidden states of every window": hidden_bytes(model, samples * sizes.length) + batch_hidden}
    # on a CPU the layer's total becomes one of the finished sums where it is: only the batch's copy is extra
    layer_sums = {"one layer's batch sums": layer} if cpu else {"one layer's sums (total + batch)": 2 * layer}
    outside = parts["model"] - g.n_layers * one
    blocks = {"one block": one, **({"the next block (read ahead)": one} if read_ahead else {})}
    if cpu:  # memory-mapped from the checkpoint: resident as read (embedding rows of the tokens; no LM head yet)
        emb = model.get_input_embeddings().weight
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        tied = head is not None and head.weight is emb
        mapped = emb.numel() * act + (0 if head is None or tied else head.weight.numel() * act)
        rows = min(emb.shape[0], samples * sizes.length)
        dev = Estimate({"weights outside the blocks (memory-mapped: the rows read)": outside - mapped + rows *
                        emb.shape[1] * act, **blocks, **layer_sums, "one batch": work})
    else:
        dev = Estimate({"weights outside the blocks": outside, **blocks, **layer_sums, "one batch": work})
    host = Estimate({**hidden, "finished sums": sums, "W_O^T W_O of every layer": grams, **scoring})
    if sizes.gradient:  # after the capture: every block's inputs kept for the backward, one batch through a block
        dev, host = _with_gradient(model, sizes, samples, dev, host, spill)
    return MemoryPlan(onload, dev, host, cpu, spill)


def _with_gradient(model, sizes: Sizes, samples: int, dev: Estimate, host: Estimate,
                   spill: bool = False) -> tuple[Estimate, Estimate]:
    """The layer-by-layer gradient pass (`pruner.pruning.layerwise.gradient_layerwise`) added to a sequential
    plan: on the host every block's input for every window (layer x windows x T x d_model, the model's dtype)
    and the gradients being handed down (windows x T x d_model); on the device the larger of the capture's
    batch and one batch backpropagated through one block (its activations, attention weights and MLP) or
    through the LM head (the logits, float32). With `spill` the inputs and gradients are in files."""
    s = model_shape(model)
    a = next(model.parameters()).element_size()
    B, T = sizes.batch_size, sizes.length
    inputs = hidden_bytes(model, (s["L"] + 1) * samples * T)
    name = "every block's inputs (gradient pass)"
    if spill:  # in files: the batch being written
        inputs, name = hidden_bytes(model, B * T), "every block's inputs (gradient pass): one batch (the rest in files)"
    backward = max(B * (BACKWARD_PER_LAYER * T * s["d"] * a + s["H"] * T * T * 4 + 3 * T * s["ffn"] * a),
                   3 * B * T * s["V"] * 4)
    dev_parts = dict(dev.parts)
    dev_parts["one batch"] = max(dev_parts["one batch"], backward)
    return Estimate(dev_parts), Estimate({**host.parts, name: inputs})


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
    options = [] if spill else [("capture.hidden: disk (every window's hidden states in files under "
                                 "capture.spill_dir)", sizes, samples, systems, True)]
    if sizes.moments == "float64":
        options.append(("capture.moments: float32 (the joint moments stored in half)", replace(sizes, moments="float32"),
                        samples, systems, spill))
    if sizes.folds:
        options.append(("surgery.ridge: a number such as 0.1 instead of auto (no fold moments)",
                        replace(sizes, folds=0), samples, systems, spill))
    if systems:
        options.append(("scorer.name: sink-aware (no refit system per layer)", sizes, samples, False, spill))
    n = samples // 2
    while n >= 1 and short(sizes, n, systems, spill):
        n //= 2
    if n >= 1:
        options.append((f"calibration.num_samples: {n} (fewer hidden states kept)", sizes, n, systems, spill))
    fits = [name for name, *option in options if not short(*option)]
    if not fits and options:  # none alone: all of them together?
        if not short(replace(sizes, moments="float32", folds=0), max(n, 1), False, True):
            fits = [" and ".join(name for name, *_ in options)]
    raise ResourceError(f"not enough memory for the layer-by-layer calibration: the {'; the '.join(missing)}; "
                        + ("set " + ", or ".join(fits) if fits else "no setting here fits this machine: use one "
                           "with more memory (`pruner plan-memory RECIPE` shows the parts)"))


def after_plan(model, windows: int | None, length: int, batch: int = 8, read_ahead: bool = True) -> str:
    """What the stages after the plan hold (a note under the table), with the blocks on disk: perplexity
    (`prune` and `compare`) keeps every evaluation window's hidden states on the host and one block (two
    with `read_ahead`) on the device (`pruner.evaluation.perplexity.window_scores`); `prune` writes model/ a
    block at a time and reads it back the same way (`pruner.checkpoints.streamed`: the weights outside the
    blocks twice, the written copy's and the base's, and the blocks)."""
    g = arch.geometry(model)
    act = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    one = block_bytes(model)
    outside = weights - g.n_layers * one
    blocks, which = (2 * one, "two blocks: one runs, one is read ahead") if read_ahead else (one, "one block")
    hidden = "" if windows is None else \
        f": host {gib(hidden_bytes(model, windows * length))} of hidden states ({windows} windows x {length} tokens),"
    vocab = getattr(model.config, "vocab_size", 0) or 0
    logits = batch * length * vocab * (act + 8)  # the LM head's output, its float32 copy and log-softmax
    return (f"after the plan, with the blocks on disk: `pruner prune` and `pruner compare` evaluate one block at a "
            f"time{hidden} device {gib(outside + blocks)} of weights (outside the blocks + {which}) "
            f"and one batch ({gib(logits)} of logits); `prune` writes model/ ({gib(weights)} before pruning) a block "
            f"at a time and reads it back the same way: {gib(2 * outside + blocks)} of weights (outside the blocks "
            f"twice + {which}); evaluation.tasks, latency and bench need the whole model")


def meta_model(config):
    """A model of `config` on the meta device: every shape, no memory, no weights read."""
    from accelerate import init_empty_weights

    from pruner.core.runtime import auto_class

    with init_empty_weights():
        return auto_class(config).from_config(config, attn_implementation="sdpa")


def render(plans: list[MemoryPlan], device: str, chosen: str) -> str:
    """The plans as a table (GiB by part), and what `auto` chooses here."""
    rows = []
    for p in plans:
        for where, est in (("device", p.device), ("host", p.host)):
            rows += [[p.onload, where, part, gib(n)] for part, n in est.parts.items()]
            rows.append([p.onload, where, "**peak**", f"**{gib(est.total)}**"])
        if p.cpu:
            rows.append([p.onload, "device + host (one memory on the CPU)", "**peak**", f"**{gib(p.total)}**"])
    free = available_memory(device)
    note = (f"free now on {device}: {gib(free)}; capture.onload: auto picks `{chosen}` here" if free is not None
            else f"{device} is not on this machine: capture.onload: auto decides on the machine that runs it"
            + (f" (`{chosen}` is set)" if chosen in ("all", "sequential") else ""))
    return markdown_table(["onload", "where", "part", "bytes"], rows) + "\n\n" + note
