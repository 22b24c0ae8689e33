"""The convention audit of one model (docs/design.md §5): what changes when the sink is removed?

Pure functions of captured statistics: `HeadStats` in (with `model_pairs`, every
head of the model against every other, from `CaptureConfig(across_layers=True)`),
plain JSON-ready dicts out. No model, hooks or files.

For each pair metric the head x head matrix under FULL (sink included) is set
against the one under CONTENT (sink removed, renormalised):

- flip rates (nearest neighbour, pair order, threshold verdict), over the whole
  model (every head against every head) and within each layer;
- clustering and a 2-D MDS map of all heads per convention (Clark et al. 2019
  style, scikit-learn on the precomputed distances), the Adjusted Rand Index
  between the two clusterings, and how strongly the leading MDS axis follows
  sink mass: structure that is a sink artefact shows up there;
- with a second, paired state of the model (same token rows), the exact
  attribution of each head's entropy change to the sink and content channels
  (docs/design.md §4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pruner.analysis import flips
from pruner.attention import composition as cp
from pruner.attention.sums import HeadStats

Tensor = torch.Tensor


@dataclass(frozen=True)
class AnalysisConfig:
    """What to audit and how to cluster.

    thresholds: metric -> redundancy threshold for the verdict flip rate. The
    default is the median FULL value over all head pairs of the model: it is
    scale-free (cosine and JS live on different scales; a fixed 0.5 would mean
    nothing for JS) and it is what a threshold tuned on sink-included rows looks
    like -- half of the pairs called redundant -- which is then kept, unchanged,
    when the sink is removed.
    clusters: number of clusters; default round(sqrt(heads / 2)) (6 for 72 heads),
    the usual rule of thumb, the same for both conventions.
    linkage: agglomerative linkage on the precomputed distances. `complete`, because
    on attention-head distances `average` tends to return one giant cluster plus
    singletons (61 of 72 heads in one cluster for all-MiniLM-L6-v2 by cosine),
    which makes the ARI and the cluster-sink relation meaningless; complete
    linkage keeps clusters compact and comparably sized.
    """

    metrics: tuple[str, ...] = ("cosine", "js")
    thresholds: dict[str, float] = field(default_factory=dict)
    clusters: int | None = None
    linkage: str = "complete"
    seed: int = 0

    def __post_init__(self):
        if len(self.metrics) < 1:
            raise ValueError("analysis needs at least one pair metric")
        if self.clusters is not None and self.clusters < 2:
            raise ValueError(f"clusters must be >= 2, got {self.clusters}")
        if self.linkage not in ("complete", "average", "single"):
            raise ValueError(f"unknown linkage {self.linkage!r}; valid: complete, average, single")
        unknown = set(self.thresholds) - set(self.metrics)
        if unknown:
            raise ValueError(f"thresholds given for metrics not analysed: {sorted(unknown)}")


def _num(x) -> float | None:
    """A float for JSON; NaN and infinities (undefined values) become null."""
    x = float(x)
    return x if math.isfinite(x) else None


def _nested(t: Tensor) -> list:
    """A tensor as nested lists of JSON-safe floats."""
    if t.dim() == 0:
        return _num(t)
    return [_nested(x) for x in t]


# --------------------------------------------------------------------------- flip rates

def distance(m: Tensor, similarity: bool) -> Tensor:
    """A head x head distance for clustering: 1 - similarity, or the distance itself.

    Symmetrised, zero on the diagonal, never negative. (n, n) -> (n, n) float64.
    """
    d = (1 - m if similarity else m).double()
    d = ((d + d.T) / 2).clamp_min(0)
    return d.fill_diagonal_(0)


def default_threshold(full: Tensor) -> float:
    """The median FULL value over the head pairs (i < j) of a model-wide matrix."""
    return float(flips.upper_pairs(full).double().median())


def flip_rates(full: Tensor, content: Tensor, similarity: bool, threshold: float) -> dict:
    """The three flip rates between two (head, head) matrices of one metric, and the verdict shares."""

    def share(m):
        return float(flips.redundant_pairs(m, threshold, similarity).double().mean())

    return {
        "nn_flip_rate": float(flips.nn_flip_rate(full[None], content[None], similarity)[0]),
        "pair_order_flip_rate": float(flips.pair_order_flip_rate(full, content)),
        "verdict_flip_rate": float(flips.verdict_flip_rate(full, content, threshold, similarity)),
        "redundant_share_full": share(full),
        "redundant_share_content": share(content),
    }


def audit_metric(full: Tensor, content: Tensor, n_layers: int, similarity: bool,
                 threshold: float | None = None) -> dict:
    """Flip rates over the whole model and within each layer, for one metric.

    full, content: (layer * head, layer * head), heads layer-major. `overall`
    compares every head with every head of the model; `per_layer` uses each
    layer's diagonal block, with the same threshold.
    """
    rule = "given"
    if threshold is None:
        threshold, rule = default_threshold(full), "median FULL value over all head pairs of the model"
    H = full.shape[-1] // n_layers

    def block(m, i):
        return m[i * H:(i + 1) * H, i * H:(i + 1) * H]

    layers = [flip_rates(block(full, i), block(content, i), similarity, threshold) for i in range(n_layers)]
    return {
        "similarity": similarity, "threshold": threshold, "threshold_rule": rule,
        "redundant_if": ">= threshold" if similarity else "<= threshold",
        "overall": flip_rates(full, content, similarity, threshold),
        "per_layer": {k: [r[k] for r in layers] for k in layers[0]},
    }


# --------------------------------------------------------------------------- clustering and MDS

def default_clusters(n_heads: int) -> int:
    """round(sqrt(n / 2)), at least 2 and at most n - 1."""
    return int(min(max(2, round(math.sqrt(n_heads / 2))), n_heads - 1))


def mds_map(dist: Tensor, seed: int) -> tuple[np.ndarray, float]:
    """Metric MDS of a precomputed distance matrix, rotated to its principal axes.

    SMACOF starts from classical MDS (deterministic); its axes come in no
    particular order, so the map is rotated so that axis 1 carries the most
    variance -- "the leading MDS axis" is then well defined. Returns the (n, 2)
    coordinates and the normalised stress (Stress-1).
    """
    from sklearn.manifold import MDS

    mds = MDS(n_components=2, metric="precomputed", metric_mds=True, init="classical_mds",
              normalized_stress=True, random_state=seed)
    x = mds.fit_transform(dist.numpy())
    x = x - x.mean(0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return x @ vt.T, float(mds.stress_)


def axis_correlation(axis: np.ndarray, sink_mass: np.ndarray) -> dict:
    """Pearson and Spearman correlation of an MDS axis with sink mass.

    An MDS axis has no sign; the caller orients it so that Pearson is >= 0, so
    Pearson is the strength of the relation, not its direction.
    """
    from scipy.stats import pearsonr, spearmanr

    if np.ptp(axis) == 0 or np.ptp(sink_mass) == 0:
        return {"pearson": None, "spearman": None}
    return {"pearson": _num(pearsonr(axis, sink_mass).statistic),
            "spearman": _num(spearmanr(axis, sink_mass).statistic)}


def plane_correlation(coords: np.ndarray, sink_mass: np.ndarray) -> float | None:
    """Multiple correlation R of sink mass with both MDS axes (least squares on the map's position).

    Rotation- and sign-invariant: it catches a map ordered by sink size along any
    direction, also when a few outlying heads claim the leading axis.
    """
    if np.ptp(sink_mass) == 0:
        return None
    x = np.column_stack([np.ones(len(coords)), coords])
    fit = x @ np.linalg.lstsq(x, sink_mass, rcond=None)[0]
    ss = ((sink_mass - sink_mass.mean()) ** 2).sum()
    return float(np.sqrt(max(0.0, 1 - ((sink_mass - fit) ** 2).sum() / ss)))


def sink_eta2(labels: np.ndarray, sink_mass: np.ndarray) -> float | None:
    """Share of the variance of sink mass explained by the cluster labels (eta squared)."""
    total = ((sink_mass - sink_mass.mean()) ** 2).sum()
    if total == 0:
        return None
    between = sum((labels == c).sum() * (sink_mass[labels == c].mean() - sink_mass.mean()) ** 2
                  for c in np.unique(labels))
    return float(between / total)


def cluster_convention(dist: Tensor, sink_mass: Tensor, k: int, linkage: str, seed: int) -> dict:
    """Agglomerative clusters and the MDS map of all heads under one convention.

    dist: (n, n) model-wide distances, heads layer-major; sink_mass: (layer, head).
    """
    from sklearn.cluster import AgglomerativeClustering

    L, H = sink_mass.shape
    s = sink_mass.double().flatten().numpy()
    clusterer = AgglomerativeClustering(n_clusters=k, metric="precomputed", linkage=linkage)
    labels = clusterer.fit_predict(dist.numpy())
    coords, stress = mds_map(dist, seed)
    if np.ptp(s) > 0 and np.corrcoef(coords[:, 0], s)[0, 1] < 0:
        coords[:, 0] = -coords[:, 0]
    var = coords.var(0)
    return {
        "labels": labels.reshape(L, H).tolist(),
        "mds": coords.reshape(L, H, 2).tolist(),
        "mds_stress": stress,
        "mds_axis1_variance_share": float(var[0] / var.sum()) if var.sum() > 0 else None,
        "mds_axis1_vs_sink_mass": axis_correlation(coords[:, 0], s),
        "mds_plane_vs_sink_mass_r": plane_correlation(coords, s),
        "sink_mass_eta2": sink_eta2(labels, s),
    }


def cluster_metric(full: Tensor, content: Tensor, sink_mass: Tensor, similarity: bool,
                   config: AnalysisConfig, k: int) -> dict:
    """Both conventions' clusterings and maps of one metric, and the ARI between them."""
    from sklearn.metrics import adjusted_rand_score

    out = {conv: cluster_convention(distance(m, similarity), sink_mass, k, config.linkage, config.seed)
           for conv, m in ((cp.FULL, full), (cp.CONTENT, content))}

    def flat(conv):
        return np.asarray(out[conv]["labels"]).flatten()

    out["ari"] = float(adjusted_rand_score(flat(cp.FULL), flat(cp.CONTENT)))
    out["distance"] = "1 - cosine" if similarity else "as is"
    return out


# --------------------------------------------------------------------------- entropy attribution

def entropy_attribution(reference: HeadStats, stats: HeadStats) -> dict:
    """Attribute each head's entropy change, reference -> stats, to sink and content (docs/design.md §4).

    Applied to the head-level means of the two paired states (the same token
    rows): g = mean H_b(s) + s H(c_S), w = mean 1 - s and the content-weighted
    mean H(c) = sum (1-s) H(c) / sum (1-s), so each state's mean H = g + w H(c)
    holds exactly and sink part + content part = dH exactly. Layers and the
    whole model are means of the per-head parts, so every level adds up; the
    sink share is sink part / dH of that level (undefined, null, when dH = 0).
    """
    if reference.sink_mass.shape != stats.sink_mass.shape:
        raise ValueError(f"cannot compare models of {tuple(reference.sink_mass.shape)} and "
                         f"{tuple(stats.sink_mass.shape)} layers x heads")
    att = cp.entropy_attribution(reference.g, reference.rest, reference.h_content_weighted,
                                 stats.g, stats.rest, stats.h_content_weighted)  # each (layer, head)

    def level(reduce):
        d, s, c = reduce(att.delta), reduce(att.sink_part), reduce(att.content_part)
        return {"delta": _nested(d), "sink_part": _nested(s), "content_part": _nested(c),
                "sink_share": _nested(s / d)}

    overall = level(lambda x: x.mean())
    overall.update({
        "entropy_full_reference": float(reference.entropy_full.mean()),
        "entropy_full": float(stats.entropy_full.mean()),
        "sink_mass_reference": float(reference.sink_mass.mean()),
        "sink_mass": float(stats.sink_mass.mean()),
    })
    return {
        "direction": "this model minus the --compare-to model (nats)",
        "per_head": level(lambda x: x), "per_layer": level(lambda x: x.mean(-1)), "overall": overall,
    }


# --------------------------------------------------------------------------- the whole analysis

def head_tables(stats: HeadStats) -> dict:
    """The per-head tables, each (layer, head) as nested lists."""
    return {"sink_mass": _nested(stats.sink_mass), "entropy_full": _nested(stats.entropy_full),
            "entropy_content": _nested(stats.entropy_content)}


def entropy_summary(stats: HeadStats) -> dict:
    """Mean full and content entropy, and how each follows sink mass across heads (Spearman)."""
    from scipy.stats import spearmanr

    s = stats.sink_mass.flatten().numpy()

    def rho(x):
        return _num(spearmanr(x.flatten().numpy(), s).statistic) if np.ptp(s) > 0 else None

    return {"mean_full": float(stats.entropy_full.mean()), "mean_content": float(stats.entropy_content.mean()),
            "full_vs_sink_mass_spearman": rho(stats.entropy_full),
            "content_vs_sink_mass_spearman": rho(stats.entropy_content)}


def analyze(stats: HeadStats, config: AnalysisConfig = AnalysisConfig()) -> dict:
    """Head tables, the per-metric audit and the clustering of one model's model-wide statistics."""
    if stats.model_pairs is None:
        raise ValueError("analysis needs model-wide pair matrices: capture with CaptureConfig(across_layers=True)")
    L, H = stats.sink_mass.shape
    k = config.clusters or default_clusters(L * H)
    if k >= L * H:
        raise ValueError(f"clusters must be < the number of heads ({L * H}), got {k}")
    clustering = {"n_clusters": k, "linkage": config.linkage,
                  "mds": "metric MDS (SMACOF from classical MDS), rotated to principal axes; axis 1 oriented "
                         "so that its Pearson correlation with sink mass is >= 0"}
    out = {"heads": head_tables(stats), "entropy": entropy_summary(stats), "audit": {}, "clustering": clustering}
    for name in config.metrics:
        full, content = stats.model_pairs[f"{name}/{cp.FULL}"], stats.model_pairs[f"{name}/{cp.CONTENT}"]
        sim = name in cp.SIMILARITIES
        out["audit"][name] = audit_metric(full, content, L, sim, config.thresholds.get(name))
        out["clustering"][name] = cluster_metric(full, content, stats.sink_mass, sim, config, k)
    return out
