"""Policy and value losses: hand-worked values, gradients where clipped and unclipped,
exactness under micro-batching, registry lookup."""

import math

import pytest
import torch

from tether.core.aggregation import num_seqs, num_tokens
from tether.core.policy_loss import ppo_clip, value_loss_clipped, vanilla_pg
from tether.core.policy_losses import POLICY_LOSSES

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _tokens(ratios, advantages):
    """One row: old log-probs 0, current log-probs log(ratio) with gradient."""
    logprobs = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    return logprobs, torch.zeros_like(logprobs), torch.tensor([advantages]), torch.ones_like(logprobs)


def test_ppo_clip_hand_values_and_gradient():
    # clip 0.2; per token l = max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5, A= 1: max(-1.5, -1.2) = -1.2  clipped high -> grad 0
    #   r=0.5, A=-1: max( 0.5,  0.8) =  0.8  clipped low  -> grad 0
    #   r=1.1, A= 1: max(-1.1, -1.1) = -1.1  inside       -> dl/dlogp = -A r = -1.1
    #   r=1.5, A=-1: max( 1.5,  1.2) =  1.5  pessimistic, unclipped -> 1.5
    #   r=0.9, A=-2: max( 1.8,  1.6) =  1.8  unclipped    -> 1.8
    # token-mean: (-1.2 + 0.8 - 1.1 + 1.5 + 1.8) / 5 = 0.36; gradients divided by N = 5
    logprobs, old, adv, mask = _tokens([1.5, 0.5, 1.1, 1.5, 0.9], [1.0, -1.0, 1.0, -1.0, -2.0])
    loss, metrics = ppo_clip(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(0.36)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1, 1.5, 1.8]]) / 5)
    assert metrics["clip_frac_high"].item() == pytest.approx(1 / 5)
    assert metrics["clip_frac_low"].item() == pytest.approx(1 / 5)
    assert metrics["dual_clip_frac"].item() == 0.0
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.9) / 5)
    # approx_kl = mean(r - 1 - log r)
    expected_kl = sum(r - 1 - math.log(r) for r in [1.5, 0.5, 1.1, 1.5, 0.9]) / 5
    assert metrics["approx_kl"].item() == pytest.approx(expected_kl, rel=1e-5)


def test_clip_higher_widens_only_the_upper_bound():
    # r=1.25, A=1: symmetric 0.2 clips to -1.2 (grad 0); DAPO clip_high=0.28 keeps -1.25 (grad -1.25)
    # r=0.75, A=-1: clip_low=0.2 clips to 0.8 in both
    logprobs, old, adv, mask = _tokens([1.25, 0.75], [1.0, -1.0])
    sym, _ = ppo_clip(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert sym.item() == pytest.approx((-1.2 + 0.8) / 2)
    dapo, metrics = ppo_clip(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert dapo.item() == pytest.approx((-1.25 + 0.8) / 2)
    dapo.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.25 / 2, 0.0]]))
    assert metrics["clip_frac_high"].item() == 0.0


