"""What calibration computes of a layer the moment its sums are final, so that the sums can go (docs/design.md §8.4).

Selection reads a layer only through its curves (`pruner.pruning.curves`); a per-layer budget's compensation
reads only that layer's sums and weights. So, with the layer's block still in memory and its sums whole
(reduced over processes), `LayerFinisher.finish` builds the one-layer `ScoringInputs` every scorer reads --
its W_O^T W_O formed now, for this layer alone -- builds every curve asked for, compensates a per-layer
budget's heads, and hands back the layer's sums without their second moments and folds: what the later
stages read (mean compensation's first moments, the reports' counts). Host memory then holds one layer's
second moments at a time, whatever the depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from pruner.attention import moments
from pruner.attention.sums import HeadStats, LayerStats, finalize
from pruner.core import arch, precision
from pruner.core.host_memory import release_freed
from pruner.pruning.compensation import compensate
from pruner.pruning.curves import CurveKey, Removal, prefix
from pruner.pruning.scoring import ScoringInputs, cross_energy, get_scorer
from pruner.pruning.selection import layer_curve_of
from pruner.pruning.surgery import Compensation


@dataclass(frozen=True)
class LocalCompensation:
    """A per-layer budget's compensation, computed as each layer finishes: the heads are the prefix of the
    layer's `key` curve that its `quota` takes (`pruner.pruning.curves.prefix`), the same heads the plan
    will hold (with quotas a layer's share does not depend on the other layers)."""

    key: CurveKey
    quota: tuple[int, ...]
    kind: str = "refit"
    ridge: float | str = "auto"

    def heads(self, curve: tuple[Removal, ...], layer: int) -> list[int]:
        return prefix(curve, self.quota[layer])


@dataclass(frozen=True)
class CurveRequest:
    """The curves a calibration builds layer by layer, and the per-layer budgets it compensates meanwhile."""

    keys: tuple[CurveKey, ...]
    local: tuple[LocalCompensation, ...] = ()

    def __post_init__(self):
        missing = [c.key for c in self.local if c.key not in self.keys]
        if missing:
            raise ValueError(f"a local compensation needs its curve asked for too: {missing}")


PRICING_RIDGE = 1e-3  # the refit-aware scorer's ridge when refit's own is cross-validated ("auto")


def pricing_ridge(ridge: float | str) -> float:
    """The refit-aware scorer's ridge: refit's own (surgery.ridge), or `PRICING_RIDGE` where refit's is chosen per
    pruned set by cross-validation only once the set is known."""
    return PRICING_RIDGE if ridge == "auto" else float(ridge)


def diagonal_blocks(grams: torch.Tensor, g: arch.Geometry) -> torch.Tensor:
    """Each head's own W_O,h^T W_O,h from the layers' whole grams: (layer, head, d_head, d_head), float64."""
    L, H, D = grams.shape[0], g.n_heads, g.head_dim
    return torch.diagonal(grams.view(L, H, D, H, D), dim1=1, dim2=3).permute(0, 3, 1, 2).double().contiguous()


def layer_gram(model, layer: int) -> torch.Tensor:
    """W_O^T W_O of the layer's whole output projection: (H*d_head, H*d_head), float32, on the CPU (its block must
    be in memory).

    Products in float32 (bfloat16 weights: on bfloat16 / TF32 units, exact products), summed
    in a fixed order (`moments.gram`): float64 products cost d_model x (H*d_head)^2 per
    layer, seconds for a 1B model, for a precision (~1e-7) no score needs. Cast to float64 exactly where a
    score reads them. Formed for one layer when it is needed, never kept for every layer.
    """
    w = arch.o_weight_cols(model, layer).detach()  # (d_model, H*d_head)
    with precision.matmul_precision(w.dtype == torch.bfloat16):
        return moments.gram(w.float(), arch.geometry(model).n_heads).cpu()


def layer_grams(model) -> torch.Tensor:
    """`layer_gram` of every layer: (layer, H*d_head, H*d_head), float32 (the studies' whole-model inputs)."""
    g = arch.geometry(model)
    D = g.n_heads * g.head_dim
    out = torch.empty((g.n_layers, D, D), dtype=torch.float32)
    for layer in range(g.n_layers):  # filled in place: no second copy from a stack
        out[layer] = layer_gram(model, layer)
    return out


def weight_norm(model, layer: int) -> torch.Tensor:
    """Norm of each head's q, k, v and o slices (k/v shared across a GQA group, split evenly): (head,), on the CPU
    (the layer's block must be in memory)."""
    g = arch.geometry(model)

    def sq(w):
        return w.detach().float().square().sum(-1, dtype=torch.float64)  # per row

    q, k, v = arch.qkv_weights(model, layer)  # (rows, d_model)
    o = arch.o_weight_cols(model, layer)  # (d_model, H*d_head)

    def per_head(x, n):
        return x.view(n, -1).sum(-1)

    q_sq = per_head(sq(q), g.n_heads)
    kv_sq = per_head(sq(k) + sq(v), g.n_kv_heads).repeat_interleave(g.group_size) / g.group_size
    o_sq = per_head(sq(o.t()), g.n_heads)
    return (q_sq + kv_sq + o_sq).sqrt().cpu()


def weight_norms(model) -> torch.Tensor:
    """`weight_norm` of every layer: (layer, head), on the CPU whatever device the model is on."""
    return torch.stack([weight_norm(model, layer) for layer in range(arch.geometry(model).n_layers)])


def one_layer_inputs(model, layer: int, stats: HeadStats, *, seed: int = 0, ridge: float | str = 1e-3) -> ScoringInputs:
    """The one-layer `ScoringInputs` of `layer` (`stats`: its one-layer HeadStats, second moments whole, residual
    set): what every scorer reads of it, with its W_O^T W_O and weight norms read off the block now."""
    g = arch.geometry(model)
    gram = layer_gram(model, layer)[None]  # (1, H*d_head, H*d_head)
    joint = stats.outputs is not None and stats.outputs[0].has_joint
    return ScoringInputs(stats=stats, gram=diagonal_blocks(gram, g), weight_norm=weight_norm(model, layer)[None],
                         seed=seed, cross=cross_energy(stats.outputs, gram) if joint else None, layer_gram=gram,
                         intercept=(arch.o_bias(model, layer) is not None,), ridge=pricing_ridge(ridge),
                         position=(layer, g.n_layers))


@dataclass
class LayerFinisher:
    """Builds each finished layer's curves and local compensations (see the module docstring) and keeps them."""

    model: object
    request: CurveRequest
    seed: int = 0
    ridge: float | str = 1e-3
    curves: dict = field(default_factory=dict)  # CurveKey -> [curve per layer]
    compensations: dict = field(default_factory=dict)  # LocalCompensation -> Compensation
    norms: dict = field(default_factory=dict)  # layer -> (head,) weight norms
    intercept: dict = field(default_factory=dict)  # layer -> the projection has a bias
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None  # where a compensation's weight goes (a file)

    def add(self, layer: int, stats: HeadStats) -> ScoringInputs:
        """Build `layer`'s curves (all but the deferred ones) from its one-layer statistics, second moments whole,
        with its block in memory; returns its one-layer inputs."""
        one = one_layer_inputs(self.model, layer, stats, seed=self.seed, ridge=self.ridge)
        self.norms[layer], self.intercept[layer] = one.weight_norm[0], one.intercept[0]
        self.curves_of(one, layer, deferred=False)
        return one

    def finish(self, layer: int, sums: LayerStats, residual: torch.Tensor | None) -> LayerStats:
        """Curves and local compensations of `layer` from its whole sums (its block in memory); returns the sums
        without second moments and folds. `residual`: the layer's mean squared residual norm R_l."""
        release_freed()  # the capture's per-batch buffers, freed but kept by the allocator, before the curves' work
        stats = finalize([sums])
        if residual is not None:
            stats = replace(stats, residual=residual.reshape(1).double())
        self.add(layer, stats)
        release_freed()  # and the curves' work, before the refit's
        for local in self.request.local:
            heads = local.heads(self.curves[local.key][layer], layer)
            if not heads:
                continue
            part = compensate(self.model, {layer: heads}, {layer: sums.outputs}, local.kind, local.ridge,
                              None if sums.folds is None else {layer: sums.folds})
            weight = part.weight if self.keep is None else {k: self.keep(v) for k, v in part.weight.items()}
            done = self.compensations.get(local, Compensation(local.kind))
            self.compensations[local] = Compensation(local.kind, done.bias | part.bias, done.weight | weight,
                                                     done.fits | part.fits)
        return sums.first_moments()

    def curves_of(self, one: ScoringInputs, layer: int, deferred: bool) -> None:
        """`layer`'s curve of every key asked for (`deferred`: those of scorers that read what exists only after
        the capture -- the gradient pass, the ablations -- else the others)."""
        g = arch.geometry(self.model)
        for key in self.request.keys:
            scorer = get_scorer(key.scorer)
            if (scorer.needs_gradient or scorer.needs_ablation) != deferred:
                continue
            self.curves.setdefault(key, [None] * g.n_layers)[layer] = layer_curve_of(scorer, one, g, key)

    def inputs(self, stats: HeadStats, gradient: torch.Tensor | None = None, ablation: torch.Tensor | None = None,
               costs: dict | None = None) -> ScoringInputs:
        """The calibration's `ScoringInputs`: the kept statistics (first moments), the curves (those of the gradient
        and ablation scorers built now, from the small per-head scores they read) and the local compensations."""
        g = arch.geometry(self.model)
        out = ScoringInputs(stats=stats, gram=None, weight_norm=torch.stack([self.norms[i] for i in range(g.n_layers)]),
                            gradient=gradient, ablation=ablation, seed=self.seed,
                            intercept=tuple(self.intercept[i] for i in range(g.n_layers)),
                            ridge=pricing_ridge(self.ridge), costs=costs or {}, curves=self.curves,
                            extra={"compensations": self.compensations})
        for layer in range(g.n_layers):
            self.curves_of(out.layer(layer), layer, deferred=True)
        return out
