"""PPO on agent episodes: observation tokens (mask 0 inside a row) take no part in GAE or the value loss.

GAE over a masked episode must equal a naive GAE over the action tokens alone, concatenated (gamma and
lambda per action token, no discount for an observation's length); observation tokens get advantage 0,
return 0, and neither their values, their token rewards nor their returns move anything.
"""

import torch

from tether.core.advantages import AdvantageInputs, compute_advantages
from tether.core.policy_losses import value_loss_clipped

# two episodes: actions | observation | actions | observation | actions | padding
MASK = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0],
                     [1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)


def episode(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, generator=g), torch.randn(MASK.shape, generator=g),
            0.1 * torch.randn(MASK.shape, generator=g))


def naive_gae(rewards, values, gamma, lam):
    """Textbook GAE on one action sequence (Schulman et al. 2016, eq. 16), V after the last step 0."""
    n = len(rewards)
    advantages, running = [0.0] * n, 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


def test_gae_over_observation_gaps_equals_naive_gae_over_the_action_tokens():
    gamma, lam = 0.9, 0.8
    outcome, values, kl_rewards = episode(0)
    inputs = AdvantageInputs(rewards=outcome, mask=MASK, group_size=1, token_rewards=kl_rewards, values=values)
    out = compute_advantages("gae", inputs, gamma=gamma, lam=lam, whiten=False)
    for b in range(2):
        actions = MASK[b].nonzero().flatten().tolist()
        rewards = [float(kl_rewards[b, t]) for t in actions]
        rewards[-1] += float(outcome[b])  # the outcome lands on the episode's last action token
        v = [float(values[b, t]) for t in actions]
        expected = naive_gae(rewards, v, gamma, lam)
        torch.testing.assert_close(out.advantages[b, actions], torch.tensor(expected))
        torch.testing.assert_close(out.returns[b, actions], torch.tensor(expected) + torch.tensor(v))
    observed = MASK == 0
    assert torch.count_nonzero(out.advantages[observed]) == 0 and torch.count_nonzero(out.returns[observed]) == 0


def test_observation_values_and_rewards_change_nothing():
    """Anything at an observation position (its value, a KL term there) leaves GAE, whitened or not, as it was."""
    outcome, values, kl_rewards = episode(1)
    _, noise, more = episode(2)
    observed = MASK == 0
    for whiten in (False, True):
        base = compute_advantages("gae", AdvantageInputs(outcome, MASK, 1, token_rewards=kl_rewards, values=values),
                                  gamma=1.0, lam=0.95, whiten=whiten)
        moved = compute_advantages("gae", AdvantageInputs(
            outcome, MASK, 1, token_rewards=torch.where(observed, kl_rewards + more, kl_rewards),
            values=torch.where(observed, values + 10 * noise, values)), gamma=1.0, lam=0.95, whiten=whiten)
        assert torch.equal(base.advantages, moved.advantages) and torch.equal(base.returns, moved.returns)


def test_whitening_uses_the_action_tokens_only():
    outcome, values, _ = episode(3)
    raw = compute_advantages("gae", AdvantageInputs(outcome, MASK, 1, values=values), whiten=False).advantages
    white = compute_advantages("gae", AdvantageInputs(outcome, MASK, 1, values=values), whiten=True).advantages
    actions = raw[MASK != 0]
    expected = (actions - actions.mean()) / (actions.std() + 1e-6)  # unbiased std over action tokens
    torch.testing.assert_close(white[MASK != 0], expected)
    assert torch.count_nonzero(white[MASK == 0]) == 0


def test_value_loss_has_no_observation_term():
    """The clipped value loss equals its naive mean over the action tokens; observation positions get exactly zero
    gradient, and their values, old values and returns do not change the loss."""
    _, old, returns = episode(4)
    values = (old + 0.3 * episode(5)[1]).requires_grad_(True)
    loss, _ = value_loss_clipped(values, old, returns, MASK, clip_range=0.2, loss_agg="token-mean")
    loss.backward()
    observed = MASK == 0
    assert torch.count_nonzero(values.grad[observed]) == 0 and torch.count_nonzero(values.grad[~observed]) > 0
    v, o, r = values.detach()[~observed], old[~observed], returns[~observed]
    clipped = o + (v - o).clamp(-0.2, 0.2)
    naive = 0.5 * torch.maximum((v - r) ** 2, (clipped - r) ** 2).mean()
    torch.testing.assert_close(loss.detach(), naive)
    junk = episode(6)[1]
    moved, _ = value_loss_clipped(torch.where(observed, junk, values.detach()), torch.where(observed, -junk, old),
                                  torch.where(observed, 5 * junk, returns), MASK, clip_range=0.2, loss_agg="token-mean")
    assert torch.equal(moved, loss.detach())
