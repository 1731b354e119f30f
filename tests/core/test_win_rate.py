"""Win rates from verdicts in both orders: hand-counted cases, a naive second count, the interval, the bias."""

import math
import random

import pytest

from tether.core.statistics import wilson_interval
from tether.core.win_rate import (
    count_swapped_verdicts,
    first_position_rate,
    judge_verifier_agreement,
    outcome_value,
    position_consistency,
    self_preference_bias,
    swapped_outcome,
    verdict_accuracy,
    verifier_outcome,
    win_rate,
    win_rate_interval,
)


def test_one_prompt_each_way():
    # forward: A's answer shown first; backward: B's answer shown first, so "A" there means model B
    assert swapped_outcome("A", "B") == "a_wins"  # A first and chosen; B first, second (A) chosen
    assert swapped_outcome("B", "A") == "b_wins"
    assert swapped_outcome("tie", "tie") == "both_tie"
    assert swapped_outcome("A", "A") == "inconsistent"  # always the first position: it followed the position
    assert swapped_outcome("B", "B") == "inconsistent"
    assert swapped_outcome("A", "tie") == "inconsistent"
    assert swapped_outcome(None, "A") == swapped_outcome("B", None) == "unparseable"
    assert [outcome_value(o) for o in ("a_wins", "b_wins", "both_tie", "inconsistent", "unparseable")] == \
        [1.0, 0.0, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="'A', 'B', 'tie' or None"):
        swapped_outcome("a", "B")


def test_counts_by_hand():
    forward = ["A", "B", "A", "tie", "A", None, "A", "B"]
    backward = ["B", "A", "A", "tie", "tie", "B", "B", "A"]
    # a_wins (0, 6), b_wins (1, 7), inconsistent (2, 4), both_tie (3), unparseable (5)
    counts = count_swapped_verdicts(forward, backward)
    assert (counts.n, counts.a_wins, counts.b_wins, counts.both_tie, counts.inconsistent, counts.unparseable) == \
        (8, 2, 2, 1, 2, 1)
    assert counts.ties == 4 and counts.a_wins + counts.b_wins + counts.ties == counts.n
    # single verdicts naming a position: forward A,B,A,A,A,B (6) + backward B,A,A,B,B,A (6) = 12; "A" = 4 + 3
    assert (counts.decisive, counts.first_chosen) == (12, 7)
    assert first_position_rate(counts) == pytest.approx(7 / 12)
    assert position_consistency(counts) == pytest.approx(5 / 7)  # (2 + 2 + 1) of the 7 with both parsed
    assert win_rate(counts.a_wins, counts.ties, counts.n) == pytest.approx((2 + 4 / 2) / 8)
    assert counts.as_dict()["ties"] == 4


def test_undefined_rates_are_none():
    counts = count_swapped_verdicts([None, "tie"], ["A", "tie"])
    assert position_consistency(count_swapped_verdicts([None], [None])) is None
    assert first_position_rate(counts) == 1.0  # the one verdict naming a position (backward "A") is the first
    assert first_position_rate(count_swapped_verdicts(["tie"], ["tie"])) is None
    with pytest.raises(ValueError, match="one verdict per order"):
        count_swapped_verdicts(["A"], [])


def naive_counts(forward, backward):
    """A second count: name the model each single verdict picks, then compare."""
    tally = {"a": 0, "b": 0, "tie": 0, "split": 0, "none": 0, "first": 0, "positional": 0}
    for f, b in zip(forward, backward, strict=True):
        for verdict in (f, b):
            if verdict in ("A", "B"):
                tally["positional"] += 1
                tally["first"] += verdict == "A"
        if f is None or b is None:
            tally["none"] += 1
            continue
        model_f = {"A": "model a", "B": "model b", "tie": "nobody"}[f]
        model_b = {"A": "model b", "B": "model a", "tie": "nobody"}[b]
        if model_f != model_b:
            tally["split"] += 1
        else:
            tally[{"model a": "a", "model b": "b", "nobody": "tie"}[model_f]] += 1
    return tally


