"""Several processes (`accelerate launch`, `torchrun`): shard the samples, reduce the sums exactly.

Plumbing only. Statistics, gradient importances and NLLs are sums over samples,
so each process takes every `world`-th sample (rank r: samples r, r + world, ...)
and the partial sums are gathered and added in rank order on every process: the
same reduction, bit for bit, on all of them, whatever the transport. Per-sample
results (window NLLs) are gathered back into sample order instead, so everything
downstream (bootstrap, plots) sees exactly what one process would.

Nothing here does anything in a single process. Under a launcher (WORLD_SIZE > 1 in
the environment) the process group is created on first use, with gloo on CPU.
"""

from __future__ import annotations

import atexit
import dataclasses
import os

import torch
import torch.distributed as dist


def _group() -> bool:
    """Whether this run has several processes; creates the process group when launched so."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    from accelerate import PartialState  # reads the launcher's environment; gloo on CPU, nccl on GPU

    PartialState()
    atexit.register(_close)
    return dist.get_world_size() > 1


def _close() -> None:
    """Tear the process group down before the interpreter exits: a live gloo group at exit
    can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if _group() else 0


def world_size() -> int:
    return dist.get_world_size() if _group() else 1


def is_main() -> bool:
    return rank() == 0


def local_device(device: str) -> str:
    """`cuda` means this process's own GPU when several processes share a machine (LOCAL_RANK)."""
    if device == "cuda" and world_size() > 1:
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return device


def shard_indices(n: int) -> list[int]:
    """This process's samples of n: rank, rank + world, ... (all of them in one process)."""
    return list(range(rank(), n, world_size()))


def shard(batch):
    """This process's rows of a TokenBatch-like (input_ids, attention_mask) dataclass."""
    if world_size() == 1:
        return batch
    idx = torch.tensor(shard_indices(len(batch)), dtype=torch.long)
    return type(batch)(batch.input_ids[idx], batch.attention_mask[idx])


def sum_in_rank_order(x):
    """Sum of `x` (anything with `+`: tensors, LayerStats, dicts of them via `merge`) over processes.

    Gathered and added in rank order on every process, so all of them hold the
    identical result. `None` contributions (a process without samples) are skipped.
    """
    if world_size() == 1:
        return x
    parts = [p for p in all_objects(x) if p is not None]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def gather_rows(x: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Per-sample rows computed on this process's shard -> all n rows in sample order. (n, ...)"""
    if world_size() == 1:
        return x
    parts = all_objects(None if x is None else x.cpu())
    if all(p is None for p in parts):
        return None
    like = next(p for p in parts if p is not None)
    out = like.new_empty((n, *like.shape[1:]))
    for r, p in enumerate(parts):
        if p is not None and len(p):
            out[r::world_size()] = p
    return out


def all_objects(x) -> list:
    """Every process's `x`, in rank order."""
    if world_size() == 1:
        return [x]
    parts = [None] * world_size()
    dist.all_gather_object(parts, x)
    return parts


def broadcast_object(x):
    """Rank 0's `x` on every process (pickled: for small things, a plan's heads and scores)."""
    if world_size() == 1:
        return x
    box = [x if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_root(compute):
    """`compute()` on rank 0 alone, its (small, picklable) value on every process; an exception on rank 0 is
    raised on every process (the others would otherwise wait for it forever)."""
    if world_size() == 1:
        return compute()
    value = error = None
    if rank() == 0:
        try:
            value = compute()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every process
            error = e
    error, value = broadcast_object((error, value))
    if error is not None:
        raise error
    return value


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank 0's named tensors on every process, by tensor collectives, one at a time (only their names, shapes
    and dtypes are pickled): what rank 0 alone computed from the sums only it keeps."""
    if world_size() == 1:
        return tensors
    meta = broadcast_object({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} if rank() == 0 else None)
    out = {}
    for k, (shape, dtype) in meta.items():
        t = tensors[k].detach().to("cpu").contiguous() if rank() == 0 else torch.empty(shape, dtype=dtype)
        dist.broadcast(t, src=0)
        out[k] = t
    return out


def leaves(x) -> list[torch.Tensor]:
    """The tensors of a tree of dataclasses, dicts (sorted keys), lists and tuples, in a fixed order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in leaves(getattr(x, f.name))]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in leaves(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in leaves(v)]
    return []


def with_leaves(x, values: list[torch.Tensor]):
    """`x` with its tensors (in `leaves` order) replaced by `values` (consumed from the front)."""
    if isinstance(x, torch.Tensor):
        return values.pop(0)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: with_leaves(getattr(x, f.name), values) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, dict):
        return {k: with_leaves(x[k], values) for k in sorted(x)}
    if isinstance(x, (list, tuple)):
        return type(x)(with_leaves(v, values) for v in x)
    return x


def reduce_tree(x, to_root: bool = False):
    """Sum a tree of float64 sums (a layer's `LayerStats`, say) over processes with tensor collectives.

    Flattened into one float64 buffer; rank 0 receives the others' buffers one at a time and adds them
    in rank order (the same order, and so the same rounding, as `sum_in_rank_order`), then broadcasts
    the total. Each process holds its own buffer and the total -- never world-size copies -- so memory
    per process does not grow with the number of processes, and nothing is pickled. With `to_root` the
    total stays on rank 0 (the others get None and keep nothing).
    """
    if world_size() == 1:
        return x
    parts = leaves(x)
    buf = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in parts])
    if rank() == 0:
        incoming = torch.empty_like(buf)
        for r in range(1, world_size()):
            dist.recv(incoming, src=r)
            buf += incoming
    else:
        dist.send(buf, dst=0)
    if to_root and rank() != 0:
        return None
    if not to_root:
        dist.broadcast(buf, src=0)
    out, i = [], 0
    for t in parts:
        out.append(buf[i:i + t.numel()].view(t.shape).to(t.dtype))
        i += t.numel()
    return with_leaves(x, out)
