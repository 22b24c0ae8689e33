"""Head surgery through the architecture adapters: mask, remove, compensate.

A head set is `{layer: [head, ...]}` in the *original* head numbering.

- `masked(...)`   -- scoped: pre-hooks zero the head slices at the input of the
                     output projection; always removed on exit; exact.
- `mask_heads`    -- permanent: zero the output-projection columns of the heads.
- `remove_heads`  -- physical: slice q/k/v rows (and biases) and the output
                     projection's input columns; update module attributes and,
                     where the config can express it, the config.

Compensation (docs/design.md §8) is a `Compensation` value, computed from the
captured `OutputMoments` by `compensate` and accepted by every surgery alike:

- `zero`  -- nothing: the pruned heads' output is simply gone;
- `mean`  -- each pruned head's mean contribution over the calibration rows,
             W_O,h mean(o_h), is added to the output projection's bias, so the
             near-constant sink channel the network relies on is kept;
- `refit` -- the kept heads' output-projection columns are refitted by ridge
             least squares to rebuild what the pruned heads wrote
             (`pruner.pruning.refit`), with the constant into the bias where the
             projection has one, and no bias at all where it has none. Plain
             weights: every vanilla config holds them. `refit_sequential`
             re-collects each layer's moments on the already-compensated model.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from pruner.core import arch
from pruner.pruning.attention_free import AttentionFree

HeadSet = dict[int, list[int]]
COMPENSATIONS = ("zero", "mean", "refit")
# what a run uses when its recipe leaves the compensation unset (`pruner.runs.context.prepare` resolves it): below
# mean on every shipped model (docs/results.md), and it adds no bias, so every vanilla form holds it
DEFAULT_COMPENSATION = "refit"


@dataclass(frozen=True)
class Compensation:
    """What the pruned heads leave behind in the output projection, per layer, in original head numbering.

    `bias[l]` (d_model,) is added to the bias; `weight[l]` (d_model, heads * d_head) to the
    projection's columns before the pruned ones are zeroed or removed (it is zero on
    them). `fits[l]` holds a refit's diagnostics: unexplained and pruned energy, lambda.
    """

    kind: str = "zero"
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    weight: dict[int, torch.Tensor] = field(default_factory=dict)
    fits: dict[int, dict] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.bias or self.weight)


def as_compensation(x: "Compensation | dict[int, torch.Tensor] | None") -> Compensation:
    """A Compensation from one, from a legacy {layer: bias} dict (mean compensation), or from None (zero)."""
    if isinstance(x, Compensation):
        return x
    return Compensation("mean", bias=dict(x)) if x else Compensation()


class SurgeryError(ValueError):
    pass


def kept_heads(model) -> dict[int, list[int]]:
    """Original indices of the heads present in each layer (all of them before any removal)."""
    if not hasattr(model, "_pruner_kept"):
        g = arch.geometry(model)
        model._pruner_kept = {layer: list(range(g.n_heads)) for layer in range(g.n_layers)}
    return model._pruner_kept


def _slots(positions: list[int], width: int) -> torch.Tensor:
    """Indices of `width`-wide blocks at `positions`: head p -> p*width ... p*width + width - 1."""
    return torch.tensor([p * width + i for p in positions for i in range(width)], dtype=torch.long)


def _channels(model, layer: int, heads: list[int]) -> torch.Tensor:
    """Input channels of the output projection that belong to `heads` (current positions)."""
    present = kept_heads(model)[layer]
    missing = [h for h in heads if h not in present]
    if missing:
        raise SurgeryError(f"layer {layer}: heads {missing} are already removed")
    return _slots([present.index(h) for h in heads], arch.geometry(model).head_dim)


def _present_channels(model, layer: int) -> torch.Tensor:
    """Original channel indices of the heads still present, in their current column order."""
    return _slots(kept_heads(model)[layer], arch.geometry(model).head_dim)


@contextmanager
def masked(model, heads: HeadSet, compensation: Compensation | dict | None = None) -> Iterator[None]:
    """Scoped mask: zero the heads' slices at the output projection's input, plus the compensation.

    Exact: a forward hook adds compensation.weight applied to the masked input
    (F.linear(x_masked, delta_W)) and the bias delta to the projection's output.
    """
    ad = arch.adapter_for(model)
    comp = as_compensation(compensation)
    handles = []
    try:
        for layer, hs in heads.items():
            o_proj = arch.get(arch.blocks(model)[layer], ad.o_proj)
            keep = torch.ones(o_proj.weight.shape[0 if ad.conv1d else 1], dtype=o_proj.weight.dtype)
            keep[_channels(model, layer, hs)] = 0
            handles.append(o_proj.register_forward_pre_hook(
                lambda m, args, keep=keep: (args[0] * keep.to(args[0].device),) + tuple(args[1:])))
            dw = comp.weight.get(layer)
            dw = None if dw is None else dw[:, _present_channels(model, layer)]
            db = comp.bias.get(layer)
            if dw is not None or db is not None:
                handles.append(o_proj.register_forward_hook(
                    lambda m, args, out, dw=dw, db=db: _shifted(out, args[0], dw, db)))
        yield
    finally:
        for h in handles:
            h.remove()


def _shifted(out: torch.Tensor, x: torch.Tensor, dw: torch.Tensor | None, db: torch.Tensor | None) -> torch.Tensor:
    """out + x dW^T + db (the masked input x: (..., D); dW: (d_model, D); db: (d_model,))."""
    if dw is not None:
        out = out + torch.nn.functional.linear(x, dw.to(x.device, x.dtype))
    if db is not None:
        out = out + db.to(out.device, out.dtype)
    return out


def _add_bias(model, layer: int, delta: torch.Tensor) -> None:
    """Add `delta` to the output projection's bias, creating one the config can express if needed."""
    ad = arch.adapter_for(model)
    o_proj = arch.get(arch.blocks(model)[layer], ad.o_proj)
    if o_proj.bias is None:
        if ad.bias_flag is not None and hasattr(model.config, ad.bias_flag):
            enable_attention_bias(model)
        else:
            # in memory this is exact; `export` refuses it, since the vanilla config cannot hold it
            o_proj.bias = nn.Parameter(torch.zeros(o_proj.weight.shape[0], dtype=o_proj.weight.dtype,
                                                   device=o_proj.weight.device))
            model._pruner_bias_not_in_config = True
    with torch.no_grad():
        o_proj.bias += delta.to(o_proj.bias.device, o_proj.bias.dtype)  # deltas are computed on the CPU


