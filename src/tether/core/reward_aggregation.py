"""Several reward functions' scores -> one reward per sample (``REWARD_AGGREGATIONS``).

Every entry: ``fn(scores, weights, group_size) -> total``, scores of shape (K, N) (K reward functions,
N samples in contiguous groups of ``group_size``; NaN where a function returned no value), weights of
shape (K,), total of shape (N,), NaN where no function returned a value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tether.core.registry import Registry

RewardAggregation = Callable[[Tensor, Tensor, int], Tensor]

REWARD_AGGREGATIONS: Registry[RewardAggregation] = Registry("reward aggregation")


def _total(terms: Tensor, scores: Tensor) -> Tensor:
    present = ~torch.isnan(scores)
    total = torch.where(present, terms, 0.0).sum(0)
    return torch.where(present.any(0), total, float("nan"))


@REWARD_AGGREGATIONS.register("sum")
def weighted_sum(scores: Tensor, weights: Tensor, group_size: int) -> Tensor:
    """total_i = sum_k w_k r_ki over the functions that scored sample i (the default)."""
    return _total(weights[:, None] * scores, scores)


@REWARD_AGGREGATIONS.register("gdpo")
def group_decoupled(scores: Tensor, weights: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GDPO (group reward-decoupled normalisation, NVIDIA 2026): each reward function is normalised within
    the group before the functions are combined,

        total_i = sum_k w_k (r_ki - mean_g(r_k)) / (std_g(r_k) + eps),

    mean and (population) std over the group's samples that function scored. With a plain weighted sum a
    dense reward with a large spread sets the group's ranking and a sparse one barely moves it; after the
    per-function normalisation each function's within-group ranking counts by its weight alone. The
    advantage estimator then runs on ``total`` (GDPO's final batch normalisation is the estimator's).
    A function constant within a group contributes 0 to that group.
    """
    k, n = scores.shape
    if n % group_size:
        raise ValueError(f"{n} samples are not whole groups of {group_size}")
    groups = scores.view(k, n // group_size, group_size)
    present = ~torch.isnan(groups)
    count = present.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(present, groups, 0.0).sum(-1, keepdim=True) / count
    var = torch.where(present, (groups - mean).square(), 0.0).sum(-1, keepdim=True) / count
    normalised = ((groups - mean) / (var.sqrt() + eps)).view(k, n)
    return _total(weights[:, None] * normalised, scores)