def test_counts_match_a_naive_count():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        forward = [rng.choice(["A", "B", "tie", None]) for _ in range(n)]
        backward = [rng.choice(["A", "B", "tie", None]) for _ in range(n)]
        counts, naive = count_swapped_verdicts(forward, backward), naive_counts(forward, backward)
        assert (counts.a_wins, counts.b_wins, counts.both_tie, counts.inconsistent, counts.unparseable) == \
            (naive["a"], naive["b"], naive["tie"], naive["split"], naive["none"])
        assert (counts.first_chosen, counts.decisive) == (naive["first"], naive["positional"])
        values = [outcome_value(swapped_outcome(f, b)) for f, b in zip(forward, backward, strict=True)]
        assert win_rate(counts.a_wins, counts.ties, n) == pytest.approx(sum(values) / n)


def test_interval_is_wilson_on_the_half_counted_ties():
    assert win_rate_interval(6, 0, 10) == wilson_interval(6, 10)
    low, high = win_rate_interval(5, 2, 10)  # 6 "wins": the same centre as 6 of 10
    assert (low, high) == pytest.approx(wilson_interval(6, 10))
    assert low < 0.6 < high
    assert win_rate_interval(0, 0, 4)[0] == 0.0 and win_rate_interval(4, 0, 4)[1] == 1.0
    with pytest.raises(ValueError, match="wins \\+ ties <= n"):
        win_rate(3, 2, 4)
    with pytest.raises(ValueError, match="n > 0"):
        win_rate_interval(0, 0, 0)


def test_verifier_outcomes_and_agreement():
    assert [verifier_outcome(a, b) for a, b in ((1, 0), (0, 1), (1, 1), (0, 0))] == [1.0, 0.0, 0.5, 0.5]
    judge = [1.0, 1.0, 0.0, 0.5, 1.0, 0.0]
    verifier = [1.0, 0.0, 0.0, 1.0, 0.5, 1.0]
    # both decide on prompts 0, 1, 2, 5; they agree on 0 and 2
    assert judge_verifier_agreement(judge, verifier) == (0.5, 4)
    assert judge_verifier_agreement([0.5], [1.0]) == (None, 0)
    with pytest.raises(ValueError, match="one judge and one verifier score"):
        judge_verifier_agreement([1.0], [])


def test_self_preference_bias_by_hand():
    # the judge is model B: it gives B 7 wins in 10 (A: 3 / 10); the verifier: B correct alone 4 times, A alone
    # 2 times, 4 ties -> B's verifier win rate (4 + 4 / 2) / 10 = 0.6; bias = 0.7 - 0.6 = +0.1
    judge_b = 1 - win_rate(3, 0, 10)
    verifier_b = 1 - win_rate(2, 4, 10)
    assert self_preference_bias(judge_b, verifier_b) == pytest.approx(0.1)
    assert math.isclose(self_preference_bias(0.5, 0.5), 0.0)
    assert self_preference_bias(0.25, 0.75) == pytest.approx(-0.5)  # it judges itself harshly


def test_verdict_accuracy_by_hand():
    # right answer is model A: pair 1 right both orders, 2 wrong both orders, 3 position-following, 4 both tie,
    # 5 unparseable
    counts = count_swapped_verdicts(["A", "B", "A", "tie", None], ["B", "A", "A", "tie", "B"])
    figures = verdict_accuracy(counts)
    assert figures["verdict_accuracy"] == pytest.approx(1 / 5)
    assert figures["decisive_rate"] == pytest.approx(2 / 5)
    assert figures["decisive_accuracy"] == pytest.approx(1 / 2)
    assert figures["position_consistency"] == pytest.approx(3 / 4)
    # single verdicts picking a position: A, B, A (forward) and B, A, A, B (backward): 4 of 7 pick the first shown
    assert figures["first_position_rate"] == pytest.approx(4 / 7)
    none_decisive = verdict_accuracy(count_swapped_verdicts(["tie"], ["tie"]))
    assert none_decisive == {"verdict_accuracy": 0.0, "decisive_rate": 0.0, "position_consistency": 1.0}
    with pytest.raises(ValueError):
        verdict_accuracy(count_swapped_verdicts([], []))
