"""Mergeable per-head attention statistics: sums and counts, reduced exactly.

Pure tensor math. The kernel (`pruner.attention.kernel`) turns each chunk of attention
rows into a `LayerStats` of sums; `LayerStats` add (batches, processes), and `finalize`
divides once at the end. Because only sums and counts are kept, batch size,
batch order, padding and query chunking cannot change any statistic.

Definitions (docs/design.md §5):

- head-level rows: non-pad query rows whose query token is not a sink;
- sink mass, full entropy, dormancy: means over head-level rows;
- content entropy and CONTENT pairwise metrics: means over head-level rows with
  >= 2 content keys (the others carry no content information; counted);
- FULL pairwise metrics: means over all head-level rows;
- pairwise head x head matrices are within a layer: the mean over the query rows
  the two heads share (all of them) of the per-row metric. Across layers
  (`unstack_layers`), every head of the model is compared with every other: the
  layers see the same query tokens, so stacking all layers' heads on one head
  axis and running the same `chunk_stats` gives the model-wide matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from pruner.attention import composition as cp
from pruner.attention.moments import FoldMoments, OutputMoments

Tensor = torch.Tensor


@dataclass
class LayerStats:
    """Sums and counts for one layer (float64). Per-head sums are (head,), pairs (head, head)."""

    rows: Tensor            # () head-level rows
    content_rows: Tensor    # () rows with >= 2 content keys
    sink_mass: Tensor       # sum s
    entropy_full: Tensor    # sum H(a)
    entropy_content: Tensor  # sum H(c) over content rows
    g: Tensor               # sum H_b(s) + s H(c_S)   (entropy attribution)
    rest: Tensor            # sum 1 - s
    rest_h_content: Tensor  # sum (1 - s) H(c)
    dormant: Tensor         # rows with s >= dormant threshold
    pairs: dict[str, Tensor] = field(default_factory=dict)  # "metric/convention" -> (head, head) sums
    outputs: "OutputMoments | None" = None
    folds: "FoldMoments | None" = None  # the output moments per calibration fold (ridge `auto`)

    def __add__(self, other: "LayerStats") -> "LayerStats":
        if self.pairs.keys() != other.pairs.keys():
            raise ValueError("cannot merge statistics with different pairwise metrics")
        if (self.outputs is None) != (other.outputs is None) or (self.folds is None) != (other.folds is None):
            raise ValueError("cannot merge statistics with and without output moments (or folds)")
        skip = ("pairs", "outputs", "folds")
        kw = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self) if f.name not in skip}

        def add(a, b):
            return None if a is None else a + b

        return LayerStats(**kw, pairs={k: v + other.pairs[k] for k, v in self.pairs.items()},
                          outputs=add(self.outputs, other.outputs), folds=add(self.folds, other.folds))

    def add_(self, other: "LayerStats") -> "LayerStats":
        """`self += other` in place (a layer's running sums taking a batch's: no third copy of the layer's sums).
        Folds that are already `self.folds` (accumulated in place by `moments.fold_moments(into=...)`) are not
        added again."""
        if self.pairs.keys() != other.pairs.keys():
            raise ValueError("cannot merge statistics with different pairwise metrics")
        if (self.outputs is None) != (other.outputs is None):
            raise ValueError("cannot merge statistics with and without output moments")
        for f in fields(self):
            if f.name not in ("pairs", "outputs", "folds"):
                getattr(self, f.name).add_(getattr(other, f.name))
        for k, v in other.pairs.items():
            self.pairs[k].add_(v)
        if self.outputs is not None:
            self.outputs.add_(other.outputs)
        if other.folds is not None and other.folds is not self.folds:
            self.folds.add_(other.folds)
        return self

    def completed(self) -> "LayerStats":
        """The finished sums with what is derived rather than accumulated filled in (the joint moment of the head
        outputs from the fold moments: `OutputMoments.completed`)."""
        if self.outputs is None or self.folds is None:
            return self
        return replace(self, outputs=self.outputs.completed(self.folds))

    def stored(self, dtype: str) -> "LayerStats":
        """The finished sums as kept: the joint second moments (and the folds') in `dtype` ("float64" or
        "float32", `CaptureConfig.moments`); every other sum stays float64."""
        if dtype == "float64" or (self.outputs is None and self.folds is None):
            return self
        cast = getattr(torch, dtype)
        outputs = None if self.outputs is None else replace(self.outputs, joint=self.outputs.joint.to(cast))
        folds = None if self.folds is None else replace(self.folds, joint=self.folds.joint.to(cast))
        return replace(self, outputs=outputs, folds=folds)

    def first_moments(self) -> "LayerStats":
        """The same sums with the head outputs' second moments and the folds dropped: what is kept of a finished
        layer once its selection curves are built (`OutputMoments.first_moments`)."""
        return replace(self, outputs=None if self.outputs is None else self.outputs.first_moments(), folds=None)

    def to(self, device, non_blocking: bool = False) -> "LayerStats":
        """The same sums on `device` (layers of a device_map model live on different devices). `non_blocking`
        from a GPU to the CPU: page-locked destinations filled asynchronously -- the caller synchronizes once
        before reading them, not once per tensor."""
        skip = ("pairs", "outputs", "folds")
        kw = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)
              if f.name not in skip}

        def move(x):
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return LayerStats(**kw, pairs={k: v.to(device, non_blocking=non_blocking) for k, v in self.pairs.items()},
                          outputs=move(self.outputs), folds=move(self.folds))


@dataclass(frozen=True)
class HeadStats:
    """Finalised per-head means. Per-head fields: (layer, head); pairs: (layer, head, head)."""

    sink_mass: Tensor
    entropy_full: Tensor
    entropy_content: Tensor
    dormancy: Tensor
    g: Tensor                 # mean H_b(s) + s H(c_S)
    rest: Tensor              # mean 1 - s
    h_content_weighted: Tensor  # sum (1-s) H(c) / sum (1-s): keeps H = g + rest * H(c) exact
    rows: Tensor              # (layer,) head-level rows
    content_rows: Tensor      # (layer,)
    excluded_rows: Tensor     # (layer,) rows with < 2 content keys
    pairs: dict[str, Tensor]
    outputs: list[OutputMoments] | None = None  # per layer, sums (see OutputMoments)
    folds: list[FoldMoments] | None = None  # per layer, the output sums per calibration fold (ridge `auto`)
    residual: Tensor | None = None  # (layer,) mean squared norm of the residual stream entering the layer
    model_pairs: dict[str, Tensor] | None = None  # (layer * head, layer * head), layer-major; see unstack_layers
    attn_cosine: Tensor | None = None  # (layer,) mean cos(h, h + attention) over real tokens (He et al. 2024)

    def layer(self, index: int) -> "HeadStats":
        """Layer `index` alone, as a one-layer HeadStats (every per-layer field sliced, not copied)."""
        cut = slice(index, index + 1)

        def per(x):
            return None if x is None else x[cut]

        def one(xs):
            return None if xs is None else [xs[index]]

        return HeadStats(
            sink_mass=self.sink_mass[cut], entropy_full=self.entropy_full[cut],
            entropy_content=self.entropy_content[cut], dormancy=self.dormancy[cut], g=self.g[cut],
            rest=self.rest[cut], h_content_weighted=self.h_content_weighted[cut], rows=self.rows[cut],
            content_rows=self.content_rows[cut], excluded_rows=self.excluded_rows[cut],
            pairs={k: v[cut] for k, v in self.pairs.items()}, outputs=one(self.outputs), folds=one(self.folds),
            residual=per(self.residual), attn_cosine=per(self.attn_cosine))


def finalize(layers: list[LayerStats]) -> HeadStats:
    """Divide the sums by their counts once, after every merge."""
    if any(float(s.rows) == 0 for s in layers):
        raise ValueError("no query rows were captured (all padding or sinks?)")
    bad = [i for i, s in enumerate(layers) if not torch.isfinite(s.sink_mass + s.entropy_full).all()]
    if bad:
        raise ValueError(f"attention statistics of layer {bad[0]} are NaN/inf: the model produced non-finite "
                         "attention logits (half-precision overflow? load it with model.dtype: float32)")

    def st(name):
        return torch.stack([getattr(s, name) for s in layers])

    rows, crows = st("rows"), st("content_rows")
    safe_c = crows.clamp_min(1)
    pairs = {}
    for key in layers[0].pairs:
        denom = rows if key.endswith(cp.FULL) else safe_c
        pairs[key] = torch.stack([s.pairs[key] for s in layers]) / denom[:, None, None]

    def per_head(name, d):
        return st(name) / d[:, None]

    return HeadStats(
        sink_mass=per_head("sink_mass", rows), entropy_full=per_head("entropy_full", rows),
        entropy_content=per_head("entropy_content", safe_c), dormancy=per_head("dormant", rows),
        g=per_head("g", rows), rest=per_head("rest", rows),
        h_content_weighted=st("rest_h_content") / st("rest").clamp_min(1e-300),
        rows=rows, content_rows=crows, excluded_rows=rows - crows, pairs=pairs,
        outputs=None if layers[0].outputs is None else [s.outputs for s in layers],
        folds=None if layers[0].folds is None else [s.folds for s in layers])


def unstack_layers(stacked: HeadStats, n_layers: int) -> HeadStats:
    """Per-layer statistics from one capture whose "layer" held every head of the model.

    `stacked` is `finalize` of a single `LayerStats` over the layer-major stacked
    head axis (layer * head). Per-head fields become (layer, head); the within-layer
    pairs are the diagonal blocks (layer, head, head), exactly what a per-layer
    capture gives; the whole matrices are kept as `model_pairs`.
    """
    n = stacked.sink_mass.shape[-1]
    if stacked.sink_mass.shape[0] != 1 or n % n_layers:
        raise ValueError(f"expected one stacked layer of layer * head heads, got {tuple(stacked.sink_mass.shape)}")
    H = n // n_layers

    def per_head(x):
        return x.reshape(n_layers, H)

    def per_layer(x):
        return x.expand(n_layers).clone()  # the same query rows in every layer

    model_pairs = {k: v[0] for k, v in stacked.pairs.items()}  # (L*H, L*H)
    blocks = {k: torch.stack([m[i * H:(i + 1) * H, i * H:(i + 1) * H] for i in range(n_layers)])
              for k, m in model_pairs.items()}
    return HeadStats(
        sink_mass=per_head(stacked.sink_mass), entropy_full=per_head(stacked.entropy_full),
        entropy_content=per_head(stacked.entropy_content), dormancy=per_head(stacked.dormancy),
        g=per_head(stacked.g), rest=per_head(stacked.rest),
        h_content_weighted=per_head(stacked.h_content_weighted),
        rows=per_layer(stacked.rows), content_rows=per_layer(stacked.content_rows),
        excluded_rows=per_layer(stacked.excluded_rows), pairs=blocks, model_pairs=model_pairs)
