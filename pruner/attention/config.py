"""What a capture accumulates and how finely it chunks the queries: `CaptureConfig`, validated on construction.

Kept apart from the capture itself so that what a run reads (`pruner.runs.calibration_needs`) and the memory model
can decide a configuration without the attention function that executes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pruner.attention import pairs


@dataclass(frozen=True)
class CaptureConfig:
    """What to accumulate and how finely to chunk the queries."""

    chunk_size: int = 128
    metrics: tuple[str, ...] = ("cosine", "js")
    dormant_threshold: float = 0.9
    outputs: bool = False  # also accumulate head-output moments (scoring, compensation)
    joint: bool = True  # the joint second moment of all heads' outputs (refit, the refit-aware and sink-aware
    #                     scorers read it); False: each head's own second moment only
    folds: int = 0  # also the output moments per fold of whole samples (cross-validating refit's ridge)
    channels: bool = False  # also each head's sink- and content-channel second moments (uu, ww; the scorer
    #                         studies read them, no shipped scorer or compensation does: not kept by default)
    moments: str = "float64"  # storage of each layer's finished joint second moments (and fold moments):
    #                           accumulated in float64 either way; float32 halves what the host keeps
    across_layers: bool = False  # pair matrices between all heads of the model (see module docstring)
    fused: bool = True  # output from the statistics' softmax; False: SDPA output + recomputed scores
    layer_cosine: bool = False  # also each layer's sum of cos(h, h + attention) over real tokens (the
    #                             layer-cosine scorer, He et al. 2024); needs outputs=True (its token count)

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.across_layers and self.outputs:
            raise ValueError("across_layers and outputs cannot be captured together")
        if self.folds and (self.folds < 2 or not self.outputs or not self.joint):
            raise ValueError(f"folds must be 0 or >= 2, with outputs=True and joint=True (got {self.folds})")
        if self.outputs and not self.fused:
            raise ValueError("output moments are computed by the fused attention (fused=True)")
        if self.layer_cosine and not self.outputs:
            raise ValueError("layer_cosine counts its tokens with the output moments' (outputs=True)")
        if self.moments not in ("float64", "float32"):
            raise ValueError(f"moments must be float64 or float32, got {self.moments!r}")
        bad = set(self.metrics) - set(pairs.PAIR_METRICS)
        if bad:
            raise ValueError(f"unknown pair metrics {sorted(bad)}; valid: {', '.join(pairs.PAIR_METRICS)}")
