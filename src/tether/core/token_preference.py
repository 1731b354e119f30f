"""Token-level preference losses: DPO with each sequence's sequential KL to the reference (TDPO).

``position_kl`` is the per-position divergence these losses read, ``KL(π_ref(·|x, y<t) ‖ π(·|x, y<t))``
over the whole vocabulary; summed over a completion's tokens it is TDPO's sequential KL
``D_SeqKL(x, y; π_ref ‖ π)``, which the trainer passes as ``PreferenceInputs.chosen_seq_kl`` /
``rejected_seq_kl`` (the losses here declare ``needs=("sequential_kl",)``, so the trainer holds a frozen
reference model and runs it on each micro-batch: the full distributions cannot be cached like
summed log-probs).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from tether.core.preference import (
    PREFERENCE_LOSSES,
    Metrics,
    PreferenceInputs,
    _batch_mean,
    _ref_based,
    _require,
)


def position_kl(ref_log_probs: Tensor, log_probs: Tensor) -> Tensor:
    """``KL(π_ref ‖ π) = Σ_v π_ref(v) (log π_ref(v) - log π(v))`` at each position.

    Zeng et al. 2024, "Token-level Direct Preference Optimization", Eq. 4 (the forward KL from the
    reference, as their code computes it). Args: log-distributions of shape (..., V), normalised.
    Returns shape (...).
    """
    return (ref_log_probs.exp() * (ref_log_probs - log_probs)).sum(-1)


def _tdpo(inputs: PreferenceInputs, loss: str, beta: float, correction: Tensor) -> tuple[Tensor, Metrics]:
    _, _, h, metrics = _ref_based(inputs, loss, beta)
    metrics["seq_kl/chosen"] = inputs.chosen_seq_kl.detach().mean()
    metrics["seq_kl/rejected"] = inputs.rejected_seq_kl.detach().mean()
    return _batch_mean(-F.logsigmoid(beta * (h - correction)), inputs.weights), metrics


@PREFERENCE_LOSSES.register("tdpo1", needs=("sequential_kl",))
def tdpo1_loss(inputs: PreferenceInputs, *, beta: float = 0.1) -> tuple[Tensor, Metrics]:
    """TDPO₁: DPO's margin corrected by the difference of the two completions' sequential KLs.

    Zeng et al. 2024, "Token-level Direct Preference Optimization", Eq. 18:
    ``l = -log σ(β h - δ)``, ``δ = β (D_SeqKL(x, y_r; π_ref ‖ π) - D_SeqKL(x, y_c; π_ref ‖ π))``, with
    ``h`` DPO's difference of log-ratios. As in the paper.
    """
    _require(inputs, "tdpo1", "chosen_seq_kl", "rejected_seq_kl")
    return _tdpo(inputs, "tdpo1", beta, inputs.rejected_seq_kl - inputs.chosen_seq_kl)


@PREFERENCE_LOSSES.register("tdpo", "tdpo2", needs=("sequential_kl",))
def tdpo2_loss(inputs: PreferenceInputs, *, beta: float = 0.1, tdpo_alpha: float = 0.5) -> tuple[Tensor, Metrics]:
    """TDPO₂: TDPO₁ with the chosen completion's sequential KL held constant and the correction scaled.

    Zeng et al. 2024, "Token-level Direct Preference Optimization", Eq. 19:
    ``l = -log σ(β h - α β (D_SeqKL(x, y_r; π_ref ‖ π) - sg(D_SeqKL(x, y_c; π_ref ‖ π))))``,
    α = ``tdpo_alpha`` (0.5 in the paper's experiments and code). ``tdpo`` names this form, the
    paper's recommended one.
    """
    _require(inputs, "tdpo", "chosen_seq_kl", "rejected_seq_kl")
    return _tdpo(inputs, "tdpo", beta, tdpo_alpha * (inputs.rejected_seq_kl - inputs.chosen_seq_kl.detach()))
