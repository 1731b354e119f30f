"""Per-token log-probabilities and entropies from LM logits, without a full-vocabulary float32 copy.

A naive ``torch.log_softmax(logits.float() / t, -1).gather(-1, labels)`` materialises a float32
(B, T, V) tensor, and autograd keeps it alive until backward: at V = 150k, B*T = 16k that is about
10 GB for one log-prob call. The functions here walk the flattened B*T rows in chunks, upcast one
chunk at a time, keep only per-row statistics (a few floats per row) for backward, and recompute
the chunk's softmax there. Peak extra memory is O(chunk_size * V), not O(B * T * V); the gradient
with respect to ``logits`` is still a full tensor in the logits' dtype, as it must be.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 512  # rows: 512 * 152k vocab * 4 bytes is ~300 MB per temporary


def _check(temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _chunks(n: int, chunk_size: int):
    for start in range(0, n, chunk_size):
        yield slice(start, min(start + chunk_size, n))


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Rows (N, V) and labels (N,) -> log-prob of each label (N,) in float32."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk_size: int) -> Tensor:
        ignore = labels == IGNORE_INDEX
        index = labels.masked_fill(ignore, 0).unsqueeze(-1)
        n = logits.shape[0]
        out = logits.new_empty(n, dtype=torch.float32)
        lse = logits.new_empty(n, dtype=torch.float32)
        for rows in _chunks(n, chunk_size):
            x = logits[rows].float() / temperature
            lse[rows] = torch.logsumexp(x, dim=-1)
            out[rows] = x.gather(-1, index[rows]).squeeze(-1) - lse[rows]
        out.masked_fill_(ignore, 0.0)
        ctx.save_for_backward(logits, index, ignore, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, index, ignore, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        t = ctx.temperature
        g = grad_out.float().masked_fill(ignore, 0.0).unsqueeze(-1)
        grad = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], ctx.chunk_size):
            # d/dx [x_y - logsumexp(x)] = onehot(y) - softmax(x); x = logits / t adds the 1/t.
            probs = torch.exp(logits[rows].float() / t - lse[rows].unsqueeze(-1))
            chunk = (-probs * g[rows]).scatter_add_(-1, index[rows], g[rows])
            grad[rows] = chunk / t
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """Rows (N, V) -> entropy of softmax(row / t) (N,) in float32."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        n = logits.shape[0]
        lse = logits.new_empty(n, dtype=torch.float32)
        entropy = logits.new_empty(n, dtype=torch.float32)
        for rows in _chunks(n, chunk_size):
            x = logits[rows].float() / temperature
            lse[rows] = torch.logsumexp(x, dim=-1)
            # In log-prob space, not as logsumexp(x) - E_p[x]: x can be large, log p of likely
            # tokens is small, so float32 rounding error is over 10x smaller.
            logp = x - lse[rows].unsqueeze(-1)
            entropy[rows] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        t = ctx.temperature
        g = grad_out.float().unsqueeze(-1)
        grad = torch.empty_like(logits)
        for rows in _chunks(logits.shape[0], ctx.chunk_size):
            logp = logits[rows].float() / t - lse[rows].unsqueeze(-1)
            # dH/dx_j = -p_j (log p_j + H)
            grad[rows] = -logp.exp() * (logp + entropy[rows].unsqueeze(-1)) * g[rows] / t
        return grad, None, None


