"""GSPO, GSPO-token, GMPO, CISPO, SAPO and DPPO: hand-computed values and gradients, and agreement with naive
per-sequence implementations (float64 loops over ragged batches) to 1e-10, values and gradients."""

import math

import pytest
import torch

from tether.core.policy_losses import POLICY_LOSSES, extra_arguments

NEW = ["gspo", "gspo_token", "gmpo", "cispo", "sapo", "dppo_tv", "dppo_kl"]


def run(name, lp, old, adv, mask=None, **kw):
    lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    old, adv = torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)
    mask = torch.ones_like(old) if mask is None else torch.tensor(mask, dtype=torch.float64)
    loss, metrics = POLICY_LOSSES.get(name)(lp, old, adv, mask, **kw)
    loss.backward()
    return loss.item(), lp.grad, metrics


def test_all_registered_with_their_extra_arguments():
    assert set(NEW) <= set(POLICY_LOSSES.names())
    assert extra_arguments("sapo") == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert extra_arguments("dppo_tv") == {"ratio_cap": 20.0} and extra_arguments("gspo") == {}


# ---- hand-computed ---------------------------------------------------------------------------------------
def test_gspo_hand_computed():
    # log s = mean(0.1, 0.3) = 0.2, s = e^0.2 = 1.2214 > 1.2: clipped for A = 1 (loss -1.2, no gradient) ...
    value, grad, m = run("gspo", [[0.1, 0.3]], [[0.0, 0.0]], [[1.0, 1.0]], clip_low=0.2, clip_high=0.2)
    assert value == pytest.approx(-1.2) and torch.all(grad == 0) and m["clip_frac"] == 1.0
    # ... not for A = -1: loss s, d s / d lp_t = s / 2.
    value, grad, _ = run("gspo", [[0.1, 0.3]], [[0.0, 0.0]], [[-1.0, -1.0]], clip_low=0.2, clip_high=0.2)
    assert value == pytest.approx(math.exp(0.2))
    torch.testing.assert_close(grad, torch.full((1, 2), math.exp(0.2) / 2, dtype=torch.float64))


def test_gspo_token_equals_gspo_when_the_advantage_is_constant_per_row():
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 5, generator=g) * 0.1, torch.randn(3, 5, generator=g) * 0.1
    adv = torch.randn(3, 1, generator=g).expand(3, 5)
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    a = run("gspo", lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_low=0.05, clip_high=0.05)
    b = run("gspo_token", lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_low=0.05, clip_high=0.05)
    assert a[0] == pytest.approx(b[0], abs=1e-12)
    torch.testing.assert_close(a[1], b[1], atol=1e-12, rtol=0)


def test_gmpo_hand_computed():
    # log r = (0.6, -0.6), A = 1, range 0.4: the first is clipped to 0.4 (the objective's side), the second kept.
    value, grad, m = run("gmpo", [[0.6, -0.6]], [[0.0, 0.0]], [[1.0, 1.0]], clip_low=0.4, clip_high=0.4)
    assert value == pytest.approx(-math.exp(-0.1))
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(-0.1) / 2]], dtype=torch.float64))
    assert m["clip_frac"] == 0.5


def test_cispo_hand_computed():
    # r = e^0.3 = 1.35 -> weight 1.2 (detached); l = -1.2 * A * log pi, gradient -1.2 * A: not dropped.
    value, grad, m = run("cispo", [[-0.5]], [[-0.8]], [[2.0]], clip_low=1.0, clip_high=0.2)
    assert value == pytest.approx(1.2)
    torch.testing.assert_close(grad, torch.tensor([[-2.4]], dtype=torch.float64))
    assert m["clip_frac_high"] == 1.0


def test_sapo_hand_computed():
    # on-policy (r = 1): gate 4 sigmoid(0) / tau = 2 / tau; the gradient is the plain policy gradient -A.
    value, grad, _ = run("sapo", [[-0.7]], [[-0.7]], [[1.0]], tau_pos=1.0, tau_neg=2.0)
    assert value == pytest.approx(-2.0)
    torch.testing.assert_close(grad, torch.tensor([[-1.0]], dtype=torch.float64))
    # off-policy r = e^0.5, A = -1: tau_neg = 2 -> l = sigmoid(2 (r - 1)) * 2, dl/dlp = 4 s (1 - s) r.
    r = math.exp(0.5)
    s = 1 / (1 + math.exp(-2 * (r - 1)))
    value, grad, _ = run("sapo", [[0.0]], [[-0.5]], [[-1.0]], tau_pos=1.0, tau_neg=2.0)
    assert value == pytest.approx(s * 2)
    assert grad.item() == pytest.approx(4 * s * (1 - s) * r)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masks_a_token_whose_probability_moved_too_far(name):
    # p_old = 0.5 -> p = 0.8: TV 0.3 > 0.2 and binary KL 0.2231 > 0.2, toward A > 0: masked (no gradient).
    value, grad, m = run(name, [[math.log(0.8)]], [[math.log(0.5)]], [[1.0]], clip_low=0.2, clip_high=0.2)
    assert value == 0.0 and grad.item() == 0.0 and m["trust_region_frac"] == 1.0
    # p = 0.6: TV 0.1, KL 0.0204: kept; l = -sg(r) A log p, r = 1.2, gradient -1.2 A.
    value, grad, m = run(name, [[math.log(0.6)]], [[math.log(0.5)]], [[1.0]], clip_low=0.2, clip_high=0.2)
    assert value == pytest.approx(-1.2 * math.log(0.6))
    assert grad.item() == pytest.approx(-1.2) and m["trust_region_frac"] == 0.0
    # moving away from the advantage's direction is never masked (p fell while A > 0).
    _, grad, _ = run(name, [[math.log(0.1)]], [[math.log(0.5)]], [[1.0]], clip_low=0.2, clip_high=0.2)
    assert grad.item() == pytest.approx(-0.2)


