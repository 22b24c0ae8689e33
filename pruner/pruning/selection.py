"""Greedy head selection with budgets, per-layer minimums and GQA constraints; the plan.

Selection removes one *unit* at a time — a head, or under GQA a set of heads
that keeps the layer valid — the one with the lowest importance, and re-scores
among the survivors when the scorer is adaptive. Re-scoring is what makes it
twin-aware: once one of two near-identical heads is gone, the other is no longer
redundant, so both are never removed together. Ties break by (layer, head), so
selection is deterministic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from pruner.attention import composition as cp
from pruner.core.arch import Geometry
from pruner.pruning.curves import CurveKey, Removal, layer_curve, merge
from pruner.pruning.scoring import Scorer, ScoringInputs

GQA_MODES = ("equal", "group")


class SelectionError(ValueError):
    pass


@dataclass(frozen=True)
class SelectionConfig:
    """What to prune. `target`: a fraction of all heads (0 < t < 1) or a head count (>= 1)."""

    target: float = 0.25
    budget: str = "global"        # "global" | "layer"
    min_heads_per_layer: int = 1
    gqa: str = "equal"            # "equal" query heads per KV group | whole KV "group"s
    shapes: tuple[int, ...] | None = None  # servable: the heads per layer a vanilla config can lose (None: any)

    def count(self, n_total: int) -> int:
        n = round(self.target * n_total) if self.target < 1 else int(self.target)
        return n


MAX_SHAPE_MOVE = 0.25  # a servable shape may move the per-layer count by at most this share of the target's


def servable_per_layer(geom: Geometry, cfg: SelectionConfig) -> int:
    """The heads every layer loses under `cfg.shapes`: the servable count nearest to the target's share of a
    layer (ties: fewer), never zero. A target further than `MAX_SHAPE_MOVE` from every servable count, or a
    family with no servable pruned shape, is a SelectionError listing the servable choices."""
    options = [k for k in sorted(cfg.shapes or ()) if 0 < k <= geom.n_heads - cfg.min_heads_per_layer]
    if not options:
        raise SelectionError(f"no servable shape prunes heads here (a vanilla config holds {geom.n_heads} heads per "
                             f"layer only, with min_heads_per_layer={cfg.min_heads_per_layer}); use "
                             "selection.shape: any for the per-layer form")
    want = cfg.count(geom.n_layers * geom.n_heads) / geom.n_layers
    k = min(options, key=lambda k: (abs(k - want), k))
    if abs(k - want) > MAX_SHAPE_MOVE * want:  # a rounding moves the target; a leap is the user's to choose
        kept = ", ".join(str(geom.n_heads - x) for x in options)
        fractions = ", ".join(f"{x / geom.n_heads:g}" for x in options)
        raise SelectionError(
            f"selection.target {cfg.target:g} ({want:g} of {geom.n_heads} heads per layer) is not a servable shape: "
            f"a vanilla config holds layers that all keep {kept} query heads (selection.target {fractions}); "
            "choose one of those, or selection.shape: any to prune the target exactly in the per-layer form")
    return k


def shape_note(geom: Geometry, cfg: SelectionConfig) -> str | None:
    """One line when a servable shape moves the target (None when it meets it exactly, or shapes are free)."""
    if cfg.shapes is None:
        return None
    total, asked = geom.n_layers * geom.n_heads, cfg.count(geom.n_layers * geom.n_heads)
    k = servable_per_layer(geom, cfg)
    if k * geom.n_layers == asked:
        return None
    kept = sorted({geom.n_heads - x for x in cfg.shapes if 0 < x < geom.n_heads} | {geom.n_heads})
    return (f"selection: {asked} of {total} heads is not a servable shape (every layer keeps the same number of "
            f"query heads, one of {', '.join(map(str, kept))}, for a vanilla checkpoint); pruning {k} per layer "
            f"instead: {k * geom.n_layers} heads ({k * geom.n_layers / total:.1%}). selection.shape: any prunes "
            "the target exactly, in the per-layer form")


@dataclass(frozen=True)
class PlanEntry:
    layer: int
    head: int
    step: int
    score: float
    twin: int | None
    twin_similarity: float | None
    sink_mass: float


@dataclass(frozen=True)
class Plan:
    """Which heads to prune, in selection order, and what the selection saw.

    `entries` (score, sink mass and nearest surviving twin of every pruned head)
    is what plan.json holds. A plan made by `pruner.plan` also carries the model's
    geometry, the convention sensitivity, every head's sink mass and the calibration
    it was made from (`calibration`, a ScoringInputs: what compensation needs);
    a plan read back from plan.json has none of those.
    """

    scorer: str
    convention: str | None
    target: int
    entries: list[PlanEntry] = field(default_factory=list)
    geometry: Geometry | None = field(default=None, compare=False)
    sensitivity: "Sensitivity | None" = field(default=None, compare=False)
    sink_mass: torch.Tensor | None = field(default=None, compare=False, repr=False)  # (layer, head)
    calibration: ScoringInputs | None = field(default=None, compare=False, repr=False)
    note: str | None = field(default=None, compare=False, repr=False)  # the servable shape moved the target
    unit: str = "head"  # "layer": whole attention layers were chosen (`select_layers`); entries are their heads
    layers: tuple[int, ...] = ()  # unit "layer": the chosen layers, in selection order

    @property
    def heads(self) -> dict[int, list[int]]:
        """{layer: [head, ...]}, original head numbering, layers and heads sorted."""
        out: dict[int, list[int]] = {}
        for e in self.entries:
            out.setdefault(e.layer, []).append(e.head)
        return {k: sorted(v) for k, v in sorted(out.items())}

    def to_dict(self) -> dict:
        """plan.json's content (floats to 10 significant digits)."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        """Byte-stable JSON: floats to 10 significant digits, because sums over a different
        number of threads differ in the last bits and the plan must not."""

        def sig(x):
            return x if not isinstance(x, float) else float(f"{x:.10g}")

        entries = [{k: sig(v) for k, v in asdict(e).items()} for e in self.entries]
        layer = {"unit": "layer", "layers": list(self.layers)} if self.unit == "layer" else {}  # head plans: as ever
        return json.dumps({"scorer": self.scorer, "convention": self.convention, "target": self.target,
                           "pruned": len(self.entries), "heads": {str(k): v for k, v in self.heads.items()},
                           "entries": entries, **layer}, indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A plan read back from plan.json (no calibration: `zero` compensation only)."""
        try:
            entries = [PlanEntry(**e) for e in d["entries"]]
            return cls(d["scorer"], d["convention"], d["target"], entries, unit=d.get("unit", "head"),
                       layers=tuple(d.get("layers", ())))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a pruner plan (plan.json): {e}") from None

    def __repr__(self) -> str:
        total = f"/{self.geometry.n_layers * self.geometry.n_heads}" if self.geometry else ""
        per_layer = ", ".join(f"{k}: {len(v)}" for k, v in self.heads.items())
        conv = f", {self.convention} convention" if self.convention else ""
        sens = ""
        if self.sensitivity is not None:
            whose = "" if self.convention else " (of the cosine plan)"
            sens = f"; {self.sensitivity.changed} heads change under the other convention{whose}"
        if self.unit == "layer":
            of = f"/{self.geometry.n_layers}" if self.geometry else ""
            return f"Plan({self.scorer}: {len(self.layers)}{of} attention layers {list(self.layers)})"
        return f"Plan({self.scorer}{conv}: {len(self.entries)}{total} heads; per layer {{{per_layer}}}{sens})"


