"""The percentile bootstrap behind every confidence interval pruner reports (perplexity, task accuracy).

Paired comparisons resample whole units -- evaluation windows, task documents -- with the same
indices for base and pruned, so the interval is of the change itself, not of two levels.
"""

from __future__ import annotations

import torch


def resamples(n: int, n_boot: int, generator: torch.Generator) -> torch.Tensor:
    """`n_boot` resamples with replacement of `n` units, as indices: (n_boot, n). At least one resample."""
    return torch.randint(n, (max(n_boot, 1), n), generator=generator)


def percentile_interval(samples: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap `samples` (n_boot,): its (1 - level)/2 and (1 + level)/2 quantiles."""
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(samples.to(torch.float64), q)
    return lo.item(), hi.item()
