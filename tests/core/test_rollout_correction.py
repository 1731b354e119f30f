"""Rollout corrections and mismatch figures against hand-computed values on a deliberately perturbed sampler."""

import math

import pytest
import torch

from tether.core.rollout_correction import ROLLOUT_CORRECTIONS, mismatch_metrics

# trainer pi_old log-probs, and a sampler perturbed so that rho = pi_old / mu is 0.25, 1, 3 (row 0) and 1.5, 0.8
# with one padded position (row 1). Row 1's geometric-mean ratio: sqrt(1.5 * 0.8) = sqrt(1.2).
RHO = [[0.25, 1.0, 3.0], [1.5, 0.8, 1.0]]
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=torch.float64)
SAMPLER = TRAINER - torch.log(torch.tensor(RHO, dtype=torch.float64))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def correction(mode, **kw):
    args = {"cap": 2.0, "low": 0.5, "high": 2.0, **kw}
    return ROLLOUT_CORRECTIONS.get(mode)(TRAINER, SAMPLER, MASK, **args)


def test_registry_names():
    assert set(ROLLOUT_CORRECTIONS.names()) == {"none", "tis", "mis", "icepop", "seq_tis", "seq_mask"}


def test_none_is_the_mask():
    weights, corrected = correction("none")
    assert torch.equal(weights, MASK) and not corrected.any()


def test_tis_truncates_at_the_cap():
    weights, corrected = correction("tis")
    expected = torch.tensor([[0.25, 1.0, 2.0], [1.5, 0.8, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert corrected.tolist() == [[False, False, True], [False, False, False]]


def test_mis_drops_tokens_outside_the_band_and_keeps_weight_one():
    weights, corrected = correction("mis", low=0.5, high=2.0)
    expected = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert corrected.tolist() == [[True, False, True], [False, False, False]]


def test_icepop_keeps_the_ratio_inside_the_band():
    weights, corrected = correction("icepop", low=0.5, high=2.0)
    expected = torch.tensor([[0.0, 1.0, 0.0], [1.5, 0.8, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert corrected.tolist() == [[True, False, True], [False, False, False]]


def test_sequence_forms_use_the_geometric_mean_ratio():
    row0 = (0.25 * 1.0 * 3.0) ** (1 / 3)  # 0.9086
    row1 = math.sqrt(1.5 * 0.8)  # 1.0954
    weights, corrected = correction("seq_tis", cap=1.05)
    expected = torch.tensor([[row0] * 3, [1.05, 1.05, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(weights, expected)
    assert corrected.tolist() == [[False] * 3, [True, True, False]]
    weights, corrected = correction("seq_mask", low=0.95, high=1.2)
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 3, [1.0, 1.0, 0.0]], dtype=torch.float64))
    assert corrected.tolist() == [[True] * 3, [False, False, False]]
    assert row1 < 1.2


def test_weights_are_detached_and_tokens_without_a_sampler_logprob_get_weight_one():
    trainer = TRAINER.clone().requires_grad_()
    sampler = SAMPLER.clone()
    sampler[0, 2] = float("nan")
    weights, corrected = ROLLOUT_CORRECTIONS.get("tis")(trainer, sampler, MASK, cap=2.0, low=0.5, high=2.0)
    assert not weights.requires_grad
    assert weights[0, 2] == 1.0 and not corrected[0, 2]


def test_mismatch_metrics_hand_computed():
    figures = mismatch_metrics(TRAINER, SAMPLER, MASK)
    log_rho = [math.log(r) for r in (0.25, 1.0, 3.0, 1.5, 0.8)]
    assert figures["logprob_abs_diff_mean"].item() == pytest.approx(sum(abs(x) for x in log_rho) / 5)
    assert figures["logprob_abs_diff_max"].item() == pytest.approx(math.log(4))
    k3 = sum(math.exp(x) - 1 - x for x in log_rho) / 5
    assert figures["kl_k3"].item() == pytest.approx(k3)
    assert figures["is_ratio_mean"].item() == pytest.approx((0.25 + 1 + 3 + 1.5 + 0.8) / 5)
    assert figures["is_ratio_max"].item() == pytest.approx(3.0)
    assert figures["tokens"].item() == 5


def test_mismatch_is_zero_when_the_sampler_is_the_trainer():
    figures = mismatch_metrics(TRAINER, TRAINER.clone(), MASK)
    assert figures["logprob_abs_diff_max"] == 0 and figures["kl_k3"] == 0 and figures["is_ratio_max"] == 1


def test_mismatch_without_sampler_logprobs_is_empty_not_nan():
    figures = mismatch_metrics(TRAINER, torch.full_like(TRAINER, float("nan")), MASK)
    assert all(not torch.isnan(v) for v in figures.values()) and figures["tokens"] == 0
