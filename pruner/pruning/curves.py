"""Selection curves: each layer's greedy removal order, built from that layer alone (docs/design.md §8.4).

Every scorer prices a layer's heads from that layer's sums (plus per-layer scalars such as the
residual norm R_l), and an adaptive scorer re-scores only the layer a removal changed. So the
global greedy selection (`pruner.pruning.selection.select`: remove the lowest-scored unit anywhere,
re-score, repeat) is a merge of per-layer sequences: the order in which the layer's own greedy
would remove its units, each with the score it had when it went. That sequence -- the layer's
*curve* -- can be built the moment the layer's sums are final and the sums then dropped: a global
budget merges the curves by score, a per-layer (servable) budget takes each curve's prefix of the
layer's quota. The plans are the ones the greedy over all layers at once gives, exactly: within a
layer the same candidates, scores and tie-breaks; across layers the same minimum.

A curve is built to the deepest removal the layer allows (`min_heads_per_layer`, the GQA mode), so
one curve serves every target and budget. Pure tensor math: the caller gives a function from the
layer's alive heads to their scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Removal:
    """One greedy step within a layer: the heads it removes (a GQA unit may hold several), the unit's score
    (the mean of its heads' scores: what the budget compares across layers), and per head what the plan
    records: (head, score, nearest surviving twin, twin similarity, sink mass)."""

    heads: tuple[int, ...]
    score: float
    entries: tuple[tuple[int, float, int | None, float | None, float], ...]


@dataclass(frozen=True)
class CurveKey:
    """What a curve depends on besides the layer's data: the scorer, the convention it compares heads under,
    the GQA mode and the minimum of heads a layer keeps."""

    scorer: str
    convention: str | None
    gqa: str
    min_heads: int


def layer_units(alive: Tensor, scores: Tensor, group_size: int, gqa: str, min_heads: int) -> list[tuple[float, list[int]]]:
    """A layer's candidate removals, each keeping every constraint: (mean score, heads). alive, scores: (head,).

    Without GQA a unit is one head; `group`: a whole KV group of alive heads; `equal`: one head from every
    kept group, the lowest-scored in each (ties: the lower head) -- none once a group is down to one head.
    """
    heads = alive.nonzero().flatten().tolist()
    gs = group_size
    if gs == 1:
        cands = [[h] for h in heads]
    elif gqa == "group":
        groups = sorted({h // gs for h in heads})
        cands = [[h for h in heads if h // gs == k] for k in groups]
    else:
        groups = sorted({h // gs for h in heads})
        pick = [min((h for h in heads if h // gs == k), key=lambda h: (scores[h].item(), h)) for k in groups]
        cands = [pick] if all(sum(1 for h in heads if h // gs == k) > 1 for k in groups) else []
    return [(scores[c].mean().item(), c) for c in cands if len(heads) - len(c) >= min_heads]


def nearest_twin(similarity: Tensor | None, alive: Tensor, head: int) -> tuple[int | None, float | None]:
    """The head's most similar other alive head of its layer and that similarity (similarity: (head, head))."""
    if similarity is None:
        return None, None
    row = similarity[head].clone()
    others = alive.clone()
    others[head] = False
    if not others.any():
        return None, None
    row[~others] = float("-inf")
    j = int(row.argmax())
    return j, float(row[j])


def layer_curve(score: Callable[[Tensor], Tensor], adaptive: bool, n_heads: int, group_size: int, gqa: str,
                min_heads: int, similarity: Tensor | None, sink_mass: Tensor) -> tuple[Removal, ...]:
    """The layer's greedy removal order to the deepest removal it allows.

    `score(alive)` gives the layer's importances (head,) given its alive heads (bool (head,)); with `adaptive`
    it is asked again after every removal, else once. `similarity` (head, head) names each removed head's
    nearest surviving twin, `sink_mass` (head,) is recorded beside it.
    """
    alive = torch.ones(n_heads, dtype=torch.bool)
    scores = score(alive).to(torch.float64)
    out = []
    while True:
        units = layer_units(alive, scores, group_size, gqa, min_heads)
        if not units:
            return tuple(out)
        unit_score, heads = min(units, key=lambda u: (u[0], u[1]))
        entries = []
        for h in heads:
            twin, sim = nearest_twin(similarity, alive, h)
            entries.append((h, float(scores[h]), twin, sim, float(sink_mass[h])))
            alive[h] = False
        out.append(Removal(tuple(heads), unit_score, tuple(entries)))
        if adaptive:
            scores = score(alive).to(torch.float64)


def merge(curves: list[tuple[Removal, ...]], target: int, quota: list[int] | None) -> list[tuple[int, Removal]]:
    """The global greedy over every layer's curve: (layer, removal) in selection order.

    At each step every layer offers its next removal if its quota and the target leave room for it; the one
    with the lowest (score, layer) goes. With quotas (a per-layer budget) each layer's share is the prefix of
    its curve that fits its quota, whatever the other layers hold.
    """
    pos = [0] * len(curves)
    done, out = 0, []
    left = None if quota is None else list(quota)
    while done < target:
        offers = []
        for layer, curve in enumerate(curves):
            if pos[layer] == len(curve):
                continue
            step = curve[pos[layer]]
            if (left is not None and left[layer] < len(step.heads)) or done + len(step.heads) > target:
                continue
            offers.append((step.score, layer, list(step.heads)))
        if not offers:
            break
        _, layer, _ = min(offers)
        step = curves[layer][pos[layer]]
        out.append((layer, step))
        pos[layer] += 1
        done += len(step.heads)
        if left is not None:
            left[layer] -= len(step.heads)
    return out


def prefix(curve: tuple[Removal, ...], quota: int) -> list[int]:
    """The heads a per-layer budget of `quota` takes from a layer's curve (sorted): its removals while they fit."""
    heads, left = [], quota
    for step in curve:
        if len(step.heads) > left:
            break
        heads += step.heads
        left -= len(step.heads)
    return sorted(heads)
