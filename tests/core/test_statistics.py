"""Intervals against values worked out by hand and a naive second implementation."""

import math
import random

import pytest

from tether.core.statistics import paired_bootstrap_interval, seed_summary, t_quantile, wilson_interval


def test_wilson_by_hand():
    # 8 of 10: p 0.8, z^2 3.8415; centre (0.8 + 0.19207) / 1.38415 = 0.71674,
    # half 1.95996 / 1.38415 * sqrt(0.016 + 0.0096037) = 0.22656 -> (0.4902, 0.9433)
    low, high = wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.49016, abs=1e-4), pytest.approx(0.94332, abs=1e-4))
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.27753, abs=1e-4))  # never below 0
    assert wilson_interval(10, 10) == (pytest.approx(0.72247, abs=1e-4), 1.0)
    low, high = wilson_interval(100, 200)  # 50% of 200: about +-6.9 points
    assert (high - low) / 2 == pytest.approx(0.0689, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_paired_bootstrap_matches_a_naive_loop():
    before = [0, 0, 1, 1, 0, 1, 0, 0, 1, 0]
    after = [1, 1, 1, 0, 0, 1, 1, 0, 1, 1]
    gain, low, high = paired_bootstrap_interval(before, after, resamples=500, seed=3)
    assert gain == pytest.approx(0.3)  # 4 gained, 1 lost, of 10
    rng, diffs, means = random.Random(3), [a - b for b, a in zip(before, after, strict=True)], []
    for _ in range(500):
        total = 0
        for _ in range(10):
            total += diffs[rng.randrange(10)]
        means.append(total / 10)
    means.sort()
    assert (low, high) == (means[12], means[487])  # the 2.5% and 97.5% order statistics of 500
    assert low < gain < high


def test_paired_bootstrap_of_identical_outcomes_is_a_point_and_needs_pairs():
    assert paired_bootstrap_interval([1, 0, 1], [1, 0, 1]) == (0.0, 0.0, 0.0)
    assert paired_bootstrap_interval([0, 0], [1, 1]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        paired_bootstrap_interval([1], [1, 0])


def test_seed_summary_by_hand():
    out = seed_summary([0.4, 0.5, 0.6])
    half = 4.303 * 0.1 / math.sqrt(3)  # t(2) = 4.303, std 0.1
    assert out["mean"] == pytest.approx(0.5) and out["std"] == pytest.approx(0.1) and out["n"] == 3
    assert out["ci95"] == [pytest.approx(0.5 - half), pytest.approx(0.5 + half)]
    assert out["values"] == [0.4, 0.5, 0.6]
    assert seed_summary([0.7]) == {"mean": 0.7, "std": 0.0, "n": 1, "ci95": [0.7, 0.7], "values": [0.7]}
    assert t_quantile(4) == 2.776 and t_quantile(100) == pytest.approx(1.96, abs=1e-3)
