"""Pair rules worked by hand: which (chosen, rejected) indices each rule makes from K scores."""

import math
import random

import pytest

from tether.core.pairing import PAIR_RULES, make_pairs, pairwise_scores


def test_best_vs_worst_takes_the_extremes_and_respects_the_margin():
    #          0    1    2     3     4
    scores = [0.2, 0.9, None, 0.9, -0.5]
    # best 0.9 (first of the tie: index 1), worst -0.5 (index 4); None takes no part
    assert make_pairs(scores, "best_vs_worst") == [(1, 4)]
    assert make_pairs(scores, "best_vs_worst", margin=1.3) == [(1, 4)]  # gap 1.4
    assert make_pairs(scores, "best_vs_worst", margin=1.5) == []
    assert make_pairs([0.0, 1.0], "best_vs_worst", margin=1.0) == []  # the gap must exceed the margin
    assert make_pairs([1.0, 1.0, 1.0], "best_vs_worst") == []  # all equal: no pair
    assert make_pairs([None, 1.0, math.nan], "best_vs_worst") == []  # one score present


def test_all_pairs_orders_by_gap_and_caps():
    scores = [1.0, 0.0, 0.5]
    # gaps: (0,1)=1.0, (0,2)=0.5, (2,1)=0.5 -> sorted by gap, then by index
    assert make_pairs(scores, "all_pairs") == [(0, 1), (0, 2), (2, 1)]
    assert make_pairs(scores, "all_pairs", margin=0.5) == [(0, 1)]
    assert make_pairs(scores, "all_pairs", max_pairs=2) == [(0, 1), (0, 2)]


def test_threshold_pairs_good_with_bad():
    scores = [1.0, 0.0, 1.0, 0.0, None]
    assert make_pairs(scores, "threshold", threshold=0.5) == [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert make_pairs([0.6, 0.4], "threshold", threshold=0.6) == [(0, 1)]  # at the threshold counts as good
    with pytest.raises(ValueError, match="threshold"):
        make_pairs(scores, "threshold")


def test_unknown_rule_lists_the_valid_names():
    with pytest.raises(KeyError, match="best_vs_worst"):
        make_pairs([1.0, 0.0], "nope")
    assert set(PAIR_RULES.names()) == {"all_pairs", "best_vs_worst", "threshold"}


def test_pairwise_scores_are_mean_win_probabilities():
    # 3 samples: 0 beats 1, 0 ties 2 (0.5), 1 vs 2 unparseable (None)
    scores = pairwise_scores(3, {(0, 1): 1.0, (0, 2): 0.5, (1, 2): None})
    assert scores == [(1.0 + 0.5) / 2, 0.0 / 1, 0.5 / 1]
    assert pairwise_scores(2, {(0, 1): None}) == [None, None]


class Script:
    """A random source returning scripted draws: randrange -> the next index, random -> the next uniform."""

    def __init__(self, indices, uniforms):
        self.indices, self.uniforms = list(indices), list(uniforms)

    def randrange(self, n):
        i = self.indices.pop(0)
        assert i < n
        return i

    def random(self):
        return self.uniforms.pop(0)


def test_rso_sample_by_hand():
    from tether.core.pairing import rso_sample, rso_scores

    # scores [0, 1, 2, None], β = 1. Proposal 1: index 0, u = 0.5 >= e^-2: rejected. Proposal 2: index 1,
    # u = 0.3 < e^-1 = 0.37: accepted; remaining [0, 2]. Proposal 3: position 1 (index 2), u = 0.99 < 1: accepted.
    assert rso_sample([0.0, 1.0, 2.0, None], beta=1.0, num_samples=2, rng=Script([0, 1, 1], [0.5, 0.3, 0.99])) == [1, 2]
    # fewer present candidates than asked: all of them, in acceptance order
    assert sorted(rso_sample([3.0, None, 1.0], beta=1.0, num_samples=5, rng=random.Random(0))) == [0, 2]
    assert rso_scores([0.0, 1.0, 2.0, None], beta=1.0, num_samples=2,
                      rng=Script([0, 1, 1], [0.5, 0.3, 0.99])) == [None, 1.0, 2.0, None]
    with pytest.raises(ValueError, match="beta"):
        rso_sample([1.0], beta=0.0, num_samples=1, rng=random.Random(0))


def test_rso_first_sample_follows_the_tilted_distribution():
    from tether.core.pairing import rso_sample

    scores, beta = [0.0, 1.0, 0.5, -1.0], 0.7
    rng = random.Random(3)
    counts = [0] * 4
    trials = 20000
    for _ in range(trials):
        counts[rso_sample(scores, beta=beta, num_samples=1, rng=rng)[0]] += 1
    weights = [math.exp(s / beta) for s in scores]
    for c, w in zip(counts, weights, strict=True):
        assert c / trials == pytest.approx(w / sum(weights), abs=0.015)


def test_rso_small_beta_keeps_the_best_and_large_beta_is_uniform():
    from tether.core.pairing import rso_sample

    rng = random.Random(0)
    assert all(rso_sample([0.1, 0.9, 0.5], beta=1e-3, num_samples=1, rng=rng) == [1] for _ in range(50))
    counts = [0, 0, 0]
    for _ in range(6000):
        counts[rso_sample([0.1, 0.9, 0.5], beta=1e3, num_samples=1, rng=rng)[0]] += 1
    assert all(abs(c / 6000 - 1 / 3) < 0.03 for c in counts)
