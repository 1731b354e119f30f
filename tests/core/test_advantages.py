"""Advantage estimators: hand-worked values, naive loop implementations, and the edge cases
(equal-reward groups, groups of one, empty rows) that must give exactly 0 and never NaN."""

import math

import pytest
import torch

from tether.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
)


def _inputs(rewards, mask=None, group_size=1, **kw):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    mask = torch.ones(len(rewards), 3) if mask is None else torch.as_tensor(mask, dtype=torch.float32)
    return AdvantageInputs(rewards=rewards, mask=mask, group_size=group_size, **kw)


def _per_seq(out):
    """The per-sequence advantage of outcome-only estimators (identical on every masked token)."""
    return out.advantages[:, 0]


def _random_batch(seed, num_prompts=3, group_size=4, length=7):
    gen = torch.Generator().manual_seed(seed)
    batch = num_prompts * group_size
    rewards = torch.randint(0, 3, (batch,), generator=gen).float()
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    mask[1, 1] = 0.0  # a hole mid-row, as a masked tool observation leaves
    mask[2] = 0.0  # an empty row
    token_rewards = torch.randn(batch, length, generator=gen) * 0.1
    values = torch.randn(batch, length, generator=gen)
    return AdvantageInputs(rewards, mask, group_size, token_rewards=token_rewards, values=values)


# ------------------------------------------------------------------- naive loop references


def _loop_group_baseline(rewards, group_size, kind):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        for i, r in enumerate(group):
            if kind == "grpo":
                out.append((r - mean) / (std + 1e-6) if std > 0 else 0.0)
            elif kind == "dr_grpo":
                out.append(r - mean)
            else:  # rloo
                others = group[:i] + group[i + 1 :]
                out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def _loop_rows(inputs, row_fn):
    """Apply row_fn to the masked positions of each row (compressed), scatter results back."""
    out = torch.zeros_like(inputs.mask)
    for b in range(inputs.mask.shape[0]):
        idx = [t for t in range(inputs.mask.shape[1]) if inputs.mask[b, t] != 0]
        if not idx:
            continue
        rewards = [float(inputs.token_rewards[b, t]) for t in idx]
        rewards[-1] += float(inputs.rewards[b])
        values = [float(inputs.values[b, t]) for t in idx]
        for t, a in zip(idx, row_fn(rewards, values), strict=True):
            out[b, t] = a
    return out


def _loop_returns(rewards, _values, gamma):
    out, running = [], 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


def _loop_gae(rewards, values, gamma, lam):
    out, next_adv = [], 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        next_adv = rewards[t] + gamma * next_value - values[t] + gamma * lam * next_adv
        out.append(next_adv)
    return out[::-1]


def _loop_whiten(x, mask, eps=1e-6):
    vals = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t] != 0]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return torch.where(mask != 0, (x - mean) / (std + eps), 0.0)


# --------------------------------------------------------------------------- hand-worked


def test_grpo_hand_values():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    # A = +-0.5 / 0.57735 = +-0.866025
    out = compute_advantages("grpo", _inputs([1, 0, 0, 1], group_size=4))
    torch.testing.assert_close(
        _per_seq(out), torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.866025, atol=1e-5, rtol=0
    )