def test_dual_clip_caps_negative_advantage_loss():
    # dual_clip c = 3:
    #   r=5, A=-1: standard max(5, 1.2) = 5, capped at -c A = 3 -> 3, grad 0
    #   r=2, A=-1: standard 2 < 3, unchanged                   -> 2, grad 2
    #   r=5, A= 1: A > 0 untouched: clipped high to -1.2          -> grad 0
    # token-mean: (3 + 2 - 1.2) / 3 = 1.266667
    logprobs, old, adv, mask = _tokens([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, metrics = ppo_clip(logprobs, old, adv, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.8 / 3)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]]) / 3)
    assert metrics["dual_clip_frac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_clip(logprobs, old, adv, mask, dual_clip=0.5)


def test_ppo_clip_gradient_is_minus_a_ratio_over_n_where_unclipped():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(6, 5, generator=gen) - 2
    logprobs = (old + 0.4 * torch.randn(6, 5, generator=gen)).requires_grad_(True)
    adv = torch.randn(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    loss, _ = ppo_clip(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.3)
    loss.backward()
    ratio = (logprobs - old).exp().detach()
    clipped = ((adv > 0) & (ratio > 1.3)) | ((adv < 0) & (ratio < 0.8))
    assert clipped.any() and (~clipped & (mask > 0)).any()
    expected = torch.where(clipped | (mask == 0), 0.0, -adv * ratio / mask.sum())
    torch.testing.assert_close(logprobs.grad, expected)


def test_on_policy_ppo_and_vanilla_pg_have_the_same_gradient():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, generator=gen)
    adv, mask = torch.randn(3, 4, generator=gen), torch.ones(3, 4)
    grads = []
    for fn in (ppo_clip, vanilla_pg):
        logprobs = base.clone().requires_grad_(True)
        loss, _ = fn(logprobs, base.clone(), adv, mask)
        loss.backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_vanilla_pg_hand_values():
    # l = -A log p: [-(1)(-1), -(-1)(-2)] = [1, -2]; token-mean -0.5; dl/dlogp = -A / N = [-0.5, 0.5]
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, metrics = vanilla_pg(logprobs, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 0.5]]))
    assert metrics["logprob_mean"].item() == pytest.approx(-1.5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ppo_clip", "vanilla_pg", "value"])
def test_micro_batches_with_global_denominators_equal_full_batch(name, mode):
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(8, 6, generator=gen)
    current = (old + 0.3 * torch.randn(8, 6, generator=gen)).requires_grad_(True)
    target = torch.randn(8, 6, generator=gen)
    mask = (torch.rand(8, 6, generator=gen) > 0.4).float()
    mask[4] = 0.0

    def call(rows, **denominators):
        args = (current[rows], old[rows], target[rows], mask[rows])
        if name == "value":
            return value_loss_clipped(*args, clip_range=0.2, loss_agg=mode, **denominators)[0]
        return POLICY_LOSSES.get(name)(*args, dual_clip=2.0, loss_agg=mode, **denominators)[0]

    full = call(slice(None))
    (full_grad,) = torch.autograd.grad(full, current)
    denominators = dict(global_tokens=num_tokens(mask), global_seqs=num_seqs(mask))
    summed = sum(call(slice(i, i + 2), **denominators) for i in range(0, 8, 2))
    (summed_grad,) = torch.autograd.grad(summed, current)
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(summed_grad, full_grad)


def test_value_loss_clipped_hand_values_and_gradient():
    # clip 0.2; l = 0.5 * max((V-R)^2, (clip(V, Vold +- 0.2) - R)^2):
    #   V=1.0, Vold=0.5, R=2: max(1, (0.7-2)^2 = 1.69) = 1.69 -> 0.845, clipped term wins -> grad 0
    #   V=0.6, Vold=0.5, R=0: inside the range: 0.36 -> 0.18,  grad V - R = 0.6
    #   V=1.0, Vold=0.5, R=0: max(1, 0.49) = 1 -> 0.5,          grad V - R = 1.0
    # token-mean: (0.845 + 0.18 + 0.5) / 3 = 0.508333; gradients / 3
    values = torch.tensor([[1.0, 0.6, 1.0]], requires_grad=True)
    old, returns = torch.tensor([[0.5, 0.5, 0.5]]), torch.tensor([[2.0, 0.0, 0.0]])
    loss, metrics = value_loss_clipped(values, old, returns, torch.ones(1, 3), clip_range=0.2)
    assert loss.item() == pytest.approx(1.525 / 3)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.6, 1.0]]) / 3)
    assert metrics["value_clip_frac"].item() == pytest.approx(1 / 3)
    assert not any(v.requires_grad for v in metrics.values())
    # unclipped: 0.5 * (1 + 0.36 + 1) / 3
    plain, _ = value_loss_clipped(values, old, returns, torch.ones(1, 3), clip_range=None)
    assert plain.item() == pytest.approx(0.5 * 2.36 / 3)


def test_explained_variance():
    # V == R: 1 - 0 / Var(R) = 1;  V == 0: 1 - Var(R) / Var(R) = 0
    returns, mask = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.ones(1, 4)
    _, perfect = value_loss_clipped(returns.clone(), returns, returns, mask)
    _, zero = value_loss_clipped(torch.zeros(1, 4), torch.zeros(1, 4), returns, mask)
    assert perfect["explained_variance"].item() == pytest.approx(1.0)
    assert zero["explained_variance"].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", ["ppo_clip", "vanilla_pg"])
def test_metrics_are_detached_tensors_and_empty_mask_is_finite(name):
    logprobs = torch.randn(2, 3, requires_grad=True)
    loss, metrics = POLICY_LOSSES.get(name)(logprobs, torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())
    assert all(torch.isfinite(v) for v in metrics.values())


def test_unknown_policy_loss_lists_valid_names():
    with pytest.raises(KeyError, match="valid names: cispo, clip_cov, dppo_kl, dppo_tv, gmpo, gspo, gspo_token, "
                                       "kl_cov, ppo_clip, sapo, vanilla_pg"):
        POLICY_LOSSES.get("grpo")


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="one shape"):
        ppo_clip(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
