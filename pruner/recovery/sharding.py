"""FSDP for recovery (`recovery.fsdp`): each of N processes holds 1/N of the student's training state.

Training state is what does not fit first: float32 weights, their gradients and AdamW's two
moments are 16 bytes a parameter, four times the weights alone. torch's `fully_shard` (FSDP2)
shards each transformer block and then the rest of the model over the processes (gloo on
CPU, NCCL on GPU); every forward gathers a block's weights just in time and every backward
reduce-scatters its gradients. What pruner adds is only its own bookkeeping:

- the loss: FSDP averages gradients over the processes, and each process's loss is already its
  share of the whole batch's mean, so it is scaled by N to give the sum (the gradient of one
  process on the whole batch, as the replicated path gives);
- every process runs every forward, even one whose share of a batch is empty (FSDP's
  collectives): `idle_rows` gives it a row to run at zero weight;
- checkpoints for `--resume`: each process saves its own shards as plain tensors
  (`to_local`) and puts them back into the sharded parameters and optimizer state (`like`,
  `optimizer_state`); `settle` reshards first what a forward without backward left gathered;
- the plain model at the end: a skeleton (the model's modules with meta-device parameters, made
  before sharding, no memory) receives the gathered full weights (`unsharded`), so saving,
  evaluation and the reload check see an ordinary model.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from pruner.core import arch, distributed


def active(spec) -> bool:
    """Whether this recovery shards the student (`recovery.fsdp` under several processes)."""
    return bool(spec.fsdp) and distributed.world_size() > 1


def skeleton(model):
    """A copy of `model` whose parameters are on the meta device (no memory); buffers are copied as they are."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def shard(model) -> None:
    """`fully_shard` each transformer block, then the model (the embeddings, final norm and head). A LoRA student
    (PEFT-wrapped) shards its frozen weights with its adapters: FSDP2 keeps frozen and trained parameters in one
    group and reduces gradients for the trained ones only."""
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for block in arch.blocks(base):
        fully_shard(block)
    fully_shard(model)


def settle(model) -> None:
    """Every parameter back to its shard (a DTensor): FSDP leaves the root's parameters gathered after a forward
    that no backward follows (a validation pass), and the guard and the checkpoints copy the parameters."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def unsharded(model, plain):
    """`plain` (a `skeleton` of `model` before sharding) holding `model`'s trained weights, gathered in full on
    every process (evaluation and saving need the whole model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain.load_state_dict(full, assign=True)
    if getattr(plain.config, "tie_word_embeddings", False) and hasattr(plain, "tie_weights"):
        plain.tie_weights()
    return plain


def to_local(x):
    """`x` (tensors, dicts, lists) with every DTensor replaced by this process's shard."""
    if isinstance(x, DTensor):
        return x.to_local().clone()
    if isinstance(x, dict):
        return {k: to_local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_local(v) for v in x)
    return x


def like(local: torch.Tensor, param) -> torch.Tensor:
    """A saved shard as the DTensor that `param` (sharded) holds; plain tensors pass through."""
    if not isinstance(param, DTensor) or local.dim() == 0:
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def optimizer_state(saved: dict, params: list) -> dict:
    """An optimizer state_dict saved with `to_local`, its moments turned back into DTensors like their params."""
    state = {i: {k: like(v, params[i]) if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in saved["state"].items()}
    return {**saved, "state": state}


def idle_rows(rows: torch.Tensor) -> torch.Tensor:
    """The row a process with no share of a batch runs (at zero weight) so that FSDP's collectives line up."""
    return rows[:1]