def check_target(geom: Geometry, cfg: SelectionConfig) -> tuple[int, list[int] | None]:
    """The number of heads to prune (and per-layer quotas), or a SelectionError saying why not.

    Depends only on the geometry, so pipelines call it before any calibration compute.
    """
    n_total = geom.n_layers * geom.n_heads
    if cfg.shapes is not None:  # servable: the same number of heads from every layer
        k = servable_per_layer(geom, cfg)
        return k * geom.n_layers, [k] * geom.n_layers
    target = cfg.count(n_total)
    if target <= 0:
        raise SelectionError(f"selection.target {cfg.target:g} selects 0 of {n_total} heads; use at least "
                             f"{1 / n_total:.3g} (one head) or a head count")
    spare = geom.n_heads - cfg.min_heads_per_layer
    if spare <= 0:
        raise SelectionError(f"selection.min_heads_per_layer={cfg.min_heads_per_layer} keeps all {geom.n_heads} "
                             "heads of every layer: nothing can be pruned")
    if target > spare * geom.n_layers:
        raise SelectionError(f"selection.target asks for {target} of {n_total} heads, but keeping "
                             f"min_heads_per_layer={cfg.min_heads_per_layer} in each of {geom.n_layers} layers "
                             f"leaves at most {spare * geom.n_layers} prunable; lower the target")
    if cfg.budget != "layer":
        return target, None
    per = target // geom.n_layers
    return target, [per + (1 if layer < target - per * geom.n_layers else 0) for layer in range(geom.n_layers)]


def curve_key(scorer: Scorer, geom: Geometry, cfg: SelectionConfig, convention: str | None = None) -> CurveKey:
    """What `scorer`'s curves depend on under `cfg` (the GQA mode only where layers have KV groups)."""
    return CurveKey(scorer.name, convention or scorer.convention, cfg.gqa if geom.group_size > 1 else "equal",
                    cfg.min_heads_per_layer)


def layer_curve_of(scorer: Scorer, one: ScoringInputs, geom: Geometry, key: CurveKey) -> tuple[Removal, ...]:
    """One layer's curve (`pruner.pruning.curves.layer_curve`) from its one-layer inputs (`ScoringInputs.layer`, or
    what a layer-by-layer calibration builds the moment the layer's sums are final). A removed head's twin is
    its nearest surviving neighbour by cosine, under the scorer's convention or CONTENT."""
    sim = one.stats.pairs.get(f"cosine/{key.convention or cp.CONTENT}")
    return layer_curve(lambda alive: scorer(one, alive[None], key.convention)[0], scorer.adaptive, geom.n_heads,
                       geom.group_size, key.gqa, key.min_heads, None if sim is None else sim[0],
                       one.stats.sink_mass[0])


