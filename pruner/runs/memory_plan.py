"""The memory a calibration will take, per device and for the host, in each onload mode, from a config alone.

`memory_plan` adds up the peaks of `pruner.runs.resources` by where they live:

- `all` (the whole model resident on the device): the device holds the weights, every layer's sums
  (twice: the total and the batch being added) and one batch's activations; the host holds the
  finished sums (float64), every layer's W_O^T W_O (float32, `pruner.pruning.calibrate.layer_grams`) and,
  when the device is a GPU, the weights while `from_pretrained` loads them;
- `sequential` (one block at a time, `pruner.core.layerwise`): the device holds the weights outside
  the blocks (embeddings, final norm, LM head), one block, one layer's sums (on a CPU only the batch's
  copy: the total is already one of the host's finished sums) and one batch's activations; the host holds every calibration window's hidden states (plus the batch being
  replaced), the finished layers' sums and their W_O^T W_O.

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
from pruner.runs.resources import Estimate, Sizes, available_memory, calibration_estimate, gib, statistics_bytes


@dataclass(frozen=True)
class MemoryPlan:
    onload: str
    device: Estimate
    host: Estimate
    cpu: bool  # device and host are one memory

    @property
    def total(self) -> int:
        return self.device.total + self.host.total if self.cpu else max(self.device.total, self.host.total)


def block_bytes(model) -> int:
    """Bytes of one block's weights (every block is the same size)."""
    return sum(p.numel() * p.element_size() for p in arch.blocks(model)[0].parameters())


def memory_plan(model, sizes: Sizes, samples: int, onload: str, device: str = "cpu",
                systems: bool = False) -> MemoryPlan:
    """Peak bytes by part on the device and on the host for a calibration of `samples` windows (see above),
    and with `systems` (the refit-aware scorer) the selection after it: every layer's float64 refit precision
    (S + lam I)^-1 beside the sums, and one layer's second moment and Cholesky factor while it is built."""
    cpu = torch.device(device).type == "cpu"
    est = calibration_estimate(model, replace(sizes, gradient=False))
    parts, g = est.parts, arch.geometry(model)
    work = parts.get("activations", 0) + parts.get("capture", 0)
    sums = statistics_bytes(model, sizes) // 2  # the finished sums (the estimate counts them twice)
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
    d_model = arch.o_weight_cols(model, 0).shape[0]
    act = next(model.parameters()).element_size()
    hidden = (samples + sizes.batch_size) * sizes.length * d_model * act
    # on a CPU the layer's total becomes one of the finished sums where it is: only the batch's copy is extra
    layer_sums = {"one layer's batch sums": sums // g.n_layers} if cpu else \
        {"one layer's sums (total + batch)": 2 * sums // g.n_layers}
    dev = Estimate({"weights outside the blocks": parts["model"] - g.n_layers * one, "one block": one,
                    **layer_sums, "one batch": work})
    host = Estimate({"hidden states of every window": hidden, "finished sums": sums,
                     "W_O^T W_O of every layer": grams, **scoring})
    return MemoryPlan(onload, dev, host, cpu)


def after_plan(model, windows: int | None, length: int) -> str:
    """What the stages after the plan hold (a note under the table), with the blocks on disk: perplexity
    (`prune` and `compare`) keeps every evaluation window's hidden states on the host and one block on the
    device (`pruner.evaluation.perplexity.window_scores`); `prune` writes model/ a block at a time and reads it
    back the same way (`pruner.checkpoints.streamed`: the weights outside the blocks twice, the written copy's
    and the base's, and one block)."""
    g = arch.geometry(model)
    d_model = arch.o_weight_cols(model, 0).shape[0]
    act = next(model.parameters()).element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    outside = weights - g.n_layers * block_bytes(model)
    hidden = "" if windows is None else \
        f": host {gib(windows * length * d_model * act)} of hidden states ({windows} windows x {length} tokens),"
    return (f"after the plan, with the blocks on disk: `pruner prune` and `pruner compare` evaluate one block at a "
            f"time{hidden} device {gib(outside + block_bytes(model))} of weights (outside the blocks + one block) "
            f"and one batch; `prune` writes model/ ({gib(weights)} before pruning) a block at a time and reads it "
            f"back the same way: {gib(2 * outside + block_bytes(model))} of weights (outside the blocks twice + "
            "one block); evaluation.tasks, latency and bench need the whole model")


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
