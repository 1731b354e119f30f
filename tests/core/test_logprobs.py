import math

import pytest
import torch

from tether.core.logprobs import (
    IGNORE_INDEX,
    entropy_from_logits,
    selective_log_softmax,
    sequence_logprobs,
    shift_labels,
)


def naive_logps(logits, labels, temperature=1.0):
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    ignore = labels == IGNORE_INDEX
    picked = logps.gather(-1, labels.masked_fill(ignore, 0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(ignore, 0.0)


def naive_entropy(logits, temperature=1.0):
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logps.exp() * logps).sum(-1)


def make(b=3, t=5, v=11, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=g)).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 1] = IGNORE_INDEX
    labels[2, 4] = IGNORE_INDEX
    return logits, labels


def test_selective_log_softmax_hand_value():
    # logits [0, ln 2, ln 3] at τ=1: softmax = [1, 2, 3] / 6, so log p(label 2) = ln(1/2).
    # At τ=2 the scaled logits are [0, ln√2, ln√3]: p(label 2) = √3 / (1 + √2 + √3).
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)]]])
    labels = torch.tensor([[2]])
    assert selective_log_softmax(logits, labels).item() == pytest.approx(math.log(0.5), rel=1e-6)
    expected = math.log(math.sqrt(3) / (1 + math.sqrt(2) + math.sqrt(3)))
    assert selective_log_softmax(logits, labels, temperature=2.0).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1000])  # 15 rows: 4 and 7 leave a ragged last chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_matches_naive_values_and_grads(chunk_size, temperature):
    logits, labels = make()
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = selective_log_softmax(a, labels, temperature=temperature, chunk_size=chunk_size)
    ref = naive_logps(b, labels, temperature)
    torch.testing.assert_close(got, ref)
    assert got[0, 1] == 0 and got[2, 4] == 0
    (got * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert torch.all(a.grad[0, 1] == 0)


def test_selective_log_softmax_bf16():
    logits, labels = make(dtype=torch.bfloat16)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = selective_log_softmax(a, labels, chunk_size=4)
    ref = naive_logps(b, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref)
    got.sum().backward()
    ref.sum().backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad, b.grad)


def test_selective_log_softmax_rejects_bad_args():
    logits, labels = make()
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        selective_log_softmax(logits, labels[:, :-1])


def test_entropy_hand_value():
    # Uniform over 4 tokens: H = ln 4 at any temperature. [0, ln 3]: p = [1/4, 3/4],
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335...
    uniform = torch.zeros(1, 1, 4)
    assert entropy_from_logits(uniform, temperature=0.5).item() == pytest.approx(math.log(4), rel=1e-6)
    two = torch.tensor([[[0.0, math.log(3)]]])
    assert entropy_from_logits(two).item() == pytest.approx(0.5623351446, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [4, 1000])
def test_entropy_matches_naive_values_and_grads(dtype, chunk_size):
    logits, _ = make(dtype=dtype)
    weights = torch.randn(logits.shape[:-1], generator=torch.Generator().manual_seed(1))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = entropy_from_logits(a, temperature=0.8, chunk_size=chunk_size)
    ref = naive_entropy(b, temperature=0.8)
    torch.testing.assert_close(got, ref)
    (got * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_shift_labels_aligns_targets_and_masks():
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.tensor([[0, 0, 1, 1]])  # prompt 5 6, completion 7 8
    assert shift_labels(ids).tolist() == [[6, 7, 8, IGNORE_INDEX]]
    # Position 1 predicts 7 (first completion token), position 2 predicts 8.
    assert shift_labels(ids, mask).tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX]]


def test_sequence_logprobs_sum_and_average():
    # Row 0: -1 + -2 over 2 tokens (the -inf is masked out) -> sum -3, average -1.5.
    # Row 1: no valid token -> 0 both ways.
    logps = torch.tensor([[-1.0, -2.0, float("-inf")], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert sequence_logprobs(logps, mask, average=False).tolist() == [-3.0, 0.0]
    assert sequence_logprobs(logps, mask, average=True).tolist() == [-1.5, 0.0]