# ---- against naive implementations --------------------------------------------------------------------
def rows(lp, mask):
    return [[t for t in range(lp.shape[1]) if mask[i, t] != 0] for i in range(lp.shape[0])]


def naive(name, lp, old, adv, mask, lo, hi):
    """Per-sequence loops in float64, each loss written from its paper's formula."""
    seqs = [(i, ts) for i, ts in enumerate(rows(lp, mask)) if ts]
    total = lp.new_zeros(())
    ntok = sum(len(ts) for _, ts in seqs)
    for i, ts in seqs:
        a_seq = sum(adv[i, t] for t in ts) / len(ts)
        if name == "gspo":
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in ts) / len(ts))
            total = total + torch.maximum(-a_seq * s, -a_seq * s.clamp(1 - lo, 1 + hi)) / len(seqs)
        elif name == "gspo_token":
            log_s = sum(lp[i, t].detach() - old[i, t] for t in ts) / len(ts)
            for t in ts:
                s = torch.exp(log_s + lp[i, t] - lp[i, t].detach())
                a = adv[i, t]
                total = total + torch.maximum(-a * s, -a * s.clamp(1 - lo, 1 + hi)) / len(ts) / len(seqs)
        elif name == "gmpo":
            sign = 1.0 if a_seq >= 0 else -1.0
            kept = [sign * torch.minimum(sign * (lp[i, t] - old[i, t]), sign * (lp[i, t] - old[i, t]).clamp(-lo, hi))
                    for t in ts]
            total = total - a_seq * torch.exp(sum(kept) / len(ts)) / len(seqs)
        else:
            for t in ts:
                r = torch.exp(lp[i, t] - old[i, t])
                a = adv[i, t]
                if name == "cispo":
                    total = total - r.detach().clamp(1 - lo, 1 + hi) * a * lp[i, t] / ntok
                elif name == "sapo":
                    tau = 1.0 if a > 0 else 1.05
                    total = total - torch.sigmoid(tau * (r - 1)) * 4 / tau * a / len(ts) / len(seqs)
                else:
                    p, p_old = torch.exp(lp[i, t]).detach(), torch.exp(old[i, t])
                    if name == "dppo_tv":
                        out = (p - p_old > hi) if a > 0 else (p - p_old < -lo)
                    else:
                        d = p_old * torch.log(p_old / p) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
                        out = (d > hi and p > p_old) if a > 0 else (d > lo and p < p_old)
                    if not out:
                        total = total - r.detach().clamp(max=20.0) * a * lp[i, t] / ntok
    return total


AGG = {"gspo": "seq-mean-token-mean", "gspo_token": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean",
       "sapo": "seq-mean-token-mean", "cispo": "token-mean", "dppo_tv": "token-mean", "dppo_kl": "token-mean"}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", NEW)
def test_matches_naive_implementation_on_ragged_batches(name, seed):
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 7
    old = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp0 = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    lp0 = lp0.clamp(max=-1e-3)  # probabilities below 1 (DPPO's binary divergence)
    per_token = seed == 2  # ragged per-token advantages on one seed, GRPO-style per-row ones on the others
    adv = (torch.randn(b, t, generator=g, dtype=torch.float64) if per_token
           else torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).clone())
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = 0  # an empty row is not a sequence
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    lo, hi = 0.15, 0.25
    lp = lp0.clone().requires_grad_()
    loss, _ = POLICY_LOSSES.get(name)(lp, old, adv, mask, clip_low=lo, clip_high=hi, loss_agg=AGG[name])
    loss.backward()
    lp_naive = lp0.clone().requires_grad_()
    expected = naive(name, lp_naive, old, adv, mask, lo, hi)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-10)
    torch.testing.assert_close(lp.grad, lp_naive.grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", NEW)
def test_on_policy_gradient_is_the_policy_gradient_direction(name):
    """At r = 1 every loss's gradient is a positive multiple of -A grad log pi per token (the clip, gate and
    trust region are inactive), so all of them agree with REINFORCE on fresh data."""
    g = torch.Generator().manual_seed(4)
    lp0 = torch.log(torch.rand(2, 4, generator=g, dtype=torch.float64) * 0.5 + 0.1)
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4], dtype=torch.float64)
    lp = lp0.clone().requires_grad_()
    POLICY_LOSSES.get(name)(lp, lp0, adv, torch.ones_like(lp0), loss_agg="token-mean").__getitem__(0).backward()
    assert torch.all(torch.sign(lp.grad) == -torch.sign(adv))
