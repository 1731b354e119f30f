"""Process-supervised GRPO (DeepSeekMath 4.1.3): step rewards normalised over the group, each token's
advantage the sum of the normalised rewards of the steps ending at or after it."""

import math

import pytest
import torch

from tether.core.advantages import AdvantageInputs, compute_advantages
from tether.data.tokenize import step_end_tokens


def inputs(step_rewards, step_ends, mask, group_size, **extra):
    return AdvantageInputs(rewards=torch.zeros(len(mask)), mask=torch.tensor(mask, dtype=torch.float32),
                           group_size=group_size, step_rewards=torch.tensor(step_rewards, dtype=torch.float32),
                           step_ends=torch.tensor(step_ends), **extra)


def test_hand_value():
    # one group of two samples: steps [1, 0] ending at tokens [1, 3]; [1] ending at token 2 (+ a padding step)
    # all step rewards R = {1, 0, 1}: mean 2/3, unbiased std sqrt(((1/3)² · 2 + (2/3)²) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    hi, lo = (1 - 2 / 3) / std, (0 - 2 / 3) / std
    out = compute_advantages("grpo_process", inputs([[1.0, 0.0], [1.0, 0.0]], [[1, 3], [2, -1]],
                                                    [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], 2), eps=0.0)
    want = [[hi + lo, hi + lo, lo, lo, 0.0], [hi, hi, hi, 0.0, 0.0]]
    torch.testing.assert_close(out.advantages, torch.tensor(want))


def naive(step_rewards, step_ends, mask, group_size, eps=1e-6):
    b, t = len(mask), len(mask[0])
    out = [[0.0] * t for _ in range(b)]
    for g in range(0, b, group_size):
        values = [r for i in range(g, g + group_size) for r, e in zip(step_rewards[i], step_ends[i], strict=True) if e >= 0]
        if len(values) < 2 or max(values) - min(values) <= eps:
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i in range(g, g + group_size):
            for pos in range(t):
                if mask[i][pos]:
                    out[i][pos] = sum((r - mean) / (std + eps) for r, e in zip(step_rewards[i], step_ends[i], strict=True)
                                      if e >= pos)
    return torch.tensor(out)


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_naive_loop_on_random_ragged_groups(seed):
    g = torch.Generator().manual_seed(seed)
    group, groups, width, steps = 4, 3, 12, 5
    b = group * groups
    lengths = torch.randint(1, width + 1, (b,), generator=g).tolist()
    mask = [[1 if p < n else 0 for p in range(width)] for n in lengths]
    rewards, ends = [], []
    for n in lengths:
        k = int(torch.randint(0, steps + 1, (1,), generator=g))
        cuts = sorted(torch.randperm(n, generator=g)[:k].tolist())
        ends.append(cuts + [-1] * (steps - len(cuts)))
        rewards.append(torch.rand(steps, generator=g).tolist())
    out = compute_advantages("grpo_process", inputs(rewards, ends, mask, group))
    torch.testing.assert_close(out.advantages, naive(rewards, ends, mask, group), rtol=1e-5, atol=1e-5)


def test_equal_step_rewards_carry_no_signal_and_kl_in_reward_is_refused():
    out = compute_advantages("grpo_process", inputs([[0.5, 0.5], [0.5, -1]], [[0, 1], [1, -1]], [[1, 1], [1, 1]], 2))
    assert out.advantages.abs().max() == 0  # the -1 is no step (its end is -1)
    with pytest.raises(ValueError, match="in the loss"):
        compute_advantages("grpo_process", inputs([[1.0]], [[0]], [[1]], 1, token_rewards=torch.zeros(1, 1)))
    with pytest.raises(ValueError, match="come together"):
        AdvantageInputs(rewards=torch.zeros(1), mask=torch.ones(1, 1), group_size=1, step_rewards=torch.zeros(1, 1))


def test_step_end_tokens():
    # character tokens with a trailing eos (decoded to ""): steps end at the token of their separator,
    # the last step at the last token
    assert step_end_tokens([*"<t>ab|cd|</t>9", ""], "|") == [5, 8, 14]
    assert step_end_tokens(["<t>a", "b|", "cd", "|", "</t>9"], "|") == [1, 3, 4]
    assert step_end_tokens([*"a||b|"], "|") == [1, 4]  # blank pieces are no step (as split_steps)
    assert step_end_tokens([], "|") == []


def test_outcome_weight_adds_grpo_s_outcome_advantage_to_every_token():
    step = inputs([[1.0, 0.0], [1.0, 0.0]], [[1, 3], [2, -1]], [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], 2)
    step.rewards = torch.tensor([1.0, 0.0])
    process = compute_advantages("grpo_process", step).advantages
    both = compute_advantages("grpo_process", step, outcome_weight=0.5).advantages
    # GRPO on rewards (1, 0): mean 0.5, unbiased std sqrt(0.5): +-0.5 / sqrt(0.5) = +-sqrt(0.5)
    outcome = torch.tensor([[1.0] * 4 + [0.0], [-1.0] * 3 + [0.0] * 2]) * math.sqrt(0.5)
    torch.testing.assert_close(both, process + 0.5 * outcome, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="outcome_weight"):
        compute_advantages("grpo_process", step, outcome_weight=-1.0)
