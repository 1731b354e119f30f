"""Per-token estimators of KL(pi || pi_ref) from the log-probabilities of sampled tokens.

Schulman, "Approximating KL Divergence" (blog, 2020). Tokens are sampled from pi, so with
r = pi_ref(x) / pi(x) and log_ratio = log pi(x) - log pi_ref(x) = -log r:

    k1 = -log r              = log_ratio                        unbiased, high variance, can be < 0
    k2 = 0.5 * (log r)^2     = 0.5 * log_ratio^2                biased, low variance, >= 0
    k3 = (r - 1) - log r     = exp(-log_ratio) - 1 + log_ratio  unbiased, low variance, >= 0

The same estimators serve both placements of the penalty: subtracted from the reward
(PPO-RLHF, REINFORCE++) or added to the loss (GRPO). Trainers dispatch through
``KL_ESTIMATORS`` or ``kl_penalty``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tether.core.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

# exp(20) ~ 5e8 is finite in fp32 and bf16 (not fp16: compute KL in fp32 there). Beyond it the
# estimate is meaningless anyway, and only its overflow would reach the optimizer.
LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ in shape"
        )
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi - log pi_ref, the plain Monte-Carlo KL estimate (Schulman 2020).

    logprobs, ref_logprobs: shape (B, T), log-probabilities of the sampled tokens under the
    policy and the reference. Returns shape (B, T). Matches the blog exactly.
    """
    return _log_ratio(logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (log pi - log pi_ref)^2 (Schulman 2020).

    logprobs, ref_logprobs: shape (B, T). Returns shape (B, T). Matches the blog exactly; its
    gradient is that of the reverse KL, which is why GRPO-style "KL in loss" variants use it.
    """
    return 0.5 * _log_ratio(logprobs, ref_logprobs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(-d) - 1 + d with d = log pi - log pi_ref, the estimator DeepSeekMath's GRPO uses.

    Schulman 2020, k3 = (r - 1) - log r with r = pi_ref / pi. logprobs, ref_logprobs: shape
    (B, T). Returns shape (B, T).

    Differs from the blog: d is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] = [-20, 20]
    before the exponential, so a token the reference finds vastly more likely cannot overflow;
    outside that range the estimate saturates and its gradient is zero.
    """
    log_ratio = _log_ratio(logprobs, ref_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate by the named estimator ("k1", "k2" or "k3").

    logprobs, ref_logprobs: shape (B, T). Returns shape (B, T); the caller masks and
    aggregates it. An unknown name raises KeyError listing the valid ones.
    """
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


# ------------------------------------------------------------------------------ KL controllers


class FixedKLController:
    """A constant KL coefficient beta (Ziegler et al. 2019, "Fine-Tuning Language Models from
    Human Preferences", the fixed-beta runs). ``update`` is a no-op, kept for the shared interface."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"the KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, kl: float, n_samples: int) -> float:
        """Nothing to adapt; returns beta."""
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019, section 2.2, the log-space proportional controller that steers KL to a target:

        e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),    beta_{t+1} = beta_t * (1 + K_beta * e_t)

    with K_beta = n_samples / horizon, n_samples the episodes behind KL_t (lm-human-preferences
    uses the batch size; the paper's K_beta = 0.1 with horizon 10000). ``kl`` is the mean
    per-sequence KL(pi || pi_ref) of the batch in nats, the quantity the target is stated in.
    Matches the paper and OpenAI's lm-human-preferences code.
    """

    def __init__(self, coef: float, *, target: float, horizon: int) -> None:
        super().__init__(coef)
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be > 0")
        self.target, self.horizon = float(target), int(horizon)

    def update(self, kl: float, n_samples: int) -> float:
        """Move beta toward the value that holds ``kl`` at the target; returns the new beta."""
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon
        return self.value


KL_CONTROLLERS: Registry[Callable[..., FixedKLController]] = Registry("KL controller")


@KL_CONTROLLERS.register("fixed")
def fixed_controller(coef: float, **_: object) -> FixedKLController:
    """A constant KL coefficient beta."""
    return FixedKLController(coef)


@KL_CONTROLLERS.register("adaptive")
def adaptive_controller(coef: float, *, target: float, horizon: float, **_: object) -> AdaptiveKLController:
    """Ziegler et al. 2019's adaptive beta, moved each batch toward holding the KL at ``target``."""
    return AdaptiveKLController(coef, target=target, horizon=horizon)
