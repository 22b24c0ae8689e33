"""The recovery loop: distil the teacher into the student on the recovery windows, guarded by a held-back slice.

Plumbing around one hand-written piece (the loss): torch's AdamW, transformers' schedules,
PEFT's LoRA. The student trains in float32 (weights, gradients, optimizer state; the loss
too) whatever its checkpoint stores, so a bf16/fp16 checkpoint never meets a NaN from
half-precision sums. It trains in eval mode (no dropout): the only randomness left is the
data order, fixed by the seed, so a resumed recovery is the uninterrupted one.

Several processes (`torchrun`, `accelerate launch`) split each batch's windows rank::world;
each backpropagates its share of the batch's KL sum divided by the whole batch's token
count, and the gradients are summed across processes: the gradient of one process on the
whole batch, up to float summation order. With `recovery.fsdp` the student's training state is
sharded over the processes instead of replicated (`sharding`): the same gradient, 1/N of the
memory for weights, gradients and AdamW state.

The guard: the validation KL is measured before the first step (the pruned model's), every
`eval_every` tokens and at the end; the best weights are kept, and when no step improves
on the pruned model the pruned weights are kept and the record says so.

Restarts: AdamW's first steps move every weight by about the learning rate whatever its
gradient's size, so a student already close to its teacher can be thrown further off than
recovery could ever win back. A pass more than `DRIFT` times the pruned model's validation KL,
before any pass beat it, is that: the student is then further from the teacher than the pruned
model by more than the pruned model's whole distance. The run goes back to the pruned weights
and a fresh AdamW at the learning rate x `BACKOFF`, its schedule over the steps left (on the
windows it had not reached: the token budget stays the budget), at most `recovery.restarts`
times. Chosen on the validation slice only (docs/recovery.md: every run of the learning-rate
table whose first pass went past 2x never came back below the pruned model; most below 2x did).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pruner.core import data, distributed, resume
from pruner.core.runtime import input_device
from pruner.recovery import loss, methods, sharding
from pruner.recovery.data import RecoveryError, Windows
from pruner.recovery.spec import RecoverySpec
from pruner.recovery.teacher import forward_logits

STAGE = "recovery"
DRIFT = 2.0  # a pass above DRIFT x the pruned model's validation KL, before any beat it, restarts the run
BACKOFF = 10 ** -0.5  # each restart's learning rate: the last one's / sqrt(10) (1e-4 -> 3.2e-5 -> 1e-5)


@dataclass
class Options:
    """What the caller knows beyond the recipe section."""

    checkpoints: resume.Checkpoints = resume.NONE
    dense_heads: dict[int, list[int]] | None = None  # a dense (mask) student's pruned heads: they stay zero
    progress: bool = True


@dataclass
class Trained:
    model: object
    record: dict = field(default_factory=dict)


def cadence(spec: RecoverySpec, steps: int) -> tuple[int, int]:
    """(steps between validation passes, steps between checkpoints)."""
    per = spec.window_tokens
    every = max(1, (spec.eval_every // per) if spec.eval_every else steps // 8)
    save = max(1, spec.save_every // per) if spec.save_every else every
    return every, save


def _mine(rows: torch.Tensor) -> torch.Tensor:
    return rows[distributed.rank()::distributed.world_size()]


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    if distributed.world_size() > 1:
        dist.all_reduce(x)
    return x


def batch_kl(model, targets, windows: data.TokenBatch, rows: torch.Tensor, spec: RecoverySpec, offset: int = 0):
    """This process's share of a batch: (KL sum [+ CE], real-token count) over `rows` of `windows`."""
    mine = _mine(rows)
    idle = not len(mine)
    dev = input_device(model)  # the windows stay on the CPU; each batch goes to the student's device
    if idle and not sharding.active(spec):
        return torch.zeros((), device=dev), torch.zeros((), device=dev)
    if idle:  # FSDP: every process runs every forward; this one's row weighs nothing
        mine = sharding.idle_rows(rows)
    b = data.TokenBatch(windows.input_ids[mine].to(dev), windows.attention_mask[mine].to(dev))
    logits = forward_logits(model, b.input_ids, b.attention_mask)  # (b, T, V)
    kl, count = targets.kl(logits, mine + offset, b)
    if spec.ce_weight:
        kl = kl + spec.ce_weight * loss.next_token_ce(logits, b.input_ids, b.attention_mask)
    return (kl * 0, torch.zeros((), device=dev)) if idle else (kl, count)


@torch.no_grad()
def validation_kl(model, targets, windows: Windows, spec: RecoverySpec, offset: int) -> float:
    """Mean KL per real token on the held-back windows (rows `offset`.. in the teacher cache)."""
    dev = input_device(model)  # NCCL sums tensors on the GPU
    total, count = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(2))
    n = len(windows.validation)
    for i in range(0, n, spec.batch_size):
        kl, c = batch_kl(model, targets, windows.validation, torch.arange(i, min(i + spec.batch_size, n)), spec,
                         offset)
        total += kl.double()
        count += c.double()
    return float(_all_sum(total) / _all_sum(count).clamp_min(1))


