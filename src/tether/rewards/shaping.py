"""Reward shaping: what happens to scores between the reward functions and the advantages.

- terms added to the task reward from properties of the rollout (its token length): pure tensor
  functions of per-sample quantities, registered in ``REWARD_SHAPING`` under the name a config
  writes; unlike reward functions they see token counts, not text, so the trainer applies them
  after tokenisation;
- :func:`shape_scores`: normalisation (per batch, or by running moments), clipping and the no-EOS
  penalty (the reward processing of lm-human-preferences and TRL's PPO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.core.registry import Registry

REWARD_SHAPING: Registry = Registry("reward shaping")


@REWARD_SHAPING.register("overlong")
def overlong_penalty(lengths: Tensor, *, max_length: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), added to the task reward.

    ``lengths``: shape (N,), response lengths in tokens. With L_max = ``max_length`` and
    L_cache = ``buffer``::

        R_length(L) = 0                                  if L <= L_max - L_cache
                    = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
                    = -1                                 if L > L_max

    a linear ramp from 0 down to -1 over the last ``buffer`` tokens before ``max_length``.
    Departure from the paper: the whole term is scaled by ``penalty`` (the paper's is 1).

    Returns shape (N,), floating (``lengths``' dtype if floating, else float32).
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"need 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0, got {penalty}")
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.float32)
    expected = max_length - buffer
    ramp = (expected - lengths) / buffer * penalty
    zero, full = torch.zeros_like(lengths), torch.full_like(lengths, -penalty)
    return torch.where(lengths <= expected, zero, torch.where(lengths <= max_length, ramp, full))


class RunningMoments:
    """Running mean and variance of every score seen (Chan et al.'s parallel update), for ``reward_norm``."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: torch.Tensor) -> None:
        n = x.numel()
        if n == 0:
            return
        mean, var = float(x.mean()), float(x.var(correction=0))
        total = self.count + n
        delta = mean - self.mean
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], int(state["count"])


def shape_scores(scores: torch.Tensor, truncated: torch.Tensor, *, norm: str, clip: float | None,
                 missing_eos_penalty: float | None, moments: RunningMoments | None = None,
                 eps: float = 1e-8) -> torch.Tensor:
    """Scores (B,) -> the outcome reward (B,): normalised, clipped, minus the no-EOS penalty.

    ``norm``: "none"; "batch" (whitened over this batch); "running" (by the running mean / std of
    every score so far, ``moments`` updated with this batch first). ``truncated``: shape (B,), bool.
    """
    out = scores.float()
    if norm == "batch" and out.numel() > 1:
        out = (out - out.mean()) / (out.std(correction=0) + eps)
    elif norm == "running":
        moments.update(out)
        out = (out - moments.mean) / (moments.var**0.5 + eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    if missing_eos_penalty:
        out = out - missing_eos_penalty * truncated.float()
    return out
