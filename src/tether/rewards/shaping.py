"""Reward shaping: terms added to the task reward from properties of the rollout (its token length).

Shaping functions are pure tensor functions of per-sample quantities, registered in
``REWARD_SHAPING`` under the name a config writes; unlike reward functions they see token counts,
not text, so the trainer applies them after tokenisation.
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
