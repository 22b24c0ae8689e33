"""Head scorers in one registry: importance per head, higher = keep. Pure tensor math.

Every scorer reads a `ScoringInputs` (built once by `pruner.pruning.calibrate`) and the
current `alive` mask, and returns importance (layer, head). Scorers whose score
depends on which heads survive (redundancy) are `adaptive`: selection re-scores
after every removal. Baselines live here beside the sink-aware scorer, so every
comparison runs through one code path.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Callable

import torch

from pruner.attention import composition as cp
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


# --------------------------------------------------------------------------- output-side quantities

def _has_channels(inputs: ScoringInputs) -> bool:
    """Whether the sink and content channels' second moments were captured (`CaptureConfig(channels=True)`)."""
    return bool(inputs.stats.outputs[0].uu.numel())


def _moments(inputs: ScoringInputs, channels: tuple[str, ...]):
    """Per layer mean and covariance of o, u (sink channel) and w (content channel), as `channels` asks."""
    if any(k != "o" for k in channels) and not _has_channels(inputs):
        raise ValueError("the sink and content channels' energies need their second moments: capture with "
                         "CaptureConfig(channels=True)")
    out = []
    for m in inputs.stats.outputs:
        n = m.tokens
        mean = {k: getattr(m, k) / n for k in channels}  # (H, d)
        cov = {k: getattr(m, k + k) / n - torch.einsum("hd,he->hde", mean[k], mean[k]) for k in channels}
        out.append((mean, cov))
    return out


def fluctuation_exact(inputs: ScoringInputs) -> dict[str, Tensor]:
    """E||W_O,h (x - E x)||^2 for x = o, u, w: the variation each head writes. Each (layer, head).

    With mean compensation, pruning head h perturbs the residual stream by exactly
    W_O,h (o_h - E o_h): `o` is that perturbation's energy, `u` the part of it in
    the sink channel, `w` the part in the content channel (o = u + w).
    """
    channels = ("o", "u", "w") if _has_channels(inputs) else ("o",)
    res = {k: [] for k in channels}
    for (mean, cov), g in zip(_moments(inputs, channels), inputs.gram):
        for k in res:
            res[k].append(torch.einsum("hde,hed->h", g, cov[k]))
    return {k: torch.stack(v).clamp_min(0) for k, v in res.items()}


