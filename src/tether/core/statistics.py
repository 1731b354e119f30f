"""Intervals for the figures tether reports: a proportion, a paired difference, a mean over seeds.

Pure functions of plain numbers (no tensors, nothing of the rest of tether):

- :func:`wilson_interval`: a 95% interval for an accuracy of k correct out of n problems (Wilson 1927),
  which, unlike the normal approximation, stays inside [0, 1] and is sound at 0% or 100%;
- :func:`paired_bootstrap_interval`: a 95% interval for the gain between two evaluations of the same
  problems (after minus before), resampling problems with their pair of outcomes (Efron and Tibshirani
  1993, the percentile bootstrap), seeded so a report is reproducible;
- :func:`seed_summary`: mean, sample standard deviation and the Student-t 95% interval of one figure
  over independent seeds, with the values themselves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054
# Student's t, two-sided 95% (the 0.975 quantile), for 1..30 degrees of freedom; beyond 30 the normal's.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval for a proportion k / n: ``(c - h, c + h)`` with ``c = (p + z²/2n) / (1 + z²/n)``,
    ``h = z / (1 + z²/n) * sqrt(p(1 - p)/n + z²/4n²)``. ``n = 0`` gives the uninformative ``(0, 1)``."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At k = 0 or k = n one endpoint is exactly 0 or 1; rounding would leave it a hair inside.
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def paired_bootstrap_interval(before: Sequence[float], after: Sequence[float], *, resamples: int = 2000,
                              seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """The mean gain ``mean(after - before)`` over the same problems and its percentile-bootstrap interval:
    ``resamples`` draws of n problems with replacement (each keeping its own pair), the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles of the resampled mean gains. Returns ``(gain, low, high)``."""
    if len(before) != len(after) or not before:
        raise ValueError(f"need two non-empty evaluations of the same problems, got {len(before)} and {len(after)}")
    diffs = [float(a) - float(b) for b, a in zip(before, after, strict=True)]
    n = len(diffs)
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    lo = means[max(0, math.floor((1 - level) / 2 * resamples))]
    hi = means[min(resamples - 1, math.ceil((1 + level) / 2 * resamples) - 1)]
    return sum(diffs) / n, lo, hi


def t_quantile(dof: int) -> float:
    """Student's t 0.975 quantile for ``dof`` degrees of freedom (the normal's beyond 30)."""
    if dof < 1:
        raise ValueError(f"need at least one degree of freedom, got {dof}")
    return T95[dof - 1] if dof <= len(T95) else Z95


def seed_summary(values: Sequence[float]) -> dict[str, object]:
    """``{"mean", "std", "n", "ci95": [low, high], "values"}`` of one figure over seeds; ``std`` is the sample
    standard deviation (n - 1) and the interval ``mean ± t(n - 1) * std / sqrt(n)`` (one value: std 0 and
    the interval the value itself)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values to summarise")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "std": 0.0, "n": 1, "ci95": [mean, mean], "values": values}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * std / math.sqrt(n)
    return {"mean": mean, "std": std, "n": n, "ci95": [mean - half, mean + half], "values": values}
