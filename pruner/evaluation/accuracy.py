"""Accuracy of one model or of base vs pruned on the same documents, with percentile bootstrap CIs over documents."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pruner.core.bootstrap import percentile_interval, resamples
from pruner.core.tables import change_cell, ci_cell, markdown_table


@dataclass(frozen=True)
class TaskScores:
    """Per-document scores of one task: doc ids in order, and {metric: (doc,) float64}."""

    task: str
    doc_ids: tuple[int, ...]
    prompts: tuple[str, ...]          # hashes of each document's first request: the same documents?
    metrics: dict[str, torch.Tensor]


@dataclass(frozen=True)
class AccuracyDelta:
    """One metric of one task for base and pruned on the same documents; the change and its bootstrap CI."""

    task: str
    metric: str
    base: float
    pruned: float
    delta: float
    ci_low: float
    ci_high: float
    docs: int


def paired_accuracy(base: TaskScores, pruned: TaskScores, n_boot: int = 1000, seed: int = 0,
                    level: float = 0.95) -> list[AccuracyDelta]:
    """Per metric: mean over documents of (pruned - base), with a percentile bootstrap over documents."""
    if base.doc_ids != pruned.doc_ids or base.prompts != pruned.prompts:
        raise ValueError(f"task {base.task}: paired comparison needs the same documents and prompts")
    out = []
    g = torch.Generator().manual_seed(seed)
    n = len(base.doc_ids)
    idx = resamples(n, n_boot, g)  # the same resamples for every metric
    for m, xb in base.metrics.items():
        diff = pruned.metrics[m] - xb  # (doc,)
        lo, hi = percentile_interval(diff[idx].mean(-1), level)
        out.append(AccuracyDelta(base.task, m, xb.mean().item(), pruned.metrics[m].mean().item(),
                                 diff.mean().item(), lo, hi, n))
    return out


def accuracy_ci(scores: dict[str, TaskScores], n_boot: int = 1000, seed: int = 0,
                level: float = 0.95) -> dict[str, dict[str, dict]]:
    """One model's accuracies: {task: {metric: {value, ci_low, ci_high, docs}}}, percentile bootstrap over documents."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, dict]] = {}
    for name, s in scores.items():
        idx = resamples(len(s.doc_ids), n_boot, g)
        for m, x in s.metrics.items():
            lo, hi = percentile_interval(x[idx].mean(-1), level)
            out.setdefault(name, {})[m] = {"value": x.mean().item(), "ci_low": lo, "ci_high": hi,
                                           "docs": len(s.doc_ids)}
    return out


def accuracy_table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown for `accuracy_ci` (one model) or `Downstream.paired` (base vs pruned) results."""

    rows = [(t, m, d) for t, ms in results.items() for m, d in ms.items()]
    if rows and "delta" in rows[0][2]:
        return markdown_table(["task", "metric", "documents", "base", "this model", "change [95% CI]"], [
            [t, m, d["docs"], f"{d['base']:.3f}", f"{d['pruned']:.3f}",
             change_cell(d, 3)] for t, m, d in rows])
    return markdown_table(["task", "metric", "documents", "accuracy [95% CI]"], [
        [t, m, d["docs"], ci_cell(d['value'], d['ci_low'], d['ci_high'], 3, signed=False)] for t, m, d in rows])
