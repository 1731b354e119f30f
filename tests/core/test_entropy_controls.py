"""Entropy controls: the adaptive coefficient, the high-entropy token mask, Clip-Cov and KL-Cov, against
hand-computed values."""

import pytest
import torch

from tether.core.covariance_policy_loss import clip_cov, kl_cov, token_covariance
from tether.core.entropy import adaptive_entropy_coef, top_entropy_mask
from tether.core.policy_loss import ppo_clip


def test_adaptive_coefficient_steps_toward_the_target_and_stays_in_bounds():
    assert adaptive_entropy_coef(0.01, 0.2, target=0.5, lr=0.005) == pytest.approx(0.015)  # too little entropy
    assert adaptive_entropy_coef(0.01, 0.9, target=0.5, lr=0.005) == pytest.approx(0.005)  # too much
    assert adaptive_entropy_coef(0.002, 0.9, target=0.5, lr=0.005) == 0.0
    assert adaptive_entropy_coef(0.02, 0.1, target=0.5, lr=0.005, max_coef=0.021) == pytest.approx(0.021)


def test_top_entropy_mask_keeps_the_top_fraction_of_trained_tokens():
    entropy = torch.tensor([[0.1, 0.9, 0.5, 2.0], [0.3, 0.7, 0.2, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])  # 5.0 is padding: never counted
    kept = top_entropy_mask(entropy, mask, 0.25)
    # 7 trained tokens; the 0.75 quantile of (0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 2.0) is 0.8: 0.9 and 2.0 are kept
    assert kept.tolist() == [[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert torch.equal(top_entropy_mask(entropy, mask, 1.0), mask)
    with pytest.raises(ValueError, match="quantile"):
        top_entropy_mask(entropy, mask, 0.0)


LP = torch.tensor([[-0.5, -2.0, -1.0], [-0.1, -3.0, -0.7]], dtype=torch.float64)
ADV = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
MASK = torch.ones(2, 3, dtype=torch.float64)


def test_token_covariance_hand_computed():
    cov = token_covariance(LP, ADV, MASK)
    mean_lp, mean_adv = LP.mean(), ADV.mean()
    torch.testing.assert_close(cov, (LP - mean_lp) * (ADV - mean_adv))
    # the largest: token (1, 1), log pi -3.0 (below the mean -1.2167) with A = -1 (below the mean 0.5)
    assert cov.argmax().item() == 4 and cov[1, 1].item() == pytest.approx(2.675)


def test_clip_cov_stops_the_gradient_of_the_highest_covariance_token_in_the_band():
    lp = LP.clone().requires_grad_()
    # in [1, 5]: token (0, 0) (cov 1.075) and (1, 1) (2.675); fraction 0.1 of 6 tokens -> 1 token, the larger
    loss, m = clip_cov(lp, LP, ADV, MASK, clip_fraction=0.1, cov_low=1.0, cov_high=5.0)
    loss.backward()
    reference = LP.clone().requires_grad_()
    ref_loss, _ = ppo_clip(reference, LP, ADV, MASK, loss_agg="token-mean")
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item())  # same value: only a gradient is stopped
    assert lp.grad[1, 1] == 0 and reference.grad[1, 1] != 0
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, 1] = False
    torch.testing.assert_close(lp.grad[keep], reference.grad[keep])
    assert m["cov_clipped_frac"].item() == pytest.approx(1 / 6)


def test_kl_cov_penalises_the_top_covariance_tokens():
    old = LP - torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.3, 0.0]], dtype=torch.float64)  # token (1, 1) moved by 0.3
    lp = LP.clone().requires_grad_()
    loss, m = kl_cov(lp, old, ADV, MASK, kl_fraction=0.1, kl_coef=0.5, clip_low=0.2, clip_high=0.2)
    loss.backward()
    r = torch.exp(torch.tensor(0.3, dtype=torch.float64))
    # token (1, 1), the top covariance: -A r + 0.5 |0.3| with A = -1 (unclipped), gradient r + 0.5; the other
    # five at r = 1: -A each, gradient -A (-2 on row 0, +1 on row 1)
    expected = (-2.0 * 3 + 1.0 * 2 + r + 0.5 * 0.3) / 6
    assert loss.item() == pytest.approx(expected.item())
    assert lp.grad[1, 1].item() == pytest.approx((r.item() + 0.5) / 6)
    assert lp.grad[0, 0].item() == pytest.approx(-2.0 / 6) and lp.grad[1, 0].item() == pytest.approx(1.0 / 6)
    assert m["cov_kl_frac"].item() == pytest.approx(1 / 6)
