"""Every registered policy loss in one import: ``POLICY_LOSSES`` filled with the PPO family
(policy_loss.py), the sequence-level losses (sequence_policy_loss.py), the weighted / gated ones
(weighted_policy_loss.py) and the covariance-based entropy controls (covariance_policy_loss.py). Configs
and trainers import the registry from here."""

from __future__ import annotations

import inspect

from tether.core import covariance_policy_loss, sequence_policy_loss, weighted_policy_loss  # noqa: F401 (register)
from tether.core.policy_loss import POLICY_LOSSES, value_loss_clipped

SHARED_ARGUMENTS = frozenset({"logprobs", "old_logprobs", "advantages", "mask", "clip_low", "clip_high", "dual_clip",
                              "loss_agg", "global_tokens", "global_seqs", "norm_constant"})


def extra_arguments(name: str) -> dict[str, object]:
    """The keyword arguments the policy loss ``name`` takes beyond the shared signature, with their defaults
    (SAPO's ``tau_pos`` / ``tau_neg``, DPPO's ``ratio_cap``); what ``policy_loss_kwargs`` may set."""
    parameters = inspect.signature(POLICY_LOSSES.get(name)).parameters
    return {k: p.default for k, p in parameters.items() if k not in SHARED_ARGUMENTS}


__all__ = ["POLICY_LOSSES", "extra_arguments", "value_loss_clipped"]
