"""Selection curves (docs/design.md §8.4): each layer's greedy order built from that layer alone, merged into the
plan the greedy over every layer at once gives -- exactly, for every budget, GQA mode, minimum and scorer."""

from __future__ import annotations

import itertools

import pytest
import torch
from greedy_reference import greedy_select

from pruner.attention.sums import HeadStats
from pruner.core.arch import Geometry
from pruner.pruning.curves import layer_curve, merge, prefix
from pruner.pruning.scoring import SCORERS, Scorer, ScoringInputs
from pruner.pruning.selection import SelectionConfig, SelectionError, select

pytestmark = pytest.mark.unit


def synthetic(L: int, H: int, seed: int, ties: bool = False) -> ScoringInputs:
    """Per-head statistics, cosine pair matrices and a symmetric interaction per layer, seeded; `ties`: values
    drawn from a handful, so that equal scores (and the tie-breaks) are common."""
    g = torch.Generator().manual_seed(seed)

    def draw(*s):
        return torch.randint(0, 3, s, generator=g).double() / 2 if ties else \
            torch.rand(*s, generator=g, dtype=torch.float64)

    def per():
        return draw(L, H)

    sim = draw(L, H, H)
    sim = (sim + sim.transpose(1, 2)) / 2
    cross = draw(L, H, H) - 0.5
    cross = (cross + cross.transpose(1, 2)) / 2
    stats = HeadStats(sink_mass=per(), entropy_full=per(), entropy_content=per(), dormancy=per(), g=per(), rest=per(),
                      h_content_weighted=per(), rows=torch.ones(L), content_rows=torch.ones(L),
                      excluded_rows=torch.zeros(L), pairs={"cosine/full": sim, "cosine/content": sim.flip(-1)},
                      residual=draw(L) + 0.5)
    return ScoringInputs(stats=stats, gram=torch.zeros(L, H, 1, 1), weight_norm=per(), cross=cross, seed=seed)


def _interacting(inputs: ScoringInputs, alive: torch.Tensor, convention) -> torch.Tensor:
    """An adaptive score that depends on which heads of the layer are gone (as the sink-aware and refit-aware
    scorers' do)."""
    pruned = (~alive).double()
    return torch.diagonal(inputs.cross, dim1=-2, dim2=-1) + 2 * (inputs.cross * pruned[:, None, :]).sum(-1)


INTERACTING = Scorer("interacting", _interacting, adaptive=True)
CHEAP = [SCORERS[n] for n in ("sink-aware", "cosine", "content-cosine", "entropy", "magnitude", "bos-sink", "random")]


@pytest.mark.parametrize("seed", range(4))
def test_curves_merge_into_the_plans_of_the_greedy_over_every_layer(seed):
    g = torch.Generator().manual_seed(100 + seed)
    for trial in range(5):
        L = int(torch.randint(1, 5, (1,), generator=g))
        groups, per_group = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        H = groups * per_group
        geom = Geometry(L, H, groups, 4)
        inputs = synthetic(L, H, seed * 100 + trial, ties=trial % 3 == 0)
        for scorer, gqa, budget, min_heads, target in itertools.product(
                [INTERACTING, *CHEAP], ["equal", "group"], ["global", "layer"], [1, 2], [0.2, 0.5, 0.9, 3]):
            cfg = SelectionConfig(target=target, budget=budget, min_heads_per_layer=min_heads, gqa=gqa)
            try:
                want = greedy_select(scorer, inputs, geom, cfg)
            except SelectionError as e:
                with pytest.raises(SelectionError, match=str(e)[:30]):
                    select(scorer, inputs, geom, cfg)
                continue
            got = select(scorer, inputs, geom, cfg)
            assert got.entries == want.entries, (scorer.name, gqa, budget, min_heads, target, L, H, groups)
            assert (got.scorer, got.convention, got.target) == (want.scorer, want.convention, want.target)


def test_a_per_layer_budget_takes_each_curves_prefix():
    """With quotas every layer's share is its own curve's prefix, whatever the others hold: what lets a
    layer-by-layer run compensate a layer the moment it finishes."""
    inputs = synthetic(3, 6, 7)
    for quota in ([2, 2, 2], [1, 3, 0], [5, 5, 5]):
        curves = [layer_curve(lambda a, i=i: _interacting(inputs.layer(i), a[None], None)[0], True, 6, 1, "equal", 1,
                              None, inputs.stats.sink_mass[i]) for i in range(3)]
        picked = merge(curves, sum(quota), quota)
        for layer in range(3):
            heads = sorted(h for i, step in picked if i == layer for h in step.heads)
            assert heads == prefix(curves[layer], quota[layer])


def test_a_curve_goes_as_deep_as_the_layer_allows():
    inputs = synthetic(1, 8, 3)

    def score(a):
        return _interacting(inputs, a[None], None)[0]

    assert sum(len(s.heads) for s in layer_curve(score, True, 8, 1, "equal", 1, None, inputs.stats.sink_mass[0])) == 7
    assert sum(len(s.heads) for s in layer_curve(score, True, 8, 1, "equal", 3, None, inputs.stats.sink_mass[0])) == 5
    equal = layer_curve(score, True, 8, 4, "equal", 1, None, inputs.stats.sink_mass[0])  # 2 groups of 4
    assert [len(s.heads) for s in equal] == [2, 2, 2]  # one head per group, until each group keeps one
    group = layer_curve(score, True, 8, 4, "group", 1, None, inputs.stats.sink_mass[0])
    assert [len(s.heads) for s in group] == [4]  # one whole group; the last must stay


def test_a_one_layer_view_scores_as_its_row_of_the_whole():
    inputs = synthetic(4, 6, 11)
    alive = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    for scorer in [INTERACTING, *CHEAP]:
        whole = scorer(inputs, alive)
        for layer in range(4):
            torch.testing.assert_close(scorer(inputs.layer(layer), alive[layer:layer + 1])[0], whole[layer],
                                       rtol=0, atol=0, msg=scorer.name)
