"""Turn-level preference losses for multi-turn agent trajectories: DMPO.

A trajectory is a prompt followed by assistant turns (the agent's actions) interleaved with
observations (tool results, user messages). Only the assistant tokens carry loss; each maximal run of
loss tokens is one turn. :func:`turn_sums` folds per-token values into per-turn sums; the trainer
passes each turn's summed policy and reference log-probs as ``PreferenceInputs.chosen_turn_logps`` /
``ref_chosen_turn_logps`` (and the rejected ones), declared by ``needs=("turn_logprobs",)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from tether.core.preference import (
    PREFERENCE_LOSSES,
    Metrics,
    PreferenceInputs,
    _batch_mean,
    _require,
    _reward_metrics,
)


def turn_sums(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-turn sums of per-token ``values``: each maximal run of ``mask`` along a row is one turn.

    Args: ``values`` (N, W) and ``mask`` (N, W), bool or 0/1, the loss tokens of each row laid out at
    consecutive positions (observation tokens between two assistant turns are unmasked).
    Returns ``(sums, turns)``: ``sums`` (N, K) with ``sums[i, t]`` the sum over turn ``t`` of row ``i``
    (0 past its last turn), K the most turns of any row (at least 1); ``turns`` (N,) the turn counts.
    Differentiable in ``values``.
    """
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(f"turn_sums takes values and mask of one (N, W) shape, got {tuple(values.shape)} "
                         f"and {tuple(mask.shape)}")
    mask = mask.bool()
    previous = F.pad(mask[:, :-1], (1, 0), value=False)
    starts = mask & ~previous
    turns = starts.sum(-1)
    index = (starts.long().cumsum(-1) - 1).clamp(min=0)
    width = max(int(turns.max()) if turns.numel() else 0, 1)
    sums = torch.zeros(values.shape[0], width, dtype=values.dtype, device=values.device)
    return sums.scatter_add(1, index, torch.where(mask, values, torch.zeros_like(values))), turns


def dmpo_discount(turns: Tensor, width: int, gamma: float) -> Tensor:
    """DMPO's turn weights ``φ(t, T) = γ^t (1 - γ^(T-t)) / (1 - γ^T)`` for ``t = 0 .. width-1``.

    Shi et al. 2024, "Direct Multi-Turn Preference Optimization for Language Agents", Eq. 13 (the
    length-normalised discounted state-action occupancy measure, summed over the turns after ``t``):
    ``(T - t) / T`` at ``γ = 1`` (its limit), and only the first turn (weight 1) at ``γ = 0``. With one
    turn ``φ(0, 1) = 1`` for every γ. ``turns``: (N,) trajectory lengths T. Returns (N, width), 0 where
    ``t >= T``. Computed as ``γ^t · expm1((T - t) log γ) / expm1(T log γ)``, stable as γ -> 1.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"dmpo_gamma must be in [0, 1], got {gamma}")
    t = torch.arange(width, dtype=torch.float64, device=turns.device)[None, :]
    big_t = turns.to(torch.float64)[:, None]
    inside = t < big_t
    if gamma == 1.0:
        phi = (big_t - t) / big_t.clamp(min=1)
    elif gamma == 0.0:
        phi = (t == 0).to(torch.float64).expand(big_t.shape[0], width)
    else:
        log_g = math.log(gamma)
        phi = torch.exp(t * log_g) * torch.expm1((big_t - t) * log_g) / torch.expm1(big_t.clamp(min=1) * log_g)
    return torch.where(inside, phi, torch.zeros_like(phi))


def _check_turns(logps: Tensor, ref: Tensor, turns: Tensor, side: str) -> None:
    if logps.shape != ref.shape or logps.dim() != 2 or logps.shape[0] != turns.shape[0]:
        raise ValueError(f"dmpo: {side}_turn_logps {tuple(logps.shape)}, ref_{side}_turn_logps {tuple(ref.shape)} and "
                         f"{side}_turns {tuple(turns.shape)} must be (B, K), (B, K) and (B,)")
    if bool((turns < 1).any()) or int(turns.max()) > logps.shape[1]:
        raise ValueError(f"dmpo: {side}_turns must lie in [1, K={logps.shape[1]}]; a trajectory needs an "
                         "assistant turn")


def _discounted_logratio(inputs: PreferenceInputs, side: str, gamma: float) -> Tensor:
    logps = getattr(inputs, f"{side}_turn_logps")
    ref = getattr(inputs, f"ref_{side}_turn_logps")
    turns = getattr(inputs, f"{side}_turns")
    _check_turns(logps, ref, turns, side)
    phi = dmpo_discount(turns, logps.shape[1], gamma).to(logps.dtype)
    return (phi * (logps - ref)).sum(-1)


@PREFERENCE_LOSSES.register("dmpo", needs=("turn_logprobs",))
def dmpo_loss(inputs: PreferenceInputs, *, beta: float = 0.1, dmpo_gamma: float = 0.7) -> tuple[Tensor, Metrics]:
    """DMPO: DPO on the turns of two agent trajectories, each weighted by a length-normalised discount.

    Shi et al. 2024, "Direct Multi-Turn Preference Optimization for Language Agents", Eq. 13:
    ``l = -log σ(β Σ_{t<T_w} φ(t, T_w) r^w_t - β Σ_{t<T_l} φ(t, T_l) r^l_t)``, with
    ``r_t = log π(a_t|s_t) - log π_ref(a_t|s_t)`` turn ``t``'s log-ratio (summed over its action tokens;
    observation tokens carry none), ``φ(t, T) = γ^t (1 - γ^(T-t)) / (1 - γ^T)`` (:func:`dmpo_discount`),
    and T_w, T_l the two trajectories' turn counts, normalised separately. γ = ``dmpo_gamma`` (0.7, the
    authors' code default). The first turn weighs 1 and later ones less (``φ`` decreases in t), so a
    trajectory's late turns, and the length of a long failed episode, count less than in DPO's plain sum.
    With one turn each (T = 1) it is DPO (``sigmoid``). Reported rewards are ``β Σ_t φ(t, T) r_t``.
    """
    _require(inputs, "dmpo", "chosen_turn_logps", "rejected_turn_logps", "ref_chosen_turn_logps",
             "ref_rejected_turn_logps", "chosen_turns", "rejected_turns")
    r_c = beta * _discounted_logratio(inputs, "chosen", dmpo_gamma)
    r_r = beta * _discounted_logratio(inputs, "rejected", dmpo_gamma)
    metrics = _reward_metrics(r_c, r_r, inputs)
    metrics["turns/chosen"] = inputs.chosen_turns.detach().float().mean()
    metrics["turns/rejected"] = inputs.rejected_turns.detach().float().mean()
    return _batch_mean(-F.logsigmoid(r_c - r_r), inputs.weights), metrics
