"""GiGPO step-level advantages: hand-worked values and a naive loop implementation."""

import math
import random

import torch

from tether.core.gigpo import discounted_step_returns, step_group_advantages


def test_discounted_returns_by_hand():
    """gamma = 0.5; row 0 has reward 1 on its third step: returns 0.25, 0.5, 1. Row 1 has two steps
    (the third is masked) with reward 1 on its second: returns 0.5, 1, 0."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(discounted_step_returns(rewards, mask, 0.5),
                          torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))


def test_step_group_advantages_by_hand():
    """Group 0 holds returns 1, 0, 1: mean 2/3, centred 1/3, -2/3, 1/3, population std sqrt(2/9) = 0.4714,
    so A = 0.7071, -1.4142, 0.7071. Group 1 is a single step: 0. Group 2's returns are equal: 0."""
    returns = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.3, 0.3])
    anchors = torch.tensor([0, 0, 0, 1, 2, 2])
    expected = torch.tensor([1 / math.sqrt(2), -math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0, 0.0])
    assert torch.allclose(step_group_advantages(returns, anchors), expected, atol=1e-4)
    centred = step_group_advantages(returns, anchors, normalize=False)
    assert torch.allclose(centred, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0, 0, 0]), atol=1e-6)


def naive(returns: list[float], anchors: list[int], normalize: bool) -> list[float]:
    out = []
    for r, a in zip(returns, anchors, strict=True):
        group = [x for x, b in zip(returns, anchors, strict=True) if b == a]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / len(group))
        if len(group) < 2 or max(group) == min(group):
            out.append(0.0)
        else:
            out.append((r - mean) / (std + 1e-6) if normalize else r - mean)
    return out


def test_matches_a_naive_loop():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(1, 30)
        returns = [rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in range(n)]
        anchors = [rng.randint(0, 5) for _ in range(n)]
        for normalize in (True, False):
            got = step_group_advantages(torch.tensor(returns), torch.tensor(anchors), normalize=normalize)
            assert torch.allclose(got, torch.tensor(naive(returns, anchors, normalize)), atol=1e-4)
