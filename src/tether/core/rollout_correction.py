"""The sampler-trainer mismatch: how far the rollout engine's log-probs are from the trainer's, and the
corrections for it (``ROLLOUT_CORRECTIONS``).

An inference engine (another precision, other kernels, a stale copy of the weights) samples from mu,
not from the trainer's pi_old. With the per-token importance ratio

    rho_t = pi_old(a_t | s_t) / mu(a_t | s_t) = exp(log pi_old - log mu)

a correction turns each token into a detached weight w_t >= 0 that multiplies its policy-gradient
term (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
Liu, Li et al. 2025, "When speed kills stability"). Every entry has one signature:

    fn(trainer_logprobs, sampler_logprobs, mask, *, cap, low, high) -> (weights, corrected)

with tensors of shape (B, T): the trainer's log-probs of the sampled tokens under pi_old, the
sampler's, and the mask of trained tokens. ``weights`` (B, T) is detached, 0 off the mask;
``corrected`` (B, T) bool marks the tokens the correction changed (weight not rho_t's plain
value 1 under no correction: truncated or dropped), for ``mismatch/frac_tokens_corrected``.
A token without a sampler log-prob (NaN: an engine that returns none) gets weight 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tether.core.aggregation import masked_mean
from tether.core.registry import Registry

RolloutCorrection = Callable[..., tuple[Tensor, Tensor]]

ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry("rollout correction")

# exp(20) is finite in float32 and far past any cap; the same bound as the policy losses.
LOG_RATIO_CLAMP = 20.0


def known(sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The tokens that are trained on and have a sampler log-prob (not NaN), shape (B, T) bool."""
    return (mask != 0) & ~torch.isnan(sampler_logprobs)


