"""Reward aggregations against hand-computed values: the weighted sum and GDPO's per-function group normalisation."""

import math

import pytest
import torch

from tether.core.reward_aggregation import REWARD_AGGREGATIONS

# a sparse 0/1 reward and a dense one with a large spread; groups of 2
SCORES = torch.tensor([[0.0, 1.0, 1.0, 1.0], [10.0, 30.0, 5.0, 5.0]])
WEIGHTS = torch.tensor([1.0, 0.5])


def test_sum_is_the_weighted_sum():
    total = REWARD_AGGREGATIONS.get("sum")(SCORES, WEIGHTS, 2)
    torch.testing.assert_close(total, torch.tensor([5.0, 16.0, 3.5, 3.5]))


def test_gdpo_normalises_each_function_within_its_group():
    total = REWARD_AGGREGATIONS.get("gdpo")(SCORES, WEIGHTS, 2)
    # group 1: sparse (0, 1) -> (-1, 1); dense (10, 30) -> (-1, 1); weighted: -1.5, 1.5. group 2: both constant.
    torch.testing.assert_close(total, torch.tensor([-1.5, 1.5, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_gdpo_lets_a_sparse_reward_reorder_a_group_the_dense_one_would_decide():
    # dense reward favours sample 0 by a hair, sparse reward (same weight) favours sample 1: the plain sum ranks
    # by the dense reward's spread; GDPO gives both the same say, so the sparse win is not drowned.
    scores = torch.tensor([[0.0, 1.0], [50.0, 48.0]])
    weights = torch.tensor([1.0, 1.0])
    plain = REWARD_AGGREGATIONS.get("sum")(scores, weights, 2)
    gdpo = REWARD_AGGREGATIONS.get("gdpo")(scores, weights, 2)
    assert plain[0] > plain[1]
    assert gdpo[0] == pytest.approx(gdpo[1], abs=1e-5)  # -1 + 1 each: a tie, not a dense-reward win


def test_missing_values_are_skipped_and_an_unscored_sample_stays_nan():
    scores = torch.tensor([[math.nan, 2.0, math.nan, 4.0], [1.0, 3.0, math.nan, 8.0]])
    for name in ("sum", "gdpo"):
        total = REWARD_AGGREGATIONS.get(name)(scores, torch.ones(2), 2)
        assert math.isnan(total[2]) and not math.isnan(total[0])
    gdpo = REWARD_AGGREGATIONS.get("gdpo")(scores, torch.ones(2), 2)
    # group 1: function 0 scored only sample 1 (normalised 0); function 1: (1, 3) -> (-1, 1)
    torch.testing.assert_close(gdpo[:2], torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)


def test_gdpo_needs_whole_groups():
    with pytest.raises(ValueError, match="whole groups"):
        REWARD_AGGREGATIONS.get("gdpo")(torch.zeros(1, 5), torch.ones(1), 2)
