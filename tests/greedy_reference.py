"""The greedy selection as it was before selection curves (issue 33): every layer re-scored as one, the lowest
unit anywhere removed. Kept only as the tests' oracle: `pruner.pruning.selection.select` (curves built a layer
at a time, then merged) must give its plans exactly."""

from __future__ import annotations

import torch

from pruner.attention import composition as cp
from pruner.pruning.selection import Plan, PlanEntry, SelectionError, check_target


def _units(alive, scores, geom, cfg, layer_quota):
    units = []
    gs = geom.group_size
    for layer in range(geom.n_layers):
        heads = alive[layer].nonzero().flatten().tolist()
        if gs == 1:
            cands = [[h] for h in heads]
        elif cfg.gqa == "group":
            groups = sorted({h // gs for h in heads})
            cands = [[h for h in heads if h // gs == k] for k in groups]
        else:
            groups = sorted({h // gs for h in heads})
            pick = [min((h for h in heads if h // gs == k), key=lambda h: (scores[layer, h].item(), h))
                    for k in groups]
            cands = [pick] if all(sum(1 for h in heads if h // gs == k) > 1 for k in groups) else []
        for c in cands:
            if len(heads) - len(c) < cfg.min_heads_per_layer:
                continue
            if layer_quota is not None and layer_quota[layer] < len(c):
                continue
            units.append((scores[layer, c].mean().item(), layer, c))
    return units


def _twin(inputs, alive, layer, head, convention):
    sim = inputs.stats.pairs.get(f"cosine/{convention or cp.CONTENT}")
    if sim is None:
        return None, None
    row = sim[layer, head].clone()
    mask = alive[layer].clone()
    mask[head] = False
    if not mask.any():
        return None, None
    row[~mask] = float("-inf")
    j = int(row.argmax())
    return j, float(row[j])


def greedy_select(scorer, inputs, geom, cfg, convention=None) -> Plan:
    target, quota = check_target(geom, cfg)
    alive = torch.ones(geom.n_layers, geom.n_heads, dtype=torch.bool)
    conv = convention or scorer.convention
    scores = scorer(inputs, alive, conv).to(torch.float64)
    entries = []
    while len(entries) < target:
        units = [u for u in _units(alive, scores, geom, cfg, quota) if len(entries) + len(u[2]) <= target]
        if not units:
            break
        score, layer, heads = min(units, key=lambda u: (u[0], u[1], u[2]))
        for h in heads:
            twin, sim = _twin(inputs, alive, layer, h, conv)
            entries.append(PlanEntry(layer, h, len(entries), float(scores[layer, h]), twin, sim,
                                     float(inputs.stats.sink_mass[layer, h])))
            alive[layer, h] = False
        if quota is not None:
            quota[layer] -= len(heads)
        if scorer.adaptive:
            scores = scorer(inputs, alive, conv).to(torch.float64)
    if not entries:
        raise SelectionError("no head could be selected under the constraints")
    return Plan(scorer.name, conv if scorer.adaptive else None, target, entries)