def selective_log_softmax(
    logits: Tensor, labels: Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """Log-probability of each label under softmax(logits / temperature), chunked over rows.

    ``log p(y_t) = z_{t, y_t} / τ - logsumexp_v(z_{t, v} / τ)``, the per-token term of the LM
    likelihood used by every loss in tether (SFT, DPO family, PPO / GRPO ratios).

    Differs from ``log_softmax(...).gather(...)`` only in memory: rows are processed ``chunk_size``
    at a time and upcast to float32 per chunk (so bf16 logits are fine), and backward recomputes the
    chunk's softmax from the saved logits instead of keeping a float32 (B, T, V) tensor. Not twice
    differentiable. Positions whose label is ``IGNORE_INDEX`` (-100) return 0 and get no gradient.

    Args:
        logits: shape (B, T, V), any float dtype (any leading shape works).
        labels: shape (B, T), long; -100 marks positions to ignore.
        temperature: sampling temperature τ > 0 the log-probs are taken under.
        chunk_size: rows of the flattened (B*T, V) logits processed at once.

    Returns:
        shape (B, T), float32.
    """
    _check(temperature, chunk_size)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    flat = logits.reshape(-1, logits.shape[-1])
    out = _SelectiveLogSoftmax.apply(flat, labels.reshape(-1), float(temperature), int(chunk_size))
    return out.view(labels.shape)


def entropy_from_logits(
    logits: Tensor, *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """Entropy of softmax(logits / temperature) at every position, chunked over rows.

    ``H_t = -sum_v p_{t,v} log p_{t,v} = logsumexp_v(x_t) - sum_v p_{t,v} x_{t,v}`` with
    ``x = logits / τ`` (the entropy bonus / diagnostic of PPO, Schulman et al. 2017).

    Memory behaviour as in :func:`selective_log_softmax`: float32 per chunk, softmax recomputed in
    backward, not twice differentiable. Masking is the caller's business (every position is scored).

    Args:
        logits: shape (B, T, V), any float dtype (any leading shape works).
        temperature: τ > 0.
        chunk_size: rows of the flattened (B*T, V) logits processed at once.

    Returns:
        shape (B, T), float32.
    """
    _check(temperature, chunk_size)
    flat = logits.reshape(-1, logits.shape[-1])
    return _Entropy.apply(flat, float(temperature), int(chunk_size)).view(logits.shape[:-1])


def shift_labels(input_ids: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Next-token labels aligned with the logits: ``labels[:, t] = input_ids[:, t + 1]``.

    The last position, and every position whose *target* token is outside ``loss_mask``, gets
    ``IGNORE_INDEX``. Shifting the labels (not slicing ``logits[:, :-1]``) keeps the logits
    contiguous, so :func:`selective_log_softmax` never copies the (B, T, V) tensor.

    Args:
        input_ids: shape (B, T), long.
        loss_mask: shape (B, T), bool or 0/1; True where a token should be scored (e.g. completion
            tokens). None scores every token but the first.

    Returns:
        shape (B, T), long; ``selective_log_softmax(logits, shift_labels(ids, m))[:, t]`` is
        ``log p(ids[:, t + 1] | ids[:, :t + 1])``.
    """
    labels = input_ids.roll(-1, dims=-1)
    keep = torch.ones_like(input_ids, dtype=torch.bool)
    if loss_mask is not None:
        keep = loss_mask.bool().roll(-1, dims=-1)
    keep[..., -1] = False
    return labels.masked_fill(~keep, IGNORE_INDEX)


def sequence_logprobs(token_logps: Tensor, mask: Tensor, *, average: bool) -> Tensor:
    """Sum (or length-average) of per-token log-probs over the masked tokens of each sequence.

    ``log π(y|x) = sum_t m_t log π(y_t | x, y_<t)``; with ``average`` divided by ``sum_t m_t``
    (the length-normalised likelihood of SimPO / ORPO / IPO-as-in-TRL). A row with no masked-in
    token returns 0 (its length is clamped to 1 so the average is defined).

    Args:
        token_logps: shape (B, T).
        mask: shape (B, T), bool or 0/1.

    Returns:
        shape (B,).
    """
    mask = mask.bool()
    # where, not multiply: ignored positions may hold -inf, and -inf * 0 is nan.
    total = torch.where(mask, token_logps, torch.zeros_like(token_logps)).sum(-1)
    if not average:
        return total
    return total / mask.sum(-1).clamp(min=1).to(total.dtype)
