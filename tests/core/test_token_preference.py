"""SPPO (soft), TDPO1 / TDPO2 and the win-probability estimate: hand values, gradients, naive loops."""

import math

import pytest
import torch

from tether.core.pairing import win_probabilities
from tether.core.preference import PreferenceInputs
from tether.core.preference_losses import PREFERENCE_LOSSES
from tether.core.token_preference import position_kl


def t(*values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def pairs(**extra):
    """Log-ratios chosen = [1, 0], rejected = [-1, 1] (h = [2, -1]), as tests/core/test_preference.py."""
    return PreferenceInputs(chosen_logps=t(-10.0, -12.0), rejected_logps=t(-14.0, -11.0),
                            ref_chosen_logps=torch.tensor([-11.0, -12.0], dtype=torch.float64),
                            ref_rejected_logps=torch.tensor([-13.0, -12.0], dtype=torch.float64), **extra)


def f64(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_sppo_hand_value_and_gradient():
    # β = 0.5, η = 2. P_c = [0.75, 1.0], P_r = [0.25, 0.5]: targets c = [0.5, 1], r = [-0.5, 0].
    # pair 1: (1 - 0.5)² + (-1 + 0.5)² = 0.5; pair 2: (0 - 1)² + (1 - 0)² = 2; mean 1.25.
    inputs = pairs(chosen_win_prob=f64(0.75, 1.0), rejected_win_prob=f64(0.25, 0.5))
    loss, metrics = PREFERENCE_LOSSES.get("sppo")(inputs, beta=0.5)
    assert loss.item() == pytest.approx(1.25)
    assert metrics["win_prob/chosen"].item() == pytest.approx(0.875)
    loss.backward()
    # d/d chosen_logps = 2 (lr_c - target) / 2 = [0.5, -1]; rejected: [-0.5, 1]
    assert inputs.chosen_logps.grad.tolist() == pytest.approx([0.5, -1.0])
    assert inputs.rejected_logps.grad.tolist() == pytest.approx([-0.5, 1.0])


def test_sppo_with_hard_win_probabilities_is_sppo_hard():
    hard = PREFERENCE_LOSSES.get("sppo_hard")(pairs(), beta=0.1)[0]
    soft = PREFERENCE_LOSSES.get("sppo")(pairs(chosen_win_prob=f64(1, 1), rejected_win_prob=f64(0, 0)), beta=0.1)[0]
    assert soft.item() == pytest.approx(hard.item()) == pytest.approx(46.5)


def test_sppo_without_win_probabilities_names_them():
    with pytest.raises(ValueError, match="chosen_win_prob"):
        PREFERENCE_LOSSES.get("sppo")(pairs(), beta=0.1)


def test_win_probabilities_hand_values():
    # hard: scores [1, 0, 0, None]; K = 3 present. y0: (1/2 + 1 + 1) / 3; y1: (0 + 1/2 + 1/2) / 3.
    out = win_probabilities([1.0, 0.0, 0.0, None])
    assert out[:3] == pytest.approx([2.5 / 3, 1 / 3, 1 / 3]) and out[3] is None
    # Bradley-Terry, τ = 1: scores [0, 1]: y0 = (1/2 + σ(-1)) / 2
    sig = 1 / (1 + math.exp(-1))
    assert win_probabilities([0.0, 1.0], temperature=1.0) == pytest.approx([(0.5 + 1 - sig) / 2, (0.5 + sig) / 2])
    # a pairwise judge's mean win probability against the other K - 1 = 2: ((K-1) s + 1/2) / K
    assert win_probabilities([1.0, 0.25, 0.25], pairwise=True) == pytest.approx([2.5 / 3, 1 / 3, 1 / 3])
    with pytest.raises(ValueError, match="temperature"):
        win_probabilities([0.0], temperature=0.0)


def test_win_probabilities_average_to_one_half():
    # P(i ≻ j) + P(j ≻ i) = 1 for every pair, so the K estimates average 1/2
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (7,), generator=g).tolist()
    for temperature in (None, 0.7):
        assert sum(win_probabilities(scores, temperature=temperature)) / 7 == pytest.approx(0.5)


def test_position_kl_matches_a_naive_sum():
    g = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(3, 4, 6, generator=g, dtype=torch.float64), -1)
    pol = torch.log_softmax(torch.randn(3, 4, 6, generator=g, dtype=torch.float64), -1)
    naive = torch.tensor([[sum(math.exp(ref[i, j, v]) * (ref[i, j, v] - pol[i, j, v]) for v in range(6))
                           for j in range(4)] for i in range(3)], dtype=torch.float64)
    torch.testing.assert_close(position_kl(ref, pol), naive)
    assert position_kl(ref, ref).abs().max() < 1e-12