def log_ratio(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log rho_t = log pi_old - log mu, detached and clamped to [-20, 20]; 0 where a token is not
    :func:`known`. Shape (B, T)."""
    diff = (trainer_logprobs.detach() - sampler_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(known(sampler_logprobs, mask), diff, 0.0)


def sequence_log_ratio(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log of the geometric-mean ratio of each sequence, (1 / n_i) sum_t log rho_t over its known tokens,
    shape (B, 1); 0 for a row without one."""
    lr = log_ratio(trainer_logprobs, sampler_logprobs, mask)
    count = known(sampler_logprobs, mask).sum(-1, keepdim=True)
    return lr.sum(-1, keepdim=True) / count.clamp(min=1)


def _weights(weights: Tensor, corrected: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    has = known(sampler_logprobs, mask)
    weights = torch.where(has, weights, torch.where(mask != 0, 1.0, 0.0)).detach()
    return weights, corrected & has


@ROLLOUT_CORRECTIONS.register("none")
def no_correction(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0,
                  low: float = 0.5, high: float = 2.0) -> tuple[Tensor, Tensor]:
    """No correction: w_t = 1 on the mask (the mismatch is only measured)."""
    weights = (mask != 0).to(trainer_logprobs.dtype)
    return weights, torch.zeros_like(mask, dtype=torch.bool)


@ROLLOUT_CORRECTIONS.register("tis")
def truncated_importance_sampling(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *,
                                  cap: float = 2.0, low: float = 0.5, high: float = 2.0) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling (TIS; Yao et al. 2025): w_t = min(rho_t, C), C = ``cap``.

    Corrected: the tokens with rho_t > C. ``low`` / ``high`` are unused.
    """
    ratio = torch.exp(log_ratio(trainer_logprobs, sampler_logprobs, mask))
    return _weights(ratio.clamp(max=cap), ratio > cap, sampler_logprobs, mask)


@ROLLOUT_CORRECTIONS.register("mis")
def masked_importance_sampling(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *,
                               cap: float = 2.0, low: float = 0.5, high: float = 2.0) -> tuple[Tensor, Tensor]:
    """Masked importance sampling, token level (Liu, Li et al. 2025, token-level rejection):
    w_t = 1[low <= rho_t <= high]; a token outside the band is dropped, the others keep weight 1.

    Corrected: the dropped tokens. ``cap`` is unused.
    """
    ratio = torch.exp(log_ratio(trainer_logprobs, sampler_logprobs, mask))
    inside = (ratio >= low) & (ratio <= high)
    return _weights(inside.to(trainer_logprobs.dtype), ~inside, sampler_logprobs, mask)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0,
           low: float = 0.5, high: float = 2.0) -> tuple[Tensor, Tensor]:
    """IcePop (Ling Team 2025, Ring-1T): w_t = M(rho_t; alpha, beta) = rho_t if alpha <= rho_t <= beta, else 0,
    alpha = ``low``, beta = ``high``: two-sided masking of the tokens where the engines disagree most, the
    ratio kept as the importance weight elsewhere.

    Corrected: the dropped tokens. ``cap`` is unused.
    """
    ratio = torch.exp(log_ratio(trainer_logprobs, sampler_logprobs, mask))
    inside = (ratio >= low) & (ratio <= high)
    return _weights(torch.where(inside, ratio, 0.0), ~inside, sampler_logprobs, mask)


@ROLLOUT_CORRECTIONS.register("seq_tis")
def sequence_truncated_importance_sampling(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *,
                                           cap: float = 2.0, low: float = 0.5, high: float = 2.0
                                           ) -> tuple[Tensor, Tensor]:
    """Sequence-level TIS with the geometric-mean ratio (Liu, Li et al. 2025): every token of sequence i gets
    w_i = min(rho_i, C), rho_i = exp((1 / n_i) sum_t log rho_t), C = ``cap``.

    Corrected: the tokens of sequences with rho_i > C. ``low`` / ``high`` are unused.
    """
    ratio = torch.exp(sequence_log_ratio(trainer_logprobs, sampler_logprobs, mask)).expand_as(trainer_logprobs)
    return _weights(ratio.clamp(max=cap), ratio > cap, sampler_logprobs, mask)


@ROLLOUT_CORRECTIONS.register("seq_mask")
def sequence_masking(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, cap: float = 2.0,
                     low: float = 0.5, high: float = 2.0) -> tuple[Tensor, Tensor]:
    """Sequence-level masking with the geometric-mean ratio (Liu, Li et al. 2025, geometric rejection):
    w_i = 1[low <= rho_i <= high] for every token of sequence i, rho_i as in ``seq_tis``.

    Corrected: the tokens of dropped sequences. ``cap`` is unused.
    """
    ratio = torch.exp(sequence_log_ratio(trainer_logprobs, sampler_logprobs, mask)).expand_as(trainer_logprobs)
    inside = (ratio >= low) & (ratio <= high)
    return _weights(inside.to(trainer_logprobs.dtype), ~inside, sampler_logprobs, mask)


def mismatch_metrics(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the sampler is from the trainer, over the trained tokens that have a sampler log-prob:

    logprob_abs_diff_mean / _max   |log pi_old - log mu|
    kl_k3                          masked mean of rho - 1 - log rho (k3, Schulman 2020, of KL(mu || pi_old))
    is_ratio_mean / _max           rho = pi_old / mu

    Shapes (B, T); detached 0-d tensors back; 0 where no token qualifies (``mismatch/tokens`` counts them).
    """
    has = known(sampler_logprobs, mask)
    lr = log_ratio(trainer_logprobs, sampler_logprobs, mask)
    ratio = torch.exp(lr)
    diff = lr.abs()
    none = not bool(has.any())
    return {
        "logprob_abs_diff_mean": masked_mean(diff, has),
        "logprob_abs_diff_max": diff.new_zeros(()) if none else diff[has].max(),
        "kl_k3": masked_mean(ratio - 1.0 - lr, has),
        "is_ratio_mean": masked_mean(ratio, has),
        "is_ratio_max": ratio.new_zeros(()) if none else ratio[has].max(),
        "tokens": has.sum(),
    }
