"""GiGPO step-level advantages (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training").

GiGPO adds to GRPO's episode-level advantage ``A^E`` a step-level one: steps of different
trajectories of the same group that start from the same environment state (an *anchor state*)
form a step group, and each step's discounted return ``R_t = sum_{k>=t} gamma^(k-t) r_k`` is
normalised within its step group (Eq. 6-7):

    A^S_t = (R_t - mean(R over the step group)) / F,   F = std(R over the step group) or 1
    A = A^E + omega * A^S                                                        (Eq. 8)

The trainer decides what a state is (here: the observations seen so far) and broadcasts each
step's ``A^S`` to the tokens the policy generated in that step. Departure: a step group of one
(a state no other trajectory reached) has no baseline, and gets ``A^S = 0`` rather than a
normalised 0/0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def discounted_step_returns(step_rewards: Tensor, step_mask: Tensor, gamma: float) -> Tensor:
    """``R_t = sum_{k>=t} gamma^(k-t) r_k`` per trajectory, shape (B, S) -> (B, S), 0 where ``step_mask`` is 0.

    ``step_rewards`` (B, S): the reward of each step (an episode's outcome sits on its last step).
    """
    returns = torch.zeros_like(step_rewards, dtype=torch.float32)
    running = torch.zeros(step_rewards.shape[0], dtype=torch.float32)
    for t in reversed(range(step_rewards.shape[1])):
        running = (step_rewards[:, t].float() + gamma * running) * step_mask[:, t].float()
        returns[:, t] = running
    return returns


def step_group_advantages(returns: Tensor, anchors: Tensor, *, normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GiGPO's ``A^S`` for S steps: ``returns`` (S,) float, ``anchors`` (S,) int64 step-group ids.

    Within each group: ``R - mean``, divided by the group's (population) std when ``normalize``.
    Groups of one step, and groups whose returns are all equal, get exactly 0.
    """
    returns = returns.detach().float()
    groups, inverse = torch.unique(anchors, return_inverse=True)
    count = torch.zeros(len(groups)).index_add_(0, inverse, torch.ones_like(returns))
    total = torch.zeros(len(groups)).index_add_(0, inverse, returns)
    mean = total / count
    centred = returns - mean[inverse]
    var = torch.zeros(len(groups)).index_add_(0, inverse, centred**2) / count
    spread = torch.zeros(len(groups)).index_add_(0, inverse, centred.abs())
    flat = (count[inverse] < 2) | (spread[inverse] <= eps * count[inverse])
    advantages = centred / (var[inverse].sqrt() + eps) if normalize else centred
    return torch.where(flat, torch.zeros_like(advantages), advantages)
