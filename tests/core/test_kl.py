"""KL estimators: hand-worked values, unbiasedness by Monte Carlo, the k3 clamp, registry lookup."""

import math

import pytest
import torch

from tether.core.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_k3,
    kl_penalty,
)


def test_k1_k2_k3_hand_values():
    # d = logprobs - ref_logprobs = [1, -1]
    # k1 = d = [1, -1];  k2 = d^2 / 2 = [0.5, 0.5]
    # k3 = exp(-d) - 1 + d = [e^-1 - 1 + 1, e^1 - 1 - 1] = [0.367879, 0.718282]
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k1"), torch.tensor([[1.0, -1.0]]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k2"), torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "k3"), torch.tensor([[math.exp(-1), math.e - 2]]))


def test_k1_and_k3_are_unbiased_estimates_of_kl_pi_ref():
    # Tokens sampled from pi; the mean of k1 and k3 must approach the exact KL(pi || pi_ref).
    gen = torch.Generator().manual_seed(0)
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25])
    exact = (pi * (pi / ref).log()).sum()
    tokens = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    logprobs, ref_logprobs = pi.log()[tokens][None], ref.log()[tokens][None]
    for name in ("k1", "k3"):
        assert kl_penalty(logprobs, ref_logprobs, name).mean() == pytest.approx(exact.item(), abs=5e-3)
    assert (kl_penalty(logprobs, ref_logprobs, "k3") >= 0).all()
    assert (kl_penalty(logprobs, ref_logprobs, "k2") >= 0).all()


def test_k3_clamps_the_log_ratio_to_stay_finite():
    # d = +100 -> clamped to 20: exp(-20) - 1 + 20;  d = -100 -> clamped to -20: exp(20) - 1 - 20
    logprobs = torch.tensor([[0.0, -100.0]], requires_grad=True)
    ref = torch.tensor([[-100.0, 0.0]])
    out = kl_k3(logprobs, ref)
    torch.testing.assert_close(out, torch.tensor([[math.exp(-20) + 19, math.exp(20) - 21]]))
    out.sum().backward()
    assert torch.isfinite(logprobs.grad).all()


def test_unknown_estimator_lists_valid_names():
    x = torch.zeros(1, 2)
    with pytest.raises(KeyError, match="valid names: k1, k2, k3"):
        kl_penalty(x, x, "k4")
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "k1")


# ------------------------------------------------------------------------------ KL controllers


def test_fixed_controller_never_moves():
    ctl = KL_CONTROLLERS.get("fixed")(0.05, target=6.0, horizon=10000)
    assert ctl.update(100.0, 64) == 0.05 and ctl.value == 0.05


def test_adaptive_controller_hand_values():
    # target 6, horizon 1000, batch 100 -> K_beta = 0.1
    # KL 9: e = clip(9/6 - 1, -0.2, 0.2) = 0.2 (clipped from 0.5) -> beta = 0.1 * (1 + 0.1 * 0.2) = 0.102
    # KL 5.4: e = 5.4/6 - 1 = -0.1 -> beta = 0.102 * (1 - 0.01) = 0.10098
    # KL 6: e = 0 -> unchanged
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    assert ctl.update(9.0, 100) == pytest.approx(0.102)
    assert ctl.update(5.4, 100) == pytest.approx(0.10098)
    assert ctl.update(6.0, 100) == pytest.approx(0.10098)


def test_adaptive_controller_converges_to_the_target_and_restores_its_state():
    # A toy "policy" whose KL is inversely proportional to beta: KL = 0.6 / beta; the fixed point is beta = 0.1.
    ctl = KL_CONTROLLERS.get("adaptive")(1.0, target=6.0, horizon=100)
    for _ in range(2000):
        ctl.update(0.6 / ctl.value, 10)
    assert ctl.value == pytest.approx(0.1, rel=1e-3)
    fresh = AdaptiveKLController(1.0, target=6.0, horizon=100)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.update(3.0, 10) == ctl.update(3.0, 10)


def test_controller_arguments_are_checked():
    with pytest.raises(ValueError, match=">= 0"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)
    with pytest.raises(KeyError, match="adaptive, fixed"):
        KL_CONTROLLERS.get("pid")
