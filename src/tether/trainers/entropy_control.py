"""The RL trainers' entropy controls: the bonus coefficient (fixed, or adaptive toward a target), the
high-entropy token mask of the policy gradient, and the collapse warning."""

from __future__ import annotations

import logging
from typing import Any

import torch

from tether.config.rl import EntropyConfig
from tether.core.entropy import adaptive_entropy_coef, top_entropy_mask

log = logging.getLogger(__name__)


class EntropyControl:
    """What the ``entropy`` block and ``top_entropy_quantile`` ask of a step; the coefficient is resumable state."""

    def __init__(self, config: EntropyConfig, top_quantile: float | None) -> None:
        self.config, self.top_quantile = config, top_quantile
        self.coef = config.coef

    @property
    def bonus_on(self) -> bool:
        """Whether the entropy term enters the loss (and so needs its gradient)."""
        return self.coef > 0 or self.config.adaptive is not None

    def policy_mask(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The tokens the policy gradient trains on: the top ``top_entropy_quantile`` by entropy, or all.
        The dropped tokens still count in the loss's denominators (they weigh 0)."""
        return mask if self.top_quantile is None else top_entropy_mask(entropy, mask, self.top_quantile)

    def end_step(self, entropy: float | None, step: int) -> dict[str, float]:
        """The step's ``entropy/coef`` (the value used) and ``entropy/collapse``; then the adaptive update."""
        out = {"entropy/coef": self.coef}
        if entropy is None:
            return out
        floor = self.config.floor
        if floor is not None:
            out["entropy/collapse"] = float(entropy < floor)
            if entropy < floor:
                log.warning("step %d: entropy collapse: mean token entropy %.4f is below entropy.floor %.4f",
                            step, entropy, floor)
        adaptive = self.config.adaptive
        if adaptive is not None:
            self.coef = adaptive_entropy_coef(self.coef, entropy, target=adaptive.target, lr=adaptive.lr,
                                              max_coef=adaptive.max_coef)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = state["coef"]