def curves_for(scorer: Scorer, inputs: ScoringInputs, geom: Geometry, key: CurveKey) -> list[tuple[Removal, ...]]:
    """Every layer's curve: the one calibration built while the layer's sums were whole, or built now from the
    inputs' layers -- which needs what the scorer reads still to be there."""
    if key in inputs.curves:
        return inputs.curves[key]
    if inputs.gram is None and (scorer.reads_joint or scorer.reads_head_moments):
        raise SelectionError(f"the {scorer.name} scorer's selection curves (GQA {key.gqa}, at least {key.min_heads} "
                             "heads per layer) were not built during calibration, and the per-layer sums it reads "
                             "were dropped once the asked-for curves were: calibrate with it asked for (`pruner "
                             "compare --scorers ...` builds every compared scorer's)")
    return [layer_curve_of(scorer, inputs.layer(layer), geom, key) for layer in range(geom.n_layers)]


def select(scorer: Scorer, inputs: ScoringInputs, geom: Geometry, cfg: SelectionConfig,
           convention: str | None = None) -> Plan:
    """Greedy selection of heads to prune; returns the plan in removal order.

    The greedy over every layer at once -- remove the lowest-scored unit anywhere, re-score, repeat -- is the
    merge of each layer's own greedy order (`pruner.pruning.curves`): the same plan, from curves that can be
    built one layer at a time.
    """
    target, quota = check_target(geom, cfg)
    key = curve_key(scorer, geom, cfg, convention)
    entries: list[PlanEntry] = []
    for layer, step in merge(curves_for(scorer, inputs, geom, key), target, quota):
        for head, score, twin, sim, sink in step.entries:
            entries.append(PlanEntry(layer, head, len(entries), score, twin, sim, sink))
    if not entries:
        raise SelectionError("no head could be selected under the constraints")
    return Plan(scorer.name, key.convention if scorer.adaptive else None, target, entries)


def check_layer_target(geom: Geometry, cfg: SelectionConfig) -> int:
    """The number of attention layers to remove (unit: layer): `cfg.target` of the layers, or a count; at least
    one, and at least one layer keeps its attention. A SelectionError otherwise, before any calibration."""
    k = cfg.count(geom.n_layers)
    if k <= 0:
        raise SelectionError(f"selection.target {cfg.target:g} selects 0 of {geom.n_layers} attention layers; use "
                             f"at least {1 / geom.n_layers:.3g} (one layer) or a layer count")
    if k >= geom.n_layers:
        raise SelectionError(f"selection.target asks for {k} of {geom.n_layers} attention layers: at most "
                             f"{geom.n_layers - 1} (one layer keeps its attention)")
    return k


def select_layers(scorer: Scorer, inputs: ScoringInputs, geom: Geometry, cfg: SelectionConfig) -> Plan:
    """The k attention layers of lowest importance (ties by layer), as a plan of every head of each.

    Whole layers are not re-scored as they go: each layer scorer reads the layer alone (its energy, its
    stream's cosine, its measured ablation), so one ranking is the greedy order. The plan's entries are the
    chosen layers' heads, so masking, removal, compensation and export run the head code path."""
    k = check_layer_target(geom, cfg)
    importance = scorer(inputs, torch.ones(geom.n_layers, geom.n_heads, dtype=torch.bool)).double()  # (layer,)
    if importance.shape != (geom.n_layers,):
        raise SelectionError(f"the {scorer.name} scorer ranks heads, not layers (selection.unit: layer)")
    order = sorted(range(geom.n_layers), key=lambda layer: (float(importance[layer]), layer))[:k]
    sink = inputs.stats.sink_mass
    entries = [PlanEntry(layer, head, step, float(importance[layer]), None, None, float(sink[layer, head]))
               for step, layer in enumerate(order) for head in range(geom.n_heads)]
    return Plan(scorer.name, None, k, entries, unit="layer", layers=tuple(order))


@dataclass(frozen=True)
class Sensitivity:
    """How many selected heads change if the other convention is used, and which."""

    convention: str
    other: str
    changed: int
    only_this: list[tuple[int, int]]
    only_other: list[tuple[int, int]]


def convention_sensitivity(scorer: Scorer, inputs: ScoringInputs, geom: Geometry, cfg: SelectionConfig,
                           plan: Plan) -> Sensitivity | None:
    """Re-select under the other convention (redundancy scorers only) and diff the head sets."""
    if not scorer.adaptive or plan.convention is None:
        return None
    other = cp.CONTENT if plan.convention == cp.FULL else cp.FULL
    alt = select(scorer, inputs, geom, cfg, convention=other)
    mine = {(e.layer, e.head) for e in plan.entries}
    theirs = {(e.layer, e.head) for e in alt.entries}
    return Sensitivity(plan.convention, other, len(mine - theirs), sorted(mine - theirs), sorted(theirs - mine))
