"""Token-level policy losses that weight or gate the log-prob gradient instead of clipping the surrogate:
CISPO, SAPO and DPPO (TV and KL forms).

Same signature as every entry of ``POLICY_LOSSES`` (see policy_loss.py), plus each loss's own keyword
arguments (``policy_loss_kwargs`` in a config). r_t = pi(a_t|s_t) / pi_old(a_t|s_t), log r_t clamped to
[-20, 20]; sg[.] stops the gradient.
"""

from __future__ import annotations

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


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


@POLICY_LOSSES.register("cispo")
def cispo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 1.0,
          clip_high: float = 2.0, dual_clip: float | None = None, loss_agg: str = "token-mean",
          global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
          norm_constant: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, eq. 4-5): the importance weight is clipped and detached, the
    gradient always flows through log pi,

        l_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] * A_t * log pi(a_t|s_t).

    Unlike PPO-clip no token's gradient is dropped: a clipped token keeps a bounded weight. The paper sets
    no lower bound (clip_low = 1: weight >= 0) and tunes the upper one. ``dual_clip`` is unused.
    Metrics: clip_frac_high / clip_frac_low (weight at the bound), approx_kl, ratio_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    log_ratio, ratio = _ratio(logprobs, old_logprobs)
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * advantages.detach() * logprobs
    loss = agg_loss(per_token, mask, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)
    r = ratio.detach()
    return loss, {"clip_frac_high": masked_fraction(r > 1.0 + clip_high, mask),
                  "clip_frac_low": masked_fraction(r < 1.0 - clip_low, mask), **ratio_metrics(log_ratio, mask)}


def sapo_gate(ratio: Tensor, tau: Tensor | float) -> Tensor:
    """SAPO's soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau: f(1) = 2 / tau and f'(1) = 1, so on-policy its
    gradient is the plain policy gradient; it decays smoothly (not a hard cut) as r leaves 1."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


@POLICY_LOSSES.register("sapo")
def sapo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
         clip_high: float = 0.2, dual_clip: float | None = None, loss_agg: str = "seq-mean-token-mean",
         global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
         norm_constant: float | None = None, tau_pos: float = 1.0, tau_neg: float = 1.05
         ) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a temperature-controlled soft
    gate instead of the hard clip,

        l_t = -f(r_t; tau_t) A_t,   f(r; tau) = sigmoid(tau (r - 1)) * 4 / tau,   tau_t = tau_pos if A_t > 0 else tau_neg,

    so grad l_t = -4 sigmoid(.) (1 - sigmoid(.)) r_t A_t grad log pi: the full policy gradient at r = 1,
    fading smoothly off-policy; tau_neg > tau_pos damps negative-advantage tokens faster (the paper's 1.0 and
    1.05). The clip arguments are unused. Metrics: gate_weight_mean (the gradient's factor
    4 sigmoid (1 - sigmoid)), approx_kl, ratio_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    advantages = advantages.detach()
    log_ratio, ratio = _ratio(logprobs, old_logprobs)
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    per_token = -sapo_gate(ratio, tau) * advantages
    loss = agg_loss(per_token, mask, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)
    sig = torch.sigmoid(tau * (ratio.detach() - 1.0))
    return loss, {"gate_weight_mean": masked_mean(4.0 * sig * (1.0 - sig), mask), **ratio_metrics(log_ratio, mask)}


def _dppo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, outside: Tensor, *,
          ratio_cap: float, loss_agg: str, global_tokens: float | Tensor | None, global_seqs: float | Tensor | None,
          norm_constant: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's shared form: l_t = -sg[min(r_t, C)] A_t log pi(a_t|s_t) * (1 - outside_t)."""
    log_ratio, ratio = _ratio(logprobs, old_logprobs)
    keep = (~outside).to(logprobs.dtype).detach()
    per_token = -ratio.detach().clamp(max=ratio_cap) * advantages.detach() * logprobs * keep
    loss = agg_loss(per_token, mask, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)
    return loss, {"trust_region_frac": masked_fraction(outside, mask), **ratio_metrics(log_ratio, mask)}


@POLICY_LOSSES.register("dppo_tv")
def dppo_tv(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
            clip_high: float = 0.2, dual_clip: float | None = None, loss_agg: str = "token-mean",
            global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
            norm_constant: float | None = None, ratio_cap: float = 20.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO, binary-TV form (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879):
    the trust region is on the divergence of the sampled token's probability, not on the ratio,

        l_t = -sg[min(r_t, C)] A_t log pi(a_t|s_t) * M_t,
        M_t = 0 if A_t > 0 and p_t - p_old,t > delta_high, or A_t <= 0 and p_t - p_old,t < -delta_low; else 1,

    p = pi(a_t|s_t). delta_low / delta_high = ``clip_low`` / ``clip_high``; C = ``ratio_cap``. A rare token
    may move far in ratio while its probability moves little (PPO-clip would stop it); a likely one is
    stopped once its probability has moved delta. ``dual_clip`` is unused. Metrics: trust_region_frac
    (tokens masked), approx_kl, ratio_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    delta = torch.exp(logprobs.detach()) - torch.exp(old_logprobs.detach())
    outside = torch.where(advantages > 0, delta > clip_high, delta < -clip_low)
    return _dppo(logprobs, old_logprobs, advantages, mask, outside, ratio_cap=ratio_cap, loss_agg=loss_agg,
                 global_tokens=global_tokens, global_seqs=global_seqs, norm_constant=norm_constant)


def binary_kl(old_logprobs: Tensor, logprobs: Tensor) -> Tensor:
    """KL(Bernoulli(p_old) || Bernoulli(p)) of the sampled token's probability, p = exp(logprobs):
    p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)); 1e-8 keeps 1 - p away from 0."""
    p_old, p = torch.exp(old_logprobs), torch.exp(logprobs)
    return p_old * (old_logprobs - logprobs) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))


@POLICY_LOSSES.register("dppo_kl")
def dppo_kl(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.2,
            clip_high: float = 0.2, dual_clip: float | None = None, loss_agg: str = "token-mean",
            global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
            norm_constant: float | None = None, ratio_cap: float = 20.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO, binary-KL form (Qi et al. 2026): as ``dppo_tv`` with the divergence D_t = :func:`binary_kl`,

        M_t = 0 if A_t > 0, p_t > p_old,t and D_t > delta_high, or A_t <= 0, p_t < p_old,t and D_t > delta_low; else 1.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    lp, old = logprobs.detach(), old_logprobs.detach()
    divergence = binary_kl(old, lp)
    outside = torch.where(advantages > 0, (divergence > clip_high) & (lp > old), (divergence > clip_low) & (lp < old))
    return _dppo(logprobs, old_logprobs, advantages, mask, outside, ratio_cap=ratio_cap, loss_agg=loss_agg,
                 global_tokens=global_tokens, global_seqs=global_seqs, norm_constant=norm_constant)