def test_dr_grpo_hand_values():
    # group [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25], no std division
    out = compute_advantages("dr_grpo", _inputs([1, 0, 0, 0], group_size=4))
    torch.testing.assert_close(_per_seq(out), torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rloo_hand_values():
    # group [1, 0, 0, 0]: A_0 = 1 - (0+0+0)/3 = 1; A_j = 0 - (1+0+0)/3 = -1/3
    out = compute_advantages("rloo", _inputs([1, 0, 0, 0], group_size=4))
    torch.testing.assert_close(_per_seq(out), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_reinforce_moving_baseline_hand_values():
    # step 1, no baseline yet: b = mean([1, 0, 1, 0]) = 0.5 -> A = [0.5, -0.5, 0.5, -0.5]
    #   new b = 0.9 * 0.5 + 0.1 * 0.5 = 0.5
    out = compute_advantages("reinforce", _inputs([1, 0, 1, 0]), baseline_momentum=0.9)
    torch.testing.assert_close(_per_seq(out), torch.tensor([0.5, -0.5, 0.5, -0.5]))
    torch.testing.assert_close(out.state["running_baseline"], torch.tensor(0.5))
    # step 2 with b = 0.2 carried in: A = r - 0.2 = [0.8, -0.2, 0.8, 0.8]
    #   new b = 0.9 * 0.2 + 0.1 * mean([1, 0, 1, 1]) = 0.18 + 0.075 = 0.255
    out = compute_advantages("reinforce", _inputs([1, 0, 1, 1], running_baseline=torch.tensor(0.2)))
    torch.testing.assert_close(_per_seq(out), torch.tensor([0.8, -0.2, 0.8, 0.8]))
    torch.testing.assert_close(out.state["running_baseline"], torch.tensor(0.255))


def test_remax_hand_values_and_missing_baseline():
    # A = r - r_greedy = [1 - 0.5, 0.5 - 0.5] = [0.5, 0]
    out = compute_advantages("remax", _inputs([1.0, 0.5], baseline_rewards=torch.tensor([0.5, 0.5])))
    torch.testing.assert_close(_per_seq(out), torch.tensor([0.5, 0.0]))
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages("remax", _inputs([1.0, 0.5]))


def test_reinforce_pp_hand_values():
    # mask [[1,1,0],[1,1,1]], outcome [1, 0], token rewards -0.1 everywhere, gamma 1
    # row 0 rewards [-0.1, -0.1 + 1]   -> returns [0.8, 0.9]
    # row 1 rewards [-0.1, -0.1, -0.1] -> returns [-0.3, -0.2, -0.1]
    # mean = 1.1 / 5 = 0.22; deviations [0.58, 0.68, -0.52, -0.42, -0.32]
    # unbiased var = (0.3364 + 0.4624 + 0.2704 + 0.1764 + 0.1024) / 4 = 0.337; std = 0.580517
    inputs = _inputs([1, 0], mask=[[1, 1, 0], [1, 1, 1]], token_rewards=torch.full((2, 3), -0.1))
    out = compute_advantages("reinforce_pp", inputs, gamma=1.0)
    expected = torch.tensor([[0.58, 0.68, 0.0], [-0.52, -0.42, -0.32]]) / 0.580517
    expected[0, 2] = 0.0
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=0)


def test_gae_hand_values():
    # one row, values [0.5, 0.6, 0.7], outcome 1 at the last token, gamma 1, lam 0.5
    # t=2: delta = 1 + 0 - 0.7 = 0.3;    A = 0.3
    # t=1: delta = 0 + 0.7 - 0.6 = 0.1;  A = 0.1 + 0.5 * 0.3 = 0.25
    # t=0: delta = 0 + 0.6 - 0.5 = 0.1;  A = 0.1 + 0.5 * 0.25 = 0.225
    # returns = A + V = [0.725, 0.85, 1.0]
    inputs = _inputs([1.0], values=torch.tensor([[0.5, 0.6, 0.7]]))
    out = compute_advantages("gae", inputs, gamma=1.0, lam=0.5, whiten=False)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.225, 0.25, 0.3]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.725, 0.85, 1.0]]))
    # lam = 1, gamma = 1: returns are the Monte-Carlo reward-to-go, whatever the values
    out = compute_advantages("gae", inputs, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(out.returns, torch.ones(1, 3))


# ---------------------------------------------------------------------- loop vs vectorised


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_group_estimators_match_loop(name, group_size):
    inputs = _random_batch(seed=group_size, group_size=group_size, num_prompts=12 // group_size)
    out = compute_advantages(name, inputs)
    # sequence-level estimators see the outcome plus the row's summed token rewards
    returns = inputs.rewards + (inputs.token_rewards * inputs.mask).sum(1)
    per_seq = torch.tensor(_loop_group_baseline(returns.tolist(), group_size, name))
    expected = torch.where(inputs.mask != 0, per_seq[:, None], 0.0)
    torch.testing.assert_close(out.advantages, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("group_baseline", [False, True])
def test_reinforce_pp_matches_loop(gamma, group_baseline):
    inputs = _random_batch(seed=1)
    out = compute_advantages("reinforce_pp", inputs, gamma=gamma, group_baseline=group_baseline)
    loop_inputs = inputs
    if group_baseline:
        centred = _loop_group_baseline(inputs.rewards.tolist(), inputs.group_size, "dr_grpo")
        loop_inputs = _random_batch(seed=1)
        loop_inputs.rewards = torch.tensor(centred)
    returns = _loop_rows(loop_inputs, lambda r, v: _loop_returns(r, v, gamma))
    torch.testing.assert_close(out.advantages, _loop_whiten(returns, inputs.mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_matches_loop(gamma, lam):
    inputs = _random_batch(seed=2)
    raw = compute_advantages("gae", inputs, gamma=gamma, lam=lam, whiten=False)
    expected = _loop_rows(inputs, lambda r, v: _loop_gae(r, v, gamma, lam))
    torch.testing.assert_close(raw.advantages, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(raw.returns, torch.where(inputs.mask != 0, expected + inputs.values, 0.0))
    whitened = compute_advantages("gae", inputs, gamma=gamma, lam=lam, whiten=True)
    torch.testing.assert_close(whitened.advantages, _loop_whiten(expected, inputs.mask), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whitened.returns, raw.returns)


# ------------------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_equal_reward_groups_give_exactly_zero(name):
    # In float32 mean([0.9, 0.9, 0.9]) - 0.9 = 6e-8, not 0: without the explicit flat-group
    # check GRPO divides that residue by a ~0 std and invents an advantage of 0.056.
    out = compute_advantages(name, _inputs([0.9, 0.9, 0.9, 1.0, 0.0, 0.7], group_size=3))
    assert torch.equal(out.advantages[:3], torch.zeros(3, 3))
    assert (out.advantages[3:] != 0).all()
    assert out.metrics["frac_zero_std_groups"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_size_one_gives_zero_not_nan(name):
    out = compute_advantages(name, _inputs([1.0, 0.0, 0.5], group_size=1))
    assert torch.equal(out.advantages, torch.zeros(3, 3))
    assert all(torch.isfinite(v) for v in out.metrics.values())


def _all_estimators_inputs(mask, name="grpo"):
    """Every input any estimator reads (the KL in the reward only where the estimator takes it)."""
    batch = mask.shape[0]
    return AdvantageInputs(
        rewards=torch.arange(batch, dtype=torch.float32),
        mask=mask,
        group_size=2,
        token_rewards=None if name == "grpo_process" else torch.full(mask.shape, -0.1),
        baseline_rewards=torch.zeros(batch),
        values=torch.ones(mask.shape),
        step_rewards=torch.arange(2 * batch, dtype=torch.float32).view(batch, 2) / 8,
        step_ends=torch.tensor([[0, 2]] * batch),
    )


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_empty_rows_get_zero_advantage_and_nothing_is_nan(name):
    mask = torch.ones(4, 3)
    mask[1] = 0.0
    out = compute_advantages(name, _all_estimators_inputs(mask, name))
    assert torch.equal(out.advantages[1], torch.zeros(3))
    assert (out.advantages[[0, 2, 3]] != 0).any()
    assert all(torch.isfinite(v).all() for v in out.metrics.values())
    # a batch with no trained token at all
    out = compute_advantages(name, _all_estimators_inputs(torch.zeros(4, 3), name))
    assert torch.equal(out.advantages, torch.zeros(4, 3))
    assert all(torch.isfinite(v).all() for v in out.metrics.values())


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_outputs_are_detached_tensors(name):
    inputs = _all_estimators_inputs(torch.ones(4, 3), name)
    inputs.values.requires_grad_(True)
    out = compute_advantages(name, inputs)
    assert not out.advantages.requires_grad
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in out.metrics.values())


# ---------------------------------------------------------------------------- dispatch


def test_compute_advantages_passes_only_the_knobs_an_estimator_names():
    knobs = dict(eps=1e-6, gamma=1.0, lam=0.5, whiten=False, baseline_momentum=0.9, group_baseline=True)
    inputs = _inputs([1.0], values=torch.tensor([[0.5, 0.6, 0.7]]))
    out = compute_advantages("gae", inputs, **knobs)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.225, 0.25, 0.3]]))  # lam=0.5 reached gae
    compute_advantages("grpo", _inputs([1.0, 0.0], group_size=2), **knobs)  # unused knobs dropped


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(
        KeyError, match="valid names: dr_grpo, gae, grpo, grpo_process, reinforce, reinforce_pp, remax, rloo"
    ):
        compute_advantages("ppo", _inputs([1.0]))


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", _inputs([1.0]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rewards=torch.zeros(4, 1), mask=torch.ones(4, 3), group_size=1), "rewards must be shape"),
        (dict(rewards=torch.zeros(4), mask=torch.ones(3, 3), group_size=1), "mask must be shape"),
        (dict(rewards=torch.zeros(4), mask=torch.ones(4, 3), group_size=3), "group_size 3"),
        (
            dict(rewards=torch.zeros(4), mask=torch.ones(4, 3), group_size=2, values=torch.ones(4, 2)),
            "values",
        ),
    ],
)
def test_inputs_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdvantageInputs(**kwargs)


