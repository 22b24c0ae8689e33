"""Head scorers in one registry: importance per head, higher = keep. Pure tensor math.

Every scorer reads a `ScoringInputs` (built once by `pruner.pruning.calibrate`) and the
current `alive` mask, and returns importance (layer, head). Scorers whose score
depends on which heads survive (redundancy) are `adaptive`: selection re-scores
after every removal. Baselines live here beside the sink-aware scorer, so every
comparison runs through one code path.
"""

from __future__ import annotations

import difflib

import torch

from pruner.attention import composition as cp
from pruner.pruning import refit
from pruner.pruning.layer_scoring import LAYER_SCORERS
from pruner.pruning.scoring_types import Scorer, ScoringInputs

Tensor = torch.Tensor


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


ALL_SCORERS: dict[str, Scorer] = {**SCORERS, **LAYER_SCORERS}


def get_scorer(name: str) -> Scorer:
    """A registered scorer (head or layer); an unknown name lists the valid ones and suggests the nearest."""
    if name in ALL_SCORERS:
        return ALL_SCORERS[name]
    near = difflib.get_close_matches(name, ALL_SCORERS, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise ValueError(f"unknown scorer {name!r}{hint}; valid: {', '.join(SCORERS)}; layer scorers (selection.unit: "
                     f"layer): {', '.join(LAYER_SCORERS)}")
