"""Every registered preference loss in one import: ``PREFERENCE_LOSSES`` filled with the sequence-level
DPO family (preference.py), the token-level losses (token_preference.py), the step-level ones
(stepwise_preference.py) and the turn-level ones (turn_preference.py). Configs and trainers import the registry from here."""

from __future__ import annotations

from tether.core import stepwise_preference, token_preference, turn_preference  # noqa: F401 (register)
from tether.core.preference import (
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    PreferenceInputs,
    mixed_preference_loss,
    wpo_weights,
)

__all__ = ["PREFERENCE_LOSSES", "UNPAIRED_LOSSES", "PreferenceInputs", "mixed_preference_loss", "wpo_weights"]
