"""Entropy controls for RL on language models: an adaptive entropy coefficient and the high-entropy token mask."""

from __future__ import annotations

import torch
from torch import Tensor


def adaptive_entropy_coef(coef: float, entropy: float, *, target: float, lr: float,
                          max_coef: float | None = None) -> float:
    """The entropy bonus's next coefficient (Skywork-OR1, He et al. 2025, adaptive entropy control):

        c_{k+1} = clip(c_k + lr if H_k < target else c_k - lr, 0, max_coef),

    H_k the step's mean token entropy and ``lr`` the controller's step size. The bonus grows while the policy is less random than the target and
    shrinks (to 0, no bonus) once it is more random, so entropy is held near the target instead of being
    pushed up for the whole run.
    """
    coef = coef + lr if entropy < target else coef - lr
    coef = max(coef, 0.0)
    return min(coef, max_coef) if max_coef is not None else coef


def top_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """The trained tokens whose entropy is in the top ``quantile`` fraction of this call's trained tokens
    (Wang et al. 2025, "Beyond the 80/20 rule: high-entropy minority tokens drive effective RL for LLM
    reasoning": the policy gradient on the top 20% "forking" tokens only). Shapes (B, T); the threshold is
    the (1 - quantile) quantile of the masked entropies (ties at it kept); ``quantile`` 1 keeps every token.
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    kept = mask != 0
    if quantile == 1 or not bool(kept.any()):
        return mask
    threshold = torch.quantile(entropy.detach()[kept].float(), 1.0 - quantile)
    return mask * (entropy.detach() >= threshold).to(mask.dtype)
