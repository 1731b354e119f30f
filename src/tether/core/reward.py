"""Reward-model math: the Bradley-Terry pairwise loss and its K-way ranking form (outcome RMs), and
step-score aggregation (PRMs)."""

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
    prompt in one batch element (``ranking_loss``); here each row is one pair and the loss is the plain
    batch mean.

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


def ranking_pairs(ranks: Tensor, mask: Tensor | None = None) -> Tensor:
    """The comparisons a ranking makes: ``better[b, i, j]`` is True when answer i of prompt b is ranked
    above answer j (lower rank is better) and both are valid under ``mask``. Equal ranks tie and make
    no pair, so K answers without ties give all K(K-1)/2 pairs.

    Args:
        ranks: shape (B, K), integer or float ranks, 0 (or any lowest value) the best.
        mask: shape (B, K), the valid answers of each prompt (ragged K); None: all valid.

    Returns:
        shape (B, K, K), bool.
    """
    better = ranks[:, :, None] < ranks[:, None, :]
    if mask is not None:
        mask = mask.bool()
        better = better & mask[:, :, None] & mask[:, None, :]
    return better


def top_is_best(scores: Tensor, ranks: Tensor, mask: Tensor | None = None) -> Tensor:
    """Shape (B,), bool: whether each prompt's top-scored valid answer is one of its best-ranked ones."""
    valid = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.bool()
    top = torch.where(valid, scores, torch.full_like(scores, float("-inf"))).argmax(-1, keepdim=True)
    return ranks.gather(-1, top).squeeze(-1) == torch.where(valid, ranks, ranks.max() + 1).amin(-1)


def ranking_loss(
    scores: Tensor,
    ranks: Tensor,
    mask: Tensor | None = None,
    *,
    center_coef: float = 0.0,
) -> tuple[Tensor, Metrics]:
    """Bradley-Terry loss over every comparison of K ranked answers to one prompt, prompts weighted equally.

    Ouyang et al. 2022 (InstructGPT), Sec. 3.5 / Eq. 1:
    ``loss = -1/C(K,2) · E_x Σ_{(y_w, y_l)} log σ(r(x, y_w) - r(x, y_l))``: all comparisons of a
    prompt form one batch element, so each answer is scored once and a prompt's C(K,2) correlated
    pairs count as one example (the paper's fix for overfitting when they are shuffled as separate
    pairs). Here the normaliser is the prompt's number of untied pairs (C(K,2) without ties, so
    ragged K and ties are allowed), and the loss is the mean over prompts. ``center_coef`` adds
    ``center_coef · mean_x mean_pairs (r_w + r_l)²`` (reward centring as in ``bradley_terry_loss``).
    With K = 2 this is ``bradley_terry_loss``.

    Args:
        scores: shape (B, K), rewards of the answers (padding anywhere under ``mask``).
        ranks: shape (B, K), lower is better; equal ranks tie.
        mask: shape (B, K), valid answers; None: all valid.
        center_coef: weight of the centring penalty (0 disables it).

    Returns:
        ``(loss, metrics)``: ``accuracy`` (fraction of all pairs with r_w > r_l), ``margin`` (mean
        r_w - r_l over pairs), ``rewards/chosen`` / ``rewards/rejected`` (mean of winners / losers
        over pairs), ``best_accuracy`` (fraction of prompts whose top-scored answer is a best-ranked
        one), ``rewards/mean`` / ``rewards/std`` over the valid answers.
    """
    valid = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.bool()
    better = ranking_pairs(ranks, valid)
    count = better.sum((1, 2))
    if bool((count == 0).any()):
        raise ValueError("ranking_loss: a prompt has no untied pair of valid answers; drop prompts whose answers "
                         "all share one rank")
    winners, losers = scores[:, :, None].expand(better.shape), scores[:, None, :].expand(better.shape)
    diff = torch.where(better, winners - losers, torch.zeros_like(winners))  # padding never reaches the loss
    per_prompt = -(F.logsigmoid(diff) * better).sum((1, 2)) / count
    loss = per_prompt.mean()
    if center_coef:
        total = torch.where(better, winners + losers, torch.zeros_like(winners)) ** 2
        loss = loss + center_coef * (total.sum((1, 2)) / count).mean()
    answers = scores.detach()[valid]
    metrics = {
        "accuracy": (diff.detach()[better] > 0).float().mean(),
        "margin": diff.detach()[better].mean(),
        "rewards/chosen": winners.detach()[better].mean(),
        "rewards/rejected": losers.detach()[better].mean(),
        "best_accuracy": top_is_best(scores.detach(), ranks, valid).float().mean(),
        "rewards/mean": answers.mean(),
        "rewards/std": answers.std(correction=0),
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