def test_sequence_estimators_fold_token_rewards_into_the_return():
    """KL in the reward for sequence-level estimators: r_i + sum_t token_rewards_it.

    rewards [1, 0], token rewards row0 [-0.1, -0.2] (sum -0.3), row1 [-0.5, 0] (sum -0.5):
    returns [0.7, -0.5]; RLOO with G=2: A0 = 0.7 - (-0.5) = 1.2, A1 = -1.2.
    """
    mask = torch.ones(2, 2)
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), mask=mask, group_size=2,
                             token_rewards=torch.tensor([[-0.1, -0.2], [-0.5, 0.0]]))
    out = compute_advantages("rloo", inputs)
    assert torch.allclose(out.advantages, torch.tensor([[1.2, 1.2], [-1.2, -1.2]]))


def test_gae_matches_a_ppo_rlhf_reference_loop_on_right_padded_rows():
    """PPO-RLHF's reward layout (-beta * KL on every token, the score added on the last one) on rows
    of different lengths, against the padded reverse loop of lm-human-preferences / TRL, row by row."""
    gen = torch.Generator().manual_seed(7)
    lengths = [5, 2, 0, 4, 1]
    width, beta, gamma, lam = 6, 0.1, 0.9, 0.8
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    kl = torch.randn(len(lengths), width, generator=gen).abs() * mask
    values = torch.randn(len(lengths), width, generator=gen) * mask
    scores = torch.randn(len(lengths), generator=gen)
    inputs = AdvantageInputs(scores, mask, 1, token_rewards=-beta * kl, values=values)
    out = compute_advantages("gae", inputs, gamma=gamma, lam=lam, whiten=False)
    expected = torch.zeros(len(lengths), width)
    for b, n in enumerate(lengths):
        rewards = [-beta * float(kl[b, t]) for t in range(n)]
        if n:
            rewards[-1] += float(scores[b])
        last_gae = 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = rewards[t] + gamma * next_value - float(values[b, t])
            last_gae = delta + gamma * lam * last_gae
            expected[b, t] = last_gae
    torch.testing.assert_close(out.advantages, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.returns, (expected + values) * mask, atol=1e-6, rtol=1e-6)
    whitened = compute_advantages("gae", inputs, gamma=gamma, lam=lam, whiten=True)
    torch.testing.assert_close(whitened.advantages, _loop_whiten(expected, mask), atol=1e-5, rtol=1e-5)
    assert whitened.metrics["returns_mean"].item() == pytest.approx(float((expected + values)[mask != 0].mean()))


