"""What a scorer reads (`ScoringInputs`) and what a scorer is (`Scorer`): the types both registries share.

Apart from the scorers so that the head scorers (`pruner.pruning.scoring`) and the layer scorers
(`pruner.pruning.layer_scoring`) each build their registry on them without importing each other;
`pruner.pruning.scoring` re-exports both, where every caller reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from pruner.attention.sums import HeadStats
from pruner.pruning import refit

Tensor = torch.Tensor


@dataclass(frozen=True)
class ScoringInputs:
    """Everything a scorer may read. Shapes: (layer, head) unless stated."""

    stats: HeadStats            # captured statistics, with output moments
    gram: Tensor | None         # (layer, head, d_head, d_head): W_O,h^T W_O,h (None once the curves are built)
    weight_norm: Tensor         # ||[W_q,h; W_k,h; W_v,h; W_O,h]|| (magnitude baseline)
    gradient: Tensor | None = None  # Michel importance, when computed
    ablation: Tensor | None = None  # measured loss increase of removing each head alone, when computed
    layer_ablation: Tensor | None = None  # (layer,) measured loss increase of removing each layer's attention
    shortlist: Tensor | None = None  # (layer, head) bool: the heads ablation-shortlist measured
    seed: int = 0
    cross: Tensor | None = None   # (layer, head, head): cross_energy(stats, W_O)
    layer_gram: Tensor | None = None  # (layer, H*d_head, H*d_head) float32: W_O^T W_O of each whole projection
    intercept: tuple[bool, ...] = ()  # per layer: the projection has a bias, so refit fits an intercept
    ridge: float = 1e-3               # refit's ridge (surgery.ridge): the refit-aware scorer prices heads with it
    costs: dict = field(default_factory=dict)  # what the measured scorers' extra passes cost ({"ablation": ...})
    position: tuple[int, int] | None = None  # a one-layer view: (its layer, the model's layers)
    curves: dict = field(default_factory=dict, repr=False, compare=False)  # CurveKey -> each layer's removal order
    #   (`pruner.pruning.curves`), built layer by layer while the layer's sums were whole
    extra: dict = field(default_factory=dict, repr=False, compare=False)  # what calibration computed for later
    #   stages while the sums were whole (the compensation of a per-layer budget, ...)
    _systems: list = field(default_factory=list, repr=False, compare=False)  # refit_systems' cache
    _costs: dict = field(default_factory=dict, repr=False, compare=False)  # refit_costs' per layer, by alive set

    @property
    def n_layers(self) -> int:
        """The model's layers (a one-layer view knows how many the model has)."""
        return self.position[1] if self.position is not None else int(self.stats.sink_mass.shape[0])

    def layer(self, index: int) -> "ScoringInputs":
        """Layer `index` alone: a one-layer view (slices, not copies) that scorers read as they read the whole,
        with caches of its own. A scorer's importances of the view are the whole's row `index`: every scorer
        prices a layer from that layer's data and per-layer scalars (`pruner.pruning.curves`)."""
        cut = slice(index, index + 1)

        def per(x):
            return None if x is None else x[cut]

        return ScoringInputs(stats=self.stats.layer(index), gram=per(self.gram), weight_norm=per(self.weight_norm),
                             gradient=per(self.gradient), ablation=per(self.ablation),
                             shortlist=per(self.shortlist), seed=self.seed,
                             cross=per(self.cross), layer_gram=per(self.layer_gram), intercept=self.intercept[cut],
                             ridge=self.ridge, costs=self.costs, position=(index, self.n_layers))

    def release(self) -> None:
        """Drop what `refit_systems` and `refit_costs` keep (a float64 (H d_head)^2 per layer): rebuilt if read
        again."""
        self._systems.clear()
        self._costs.clear()

    def refit_systems(self) -> list[refit.System]:
        """Per layer, the refit system the refit-aware scorer evaluates; built on first use (one
        Cholesky factor and inverse per layer, which scorers that do not need it never pay for)."""
        if self.layer_gram is None:
            raise ValueError("the refit-aware scorer needs the layers' W_O^T W_O (pruner.pruning.calibrate computes it)")
        if not self._systems:
            first = 0 if self.position is None else self.position[0]
            for layer, (m, gram, icpt) in enumerate(zip(self.stats.outputs, self.layer_gram, self.intercept)):
                mu, s = refit.second_moment(m.o, m.joint, m.tokens, icpt)
                self._systems.append(refit.system(gram, mu if icpt else None, s, self.ridge, first + layer))
        return self._systems


@dataclass(frozen=True)
class Scorer:
    name: str
    fn: Callable[[ScoringInputs, Tensor, str], Tensor]
    adaptive: bool = False      # re-score among survivors after every removal
    needs_gradient: bool = False
    needs_ablation: bool = False  # L x H measured passes (`pruner.pruning.ablation`)
    needs_systems: bool = False   # every layer's refit system (`ScoringInputs.refit_systems`: a float64
    #                               (H d_head)^2 precision per layer, kept while it selects)
    convention: str | None = None  # the convention a redundancy scorer compares heads under
    doc: str = ""
    reads: str = ""             # what it reads, for scorers without a convention (metrics.json, reports)
    reads_joint: bool = False   # the joint second moment of the layer's head outputs (and W_O^T W_O)
    reads_head_moments: bool = False  # each head's own output second moment and W_O,h^T W_O,h
    unit: str = "head"          # what it ranks: "head" -> (layer, head) importances; "layer" -> (layer,)
    reads_layer_cosine: bool = False  # the attention block's input/output cosine sums (CaptureConfig.layer_cosine)

    def __call__(self, inputs: ScoringInputs, alive: Tensor, convention: str | None = None) -> Tensor:
        return self.fn(inputs, alive, convention or self.convention)
