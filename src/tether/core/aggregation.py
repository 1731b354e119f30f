"""The single place that turns a per-token loss matrix into a scalar: token-mean vs sequence-mean.

After verl's ``agg_loss``. Every policy, value, KL and entropy term is aggregated here, so the
choice a config makes (``loss_agg``) means the same thing for every term.

    token-mean                sum_{i,t} m_it l_it / N_tok                     (DAPO, Yu et al. 2025)
    seq-mean-token-mean       sum_i [sum_t m_it l_it / n_i] / N_seq           (GRPO, Shao et al. 2024)
    seq-mean-token-sum        sum_i [sum_t m_it l_it] / N_seq
    seq-mean-token-sum-norm   sum_{i,t} m_it l_it / (N_seq * L)               (Dr. GRPO, Liu et al. 2025)

n_i is row i's masked-token count, N_tok and N_seq the token and sequence counts of the whole
(global) batch, and L a constant (Dr. GRPO's maximum generation length).

Exact accumulation: each micro-batch on each rank passes the *global* N_tok / N_seq (the sum
of ``num_tokens`` / ``num_seqs`` over every micro-batch of the optimizer step and every rank)
and the trainer sums the results; values and gradients then equal one call on the full batch.
With the defaults (local counts) the result is the usual per-call mean.

A row with no masked token is not a sequence: it is excluded from N_seq (typically padding
from dynamic sampling, or a sample dropped for being overlong). Masks are read as booleans
(non-zero = the token counts); positions where mask == 0 are ignored even if they hold inf or NaN.
The registry entries take resolved denominators: call ``agg_loss``, not them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tether.core.registry import Registry

Aggregation = Callable[..., Tensor]

LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def num_tokens(mask: Tensor) -> Tensor:
    """Number of masked tokens (int64, exact at any size); mask: shape (B, T).

    Summed over the micro-batches of a step and all-reduced over ranks, it is N_tok.
    """
    return (mask != 0).sum()


def num_seqs(mask: Tensor) -> Tensor:
    """Number of rows with at least one masked token (int64); mask: shape (B, T). Summed, it is N_seq."""
    return (mask != 0).any(dim=-1).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over positions where mask != 0; x, mask: shape (B, T). 0 for an empty mask."""
    return torch.where(mask != 0, x, 0).sum() / num_tokens(mask).clamp(min=1)


def _masked(loss_mat: Tensor, mask: Tensor) -> Tensor:
    # torch.where, not multiplication, so inf/NaN at masked positions cannot leak into the sum.
    return torch.where(mask != 0, loss_mat, 0)


@LOSS_AGGREGATIONS.register("token-mean")
def _token_mean(loss_mat: Tensor, mask: Tensor, *, global_tokens: Tensor, **_: object) -> Tensor:
    """Every token weighs the same: long answers carry more weight (DAPO's token-level loss)."""
    return _masked(loss_mat, mask).sum() / global_tokens


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, *, global_seqs: Tensor, **_: object) -> Tensor:
    """Every sequence weighs the same: GRPO's 1/|o_i|, the length bias Dr. GRPO removes."""
    row_tokens = (mask != 0).sum(dim=-1).clamp(min=1)
    return (_masked(loss_mat, mask).sum(dim=-1) / row_tokens).sum() / global_seqs


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, *, global_seqs: Tensor, **_: object) -> Tensor:
    """Sequence sums averaged over sequences: scale grows with length."""
    return _masked(loss_mat, mask).sum() / global_seqs


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, *, global_seqs: Tensor, norm_constant: float, **_: object
) -> Tensor:
    """Dr. GRPO: token sum over a constant, so no sequence's length changes its tokens' weight."""
    return _masked(loss_mat, mask).sum() / (global_seqs * norm_constant)


def _denominator(value: float | Tensor | None, local: Tensor, like: Tensor) -> Tensor:
    count = local if value is None else torch.as_tensor(value)
    # At least fp32: a bf16 token count of 100k is off by ~0.4%.
    dtype = torch.promote_types(like.dtype, torch.float32)
    # At least 1, so an empty (all-masked) batch aggregates to 0 instead of 0/0.
    return count.detach().to(device=like.device, dtype=dtype).clamp(min=1)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss into a scalar by the named mode (see the module docstring).

    loss_mat: shape (B, T), per-token loss. mask: shape (B, T), 1 on tokens that count.
    mode: a name in ``LOSS_AGGREGATIONS``; an unknown one raises KeyError listing the valid ones.
    global_tokens / global_seqs: N_tok / N_seq of the whole batch across micro-batches and
    ranks; default to this call's ``num_tokens(mask)`` / ``num_seqs(mask)``. Clamped to >= 1.
    norm_constant: L of ``seq-mean-token-sum-norm``; defaults to T = mask.shape[1], which is
    only constant across micro-batches padded to the same length: pass the maximum generation
    length for Dr. GRPO proper.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must both be (B, T)")
    fn = LOSS_AGGREGATIONS.get(mode)
    return fn(
        loss_mat,
        mask,
        global_tokens=_denominator(global_tokens, num_tokens(mask), loss_mat),
        global_seqs=_denominator(global_seqs, num_seqs(mask), loss_mat),
        norm_constant=float(mask.shape[1] if norm_constant is None else norm_constant),
    )
