"""Compensation: what pruned heads leave behind in the output projection (docs/design.md §8), from the
calibration moments of the unpruned model: nothing (`zero`), their mean output folded into the bias (`mean`),
or the kept heads' output columns refitted by ridge least squares to rebuild them (`refit`, the ridge fixed
or cross-validated per layer). The value, a `surgery.Compensation`, is applied alike by every surgery."""

from __future__ import annotations

from typing import Callable

import torch

from pruner.attention.moments import FoldMoments, OutputMoments
from pruner.core import arch
from pruner.core.host_memory import release_freed
from pruner.pruning import refit
from pruner.pruning.surgery import (
    COMPENSATIONS,
    Compensation,
    HeadSet,
    SurgeryError,
    _channels,
    _slots,
    kept_heads,
    masked,
)


def compensation_bias(model, heads: HeadSet, outputs: list[OutputMoments]) -> dict[int, torch.Tensor]:
    """Per layer, sum over pruned heads of W_O,h mean(o_h): what mean ablation keeps. (d_model,)"""
    out = {}
    for layer, hs in heads.items():
        if not hs:
            continue
        mom = outputs[layer]
        w = arch.o_weight_cols(model, layer)  # (d_model, heads * d_head)
        mean = (mom.o / mom.tokens)[hs].reshape(-1).to(w.device)  # (len(hs) * d_head,) original numbering
        out[layer] = (w[:, _channels(model, layer, hs)].double() @ mean.double()).to(w.dtype)
    return out


def compensate(model, heads: HeadSet, outputs: list[OutputMoments], kind: str, ridge: float | str = 1e-3,
               folds: list[FoldMoments] | None = None) -> Compensation:
    """The `kind` compensation of pruning `heads` from the calibration moments of the unpruned model.

    `refit` fits an intercept exactly where the layer's output projection has a bias. `ridge`
    "auto" chooses each layer's ridge by cross-validation over the calibration folds (`folds`,
    captured with `CaptureConfig(folds=K)`; `refit.choose_ridge`).
    """
    if kind == "zero":
        return Compensation()
    if kind == "mean":
        return Compensation("mean", bias=compensation_bias(model, heads, outputs))
    if kind != "refit":
        raise ValueError(f"unknown compensation {kind!r}; valid: {', '.join(COMPENSATIONS)}")
    whole = whole_layers(model, heads)  # nothing left to refit from: mean where a bias is carried, else zero
    if ridge == "auto" and not folds and any(hs and k not in whole for k, hs in heads.items()):
        raise ValueError("surgery.ridge auto cross-validates over calibration folds: capture them "
                         "(CaptureConfig(folds=K)), or give a number")
    bias = compensation_bias(model, {k: v for k, v in whole.items() if can_carry_bias(model, k)}, outputs)
    weight, fits = {}, {}
    for layer, hs in heads.items():
        if hs and layer not in whole:
            choice = None if ridge != "auto" else choose_layer_ridge(model, layer, hs, folds[layer])
            fit = refit_layer(model, layer, hs, outputs[layer], ridge if choice is None else choice.ridge)
            weight[layer], fits[layer] = fit.delta_w, diagnostics(fit, choice)
            if fit.delta_b is not None:
                bias[layer] = fit.delta_b
    dtype = arch.o_weight_cols(model, 0).dtype
    return Compensation("refit", {k: v.to(dtype) for k, v in bias.items()},
                        {k: v.to(dtype) for k, v in weight.items()}, fits)


def whole_layers(model, heads: HeadSet) -> HeadSet:
    """The layers `heads` empties (every head of the layer: selection.unit layer)."""
    n = arch.geometry(model).n_heads
    return {layer: hs for layer, hs in heads.items() if len(set(hs)) == n}


def can_carry_bias(model, layer: int) -> bool:
    """Whether the layer's output projection has a bias, or its config a switch that gives it one."""
    flag = arch.adapter_for(model).bias_flag
    return has_bias(model, layer) or (flag is not None and hasattr(model.config, flag))


def whole_layer_note(model, heads: HeadSet, kind: str) -> str | None:
    """One line when refit meets a layer with no head left: there is nothing to refit from, so such a layer gets
    its mean output in the bias (refit with an intercept and no kept head is exactly that), or nothing where no
    bias can be carried. None when no layer is emptied or the compensation is not refit."""
    whole = whole_layers(model, heads)
    if kind != "refit" or not whole:
        return None
    mean = [k for k in whole if can_carry_bias(model, k)]
    zero = [k for k in whole if k not in mean]
    return ("compensation: refit has no kept head to refit from in a removed layer: "
            + "; ".join(x for x in (f"mean (its mean output in the bias) for layers {mean}" if mean else "",
                                    f"zero for layers {zero} (no bias to carry it)" if zero else "") if x))