def _optimizer(model, spec: RecoverySpec, lr: float, steps: int):
    """A fresh AdamW at `lr` and its schedule over `steps` steps."""
    from transformers import get_scheduler

    params = list(methods.trainable(model).values())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay, foreach=False)
    sched = get_scheduler(spec.schedule, opt, num_warmup_steps=int(spec.warmup * steps), num_training_steps=steps)
    return opt, sched


def _weights(model, clone: bool = True) -> dict[str, torch.Tensor]:
    """The trained weights: a copy, or (`clone` False, for a checkpoint written at once) the tensors themselves."""
    sharding.settle(model)  # sharded: the parameters as shards, as they are stepped and loaded
    return {n: p.detach().clone() if clone else p.detach() for n, p in methods.trainable(model).items()}


@torch.no_grad()
def _copy_into(to: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    for n, w in weights.items():
        to[n].copy_(w)


def _load_weights(model, weights: dict[str, torch.Tensor]) -> None:
    params = methods.trainable(model)
    with torch.no_grad():
        for n, w in weights.items():
            params[n].copy_(w)


def step(model, targets, windows: Windows, rows: torch.Tensor, spec: RecoverySpec, opt, sched) -> float:
    """One optimizer step on the batch `rows`; returns its mean KL (over every process)."""
    kl, count = batch_kl(model, targets, windows.train, rows, spec)
    total = _all_sum(count.detach().clone().double()).clamp_min(1)
    sharded = sharding.active(spec)
    if kl.requires_grad:  # a process without windows in this batch has nothing to backpropagate
        # FSDP averages the gradients over the processes; each loss is a share of the batch's mean: x N sums them
        (kl / total.float() * (distributed.world_size() if sharded else 1)).backward()
    params = list(methods.trainable(model).values())
    if distributed.world_size() > 1 and not sharded:
        for p in params:
            if p.grad is None:  # a process without windows in this batch
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(_all_sum(kl.detach().double()) / total)


def _state(model, opt, sched, k: int, guard: dict) -> dict:
    """What a checkpoint holds (this process's shards as plain tensors when the student is sharded)."""
    return sharding.to_local({"step": k, "weights": _weights(model, clone=False), "optimizer": opt.state_dict(),
                              "scheduler": sched.state_dict(), "guard": guard})


def _resume(model, spec: RecoverySpec, steps: int, checkpoints: resume.Checkpoints):
    """(first step, guard, AdamW, schedule) from a saved checkpoint (after a restart: the restarted
    optimizer's), or (0, None, fresh AdamW, schedule) for a fresh start."""
    saved = checkpoints.load(STAGE)
    guard = saved["guard"] if saved is not None else None
    if guard and guard.get("method", spec.method) != spec.method:  # an unset method is decided by free memory
        raise RecoveryError(f"the recovery to resume trained with method {guard['method']}, this one would train "
                            f"with {spec.method}: set recovery.method: {guard['method']} to resume it")
    lr, since = (guard["lr"], guard["since"]) if guard else (spec.peak_lr(), 0)
    opt, sched = _optimizer(model, spec, lr, steps - since)
    if saved is None:
        return 0, None, opt, sched
    params = methods.trainable(model)

    def as_params(ws):
        return {n: sharding.like(w, params[n]) for n, w in ws.items()}  # (shards: DTensors)

    _load_weights(model, as_params(saved["weights"]))
    saved["guard"]["best_weights"] = as_params(saved["guard"]["best_weights"])
    opt.load_state_dict(sharding.optimizer_state(saved["optimizer"], list(params.values())))
    sched.load_state_dict(saved["scheduler"])
    return saved["step"], guard, opt, sched


def _validate(model, targets, windows: Windows, spec: RecoverySpec, guard: dict, k: int) -> None:
    """A validation pass after step `k`: the history, and the best weights so far."""
    v = validation_kl(model, targets, windows, spec, len(windows.train))
    guard["history"].append([k, v])
    if v < guard["best"]:  # into the best copy's own buffers: never two copies at once
        _copy_into(guard["best_weights"], _weights(model, clone=False))
        guard.update(best=v, best_step=k)


def drifted(guard: dict, spec: RecoverySpec) -> bool:
    """Whether the last pass found the student thrown off (module docstring) with a restart left."""
    return (len(guard["restarts"]) < spec.restarts and guard["best_step"] == 0
            and guard["history"][-1][1] > DRIFT * guard["pruned"])


def _restart(model, spec: RecoverySpec, guard: dict, k: int, steps: int):
    """Back to the pruned weights (the guard's best: no pass beat them) with a fresh AdamW at a lower
    learning rate, its schedule over the steps after `k`. Returns (AdamW, schedule)."""
    _load_weights(model, guard["best_weights"])
    guard.update(lr=guard["lr"] * BACKOFF, since=k)
    guard["restarts"].append([k, guard["lr"]])
    return _optimizer(model, spec, guard["lr"], steps - k)


def _restart_note(guard: dict) -> str:
    first = guard["restarts"][0][0]
    v = dict(guard["history"])[first]
    lrs = ", ".join(f"{lr:.2g} at step {k}" for k, lr in guard["restarts"])
    return (f"validation KL {v:.4f} after step {first}, more than {DRIFT:g}x the pruned model's "
            f"({guard['pruned']:.4f}): restarted from the pruned weights at learning rate {lrs}")


def train(student, targets, windows: Windows, spec: RecoverySpec, options: Options | None = None) -> Trained:
    """Distil into `student` (in place; the returned model is the one to save) and say what happened."""
    options = options or Options()
    model = methods.prepare(student, spec.method, options.dense_heads, spec.lora_rank, spec.lora_alpha, spec.seed)
    plain = _sharded(model, spec, options)
    steps = len(windows.train) // spec.batch_size
    every, save_every = cadence(spec, steps)
    start, guard, opt, sched = _resume(model, spec, steps, options.checkpoints)
    if guard is None:
        v0 = validation_kl(model, targets, windows, spec, len(windows.train))
        guard = {"pruned": v0, "best": v0, "best_step": 0, "best_weights": _weights(model), "history": [[0, v0]],
                 "lr": spec.peak_lr(), "since": 0, "restarts": [], "method": spec.method}
    model.eval()  # no dropout: the data order is the only randomness
    bar = tqdm(total=steps, initial=start, desc="recovery", unit="step", disable=not options.progress)
    t0, last = time.perf_counter(), float("nan")
    for k in range(start, steps):
        rows = torch.arange(k * spec.batch_size, (k + 1) * spec.batch_size)
        last = step(model, targets, windows, rows, spec, opt, sched)
        methods.keep_pruned_zero(model, None if spec.method == "lora" else options.dense_heads)  # lora: frozen
        done = k + 1
        if done % every == 0 or done == steps:
            _validate(model, targets, windows, spec, guard, done)
            if done < steps and drifted(guard, spec):
                opt, sched = _restart(model, spec, guard, done, steps)
                if options.progress and distributed.is_main():
                    bar.write(f"recovery: {_restart_note(guard)}")
        rate = (done - start) * spec.window_tokens / max(time.perf_counter() - t0, 1e-9)
        bar.update(1)
        bar.set_postfix(tok_s=f"{rate:.0f}", loss=f"{last:.4f}", val_kl=f"{guard['history'][-1][1]:.4f}")
        if options.checkpoints.active and done % save_every == 0 and done < steps:
            options.checkpoints.save(STAGE, _state(model, opt, sched, done, guard))
        resume.kill_point(f"{STAGE}:{done}")
    bar.close()
    seconds = time.perf_counter() - t0
    _load_weights(model, guard["best_weights"])  # the best validation step (step 0: the pruned weights)
    if plain is not None:
        model = sharding.unsharded(model, plain)
    return Trained(methods.finish(model, spec.method), _record(guard, spec, steps, start, last, seconds))


def _sharded(model, spec: RecoverySpec, options: Options):
    """recovery.fsdp: the model sharded in place; returns its unsharded skeleton to gather it into after (None
    without fsdp). A dense (mask) student is refused but with lora."""
    if not sharding.active(spec):
        return None
    if options.dense_heads and spec.method != "lora":
        raise RecoveryError(f"recovery.fsdp trains a dense (mask) student with lora only: {spec.method} keeps its "
                            "pruned heads at zero in whole weights; set recovery.method: lora, or recover it "
                            "without fsdp")
    plain = sharding.skeleton(model)
    sharding.shard(model)
    return plain


def _record(guard: dict, spec: RecoverySpec, steps: int, start: int, last: float, seconds: float) -> dict:
    """What the training did: steps, validation KL history, restarts, which weights were kept, and its notes."""
    improved = guard["best"] < guard["pruned"]
    record = {"steps": steps, "steps_run": steps - start, "tokens": steps * spec.window_tokens,
              "validation_kl_pruned": guard["pruned"], "validation_kl_best": guard["best"],
              "best_step": guard["best_step"], "validation_history": guard["history"],
              "lr": guard["lr"], "restarts": guard["restarts"],
              "kept": "recovered" if improved else "pruned", "last_loss": last,
              "seconds": round(seconds, 2),
              "tokens_per_second": round((steps - start) * spec.window_tokens / max(seconds, 1e-9), 1)}
    notes = [_restart_note(guard)] if guard["restarts"] else []
    if not improved:
        notes.append(f"recovery did not improve the validation KL of the pruned model "
                     f"({guard['pruned']:.4f}): the pruned weights are kept")
    if notes:
        record["note"] = "; ".join(notes)
    return record
