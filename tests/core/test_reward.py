import pytest
import torch

from tether.core.reward import STEP_AGGREGATIONS, bradley_terry_loss, ranking_loss, ranking_pairs


def rewards():
    # r_c - r_r = [1, -1]; r_c + r_r = [3, 1].
    chosen = torch.tensor([2.0, 0.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([1.0, 1.0], dtype=torch.float64, requires_grad=True)
    return chosen, rejected


def test_bradley_terry_hand_value_and_metrics():
    # -log σ(1) = 0.313262, -log σ(-1) = 1.313262; mean 0.813262.
    chosen, rejected = rewards()
    loss, m = bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(0.8132616875, abs=1e-9)
    assert m["accuracy"].item() == pytest.approx(0.5)
    assert m["margin"].item() == pytest.approx(0.0)
    assert m["rewards/mean"].item() == pytest.approx(1.0)  # mean of [2, 0, 1, 1]
    assert m["rewards/std"].item() == pytest.approx(0.5**0.5)  # deviations [1, -1, 0, 0]
    assert all(not v.requires_grad for v in m.values())


def test_bradley_terry_margin_and_centering_hand_value():
    # margin [0.5, 0]: -log σ(0.5) = 0.474077, -log σ(-1) = 1.313262, mean 0.893670;
    # centring 0.01 · mean([9, 1]) = 0.05 -> 0.943670.
    chosen, rejected = rewards()
    margin = torch.tensor([0.5, 0.0], dtype=torch.float64)
    loss, _ = bradley_terry_loss(chosen, rejected, margin=margin, center_coef=0.01)
    assert loss.item() == pytest.approx(0.9436695, abs=1e-6)


def test_bradley_terry_gradient_hand_value():
    # d/dr_c [-log σ(d)] / B = -σ(-d) / 2: d = 1 -> -0.268941/2 = -0.134471, d = -1 -> -0.731059/2 = -0.365529.
    # Centring adds 0.01 · 2 (r_c + r_r) / 2 = [0.03, 0.01] to both r_c and r_r gradients.
    chosen, rejected = rewards()
    loss, _ = bradley_terry_loss(chosen, rejected, center_coef=0.01)
    loss.backward()
    torch.testing.assert_close(
        chosen.grad, torch.tensor([-0.1344707 + 0.03, -0.3655293 + 0.01], dtype=torch.float64)
    )
    torch.testing.assert_close(
        rejected.grad, torch.tensor([0.1344707 + 0.03, 0.3655293 + 0.01], dtype=torch.float64)
    )


# Row 0: steps 0.9, 0.5, 0.8 valid. Row 1: steps 0.6 and 0.2 valid (non-contiguous mask). Row 2: none.
SCORES = torch.tensor([[0.9, 0.5, 0.8, 0.1], [0.6, 0.7, 0.2, 0.3], [0.4, 0.4, 0.4, 0.4]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("min", [0.5, 0.2, 0.0]),
        ("product", [0.9 * 0.5 * 0.8, 0.6 * 0.2, 0.0]),  # 0.36, 0.12
        ("last", [0.8, 0.2, 0.0]),
        ("mean", [2.2 / 3, 0.4, 0.0]),
    ],
)
def test_step_aggregation_hand_values(name, expected):
    # An all-masked row scores 0 under every aggregation (never outscoring a scored trajectory).
    got = STEP_AGGREGATIONS.get(name)(SCORES, MASK)
    torch.testing.assert_close(got, torch.tensor(expected))


def test_unknown_aggregation_lists_valid_ones():
    with pytest.raises(KeyError, match="valid names: last, mean, min, product"):
        STEP_AGGREGATIONS.get("max")


# ---------------------------------------------------------------- K-way rankings (InstructGPT Eq. 1)


def test_ranking_loss_hand_value_and_gradient():
    # One prompt, K = 3, scores [2, 1, 0] best first: pairs d01 = 1, d02 = 2, d12 = 1.
    # -log σ(1) = 0.3132617, -log σ(2) = 0.1269280 -> (2 · 0.3132617 + 0.1269280) / 3 = 0.2511505.
    # d/ds0 = -(σ(-1) + σ(-2)) / 3 = -(0.2689414 + 0.1192029) / 3 = -0.1293814; d/ds1 = (σ(-1) - σ(-1)) / 3 = 0;
    # d/ds2 = +0.1293814.
    scores = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = ranking_loss(scores, torch.tensor([[0, 1, 2]]))
    assert loss.item() == pytest.approx(0.2511505, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(scores.grad, torch.tensor([[-0.1293814, 0.0, 0.1293814]], dtype=torch.float64))
    assert m["accuracy"].item() == 1.0 and m["best_accuracy"].item() == 1.0
    assert m["margin"].item() == pytest.approx(4 / 3)
    assert m["rewards/chosen"].item() == pytest.approx(5 / 3) and m["rewards/rejected"].item() == pytest.approx(1 / 3)


def test_ranking_loss_ties_make_no_pair_and_k2_is_bradley_terry():
    # ranks [0, 0, 1]: pairs (0, 2) and (1, 2) only; scores [0, 3, 1]: d = -1 and 2.
    scores = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.float64)
    loss, m = ranking_loss(scores, torch.tensor([[0, 0, 1]]))
    assert loss.item() == pytest.approx((1.3132617 + 0.1269280) / 2, abs=1e-6)
    assert ranking_pairs(torch.tensor([[0, 0, 1]])).sum().item() == 2
    assert m["accuracy"].item() == 0.5 and m["best_accuracy"].item() == 1.0  # the top score is a tied best
    chosen, rejected = rewards()
    pair, _ = ranking_loss(torch.stack([chosen, rejected], -1), torch.tensor([[0, 1], [0, 1]]), center_coef=0.01)
    expected, _ = bradley_terry_loss(chosen, rejected, center_coef=0.01)
    assert pair.item() == pytest.approx(expected.item(), abs=1e-12)


def naive_ranking_loss(groups, center_coef=0.0):
    """A prompt at a time, a pair at a time, in Python floats."""
    import math

    total = 0.0
    for scores, ranks in groups:
        pairs = [(scores[i], scores[j]) for i in range(len(scores)) for j in range(len(scores)) if ranks[i] < ranks[j]]
        total += sum(math.log1p(math.exp(-(w - lo))) + center_coef * (w + lo) ** 2 for w, lo in pairs) / len(pairs)
    return total / len(groups)


def test_ranking_loss_matches_a_naive_loop_on_ragged_k_with_ties():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        sizes = torch.randint(2, 7, (5,), generator=gen).tolist()
        groups = []
        for k in sizes:
            ranks = torch.randint(0, 3, (k,), generator=gen)
            if len(set(ranks.tolist())) < 2:
                ranks[0], ranks[1] = 0, 1
            groups.append((torch.randn(k, generator=gen, dtype=torch.float64).tolist(), ranks.tolist()))
        width = max(sizes)
        scores = torch.full((5, width), 123.0, dtype=torch.float64)  # padding must not reach the loss
        ranks = torch.zeros(5, width, dtype=torch.long)
        mask = torch.zeros(5, width, dtype=torch.bool)
        for b, (s, r) in enumerate(groups):
            scores[b, : len(s)], ranks[b, : len(r)], mask[b, : len(s)] = torch.tensor(s, dtype=torch.float64), torch.tensor(r), True
        loss, _ = ranking_loss(scores, ranks, mask, center_coef=0.01)
        assert loss.item() == pytest.approx(naive_ranking_loss(groups, center_coef=0.01), abs=1e-10)


def test_ranking_loss_gradient_matches_finite_differences_and_ignores_padding():
    scores = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ranks = torch.tensor([[0, 1, 2, 3], [1, 0, 1, 0], [2, 0, 1, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    torch.autograd.gradcheck(lambda s: ranking_loss(s, ranks, mask, center_coef=0.1)[0], (scores,))
    ranking_loss(scores, ranks, mask)[0].backward()
    assert torch.all(scores.grad[~mask] == 0)


def test_ranking_loss_rejects_a_prompt_with_every_answer_tied():
    with pytest.raises(ValueError, match="no untied pair"):
        ranking_loss(torch.zeros(2, 2), torch.tensor([[0, 1], [1, 1]]))