def refit_layer(model, layer: int, heads: list[int], moments: OutputMoments, ridge: float,
                intercept: bool | None = None) -> refit.Fit:
    """`refit.fit_layer` for pruning `heads` of `layer`: the projection of the unpruned model, its moments.

    `intercept` defaults to whether the projection has a bias (forcing it on where there is
    none would need a bias the config may not hold; studies compare the two on biased models).
    """
    g = arch.geometry(model)
    if len(kept_heads(model)[layer]) != g.n_heads:
        raise SurgeryError(f"layer {layer}: refit compensation is computed on the unpruned model")
    w = arch.o_weight_cols(model, layer).detach().cpu()  # (d_model, D), the model's dtype: fit_layer reads its pruned
    refit.check_tokens(int(moments.tokens), w.shape[1], layer)
    intercept = has_bias(model, layer) if intercept is None else intercept
    mu, s = refit.second_moment(moments.o, moments.joint, moments.tokens, intercept)
    pruned = torch.zeros(w.shape[1], dtype=torch.bool)
    pruned[_slots(heads, g.head_dim)] = True
    return refit.fit_layer(w, mu if intercept else None, s, pruned, ridge, layer)


def choose_layer_ridge(model, layer: int, heads: list[int], folds: FoldMoments) -> refit.RidgeChoice:
    """`refit.choose_ridge` for pruning `heads` of `layer` (intercept where the projection has a bias)."""
    w = arch.o_weight_cols(model, layer).detach().cpu()  # the model's dtype: only the pruned columns are read
    pruned = torch.zeros(w.shape[1], dtype=torch.bool)
    pruned[_slots(heads, arch.geometry(model).head_dim)] = True
    f = folds.to("cpu")
    return refit.choose_ridge(w, f.joint, f.o, f.tokens, pruned, has_bias(model, layer),
                              between_folds=release_freed)  # each fold's buffers back to the system


def has_bias(model, layer: int) -> bool:
    """Whether the layer's output projection has a bias: refit then fits an intercept."""
    return arch.o_bias(model, layer) is not None


def diagnostics(fit: refit.Fit, choice: refit.RidgeChoice | None = None) -> dict:
    out = {"unexplained": fit.unexplained, "pruned": fit.pruned, "lambda": fit.lam, "intercept": fit.delta_b is not None}
    if choice is not None:  # the cross-validated ridge: what each ridge left on the held-out folds
        i = choice.grid.index(choice.ridge)
        out.update(ridge=choice.ridge, heldout=choice.heldout[i], heldout_no_refit=choice.heldout[-1],
                   heldout_best=choice.best)
    return out


def refit_sequential(model, heads: HeadSet, collect: Callable[[], list[OutputMoments]],
                     ridge: float | str = 1e-3,
                     collect_folds: Callable[[], list[FoldMoments]] | None = None) -> Compensation:
    """Refit layer by layer, each from moments re-collected on the model already pruned and refitted below it.

    `collect()` runs a calibration capture of the model as it is and returns its output
    moments; it is called once per pruned layer, under a scoped mask of the layers done.
    Layer l's fit then sees the inputs the pruned network really gives it, as
    OBS/SparseGPT-style sequential methods do. With ridge "auto", `collect_folds()` (called
    right after `collect()`, on the same capture) gives the fold moments the ridge is chosen from.
    """
    if ridge == "auto" and collect_folds is None:
        raise ValueError("sequential refit with ridge auto needs the re-collected fold moments (collect_folds)")
    done: HeadSet = {}
    comp = Compensation("refit")
    for layer in sorted(k for k, v in heads.items() if v):
        with masked(model, done, comp):
            outputs = collect()
            choice = None if ridge != "auto" else choose_layer_ridge(model, layer, heads[layer], collect_folds()[layer])
        fit = refit_layer(model, layer, heads[layer], outputs[layer], ridge if choice is None else choice.ridge)
        dtype = arch.o_weight_cols(model, layer).dtype
        bias = comp.bias | ({} if fit.delta_b is None else {layer: fit.delta_b.to(dtype)})
        comp = Compensation("refit", bias, comp.weight | {layer: fit.delta_w.to(dtype)},
                            comp.fits | {layer: diagnostics(fit, choice)})
        done[layer] = heads[layer]
    return comp
