"""DMPO: per-turn sums, the turn discount φ(t, T), hand-computed loss and gradients, an independent naive
implementation on random ragged batches, and its limits (one turn: DPO; γ = 1; γ = 0)."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from tether.core.preference_losses import PREFERENCE_LOSSES, PreferenceInputs
from tether.core.turn_preference import dmpo_discount, dmpo_loss, turn_sums


def test_turn_sums_split_rows_at_each_run_of_loss_tokens():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [7.0, 8.0, 9.0, 0.0, 0.0, 0.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 1, 0, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    sums, turns = turn_sums(values, mask)
    assert turns.tolist() == [3, 1, 0]
    assert sums.tolist() == [[3.0, 4.0, 6.0], [24.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    (sums * torch.tensor([1.0, 10.0, 100.0])).sum().backward()
    assert values.grad.tolist() == [[1, 1, 0, 10, 0, 100], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]]


def test_discount_by_hand_and_its_limits():
    phi = dmpo_discount(torch.tensor([3, 1]), 3, 0.5)
    # γ = 0.5, T = 3: φ(t) = 0.5^t (1 - 0.5^(3-t)) / (1 - 0.125) = 1, 3/7, 1/7
    assert torch.allclose(phi, torch.tensor([[1, 3 / 7, 1 / 7], [1, 0, 0]], dtype=torch.float64))
    assert torch.allclose(dmpo_discount(torch.tensor([3]), 3, 1.0), torch.tensor([[1, 2 / 3, 1 / 3]], dtype=torch.float64))
    near = dmpo_discount(torch.tensor([3, 5]), 5, 1 - 1e-9)
    assert torch.allclose(near, dmpo_discount(torch.tensor([3, 5]), 5, 1.0), atol=1e-6)
    assert dmpo_discount(torch.tensor([4]), 4, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="dmpo_gamma must be in"):
        dmpo_discount(torch.tensor([2]), 2, 1.5)


def hand_inputs():
    """Pair 1: chosen 1 turn, rejected 3; pair 2: chosen 3, rejected 1. Reference -1 on every turn."""
    r_chosen = torch.tensor([[0.4, 0.0, 0.0], [0.7, 0.0, -1.4]])
    r_rejected = torch.tensor([[0.2, -0.7, 1.4], [0.9, 0.0, 0.0]])
    chosen_turns, rejected_turns = torch.tensor([1, 3]), torch.tensor([3, 1])
    ref_c = torch.where(torch.arange(3) < chosen_turns[:, None], -1.0, 0.0)
    ref_r = torch.where(torch.arange(3) < rejected_turns[:, None], -1.0, 0.0)
    pol_c = (r_chosen + ref_c).requires_grad_()
    pol_r = (r_rejected + ref_r).requires_grad_()
    inputs = PreferenceInputs(pol_c.sum(-1), pol_r.sum(-1), ref_c.sum(-1), ref_r.sum(-1), chosen_turn_logps=pol_c,
                              rejected_turn_logps=pol_r, ref_chosen_turn_logps=ref_c, ref_rejected_turn_logps=ref_r,
                              chosen_turns=chosen_turns, rejected_turns=rejected_turns)
    return inputs, pol_c, pol_r


def test_hand_computed_value_and_gradient():
    inputs, pol_c, pol_r = hand_inputs()
    loss, metrics = dmpo_loss(inputs, beta=0.5, dmpo_gamma=0.5)
    # pair 1: 0.4 - (0.2 - 0.7·3/7 + 1.4/7) = 0.4 - 0.1 = 0.3, β·0.3 = 0.15
    # pair 2: (0.7 + 0 - 1.4/7) - 0.9 = -0.4, β·(-0.4) = -0.2
    expected = (math.log1p(math.exp(-0.15)) + math.log1p(math.exp(0.2))) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.709548, abs=1e-6)
    assert metrics["rewards/margin"].item() == pytest.approx((0.15 - 0.2) / 2, abs=1e-6)
    assert metrics["rewards/accuracy"].item() == 0.5
    loss.backward()
    # ∂l/∂log π(turn t) = ∓ (1/B) β φ(t, T) σ(-m)
    g1 = 0.5 * 0.5 / (1 + math.exp(0.15))   # pair 1: σ(-0.15) · β / B
    g2 = 0.5 * 0.5 / (1 + math.exp(-0.2))   # pair 2: σ(0.2) · β / B
    want_c = torch.tensor([[-g1, 0, 0], [-g2, -g2 * 3 / 7, -g2 / 7]])
    want_r = torch.tensor([[g1, g1 * 3 / 7, g1 / 7], [g2, 0, 0]])
    assert torch.allclose(pol_c.grad, want_c, atol=1e-6) and torch.allclose(pol_r.grad, want_r, atol=1e-6)
    assert PREFERENCE_LOSSES.get("dmpo") is dmpo_loss and PREFERENCE_LOSSES.needs("dmpo") == {"turn_logprobs"}


def naive_dmpo(token_logps, ref_token_logps, masks, *, beta, gamma):
    """Per pair, per token, in plain Python loops (scalar tensors, for autograd): find the runs of loss
    tokens, sum each, weight each with the closed form of φ, compare."""
    total = 0.0
    for pair in range(len(masks[0])):
        score = []
        for side in (0, 1):
            mask, pol, ref = masks[side][pair], token_logps[side][pair], ref_token_logps[side][pair]
            turns, inside = [], False
            for j, on in enumerate(mask):
                if on and not inside:
                    turns.append(0.0)
                if on:
                    turns[-1] = turns[-1] + (pol[j] - ref[j])
                inside = on
            big_t = len(turns)
            score.append(sum(gamma ** t * (1 - gamma ** (big_t - t)) / (1 - gamma ** big_t) * r
                             for t, r in enumerate(turns)))
        total = total - F.logsigmoid(beta * (score[0] - score[1]))
    return total / len(masks[0])


def random_side(rng, b, width):
    """Random ragged trajectories: 1-4 turns of 1-3 tokens, gaps (observations) of 1-2 tokens."""
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i in range(b):
        position = rng.randint(0, 2)
        for _ in range(rng.randint(1, 4)):
            length = rng.randint(1, 3)
            mask[i, position:position + length] = True
            position += length + rng.randint(1, 2)
    return mask


@pytest.mark.parametrize("seed", range(4))
def test_matches_a_naive_loop_on_random_ragged_batches(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b, width, beta, gamma = 5, 24, rng.choice([0.1, 0.5, 2.0]), rng.choice([0.3, 0.7, 0.95])
    masks = [random_side(rng, b, width), random_side(rng, b, width)]
    pol = [torch.randn(b, width, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ref = [torch.randn(b, width, dtype=torch.float64) for _ in range(2)]
    c, nc = turn_sums(pol[0], masks[0])
    r, nr = turn_sums(pol[1], masks[1])
    inputs = PreferenceInputs(c.sum(-1), r.sum(-1), chosen_turn_logps=c, rejected_turn_logps=r,
                              ref_chosen_turn_logps=turn_sums(ref[0], masks[0])[0],
                              ref_rejected_turn_logps=turn_sums(ref[1], masks[1])[0], chosen_turns=nc, rejected_turns=nr)
    loss, _ = dmpo_loss(inputs, beta=beta, dmpo_gamma=gamma)
    grads = torch.autograd.grad(loss, pol)
    pol_leaf = [p.detach().clone().requires_grad_() for p in pol]  # a separate graph, element by element
    naive = naive_dmpo([list(p) for p in pol_leaf], [x.tolist() for x in ref], [m.tolist() for m in masks],
                       beta=beta, gamma=gamma)
    naive_grads = torch.autograd.grad(naive, pol_leaf)
    assert loss.item() == pytest.approx(naive.item(), rel=1e-9)
    for got, want, mask in zip(grads, naive_grads, masks, strict=True):
        assert torch.allclose(got, want, atol=1e-10)
        assert bool((got[~mask] == 0).all())  # observation tokens get no gradient


def test_one_turn_each_is_dpo_and_gamma_zero_keeps_the_first_turn():
    inputs, _, _ = hand_inputs()
    single = PreferenceInputs(torch.tensor([-1.2, -0.3]), torch.tensor([-0.5, -2.0]), torch.tensor([-1.0, -1.0]),
                              torch.tensor([-1.0, -1.0]), chosen_turn_logps=torch.tensor([[-1.2], [-0.3]]),
                              rejected_turn_logps=torch.tensor([[-0.5], [-2.0]]),
                              ref_chosen_turn_logps=torch.tensor([[-1.0], [-1.0]]),
                              ref_rejected_turn_logps=torch.tensor([[-1.0], [-1.0]]), chosen_turns=torch.tensor([1, 1]),
                              rejected_turns=torch.tensor([1, 1]))
    dpo, _ = PREFERENCE_LOSSES.get("sigmoid")(single, beta=0.3)
    for gamma in (0.0, 0.5, 1.0):
        assert dmpo_loss(single, beta=0.3, dmpo_gamma=gamma)[0].item() == pytest.approx(dpo.item(), abs=1e-7)
    # γ = 0: only the first turns' log-ratios, 0.4 - 0.2 and 0.7 - 0.9
    first_only = (-F.logsigmoid(torch.tensor(0.5 * 0.2)) - F.logsigmoid(torch.tensor(-0.5 * 0.2))) / 2
    assert dmpo_loss(inputs, beta=0.5, dmpo_gamma=0.0)[0].item() == pytest.approx(first_only.item(), abs=1e-6)


def test_bad_inputs_are_one_line_errors():
    inputs, _, _ = hand_inputs()
    with pytest.raises(ValueError, match=r"needs PreferenceInputs\.chosen_turn_logps"):
        dmpo_loss(PreferenceInputs(inputs.chosen_logps, inputs.rejected_logps, inputs.ref_chosen_logps,
                                   inputs.ref_rejected_logps))
    inputs.chosen_turns = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="chosen_turns must lie in"):
        dmpo_loss(inputs)
    inputs.chosen_turns = torch.tensor([1, 3])
    inputs.ref_rejected_turn_logps = inputs.ref_rejected_turn_logps[:, :2]
    with pytest.raises(ValueError, match="must be \\(B, K\\)"):
        dmpo_loss(inputs)