def test_estimators_declare_the_inputs_they_read_beyond_rewards():
    """A trainer asks the registry what to prepare: ReMax a greedy rollout's rewards, GAE a critic's values."""
    from tether.core.advantages import ADVANTAGE_ESTIMATORS
    from tether.core.registry import Registry

    assert ADVANTAGE_ESTIMATORS.needs("remax") == {"baseline_rewards"}
    assert ADVANTAGE_ESTIMATORS.needs("gae") == {"values"}
    assert all(not ADVANTAGE_ESTIMATORS.needs(n) for n in ("grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp"))
    with pytest.raises(KeyError, match="valid names"):
        ADVANTAGE_ESTIMATORS.needs("nope")
    registry = Registry("thing")
    registry.register("a", "alias", needs=("x",))(lambda: None)
    assert registry.needs("alias") == {"x"}


def test_reinforce_mean_of_all_past_rewards_baseline():
    # step 1: nothing seen yet, b = mean([1, 0, 1, 0]) = 0.5 -> A = [0.5, -0.5, 0.5, -0.5]; state [0.5, 4]
    out = compute_advantages("reinforce", _inputs([1, 0, 1, 0]), baseline="mean")
    torch.testing.assert_close(_per_seq(out), torch.tensor([0.5, -0.5, 0.5, -0.5]))
    torch.testing.assert_close(out.state["running_baseline"], torch.tensor([0.5, 4.0]))
    # step 2: b = 0.5 (the 4 rewards so far) -> A = [0.5, 0.5, 0.5, -0.5]; all 8 rewards: 5 / 8 = 0.625
    out = compute_advantages("reinforce", _inputs([1, 1, 1, 0], running_baseline=out.state["running_baseline"]),
                             baseline="mean")
    torch.testing.assert_close(_per_seq(out), torch.tensor([0.5, 0.5, 0.5, -0.5]))
    torch.testing.assert_close(out.state["running_baseline"], torch.tensor([0.625, 8.0]))
    # a naive loop over 5 random steps: the baseline of step k is the plain mean of every earlier reward
    g = torch.Generator().manual_seed(0)
    seen, state = [], None
    for _ in range(5):
        rewards = torch.rand(6, generator=g).tolist()
        out = compute_advantages("reinforce", _inputs(rewards, running_baseline=state), baseline="mean")
        expected_b = sum(seen) / len(seen) if seen else sum(rewards) / len(rewards)
        torch.testing.assert_close(_per_seq(out), torch.tensor(rewards) - expected_b)
        seen += rewards
        state = out.state["running_baseline"]
    with pytest.raises(ValueError, match="moving_average or mean"):
        compute_advantages("reinforce", _inputs([1.0, 0.0]), baseline="median")
