"""Reward-model math: the Bradley-Terry pairwise loss (outcome RMs) and step-score aggregation (PRMs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tether.core.registry import Registry

Metrics = dict[str, Tensor]

STEP_AGGREGATIONS: Registry = Registry("step-score aggregation")


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, Metrics]:
    """Pairwise Bradley-Terry loss for a scalar reward model, with optional margin and centring.

    Ouyang et al. 2022 (InstructGPT), Eq. 1: ``l = -log σ(r_c - r_r)``; Llama 2 (Touvron et al.
    2023) subtracts a per-pair ``margin`` m(r) inside the sigmoid: ``-log σ(r_c - r_r - m)``.
    Reward centring (Eisenstein et al. 2023, "Helping or Herding?") adds
    ``center_coef · mean((r_c + r_r)²)`` to pin the unidentified offset of the rewards near 0,
    as TRL's ``center_rewards_coefficient``. InstructGPT averages over all K-choose-2 pairs of a
    prompt in one batch element; here each row is one pair and the loss is the plain batch mean.

    Args:
        chosen_rewards: shape (B,), scalar rewards of the preferred completions.
        rejected_rewards: shape (B,).
        margin: shape (B,), optional required gap per pair (e.g. from preference strength).
        center_coef: weight of the centring penalty (0 disables it).

    Returns:
        ``(loss, metrics)`` with ``accuracy`` (fraction r_c > r_r), ``margin`` (mean r_c - r_r),
        ``rewards/chosen``, ``rewards/rejected``, ``rewards/mean`` and ``rewards/std`` over all 2B.
    """
    diff = chosen_rewards - rejected_rewards
    logits = diff if margin is None else diff - margin
    loss = -F.logsigmoid(logits).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen_rewards + rejected_rewards) ** 2).mean()
    both = torch.cat([chosen_rewards, rejected_rewards]).detach()
    diff = diff.detach()
    metrics = {
        "accuracy": (diff > 0).float().mean(),
        "margin": diff.mean(),
        "rewards/chosen": chosen_rewards.detach().mean(),
        "rewards/rejected": rejected_rewards.detach().mean(),
        "rewards/mean": both.mean(),
        # population std: defined for B = 1, and a diagnostic rather than an estimator
        "rewards/std": both.std(correction=0),
    }
    return loss, metrics


# Aggregations: step_scores (B, S) in [0, 1], step_mask (B, S) -> (B,). A row with no valid step
# scores 0: the identity of min / product (1) would make "emit no steps" the best trajectory.


@STEP_AGGREGATIONS.register("min")
def aggregate_min(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """Weakest step: a solution is as good as its worst step (Math-Shepherd, Wang et al. 2024;
    Lightman et al. 2023 compare it with the product). Masked steps ignored; empty row -> 0.
    """
    mask = step_mask.bool()
    worst = torch.where(mask, step_scores, torch.ones_like(step_scores)).amin(-1)
    return torch.where(mask.any(-1), worst, torch.zeros_like(worst))


@STEP_AGGREGATIONS.register("product")
def aggregate_product(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """Probability that every step is correct, treating steps as independent (Lightman et al.
    2023, "Let's Verify Step by Step": their PRM's solution score). Masked steps ignored; empty row -> 0.
    """
    mask = step_mask.bool()
    prod = torch.where(mask, step_scores, torch.ones_like(step_scores)).prod(-1)
    return torch.where(mask.any(-1), prod, torch.zeros_like(prod))


@STEP_AGGREGATIONS.register("last")
def aggregate_last(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """Score of the last valid step, the PRM's verdict on the whole solution so far, read like an
    outcome-RM score. Masks need not be contiguous: the highest-index valid step is used.
    Empty row -> 0.
    """
    mask = step_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(-1)
    picked = step_scores.gather(-1, last.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(last >= 0, picked, torch.zeros_like(picked))


@STEP_AGGREGATIONS.register("mean")
def aggregate_mean(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """Average step score: a smoother alternative to min that does not let one noisy step decide.
    Masked steps ignored; empty row -> 0.
    """
    mask = step_mask.bool()
    total = torch.where(mask, step_scores, torch.zeros_like(step_scores)).sum(-1)
    return total / mask.sum(-1).clamp(min=1).to(total.dtype)
