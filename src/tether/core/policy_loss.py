"""Policy-gradient losses (``POLICY_LOSSES``) and PPO's clipped value loss.

Every policy loss has one signature, so trainers switch by name:

    fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, dual_clip, loss_agg,
       global_tokens, global_seqs, norm_constant) -> (loss, metrics)

All tensors are shape (B, T): log-probabilities of the sampled tokens under the current policy
(with gradient) and the behaviour policy that sampled them, per-token advantages, and the mask
of trained tokens. The per-token loss goes through ``agg_loss`` (see aggregation.py for the
modes and the global denominators that make micro-batching exact). Metrics are local masked
means over this call's tokens, detached.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tether.core.aggregation import agg_loss, masked_mean
from tether.core.registry import Registry

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")

# Same bound as the KL estimators: exp(20) is finite in fp32/bf16 and far past any clip range.
LOG_RATIO_CLAMP = 20.0


def check_shapes(**tensors: Tensor) -> None:
    """ValueError unless every tensor has the same 2-d shape (B, T)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or next(iter(tensors.values())).dim() != 2:
        raise ValueError(f"expected tensors of one shape (B, T), got {shapes}")


def ratio_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``approx_kl`` (k3 of KL(pi_old || pi): r - 1 - log r) and ``ratio_mean`` over the mask, detached."""
    lr = log_ratio.detach()
    ratio = torch.exp(lr)
    return {"approx_kl": masked_mean(ratio - 1.0 - lr, mask), "ratio_mean": masked_mean(ratio, mask)}


def masked_fraction(condition: Tensor, mask: Tensor) -> Tensor:
    """The fraction of masked positions where ``condition`` holds, detached; shapes (B, T)."""
    return masked_mean(condition.to(torch.float32), mask).detach()


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)).

    Schulman et al. 2017, eq. 7 (L^CLIP, negated into a loss), r_t = pi(a_t|s_t) / pi_old(a_t|s_t).
    Separate ``clip_low`` / ``clip_high`` are DAPO's clip-higher (Yu et al. 2025); equal values
    give the paper. ``dual_clip`` = c > 1 is dual-clip PPO (Ye et al. 2020): for A_t < 0 the loss
    is min(l_t, -c A_t), i.e. capped at c |A_t|, so a token whose ratio has grown past c stops
    pushing; tokens with A_t >= 0 are unaffected.

    logprobs: shape (B, T), with gradient. old_logprobs, advantages, mask: shape (B, T).
    Differs from the paper: log r_t is clamped to [-20, 20] before the exponential (no overflow;
    zero gradient beyond it). Metrics: clip_frac_low (A < 0 and r < 1 - clip_low), clip_frac_high
    (A > 0 and r > 1 + clip_high), dual_clip_frac (A < 0 and r > c; 0 without dual_clip),
    approx_kl (k3 estimate of KL(pi_old || pi): r - 1 - log r), ratio_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at dual_clip * |A|), got {dual_clip}")
    advantages = advantages.detach()
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip), per_token)
    loss = agg_loss(
        per_token,
        mask,
        loss_agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    ratio, log_ratio = ratio.detach(), log_ratio.detach()
    metrics = {
        "clip_frac_low": masked_fraction((advantages < 0) & (ratio < 1.0 - clip_low), mask),
        "clip_frac_high": masked_fraction((advantages > 0) & (ratio > 1.0 + clip_high), mask),
        "dual_clip_frac": masked_fraction((advantages < 0) & (ratio > (dual_clip or float("inf"))), mask),
        **ratio_metrics(log_ratio, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("vanilla_pg")
def vanilla_pg(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE-style policy gradient: l_t = -A_t log pi(a_t|s_t), no ratio and no clipping.

    Williams 1992; the per-token form nanochat and on-policy "GRPO" implementations use.
    logprobs: shape (B, T), with gradient. old_logprobs, advantages, mask: shape (B, T).
    ``old_logprobs`` and the clip arguments are accepted for the shared signature and unused:
    the gradient equals ppo_clip's when the data is exactly on-policy (r = 1). Metrics:
    logprob_mean.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    per_token = -advantages.detach() * logprobs
    loss = agg_loss(
        per_token,
        mask,
        loss_agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    return loss, {"logprob_mean": masked_mean(logprobs.detach(), mask)}


def value_loss_clipped(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_range: float | None = 0.2,
    loss_agg: str = "token-mean",
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: l_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old ± eps) - R_t)^2).

    Not in Schulman et al. 2017's text; it is the value clipping of OpenAI baselines' PPO2, kept
    by InstructGPT-style RLHF (Ouyang et al. 2022) and verl. eps = ``clip_range``; None gives the
    plain 0.5 * (V_t - R_t)^2.

    values: shape (B, T), critic output with gradient. old_values: shape (B, T), the critic's
    values at rollout time. returns: shape (B, T), targets (GAE's A + V). mask: shape (B, T).
    Metrics: value_clip_frac (the clipped term is the larger), explained_variance
    (1 - Var(R - V) / Var(R), masked, +1e-8 in the denominator), value_mean.
    """
    check_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns).square()
    clipped = unclipped
    if clip_range is not None:
        clipped = (old_values + (values - old_values).clamp(-clip_range, clip_range) - returns).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = agg_loss(
        per_token,
        mask,
        loss_agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_constant=norm_constant,
    )
    v = values.detach()
    metrics = {
        "value_clip_frac": masked_fraction(clipped.detach() > unclipped.detach(), mask),
        "explained_variance": 1.0 - _masked_var(returns - v, mask) / (_masked_var(returns, mask) + 1e-8),
        "value_mean": masked_mean(v, mask),
    }
    return loss, metrics


def _masked_var(x: Tensor, mask: Tensor) -> Tensor:
    return masked_mean((x - masked_mean(x, mask)).square(), mask)