def enable_attention_bias(model) -> None:
    """Turn on the config's attention-bias flag: zero biases on every q, k, v and o projection."""
    ad = arch.adapter_for(model)
    setattr(model.config, ad.bias_flag, True)
    for block in arch.blocks(model):
        for path in (ad.q, ad.k, ad.v, ad.o_proj):
            lin = arch.get(block, path)
            if lin.bias is None:
                lin.bias = nn.Parameter(torch.zeros(lin.weight.shape[0], dtype=lin.weight.dtype,
                                                    device=lin.weight.device))


def _add_weight(model, layer: int, delta: torch.Tensor) -> None:
    """Add a (d_model, heads * d_head) original-numbering delta to the present columns of the projection."""
    ad = arch.adapter_for(model)
    o_proj = arch.get(arch.blocks(model)[layer], ad.o_proj)
    d = delta[:, _present_channels(model, layer)].to(o_proj.weight.device, o_proj.weight.dtype)
    with torch.no_grad():
        o_proj.weight += d.t() if ad.conv1d else d


def _apply(model, layer: int, comp: Compensation) -> None:
    """The layer's compensation into the weights (before its pruned columns are zeroed or removed)."""
    if layer in comp.weight:
        _add_weight(model, layer, comp.weight[layer])
    if layer in comp.bias:
        _add_bias(model, layer, comp.bias[layer])


def mask_heads(model, heads: HeadSet, compensation: Compensation | dict | None = None) -> None:
    """Permanent mask: zero the heads' output-projection columns (shapes kept; loads anywhere)."""
    ad = arch.adapter_for(model)
    comp = as_compensation(compensation)
    with torch.no_grad():
        for layer, hs in heads.items():
            _apply(model, layer, comp)
            o_proj = arch.get(arch.blocks(model)[layer], ad.o_proj)
            cols = _channels(model, layer, hs)
            if ad.conv1d:
                o_proj.weight[cols, :] = 0
            else:
                o_proj.weight[:, cols] = 0


