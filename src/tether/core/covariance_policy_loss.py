"""Covariance-based entropy control as policy losses: Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617).

Cui et al. show the policy entropy falls by the covariance between a token's log-probability and its
advantage: a few tokens with large Cov(log pi, A) drive the collapse. Both losses compute, over this
call's trained tokens, the centred product

    cov_t = (log pi_t - mean(log pi)) * (A_t - mean(A))

and treat the highest-covariance tokens differently; every other token gets the PPO clipped surrogate.
Same signature as every ``POLICY_LOSSES`` entry, plus their own keyword arguments.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tether.core.aggregation import agg_loss, masked_mean
from tether.core.policy_loss import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    check_shapes,
    masked_fraction,
    ratio_metrics,
)


def token_covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """cov_t = (log pi_t - mean log pi) (A_t - mean A), means over the masked tokens; 0 off the mask. (B, T)."""
    lp, adv = logprobs.detach(), advantages.detach()
    cov = (lp - masked_mean(lp, mask)) * (adv - masked_mean(adv, mask))
    return torch.where(mask != 0, cov, 0.0)


def top_tokens(score: Tensor, candidates: Tensor, fraction: float, mask: Tensor) -> Tensor:
    """The ceil(fraction * N) ``candidates`` (bool, (B, T)) with the largest ``score``, N the number of masked
    tokens (at least one, at most every candidate); bool (B, T)."""
    flat = candidates.flatten()
    available = int(flat.sum())
    picked = torch.zeros_like(flat)
    if available:
        count = min(available, max(1, math.ceil(fraction * int((mask != 0).sum()))))
        ranked = torch.where(flat, score.flatten(), -torch.inf)
        picked[torch.topk(ranked, count).indices] = True
    return picked.view_as(candidates)


def _clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_low: float,
                       clip_high: float) -> tuple[Tensor, Tensor]:
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)), log_ratio


@POLICY_LOSSES.register("clip_cov")
def clip_cov(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
             clip_high: float = 0.2, dual_clip: float | None = None, loss_agg: str = "token-mean",
             global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
             norm_constant: float | None = None, clip_fraction: float = 2e-4, cov_low: float = 1.0,
             cov_high: float = 5.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, eq. 11): the PPO clipped surrogate, with the gradient of a ``clip_fraction``
    of the tokens whose cov_t lies in [cov_low, cov_high] stopped (their term detached).

    Differs from the paper: the paper samples those tokens at random; here the highest-covariance ones in
    the band are taken, so the loss is a pure function of its inputs. ``dual_clip`` is unused. Metrics:
    cov_clipped_frac, approx_kl, ratio_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    per_token, log_ratio = _clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)
    cov = token_covariance(logprobs, advantages, mask)
    band = (mask != 0) & (cov >= cov_low) & (cov <= cov_high)
    stopped = top_tokens(cov, band, clip_fraction, mask)
    per_token = torch.where(stopped, per_token.detach(), per_token)
    loss = agg_loss(per_token, mask, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)
    return loss, {"cov_clipped_frac": masked_fraction(stopped, mask),
                  **ratio_metrics(log_ratio, mask)}


@POLICY_LOSSES.register("kl_cov")
def kl_cov(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
           clip_high: float = 0.2, dual_clip: float | None = None, loss_agg: str = "token-mean",
           global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
           norm_constant: float | None = None, kl_fraction: float = 2e-3, kl_coef: float = 1.0
           ) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, eq. 12): the top ``kl_fraction`` of tokens by cov_t get, instead of the clipped
    surrogate, -A_t r_t + kl_coef * |log pi_t - log pi_old,t| (a KL penalty on exactly the tokens that drive
    the entropy down); the others keep the clipped surrogate. ``dual_clip`` is unused. Metrics:
    cov_kl_frac, approx_kl, ratio_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    per_token, log_ratio = _clipped_surrogate(logprobs, old_logprobs, advantages, clip_low, clip_high)
    cov = token_covariance(logprobs, advantages, mask)
    chosen = top_tokens(cov, mask != 0, kl_fraction, mask)
    penalised = -advantages.detach() * torch.exp(log_ratio) + kl_coef * log_ratio.abs()
    per_token = torch.where(chosen, penalised, per_token)
    loss = agg_loss(per_token, mask, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)
    return loss, {"cov_kl_frac": masked_fraction(chosen, mask),
                  **ratio_metrics(log_ratio, mask)}
