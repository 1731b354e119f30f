"""Step-level preference losses: DPO applied to one reasoning step of a trace (Step-DPO).

The pairs are built by :func:`tether.data.step_pairs.step_pairs` (the prompt extended by the shared
correct steps; chosen and rejected one step each); the loss declares ``needs=("step_pairs",)`` so the
trainer builds them from sequence-level pairs.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from tether.core.preference import PREFERENCE_LOSSES, Metrics, PreferenceInputs, _batch_mean, _ref_based


@PREFERENCE_LOSSES.register("step_dpo", needs=("step_pairs",))
def step_dpo_loss(inputs: PreferenceInputs, *, beta: float = 0.1) -> tuple[Tensor, Metrics]:
    """Step-DPO: the DPO loss on the first wrong step, given the correct steps before it.

    Lai et al. 2024, "Step-DPO: Step-wise Preference Optimization for Long-chain Reasoning of LLMs", Eq. 3:
    ``l = -log σ(β log π(s_win | x, s_<k)/π_ref(s_win | x, s_<k) - β log π(s_lose | x, s_<k)/π_ref(s_lose | x, s_<k))``,
    where ``s_<k`` are the shared correct steps (in the pair's prompt) and ``s_win`` / ``s_lose`` the
    correct and the first wrong step (its chosen and rejected). As in the paper; the paper samples
    ``s_win`` from the model given ``x, s_<k`` and keeps a verified one, here it is the chosen trace's step.
    """
    _, _, h, metrics = _ref_based(inputs, "step_dpo", beta)
    return _batch_mean(-F.logsigmoid(beta * h), inputs.weights), metrics
