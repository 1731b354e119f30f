"""Sequence-level policy losses: the importance ratio of a whole completion (GSPO, GSPO-token, GMPO).

Same signature as every entry of ``POLICY_LOSSES`` (see policy_loss.py). A per-sequence loss l_i is
written onto each of the row's masked tokens, so ``seq-mean-token-mean`` (these presets' aggregation)
gives (1 / N_seq) sum_i l_i exactly; the sequence's advantage A_i is the masked mean of the row's
per-token advantages (GRPO's advantages are constant over a row, so A_i is the group advantage).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.core.aggregation import agg_loss, masked_mean
from tether.core.policy_loss import LOG_RATIO_CLAMP, POLICY_LOSSES, check_shapes, masked_fraction


def row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean of each row, shape (B, 1); 0 for a row without masked tokens."""
    m = mask != 0
    return torch.where(m, x, 0).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def _sequence_metrics(log_seq_ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict[str, Tensor]:
    ratio = torch.exp(log_seq_ratio.detach()).expand_as(mask)
    return {"clip_frac": masked_fraction(clipped.expand_as(mask), mask),
            "seq_ratio_mean": masked_mean(ratio, mask),
            "seq_ratio_max": ratio[mask != 0].max() if bool((mask != 0).any()) else ratio.new_zeros(())}


@POLICY_LOSSES.register("gspo")
def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 3e-4,
         clip_high: float = 4e-4, dual_clip: float | None = None, loss_agg: str = "seq-mean-token-mean",
         global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
         norm_constant: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, eq. 5-7): the sequence ratio

        s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp((1/|y_i|) sum_t log r_it),

    clipped per sequence: l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)). The paper's
    clip range is tiny (3e-4, 4e-4): s_i is a per-token geometric mean. ``dual_clip`` is unused.
    Metrics: clip_frac (sequences clipped, token-weighted), seq_ratio_mean, seq_ratio_max.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    seq_adv = row_mean(advantages.detach(), mask)
    log_s = row_mean(logprobs - old_logprobs.detach(), mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(log_s)
    per_seq = torch.maximum(-seq_adv * s, -seq_adv * s.clamp(1.0 - clip_low, 1.0 + clip_high))
    loss = agg_loss(per_seq.expand_as(logprobs), mask, loss_agg, global_tokens=global_tokens,
                    global_seqs=global_seqs, norm_constant=norm_constant)
    s_d = s.detach()
    clipped = ((seq_adv > 0) & (s_d > 1.0 + clip_high)) | ((seq_adv < 0) & (s_d < 1.0 - clip_low))
    return loss, _sequence_metrics(log_s, clipped, mask)


@POLICY_LOSSES.register("gspo_token")
def gspo_token(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 3e-4,
               clip_high: float = 4e-4, dual_clip: float | None = None, loss_agg: str = "seq-mean-token-mean",
               global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
               norm_constant: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (Zheng et al. 2025, eq. 13-14): per-token advantages with the sequence ratio's value,

        s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)],   l_it = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high)).

    s_it equals s_i in value; its gradient is s_i grad log pi(y_it). With A_it = A_i on the whole row it
    is GSPO, value and gradient. ``dual_clip`` is unused. Metrics as ``gspo``.
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    advantages = advantages.detach()
    log_s = row_mean(logprobs.detach() - old_logprobs.detach(), mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s_token = torch.exp(log_s + logprobs - logprobs.detach())
    per_token = torch.maximum(-advantages * s_token, -advantages * s_token.clamp(1.0 - clip_low, 1.0 + clip_high))
    loss = agg_loss(per_token, mask, loss_agg, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)
    s_d = s_token.detach()
    clipped = ((advantages > 0) & (s_d > 1.0 + clip_high)) | ((advantages < 0) & (s_d < 1.0 - clip_low))
    return loss, _sequence_metrics(log_s, clipped, mask)


@POLICY_LOSSES.register("gmpo")
def gmpo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float = 0.4,
         clip_high: float = 0.4, dual_clip: float | None = None, loss_agg: str = "seq-mean-token-mean",
         global_tokens: float | Tensor | None = None, global_seqs: float | Tensor | None = None,
         norm_constant: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673, eq. 4): the token ratios combined
    geometrically, each clipped in log space first,

        l_i = -A_i * exp((1/|y_i|) sum_t sgn(A_i) min(sgn(A_i) log r_it, sgn(A_i) clip(log r_it, -clip_low, clip_high))),

    i.e. r_it clipped to [e^-clip_low, e^clip_high] on the side that would grow the objective (the paper's
    range (e^-0.4, e^0.4)). ``dual_clip`` is unused. Metrics: clip_frac (tokens clipped), seq_ratio_mean,
    seq_ratio_max (the geometric mean after clipping).
    """
    check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    seq_adv = row_mean(advantages.detach(), mask)
    sign = torch.where(seq_adv >= 0, 1.0, -1.0)
    log_r = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    kept = sign * torch.minimum(sign * log_r, sign * log_r.clamp(-clip_low, clip_high))
    log_s = row_mean(kept, mask)
    per_seq = -seq_adv * torch.exp(log_s)
    loss = agg_loss(per_seq.expand_as(logprobs), mask, loss_agg, global_tokens=global_tokens,
                    global_seqs=global_seqs, norm_constant=norm_constant)
    clipped = kept.detach() != log_r.detach()
    return loss, _sequence_metrics(log_s, clipped, mask)