def test_tdpo_hand_values():
    # h = [2, -1], β = 0.1; seq KL chosen = [0.5, 1], rejected = [2, 1].
    # TDPO1: δ = rejected - chosen = [1.5, 0]; l = -log σ(0.1 (2 - 1.5)), -log σ(0.1 (-1 - 0)).
    kl = {"chosen_seq_kl": t(0.5, 1.0), "rejected_seq_kl": t(2.0, 1.0)}
    want1 = (-math.log(1 / (1 + math.exp(-0.05))) - math.log(1 / (1 + math.exp(0.1)))) / 2
    assert PREFERENCE_LOSSES.get("tdpo1")(pairs(**kl), beta=0.1)[0].item() == pytest.approx(want1)
    # TDPO2, α = 0.5: δ = 0.5 [1.5, 0] = [0.75, 0]
    want2 = (-math.log(1 / (1 + math.exp(-0.1 * 1.25))) - math.log(1 / (1 + math.exp(0.1)))) / 2
    for name in ("tdpo", "tdpo2"):
        assert PREFERENCE_LOSSES.get(name)(pairs(**kl), beta=0.1, tdpo_alpha=0.5)[0].item() == pytest.approx(want2)
    # zero KL: both are DPO
    zero = {"chosen_seq_kl": f64(0, 0), "rejected_seq_kl": f64(0, 0)}
    dpo = PREFERENCE_LOSSES.get("sigmoid")(pairs(), beta=0.1)[0].item()
    assert PREFERENCE_LOSSES.get("tdpo1")(pairs(**zero), beta=0.1)[0].item() == pytest.approx(dpo)


def test_tdpo2_stops_the_gradient_of_the_chosen_kl_only():
    kl = {"chosen_seq_kl": t(0.5, 1.0), "rejected_seq_kl": t(2.0, 1.0)}
    inputs = pairs(**kl)
    PREFERENCE_LOSSES.get("tdpo")(inputs, beta=0.1, tdpo_alpha=0.5)[0].backward()
    assert inputs.chosen_seq_kl.grad is None or inputs.chosen_seq_kl.grad.abs().max() == 0
    assert inputs.rejected_seq_kl.grad.abs().min() > 0
    inputs = pairs(**{k: v.detach().clone().requires_grad_(True) for k, v in kl.items()})
    PREFERENCE_LOSSES.get("tdpo1")(inputs, beta=0.1)[0].backward()
    torch.testing.assert_close(inputs.chosen_seq_kl.grad, -inputs.rejected_seq_kl.grad)


@pytest.mark.parametrize("name", ["tdpo1", "tdpo"])
def test_tdpo_matches_a_naive_loop_on_random_pairs(name):
    g = torch.Generator().manual_seed(4)
    vals = [-20 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4)]
    kls = [3 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(2)]
    leaves = [v.clone().requires_grad_(True) for v in (vals[0], vals[1], kls[0], kls[1])]
    inputs = PreferenceInputs(chosen_logps=leaves[0], rejected_logps=leaves[1], ref_chosen_logps=vals[2],
                              ref_rejected_logps=vals[3], chosen_seq_kl=leaves[2], rejected_seq_kl=leaves[3])
    loss, _ = PREFERENCE_LOSSES.get(name)(inputs, beta=0.3, **({"tdpo_alpha": 0.7} if name == "tdpo" else {}))
    loss.backward()
    naive_leaves = [v.clone().requires_grad_(True) for v in (vals[0], vals[1], kls[0], kls[1])]
    c, r, kc, kr = naive_leaves
    total = 0.0
    for i in range(6):
        h = (c[i] - vals[2][i]) - (r[i] - vals[3][i])
        delta = kr[i] - kc[i] if name == "tdpo1" else 0.7 * (kr[i] - kc[i].detach())
        total = total - torch.log(torch.sigmoid(0.3 * (h - delta)))
    (total / 6).backward()
    torch.testing.assert_close(loss, total / 6)
    for a, b in zip(leaves, naive_leaves, strict=True):
        torch.testing.assert_close(a.grad if a.grad is not None else torch.zeros(6, dtype=torch.float64),
                                   b.grad if b.grad is not None else torch.zeros(6, dtype=torch.float64))
