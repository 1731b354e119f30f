import math

import pytest
import torch

from tether.core.preference import (
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    PreferenceInputs,
    kto_loss,
    mixed_preference_loss,
    wpo_weights,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def pairs(**extra):
    """Two pairs with log-ratios chosen = [1, 0], rejected = [-1, 1], so h = [2, -1].

    chosen - ref_chosen: -10 - -11 = 1, -12 - -12 = 0; rejected - ref_rejected: -14 - -13 = -1,
    -11 - -12 = 1. At β = 0.1, βh = [0.2, -0.1].
    """
    return PreferenceInputs(
        chosen_logps=t(-10.0, -12.0),
        rejected_logps=t(-14.0, -11.0),
        ref_chosen_logps=torch.tensor([-11.0, -12.0], dtype=torch.float64),
        ref_rejected_logps=torch.tensor([-13.0, -12.0], dtype=torch.float64),
        **extra,
    )


def ref_free(**extra):
    """Summed log-probs with lengths: mean log-probs chosen = [-2/4, -6/3] = [-0.5, -2],
    rejected = [-6/3, -4/4] = [-2, -1]."""
    return PreferenceInputs(
        chosen_logps=t(-2.0, -6.0),
        rejected_logps=t(-6.0, -4.0),
        chosen_lengths=torch.tensor([4, 3]),
        rejected_lengths=torch.tensor([3, 4]),
        **extra,
    )


def loss_of(name, inputs, **hp):
    return PREFERENCE_LOSSES.get(name)(inputs, **hp)


def test_sigmoid_dpo_hand_value_and_rewards():
    # -log σ(0.2) = log(1 + e^-0.2) = 0.598139; -log σ(-0.1) = log(1 + e^0.1) = 0.744397;
    # mean 0.671268. Rewards β·logratio: chosen [0.1, 0], rejected [-0.1, 0.1].
    loss, m = loss_of("sigmoid", pairs(), beta=0.1)
    assert loss.item() == pytest.approx(0.6712677647, abs=1e-9)
    assert m["rewards/chosen"].item() == pytest.approx(0.05)
    assert m["rewards/rejected"].item() == pytest.approx(0.0)
    assert m["rewards/margin"].item() == pytest.approx(0.05)  # mean of [0.2, -0.1]
    assert m["rewards/accuracy"].item() == pytest.approx(0.5)
    assert all(not v.requires_grad for v in m.values())


def test_sigmoid_dpo_weighted_mean():
    # weights [3, 1]: (3 · 0.598139 + 0.744397) / 4 = 0.634703
    loss, _ = loss_of("sigmoid", pairs(weights=torch.tensor([3.0, 1.0])), beta=0.1)
    assert loss.item() == pytest.approx(0.6347033171, abs=1e-9)


def test_cdpo_hand_value():
    # ε = 0.1: 0.9 · 0.598139 + 0.1 · log(1 + e^0.2) = 0.538325 + 0.079814 = 0.618139;
    #          0.9 · 0.744397 + 0.1 · log(1 + e^-0.1) = 0.669957 + 0.064440 = 0.734397; mean 0.676268
    loss, _ = loss_of("cdpo", pairs(), beta=0.1, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.6762677647, abs=1e-9)
    with pytest.raises(ValueError, match="label_smoothing"):
        loss_of("cdpo", pairs(), label_smoothing=0.7)


def test_robust_dpo_hand_value():
    # ε = 0.1: (0.9 · 0.598139 - 0.1 · 0.798139) / 0.8 = 0.573139;
    #          (0.9 · 0.744397 - 0.1 · 0.644397) / 0.8 = 0.756897; mean 0.665018
    loss, _ = loss_of("robust", pairs(), beta=0.1, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.6650177647, abs=1e-9)
    with pytest.raises(ValueError, match="label_smoothing"):
        loss_of("robust", pairs(), label_smoothing=0.5)


def test_ipo_hand_value_summed_and_length_normalized():
    # 1/(2β) = 5. Summed: (2 - 5)² = 9, (-1 - 5)² = 36, mean 22.5.
    loss, _ = loss_of("ipo", pairs(), beta=0.1)
    assert loss.item() == pytest.approx(22.5)
    # Length-normalised, lengths chosen [2, 4], rejected [1, 2]: h = [1/2 + 1/1, 0/4 - 1/2] = [1.5, -0.5];
    # (1.5 - 5)² = 12.25, (-0.5 - 5)² = 30.25, mean 21.25.
    inputs = pairs(chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([1, 2]))
    loss, _ = loss_of("ipo", inputs, beta=0.1, length_normalize=True)
    assert loss.item() == pytest.approx(21.25)


def test_hinge_hand_value():
    # β = 0.1: max(0, 1 - 0.2) = 0.8, max(0, 1 + 0.1) = 1.1, mean 0.95.
    # β = 1: max(0, 1 - 2) = 0 (margin met, no gradient), max(0, 1 + 1) = 2, mean 1.
    assert loss_of("hinge", pairs(), beta=0.1)[0].item() == pytest.approx(0.95)
    inputs = pairs()
    loss, _ = loss_of("hinge", inputs, beta=1.0)
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    assert inputs.chosen_logps.grad.tolist() == [0.0, -0.5]  # d/dc of 2/2 · (1 - h) for pair 2


def test_rpo_hand_value():
    # DPO 0.671268 + α · mean NLL, NLL [0.5, 1.0], α = 1: 0.671268 + 0.75 = 1.421268.
    loss, m = loss_of("rpo", pairs(chosen_nll=torch.tensor([0.5, 1.0], dtype=torch.float64)), beta=0.1)
    assert loss.item() == pytest.approx(1.4212677647, abs=1e-9)
    assert m["nll"].item() == pytest.approx(0.75)
    # NLL derived from lengths when chosen_nll is absent: -(-10)/20 = 0.5, -(-12)/12 = 1.
    derived = pairs(chosen_lengths=torch.tensor([20, 12]))
    assert loss_of("rpo", derived, beta=0.1)[0].item() == pytest.approx(1.4212677647, abs=1e-9)


def test_nll_norm_token_averages_over_all_chosen_tokens_as_trl():
    # RPO: token NLL = (10 + 12) / (20 + 12) = 0.6875 (sequence: 0.75); DPO term 0.671268 unchanged.
    derived = pairs(chosen_lengths=torch.tensor([20, 12]))
    loss, m = loss_of("rpo", derived, beta=0.1, nll_norm="token")
    assert loss.item() == pytest.approx(0.6712677647 + 0.6875, abs=1e-9)
    assert m["nll"].item() == pytest.approx(0.75)  # the logged figure stays the per-sequence mean
    # ORPO: token NLL = (2 + 6) / (4 + 3) = 8/7 (sequence: 1.25); penalty mean 0.0824075289 unchanged.
    assert loss_of("orpo", ref_free(), beta=0.1, nll_norm="token")[0].item() == pytest.approx(
        8 / 7 + 0.0824075289, abs=1e-9)
    equal = pairs(chosen_lengths=torch.tensor([16, 16]))  # equal lengths: the two conventions agree
    assert loss_of("rpo", equal, nll_norm="token")[0].item() == pytest.approx(loss_of("rpo", equal)[0].item())
    with pytest.raises(ValueError, match="nll_norm"):
        loss_of("rpo", derived, nll_norm="batch")


def test_simpo_hand_value():
    # β = 2, γ = 1: rewards chosen 2·[-0.5, -2] = [-1, -4], rejected 2·[-2, -1] = [-4, -2];
    # z = r_c - r_r - γ = [2, -3]; -log σ(2) = 0.126928, -log σ(-3) = 3.048587; mean 1.587758.
    loss, m = loss_of("simpo", ref_free(), beta=2.0, simpo_gamma=1.0)
    assert loss.item() == pytest.approx(1.5877576813, abs=1e-9)
    assert m["rewards/chosen"].item() == pytest.approx(-2.5)
    assert m["rewards/accuracy"].item() == pytest.approx(0.5)


def test_orpo_hand_value():
    # log odds(a) = a - log(1 - e^a): chosen [-0.5, -2] -> [0.432752, -1.854587],
    # rejected [-2, -1] -> [-1.854587, -0.541325]. Ratios [2.287339, -1.313262];
    # -log σ: [0.096706, 1.551445]. NLL = -mean logp = [0.5, 2]. λ = β = 0.1:
    # [0.5 + 0.0096706, 2 + 0.1551445] = [0.509671, 2.155144], mean 1.332408.
    loss, m = loss_of("orpo", ref_free(), beta=0.1)
    assert loss.item() == pytest.approx(1.3324075289, abs=1e-9)
    assert m["rewards/chosen"].item() == pytest.approx((0.4327521296 - 1.8545865421) / 2, abs=1e-9)


def test_orpo_log_odds_stable_near_certainty_and_far_tail():
    # mean log-prob 0 (certain) and -200 (p underflows in float32): loss and grads stay finite.
    inputs = PreferenceInputs(
        chosen_logps=torch.tensor([0.0, -2000.0], requires_grad=True),
        rejected_logps=torch.tensor([-2000.0, -1e-3], requires_grad=True),
        chosen_lengths=torch.tensor([10, 10]),
        rejected_lengths=torch.tensor([10, 10]),
    )
    loss, _ = loss_of("orpo", inputs)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(inputs.chosen_logps.grad).all() and torch.isfinite(inputs.rejected_logps.grad).all()


def test_sppo_hard_hand_value():
    # 1/(2β) = 5: (1 - 5)² + (-1 + 5)² = 32; (0 - 5)² + (1 + 5)² = 61; mean 46.5.
    assert loss_of("sppo_hard", pairs(), beta=0.1)[0].item() == pytest.approx(46.5)


def naive_grads(per_pair, inputs):
    """Autograd of a per-example Python loop: mean_i per_pair(i)."""
    c = inputs.chosen_logps.detach().clone().requires_grad_(True)
    r = inputs.rejected_logps.detach().clone().requires_grad_(True)
    n = len(c)
    total = 0.0
    for i in range(n):
        h = (c[i] - inputs.ref_chosen_logps[i]) - (r[i] - inputs.ref_rejected_logps[i])
        total = total + per_pair(h)
    (total / n).backward()
    return c.grad, r.grad


@pytest.mark.parametrize(
    "name, per_pair",
    [
        ("sigmoid", lambda h: -torch.log(1 / (1 + torch.exp(-0.1 * h)))),
        ("ipo", lambda h: (h - 1 / (2 * 0.1)) * (h - 1 / (2 * 0.1))),
    ],
)
def test_gradients_match_per_example_loop(name, per_pair):
    g = torch.Generator().manual_seed(0)
    values = [(-20 * torch.rand(5, generator=g, dtype=torch.float64)) for _ in range(4)]
    inputs = PreferenceInputs(
        chosen_logps=values[0].clone().requires_grad_(True),
        rejected_logps=values[1].clone().requires_grad_(True),
        ref_chosen_logps=values[2],
        ref_rejected_logps=values[3],
    )
    loss, _ = loss_of(name, inputs, beta=0.1)
    loss.backward()
    grad_c, grad_r = naive_grads(per_pair, inputs)
    torch.testing.assert_close(inputs.chosen_logps.grad, grad_c)
    torch.testing.assert_close(inputs.rejected_logps.grad, grad_r)


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        loss_of("sigmoid", ref_free())
    with pytest.raises(ValueError, match="chosen_lengths"):
        loss_of("simpo", pairs())


def test_unknown_names_list_valid_ones():
    # dmpo (turn_preference.py) is listed once that module is imported, as in the full suite
    with pytest.raises(KeyError, match=r"valid names: cdpo, (dmpo, )?hinge, ipo, orpo, robust, rpo, sigmoid"):
        PREFERENCE_LOSSES.get("dpo")
    with pytest.raises(KeyError, match="valid names: kto"):
        UNPAIRED_LOSSES.get("bco")


def test_mixed_loss_is_weighted_sum_with_routed_hparams():
    inputs = pairs(chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([1, 2]))
    loss, m = mixed_preference_loss(inputs, {"sigmoid": 0.7, "ipo": 0.3}, beta=0.1, length_normalize=True)
    # 0.7 · 0.671268 + 0.3 · 21.25 (length-normalised IPO above; sigmoid never sees length_normalize)
    assert loss.item() == pytest.approx(0.7 * 0.6712677647 + 0.3 * 21.25, abs=1e-9)
    assert m["sigmoid/loss"].item() == pytest.approx(0.6712677647, abs=1e-9)
    assert m["ipo/loss"].item() == pytest.approx(21.25)
    assert "ipo/rewards/margin" in m
    with pytest.raises(TypeError, match="simpo_gamma"):
        mixed_preference_loss(inputs, {"sigmoid": 1.0}, simpo_gamma=1.0)
    with pytest.raises(KeyError, match="valid names"):
        mixed_preference_loss(inputs, {"dpo": 1.0})


def test_wpo_weights_hand_value():
    # Row 0: mean logp chosen (-1 - 3)/2 = -2, rejected -1 -> log w = -3.
    # Row 1: chosen -0.5, rejected (-0.2 - 0.8)/2 = -0.5 -> log w = -1.
    # Raw [e^-3, e^-1]; batch mean 1: 2/(1 + e²) = 0.238406, 2e²/(1 + e²) = 1.761594.
    chosen = torch.tensor([[-1.0, -3.0, -50.0], [-0.5, -9.0, -9.0]], requires_grad=True)
    chosen_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rejected = torch.tensor([[-1.0, -7.0], [-0.2, -0.8]])
    rejected_mask = torch.tensor([[1, 0], [1, 1]])
    raw = wpo_weights(chosen, chosen_mask, rejected, rejected_mask, normalize=False)
    torch.testing.assert_close(raw, torch.tensor([math.exp(-3), math.exp(-1)]))
    w = wpo_weights(chosen, chosen_mask, rejected, rejected_mask)
    torch.testing.assert_close(w, torch.tensor([0.2384058440, 1.7615941560]))
    assert not w.requires_grad
    # Far off-policy text: raw weights underflow to 0, normalised ones stay defined.
    far = wpo_weights(chosen - 200, chosen_mask, rejected - 200, rejected_mask)
    torch.testing.assert_close(far, w)


def kto_batch():
    # logratios [1, 0, -2]; KL pairs' logratios [1, 0, 2] -> z0 = 1. Desirable: only example 0.
    return dict(
        logps=torch.tensor([-5.0, -6.0, -7.0], dtype=torch.float64, requires_grad=True),
        ref_logps=torch.tensor([-6.0, -6.0, -5.0], dtype=torch.float64),
        desirable=torch.tensor([True, False, False]),
        kl_logps=torch.tensor([-8.0, -9.0, -10.0], dtype=torch.float64, requires_grad=True),
        kl_ref_logps=torch.tensor([-9.0, -9.0, -12.0], dtype=torch.float64),
    )


def test_kto_hand_value():
    # β = 0.1, w_d = 1, w_u = 2, z0 = 1:
    # desirable 1 - σ(0.1 (1 - 1)) = 0.5;
    # undesirable 2 (1 - σ(0.1 (1 - 0))) = 0.950042, 2 (1 - σ(0.1 (1 + 2))) = 0.851115; mean 0.767052.
    loss, m = kto_loss(**kto_batch(), beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    assert loss.item() == pytest.approx(0.7670521971, abs=1e-9)
    assert m["kl"].item() == pytest.approx(1.0)
    assert m["rewards/chosen"].item() == pytest.approx(0.1)
    assert m["rewards/rejected"].item() == pytest.approx(-0.1)  # mean of 0.1·[0, -2]
    # A negative KL estimate is clamped to 0: 1 - σ(0.1 · 1) = 0.475021, 1 - σ(0) = 0.5,
    # 1 - σ(0.1 · (0 + 2)) = 0.450166; mean 0.475062.
    batch = kto_batch()
    batch["kl_ref_logps"] = batch["kl_ref_logps"] + 10
    loss, m = kto_loss(**batch, beta=0.1)
    assert m["kl"].item() == 0.0
    expected = ((1 - 1 / (1 + math.exp(-0.1))) + 0.5 + (1 - 1 / (1 + math.exp(-0.2)))) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_kto_gradient_matches_per_example_loop():
    batch = kto_batch()
    loss, _ = kto_loss(**batch, beta=0.1, desirable_weight=1.5, undesirable_weight=0.5)
    loss.backward()
    assert batch["kl_logps"].grad is None  # the KL baseline is detached

    logps = batch["logps"].detach().clone().requires_grad_(True)
    kl = batch["kl_logps"].detach() - batch["kl_ref_logps"]
    z0 = max(0.0, sum(kl.tolist()) / len(kl))
    total = 0.0
    for i in range(len(logps)):
        r = logps[i] - batch["ref_logps"][i]
        if batch["desirable"][i]:
            total = total + 1.5 * (1 - 1 / (1 + torch.exp(-0.1 * (r - z0))))
        else:
            total = total + 0.5 * (1 - 1 / (1 + torch.exp(-0.1 * (z0 - r))))
    (total / len(logps)).backward()
    torch.testing.assert_close(batch["logps"].grad, logps.grad)


def test_slic_hand_value_and_gradient():
    # ref_free(): chosen [-2, -6], rejected [-6, -4], margins [4, -2]. δ = 1, λ = 0.1:
    # pair 1: max(0, 1 - 4) = 0, + 0.2 = 0.2; pair 2: max(0, 1 + 2) = 3, + 0.6 = 3.6; mean 1.9.
    inputs = ref_free()
    loss, metrics = loss_of("slic", inputs, slic_delta=1.0, slic_lambda=0.1)
    assert loss.item() == pytest.approx(1.9)
    assert metrics["calibration"].item() == pytest.approx(1.5) and metrics["rewards/accuracy"].item() == 0.5
    loss.backward()
    # d/dc: (-1[margin < δ] - λ) / 2 -> pair 1: -0.05, pair 2: -0.55; d/dr: 1[margin < δ] / 2 -> 0, 0.5
    assert inputs.chosen_logps.grad.tolist() == pytest.approx([-0.05, -0.55])
    assert inputs.rejected_logps.grad.tolist() == pytest.approx([0.0, 0.5])
    assert loss_of("slic", ref_free(), slic_delta=0.0, slic_lambda=0.0)[0].item() == pytest.approx(1.0)  # hinge only


def test_slic_matches_a_naive_loop_on_random_pairs():
    g = torch.Generator().manual_seed(3)
    chosen, rejected = (-30 * torch.rand(9, generator=g, dtype=torch.float64) for _ in range(2))
    weights = torch.rand(9, generator=g, dtype=torch.float64) + 0.1
    inputs = PreferenceInputs(chosen_logps=chosen.clone().requires_grad_(True),
                              rejected_logps=rejected.clone().requires_grad_(True), weights=weights)
    loss, _ = loss_of("slic", inputs, slic_delta=2.5, slic_lambda=0.3)
    loss.backward()
    c, r = chosen.clone().requires_grad_(True), rejected.clone().requires_grad_(True)
    total = sum(weights[i] * (max(0.0, 2.5 - (c[i] - r[i])) - 0.3 * c[i]) for i in range(9)) / weights.sum()
    total.backward()
    torch.testing.assert_close(loss, total, rtol=0, atol=1e-10)
    torch.testing.assert_close(inputs.chosen_logps.grad, c.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(inputs.rejected_logps.grad, r.grad, rtol=0, atol=1e-10)
