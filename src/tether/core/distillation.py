"""Distillation signals on the student's own samples: on-policy distillation and GKD.

The student samples a completion y ~ π_S(· | x); the teacher π_T only scores the student's tokens.

- ``reverse_kl`` (sampled token; on-policy distillation, Lu and Thinking Machines Lab 2025, "On-Policy
  Distillation"; Agarwal et al. 2024, GKD, with the sampled-token estimate): the per-token k1 estimate
  of the reverse KL at the sampled token, ``d_t = log π_S(y_t | x, y_<t) - log π_T(y_t | x, y_<t)``,
  whose expectation over y_t ~ π_S is KL(π_S || π_T) at that position. The RL trainer uses ``-d_t`` as
  each token's advantage (discount 0: every token is charged its own divergence only), so the policy
  gradient lowers the reverse KL; it needs only the teacher's log-prob of each sampled token, which a
  served teacher can return.
- ``forward_kl`` and ``jsd`` (GKD, Agarwal et al. 2024, Eq. 1 and Sec. 3): divergences between the
  teacher's and the student's whole next-token distributions at every position of the student's
  sample, differentiated directly through π_S (the sampling itself is not differentiated, as in GKD):
  ``KL(π_T || π_S) = Σ_v π_T(v) (log π_T(v) - log π_S(v))``, and the generalised Jensen-Shannon
  divergence with mixture ``M = β π_T + (1 - β) π_S``:
  ``JSD(β) = β KL(π_T || M) + (1 - β) KL(π_S || M)``, which is 0 at β = 0 and 1 and interpolates
  between forward KL and reverse KL in its gradients (GKD Sec. 3); at exactly β = 0 and β = 1 this
  function returns ``KL(π_T || π_S)`` and ``KL(π_S || π_T)`` (as TRL's ``GKDTrainer`` does). They need
  the teacher's full distribution (a local teacher).
- :func:`top_k_restricted`: both distributions restricted to the teacher's top-k tokens at each position
  and renormalised there (the top-k-logits variant, for teachers whose full vocabulary is too large to
  keep or send).

Each registered function returns one value per token; the trainer masks and aggregates them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from tether.core.registry import Registry

DistillationDivergence = Callable[..., Tensor]

DISTILLATION_DIVERGENCES: Registry[DistillationDivergence] = Registry("distillation divergence")


@DISTILLATION_DIVERGENCES.register("reverse_kl", needs=("token_logprobs",))
def sampled_reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """``log π_S(y_t) - log π_T(y_t)`` at each sampled token, (B, T): the k1 estimate of KL(π_S || π_T).

    On-policy distillation (Lu and Thinking Machines Lab 2025): the advantage of token t is ``-d_t``.
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)} and teacher {tuple(teacher_logprobs.shape)} "
                         "log-probs differ in shape")
    return student_logprobs - teacher_logprobs


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(P || Q) over the last dimension from log-probabilities; 0 * log 0 terms are 0."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def _check(student_log_dist: Tensor, teacher_log_dist: Tensor) -> None:
    if student_log_dist.shape != teacher_log_dist.shape:
        raise ValueError(f"student {tuple(student_log_dist.shape)} and teacher {tuple(teacher_log_dist.shape)} "
                         "distributions differ in shape: the teacher must share the student's vocabulary")


@DISTILLATION_DIVERGENCES.register("forward_kl", needs=("distributions",))
def forward_kl(student_log_dist: Tensor, teacher_log_dist: Tensor) -> Tensor:
    """``KL(π_T || π_S)`` per position from log-distributions (..., V): GKD's forward KL (Agarwal et al. 2024)."""
    _check(student_log_dist, teacher_log_dist)
    return _kl(teacher_log_dist, student_log_dist)


@DISTILLATION_DIVERGENCES.register("jsd", needs=("distributions",))
def generalized_jsd(student_log_dist: Tensor, teacher_log_dist: Tensor, beta: float = 0.5) -> Tensor:
    """GKD's generalised JSD per position (Agarwal et al. 2024, Sec. 3): with ``M = β π_T + (1-β) π_S``,
    ``β KL(π_T || M) + (1-β) KL(π_S || M)``; ``KL(π_T || π_S)`` at β = 0 and ``KL(π_S || π_T)`` at β = 1."""
    _check(student_log_dist, teacher_log_dist)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return _kl(teacher_log_dist, student_log_dist)
    if beta == 1.0:
        return _kl(student_log_dist, teacher_log_dist)
    mixture = torch.logsumexp(torch.stack([teacher_log_dist + math.log(beta),
                                           student_log_dist + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(teacher_log_dist, mixture) + (1.0 - beta) * _kl(student_log_dist, mixture)


def top_k_restricted(student_log_dist: Tensor, teacher_log_dist: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Both log-distributions (..., V) restricted to the teacher's ``k`` most likely tokens at each position
    and renormalised over them, (..., k) each: the top-k-logits variant of the divergences."""
    _check(student_log_dist, teacher_log_dist)
    if k < 1:
        raise ValueError(f"top_k must be at least 1, got {k}")
    k = min(k, teacher_log_dist.shape[-1])
    teacher_top, index = teacher_log_dist.topk(k, dim=-1)
    student_top = student_log_dist.gather(-1, index)
    return torch.log_softmax(student_top, dim=-1), torch.log_softmax(teacher_top, dim=-1)
