"""The sampler beside the trainer, for the RL trainers: which log-probs are the old policy, the correction
weights of a micro-batch, and the step's ``mismatch/*`` figures.

The trainer's log-probs of the sampled tokens are taken at rollout time: by the recompute pass when there
is one, otherwise from the first update's forward pass (before any optimiser step of the step, so they are
pi_old exactly); rows first seen after an optimiser step (later minibatches under ``old_logprobs:
sampler``) are left out of the figures rather than compared with a moved policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tether.config.base import ConfigError
from tether.config.rl import RolloutCorrectionConfig
from tether.core.rollout_correction import ROLLOUT_CORRECTIONS, mismatch_metrics


def sampler_as_old(sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sampler's log-probs as the old policy (``old_logprobs: sampler``); a clear error when the engine
    returned none for a trained token (an OpenAI-compatible server without log-probs)."""
    if bool(torch.isnan(sampler_logprobs[mask != 0]).any()):
        raise ConfigError("old_logprobs: sampler needs the engine's log-probs, and this engine returned none for "
                         "some tokens; use old_logprobs: recompute")
    return torch.where(mask != 0, sampler_logprobs, 0.0)  # no NaN off the mask: a NaN there poisons gradients


class MismatchTracker:
    """One step's trainer log-probs of the sampled tokens (NaN until measured) and the correction."""

    def __init__(self, sampler_logprobs: torch.Tensor, mask: torch.Tensor, correction: RolloutCorrectionConfig, *,
                 policy_version: Callable[[], int]) -> None:
        self.sampler = sampler_logprobs
        self.mask = mask
        self.correction = correction
        self.trainer = torch.full_like(sampler_logprobs, float("nan"))
        self.policy_version = policy_version  # counts optimiser steps: the policy moved when it changes
        self.version = policy_version()

    def record(self, rows: torch.Tensor, trainer_logprobs: torch.Tensor) -> None:
        """The trainer's pi_old log-probs of ``rows`` where not yet measured; ignored once the policy has
        moved this step."""
        if self.policy_version() != self.version:
            return
        current = self.trainer[rows]
        self.trainer[rows] = torch.where(torch.isnan(current), trainer_logprobs.detach().to(current.dtype), current)

    def weights(self, rows: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor | None:
        """The correction's detached per-token weights for ``rows`` (None under ``mode: none``)."""
        c = self.correction
        if c.mode == "none":
            return None
        weights, _ = ROLLOUT_CORRECTIONS.get(c.mode)(old_logprobs, self.sampler[rows], self.mask[rows],
                                                     cap=c.cap, low=c.low, high=c.high)
        return weights

    def metrics(self) -> dict[str, torch.Tensor]:
        """``mismatch/*`` over the measured tokens: the figures of :func:`mismatch_metrics`, and with a
        correction on, ``frac_tokens_corrected`` (tokens truncated or dropped)."""
        measured = self.mask * (~torch.isnan(self.trainer)).to(self.mask.dtype)
        trainer = self.trainer.nan_to_num(0.0)
        out = mismatch_metrics(trainer, self.sampler, measured)
        c = self.correction
        if c.mode != "none":
            _, corrected = ROLLOUT_CORRECTIONS.get(c.mode)(trainer, self.sampler, measured, cap=c.cap, low=c.low,
                                                           high=c.high)
            has = (measured != 0) & ~torch.isnan(self.sampler)
            out["frac_tokens_corrected"] = (corrected & has).sum() / has.sum().clamp(min=1)
        return {f"mismatch/{k}": v for k, v in out.items()}
