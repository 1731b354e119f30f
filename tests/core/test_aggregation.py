"""agg_loss: each mode worked by hand, exactness under micro-batching, empty and NaN-padded inputs."""

import pytest
import torch

from tether.core.aggregation import LOSS_AGGREGATIONS, agg_loss, masked_mean, num_seqs, num_tokens

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_counts():
    # 3 + 1 + 0 tokens; rows 0 and 1 have tokens, row 2 is empty
    assert num_tokens(MASK) == 4
    assert num_seqs(MASK) == 2


@pytest.mark.parametrize(
    "mode, expected",
    [
        # masked sum = (1 + 2 + 3) + 5 = 11 over 4 tokens
        ("token-mean", 11 / 4),
        # row means: 6/3 = 2 and 5/1 = 5; over the 2 non-empty rows: 7/2
        ("seq-mean-token-mean", 3.5),
        # row sums 6 and 5 over 2 rows
        ("seq-mean-token-sum", 11 / 2),
        # 11 / (2 rows * T=4)
        ("seq-mean-token-sum-norm", 11 / 8),
    ],
)
def test_modes_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_explicit_denominators_and_norm_constant():
    # 11 / 10 tokens; 11 / (5 seqs * 100)
    assert agg_loss(LOSS, MASK, "token-mean", global_tokens=10).item() == pytest.approx(1.1)
    got = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", global_seqs=torch.tensor(5.0), norm_constant=100)
    assert got.item() == pytest.approx(11 / 500)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_with_global_denominators_equal_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss_param = torch.randn(8, 6, generator=gen, requires_grad=True)
    mask = (torch.rand(8, 6, generator=gen) > 0.4).long()
    mask[3] = 0  # an empty row must not count as a sequence in any micro-batch
    mask[5] = 1

    full = agg_loss(loss_param.square(), mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_param)

    denominators = dict(global_tokens=num_tokens(mask), global_seqs=num_seqs(mask))
    summed = sum(
        agg_loss(loss_param[i : i + 2].square(), mask[i : i + 2], mode, **denominators)
        for i in range(0, 8, 2)
    )
    (summed_grad,) = torch.autograd.grad(summed, loss_param)

    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(summed_grad, full_grad)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch_gives_zero_not_nan(mode):
    loss = torch.ones(2, 3, requires_grad=True)
    out = agg_loss(loss, torch.zeros(2, 3), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", MODES)
def test_nan_and_inf_at_masked_positions_are_ignored(mode):
    loss = torch.tensor([[1.0, float("nan")], [2.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    assert torch.isfinite(agg_loss(loss, mask, mode))


def test_masked_mean():
    # (1 + 2 + 3 + 5) / 4
    assert masked_mean(LOSS, MASK).item() == pytest.approx(11 / 4)
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


def test_unknown_mode_lists_valid_names():
    with pytest.raises(KeyError, match="valid names: seq-mean-token-mean, seq-mean-token-sum"):
        agg_loss(LOSS, MASK, "sum")
    assert LOSS_AGGREGATIONS.names() == sorted(MODES)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="must both be"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
