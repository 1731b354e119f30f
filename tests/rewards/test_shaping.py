"""DAPO overlong penalty (Yu et al. 2025, eq. 13) against hand values and a naive per-sample version."""

import pytest
import torch

from tether.rewards.shaping import REWARD_SHAPING, overlong_penalty


def test_overlong_penalty_at_the_boundaries():
    """max_length=10, buffer=4 -> the ramp starts after L = 6.

    L=0, 6 -> 0;  L=7 -> (6-7)/4 = -0.25;  L=9 -> (6-9)/4 = -0.75;  L=10 -> (6-10)/4 = -1;  L=11 -> -1.
    """
    lengths = torch.tensor([0, 6, 7, 9, 10, 11, 50])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0])
    out = overlong_penalty(lengths, max_length=10, buffer=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_overlong_penalty_scaled():
    """penalty=2: L=7 -> (6-7)/4*2 = -0.5;  L=8 -> -1.0;  L=10 -> -2;  L=11 -> -2."""
    lengths = torch.tensor([6.0, 7.0, 8.0, 10.0, 11.0], dtype=torch.float64)
    out = overlong_penalty(lengths, max_length=10, buffer=4, penalty=2.0)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor([0.0, -0.5, -1.0, -2.0, -2.0], dtype=torch.float64))


def test_overlong_penalty_buffer_equals_max_length():
    """buffer = max_length = 4: every non-empty response is on the ramp, L=1 -> -0.25, L=4 -> -1."""
    out = overlong_penalty(torch.tensor([0, 1, 4, 5]), max_length=4, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.25, -1.0, -1.0]))


def naive_overlong(length: int, max_length: int, buffer: int, penalty: float) -> float:
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer) - length) / buffer * penalty
    return -penalty


def test_overlong_penalty_matches_naive_loop():
    lengths = torch.randint(0, 40, (200,), generator=torch.Generator().manual_seed(0))
    out = overlong_penalty(lengths, max_length=30, buffer=7, penalty=0.3)
    expected = torch.tensor([naive_overlong(int(n), 30, 7, 0.3) for n in lengths])
    torch.testing.assert_close(out, expected)


def test_overlong_penalty_argument_checks_and_registry():
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=5)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(torch.tensor([1]), max_length=4, buffer=2, penalty=-1.0)
    assert REWARD_SHAPING.get("overlong") is overlong_penalty