def check_gqa(model, heads: HeadSet) -> None:
    """Removal keeps GQA valid: whole KV groups, or the same number of query heads in every group."""
    g = arch.geometry(model)
    if g.group_size == 1:
        return
    for layer, hs in heads.items():
        present = kept_heads(model)[layer]
        left = [h for h in present if h not in hs]
        per_group = {k: sum(1 for h in left if h // g.group_size == k) for k in range(g.n_kv_heads)}
        counts = {c for c in per_group.values() if c > 0}
        if len(counts) > 1:
            raise SurgeryError(
                f"layer {layer}: removing heads {sorted(hs)} leaves {per_group} query heads per KV group; "
                "GQA needs the same number in every kept group (prune equal numbers per group, "
                "or whole groups)")


def _slice(lin, idx: torch.Tensor, dim: int) -> None:
    """Keep `idx` along `dim` of a Linear/Conv1D weight (and bias along its output dim)."""
    linear = isinstance(lin, nn.Linear)
    out_dim = 0 if linear else 1  # nn.Linear stores (out, in); transformers' Conv1D (in, out)
    with torch.no_grad():
        lin.weight = nn.Parameter(lin.weight.index_select(dim, idx.to(lin.weight.device)).contiguous())
        if lin.bias is not None and dim == out_dim:
            lin.bias = nn.Parameter(lin.bias.index_select(0, idx.to(lin.bias.device)).contiguous())
    if linear:
        lin.out_features, lin.in_features = lin.weight.shape
    else:
        lin.nf = lin.weight.shape[1]


def remove_heads(model, heads: HeadSet, compensation: Compensation | dict | None = None) -> None:
    """Physically remove heads (q/k/v rows, o_proj input columns), GQA-aware."""
    ad, g = arch.adapter_for(model), arch.geometry(model)
    comp = as_compensation(compensation)
    check_gqa(model, heads)
    hd = g.head_dim
    for layer, hs in heads.items():
        if not hs:
            continue
        present = kept_heads(model)[layer]
        gone = sorted(set(hs) - set(present))
        if gone:
            raise SurgeryError(f"layer {layer}: heads {gone} are already removed")
        left = [h for h in present if h not in hs]
        if not left and not ad.attention_free:
            raise SurgeryError(f"layer {layer}: removing heads {sorted(hs)} would leave no head, and a "
                               f"{model.config.model_type} layer without attention is not supported (llama-like "
                               "decoders and Gemma 3 are)")
        _apply(model, layer, comp)
        block = arch.blocks(model)[layer]
        keep_q = _slots([present.index(h) for h in left], hd)
        o_proj = arch.get(block, ad.o_proj)
        _slice(o_proj, keep_q, 0 if ad.conv1d else 1)
        if ad.qkv_layout == "separate":
            kv_present = sorted({h // g.group_size for h in present})
            kv_left = sorted({h // g.group_size for h in left})
            keep_kv = _slots([kv_present.index(k) for k in kv_left], hd)
            _slice(arch.get(block, ad.q), keep_q, 0)
            _slice(arch.get(block, ad.k), keep_kv, 0)
            _slice(arch.get(block, ad.v), keep_kv, 0)
            attn = arch.get(block, ad.attn)
            if not left:  # the layer's attention is gone: no kernel, no KV cache (`attention_free`)
                arch.set_attr(block, ad.attn, AttentionFree(attn))
            elif hasattr(attn, "num_key_value_groups"):
                attn.num_key_value_groups = len(left) // len(kv_left)
        elif ad.qkv_layout == "split":  # [q | k | v], each (heads * d_head)
            width = len(present) * hd
            idx = torch.cat([keep_q + i * width for i in range(3)])
            _slice(arch.get(block, ad.qkv), idx, 1 if ad.conv1d else 0)
            arch.get(block, ad.attn).split_size = len(left) * hd
        elif ad.qkv_layout == "per_head":  # per head [q_h, k_h, v_h]
            idx = _slots([present.index(h) for h in left], 3 * hd)
            _slice(arch.get(block, ad.qkv), idx, 0)
        for path in ad.n_heads_attrs:
            arch.set_attr(block, path, len(left))
        if left and hasattr(arch.get(block, ad.attn), "all_head_size"):
            arch.get(block, ad.attn).all_head_size = len(left) * hd
        kept_heads(model)[layer] = left
    _sync_config(model)


def _sync_config(model) -> None:
    """Write head counts into the config when they are uniform and `head_dim` is explicit."""
    counts = {len(v) for v in kept_heads(model).values()}
    if len(counts) != 1 or getattr(model.config, "head_dim", None) is None:
        return
    g = arch.geometry(model)
    n = counts.pop()
    kv = {len({h // g.group_size for h in v}) for v in kept_heads(model).values()}
    if len(kv) == 1:
        model.config.num_attention_heads = n
        if hasattr(model.config, "num_key_value_heads"):
            model.config.num_key_value_heads = kv.pop()