def cross_energy(outputs: list, o_gram: Tensor) -> Tensor:
    """K[l, h, g] = E[(W_h (o_h - E o_h)) . (W_g (o_g - E o_g))]. (layer, head, head)

    The energy of pruning a set P of heads of a layer with mean compensation is
    exactly sum_{h, g in P} K[h, g]: K's diagonal is each head's own fluctuation,
    its off-diagonal the interaction of two heads' deviations (positive when they
    carry the same signal, so removing both costs more than the sum).
    """
    out = []
    for m, gram in zip(outputs, o_gram):  # o_gram: (layer, H*d_head, H*d_head) W_O^T W_O
        mean = (m.o / m.tokens).reshape(-1)
        cov = m.joint.double() / m.tokens  # (D, D), D = H * d_head; in place from here (one more matrix, not three)
        cov.sub_(torch.outer(mean, mean))
        H = m.o.shape[0]
        prod = cov.mul_(gram).view(H, cov.shape[0] // H, H, cov.shape[0] // H)  # G_ij C_ij (C symmetric)
        out.append(prod.sum(dim=(1, 3)))
    return torch.stack(out)


def _flap(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """FLAP: per channel variance around the calibration mean x squared column norm, summed per head."""
    rows = []
    for (mean, cov), g in zip(_moments(inputs, ("o",)), inputs.gram):
        var = torch.diagonal(cov["o"], dim1=-2, dim2=-1)  # (H, d)
        col_sq = torch.diagonal(g, dim1=-2, dim2=-1)      # ||W_O[:, c]||^2
        rows.append((var * col_sq).sum(-1))
    return torch.stack(rows)


# --------------------------------------------------------------------------- redundancy

def _max_similarity(sim: Tensor, alive: Tensor) -> Tensor:
    """Each head's highest similarity to another *alive* head of its layer. (layer, head)."""
    H = sim.shape[-1]
    other = alive[:, None, :] & ~torch.eye(H, dtype=torch.bool)[None]
    return torch.where(other, sim, torch.full_like(sim, float("-inf"))).amax(-1).clamp_min(0)


def _redundancy(inputs: ScoringInputs, alive: Tensor, convention: str) -> Tensor:
    """Greedy redundancy: a head nearly identical to a surviving head is least important."""
    return -_max_similarity(inputs.stats.pairs[f"cosine/{convention}"], alive)


def _sink_aware(inputs: ScoringInputs, alive: Tensor, convention: str) -> Tensor:
    """Unique signal per head: what pruning it would still change, weighted by its content share.

    Importance of head h in layer l, given the heads already pruned there (P):
    (K[h, h] + 2 sum_{g in P} K[h, g]) x (1 - s_h) / R_l, with K the cross energy.

    - Mean compensation folds E[W_O,h o_h] -- mostly the sink channel, which
      writes nearly the same vector for every query -- into the bias, so what
      pruning costs is the energy of the deviation W_O,h (o_h - E o_h).
    - Heads pruned from one layer interact: K's cross terms add the covariance of
      their deviations, so two heads carrying the same signal (output-space
      twins) cost more together and the greedy selection, which re-scores after
      every removal, does not take both.
    - (1 - s_h), the content share of the head's attention, discounts heads whose
      deviation is mostly the sink channel's (s varying row to row along the
      single direction of the sink's value) rather than content.
    - / R_l, the mean squared norm of the residual stream the layer writes into:
      what later layers (behind their norms) see is the perturbation *relative*
      to the stream. Without it, early heads of small models, whose stream is
      tiny, look unimportant and get pruned first (catastrophic on the
      from-scratch Llama: +41 instead of +6 perplexity at 25% on the dev split).
    The choice is made with evidence (eval/studies/scorers.py on a development
    split): see docs/scorers.md.
    """
    if inputs.cross is None:
        raise ValueError("the sink-aware scorer needs the cross energy (pruner.pruning.calibrate computes it)")
    k = inputs.cross
    pruned = (~alive).to(k.dtype)
    marginal = torch.diagonal(k, dim1=-2, dim2=-1) + 2 * torch.einsum("lhg,lg->lh", k, pruned)
    residual = inputs.stats.residual if inputs.stats.residual is not None else torch.ones(k.shape[0])
    return marginal * (1 - inputs.stats.sink_mass) / residual.to(k.dtype)[:, None]


def refit_costs(inputs: ScoringInputs, alive: Tensor) -> Tensor:
    """Marginal refit cost of pruning each alive head next: E_l(P_l + h) - E_l(P_l). (layer, head)

    E_l is the Schur-complement energy `refit.System.unexplained` of layer l, P_l its
    heads already pruned; pruned heads get 0. Bordered-inverse updates (`refit.marginal_costs`): a d x d
    Schur complement per candidate, and the pruned set's inverse carried from step to step (bordered by
    the head a step removed, not inverted afresh). Only the layer a greedy step changed is priced again.
    """
    L, H = alive.shape
    out = torch.zeros(L, H, dtype=torch.float64)
    for layer, sys in enumerate(inputs.refit_systems()):
        key = tuple(alive[layer].tolist())
        if inputs._costs.get(layer, (None,))[0] == key:  # a greedy step changes one layer: the others are as were
            out[layer] = inputs._costs[layer][1]
            continue
        d = sys.gram.shape[0] // H
        pruned = (~alive[layer]).repeat_interleave(d)  # (D,) channels
        heads = alive[layer].nonzero().flatten().tolist()
        state = inputs._costs.setdefault(("inverse", layer), {})  # A^-1 of the layer's pruned set, bordered
        costs = refit.marginal_costs(sys, pruned, [torch.arange(h * d, (h + 1) * d) for h in heads], state)
        for h, c in zip(heads, costs):
            out[layer, h] = c
        inputs._costs[layer] = (key, out[layer].clone())
    return out


def _refit_energy(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """What refit compensation cannot recover if the head goes next, relative to the residual stream.

    Importance of head h in layer l, given the heads P already pruned there:
    (E_l(P + h) - E_l(P)) / R_l, with E_l(P) = tr(W_P (S_PP - S_PK (S_KK + lam I)^-1 S_KP) W_P^T)
    the energy the kept heads' refitted columns cannot rebuild (docs/design.md §8.1).
    A head is cheap exactly when the other heads of its layer -- their sink channels
    included, which write a near-constant vector -- reconstruct its output: literal
    redundancy, and dormant near-constant heads. Greedy and re-scored after every
    removal, since what the kept heads can rebuild depends on which are kept.
    R_l is the sink-aware scorer's residual normalisation (a common cross-layer scale).
    """
    residual = inputs.stats.residual if inputs.stats.residual is not None else torch.ones(alive.shape[0])
    return refit_costs(inputs, alive) / residual.double()[:, None]


def _bos_sink(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """Sok et al. 2026 ("BOS sink heads"): the mean attention a head gives the sink, highest pruned first.

    The sink is the run's sink set: the first token by default for decoders, which is the
    paper's BOS score exactly (`[CLS]`/`[SEP]` for encoders). A head that parks nearly all
    of its attention there writes a near-constant vector: the paper prunes those first.
    """
    return -inputs.stats.sink_mass


def output_norm(inputs: ScoringInputs) -> Tensor:
    """E||W_O,h o_h||^2 per head: the mean squared norm of what each head writes into the residual stream.
    (layer, head), float64.

    After W_O, not before: the residual stream receives W_O,h o_h, and a head with large
    values but small output columns (or the reverse) writes little (much); the norm of o_h
    alone would rank heads by a scale the next layer never sees. E[o o^T] is the head's
    uncentred second moment from the calibration capture, so the mean (the sink channel's
    near-constant vector) counts: a head that writes a large constant is not inactive.
    """
    rows = []
    for m, g in zip(inputs.stats.outputs, inputs.gram):  # g: (H, d, d) W_O,h^T W_O,h
        rows.append(torch.einsum("hde,hed->h", g.double(), m.oo.double() / m.tokens))
    return torch.stack(rows).clamp_min(0)


def _output_norm(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """Sandoval-Segura et al. 2025 ("inactive heads"): the head output norm, lowest pruned first."""
    return output_norm(inputs)


def _ablation(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """The measured reference: the calibration-loss increase when the head alone is removed (with the run's
    compensation), on a calibration subset. Computed by `pruner.pruning.ablation` (L x H extra passes)."""
    if inputs.ablation is None:
        raise ValueError("the ablation scorer needs measured single-head ablations (calibrate with ablation=...)")
    return inputs.ablation


def _ablation_shortlist(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """The cheaper measured scorer: the loss increase of removing the head alone (with the run's compensation)
    for the shortlist of each layer -- the heads the refit-aware proxy would prune first -- and, above every
    measured head, the others in head order (never pruned before a measured head). `shortlist` x L x H + 1 passes instead of L x H + 1."""
    if inputs.ablation is None or inputs.shortlist is None:
        raise ValueError("the ablation-shortlist scorer needs measured ablations of its shortlist (calibrate with "
                         "ablation=AblationRequest(..., scorers=('ablation-shortlist',)))")
    short = inputs.shortlist
    measured = torch.where(short, inputs.ablation, torch.zeros_like(inputs.ablation))
    top = float(measured.abs().max()) + 1.0
    rank = (~short).cumsum(-1).to(measured.dtype) / short.shape[-1]  # unmeasured heads, in head order
    return torch.where(short, measured, top + rank)


def _entropy(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """Full-row entropy (bertology style): the lowest-entropy heads go first."""
    return inputs.stats.entropy_full


def _magnitude(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    return inputs.weight_norm


def _gradient(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    if inputs.gradient is None:
        raise ValueError("the gradient scorer needs gradient importance (calibrate with gradient=True)")
    return inputs.gradient


def _random(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """Seeded uniform importances of every head of the model (a one-layer view takes its layer's row)."""
    g = torch.Generator().manual_seed(inputs.seed)
    scores = torch.rand((inputs.n_layers, alive.shape[1]), generator=g, dtype=torch.float64)
    return scores if inputs.position is None else scores[inputs.position[0]:inputs.position[0] + 1]


# --------------------------------------------------------------------------- whole attention layers
# Layer scorers return importance (layer,), higher = keep; selection.unit: layer removes the lowest.

def _layer_sink_aware(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """The sink-aware reading of a whole layer: what removing its attention changes after mean compensation,
    weighted by content share, relative to the residual stream. (layer,)

    sum_{h,g} (1 - s_h) K[h, g] / R_l, with K the cross energy (`cross_energy`): sum_{h,g} K[h, g] is exactly
    the energy of the perturbation E||W_O (o - E o)||^2 that removing every head of the layer leaves once their
    mean output -- mostly the sink channel's near-constant vector, which later layers expect -- is folded into
    the bias. A layer whose heads park their attention on the sink writes nearly a constant: mean compensation
    keeps it, and its content share (1 - s_h) discounts what little varies. It is the head scorer's
    `_sink_aware` with every head of the layer pruned at once.
    """
    if inputs.cross is None:
        raise ValueError("the layer-sink-aware scorer needs the cross energy (the joint output moments)")
    content = (1 - inputs.stats.sink_mass).to(inputs.cross.dtype)  # (layer, head)
    energy = torch.einsum("lhg,lh->l", inputs.cross, content)
    residual = inputs.stats.residual if inputs.stats.residual is not None else torch.ones(energy.shape[0])
    return energy / residual.to(energy.dtype)


def _layer_cosine(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """He et al. 2024 ("What Matters in Transformers? Not All Attention is Needed"): 1 - the mean cosine
    similarity between the residual stream entering the attention sub-block and leaving it. (layer,)

    A layer whose attention barely turns the stream (similarity near 1) is the most droppable. The cosine is
    averaged over every real calibration token (sums and a count from the capture, padding-free)."""
    if inputs.stats.attn_cosine is None:
        raise ValueError("the layer-cosine scorer needs the attention blocks' input/output cosines "
                         "(CaptureConfig(layer_cosine=True))")
    return 1 - inputs.stats.attn_cosine


def _layer_ablation(inputs: ScoringInputs, alive: Tensor, convention) -> Tensor:
    """Measured: the calibration-loss increase when the layer's whole attention is removed (with the run's
    compensation), on a calibration subset: L + 1 passes (`pruner.pruning.ablation.layer_ablations`). (layer,)"""
    if inputs.layer_ablation is None:
        raise ValueError("the layer-ablation scorer needs measured layer ablations (calibrate with "
                         "AblationRequest(..., scorers=('layer-ablation',)))")
    return inputs.layer_ablation


SCORERS: dict[str, Scorer] = {s.name: s for s in [
    Scorer("sink-aware", _sink_aware, adaptive=True, reads_joint=True,
           doc="energy left after mean compensation (joint within a layer) x content share (1 - s), "
               "relative to the residual stream", reads="sink and content channels separated (no convention)"),
    Scorer("refit-energy", _refit_energy, adaptive=True, needs_systems=True, reads_joint=True,
           doc="what refit compensation cannot rebuild if the head goes next (Schur-complement energy), "
               "relative to the residual stream", reads="head outputs (no attention rows)"),
    Scorer("cosine", _redundancy, adaptive=True, convention=cp.FULL,
           doc="greedy redundancy on full rows (sink included): the naive baseline"),
    Scorer("content-cosine", _redundancy, adaptive=True, convention=cp.CONTENT,
           doc="greedy redundancy on content rows only (sink separated, then ignored)"),
    Scorer("entropy", _entropy, doc="full-row attention entropy, lowest first", reads="full rows (sink included)"),
    Scorer("gradient", _gradient, needs_gradient=True, doc="Michel et al. 2019: E|dL/d mask_h|",
           reads="loss gradients (no attention rows)"),
    Scorer("magnitude", _magnitude, doc="norm of the head's q/k/v/o weight slices", reads="weights (no attention rows)"),
    Scorer("fluctuation", _flap, reads_head_moments=True, doc="FLAP (An et al. 2024): output-channel variance x column norm",
           reads="head outputs (no attention rows)"),
    Scorer("bos-sink", _bos_sink, doc="Sok et al. 2026: mean attention to the sink (BOS), highest pruned first",
           reads="sink mass"),
    Scorer("output-norm", _output_norm, reads_head_moments=True, doc="Sandoval-Segura et al. 2025: mean squared norm of the head's output "
           "after W_O, lowest pruned first", reads="head outputs (no attention rows)"),
    Scorer("ablation", _ablation, needs_ablation=True, doc="measured: calibration-loss increase when the head "
           "alone is removed with the run's compensation", reads="the loss (L x H extra passes)"),
    Scorer("ablation-shortlist", _ablation_shortlist, needs_ablation=True, reads_joint=True,
           doc="measured on a shortlist: the ablation of each layer's heads the refit-aware proxy finds "
               "cheapest (scorer.shortlist of them), the rest kept above", reads="the loss (shortlist x L x H "
                                                                                 "extra passes)"),
    Scorer("random", _random, doc="seeded uniform", reads="nothing (seeded)"),
]}
# The layer scorers (selection.unit: layer): a registry of their own, so every loop over the head scorers
# (compare's default, the studies) stays as it was; `get_scorer` knows both.
LAYER_SCORERS: dict[str, Scorer] = {s.name: s for s in [
    Scorer("layer-sink-aware", _layer_sink_aware, reads_joint=True, unit="layer",
           doc="a layer's energy left after mean compensation (its heads jointly) x content share, relative to "
               "the residual stream", reads="sink and content channels separated (no convention)"),
    Scorer("layer-cosine", _layer_cosine, reads_layer_cosine=True, unit="layer",
           doc="He et al. 2024: cosine similarity of the attention block's input and output, highest removed "
               "first", reads="the residual stream around the attention block"),
    Scorer("layer-ablation", _layer_ablation, needs_ablation=True, unit="layer",
           doc="measured: calibration-loss increase when the layer's attention is removed with the run's "
               "compensation", reads="the loss (L extra passes)"),
]}


ALL_SCORERS: dict[str, Scorer] = {**SCORERS, **LAYER_SCORERS}


def get_scorer(name: str) -> Scorer:
    """A registered scorer (head or layer); an unknown name lists the valid ones and suggests the nearest."""
    if name in ALL_SCORERS:
        return ALL_SCORERS[name]
    near = difflib.get_close_matches(name, ALL_SCORERS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"unknown scorer {name!r}{hint}; valid: {', '.join(SCORERS)}; layer scorers (selection.unit: "
                     f"layer): {', '.join(LAYER_SCORERS)}")
