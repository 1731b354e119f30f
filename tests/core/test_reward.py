import pytest
import torch

from tether.core.reward import STEP_AGGREGATIONS, bradley_terry_loss


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
