"""Next-token prediction loss for pretraining and SFT."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def predicted_labels(labels: Tensor) -> Tensor:
    """The label each position predicts, (B, T): ``labels`` shifted left by one, -100 at each row's last position."""
    following = labels.new_full(labels.shape, -100)
    following[:, :-1] = labels[:, 1:]
    return following


def next_token_loss(logits: Tensor, labels: Tensor, *, denominator: float | Tensor | None = None,
                    aligned: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """Summed next-token negative log-likelihood divided by a (global) token count.

    ``loss = sum_t -log p(labels[t+1] | x_<=t) / denominator`` over positions whose label is
    not -100 (Radford et al. 2018, the language-modelling objective). Labels are aligned with
    the inputs (Hugging Face convention) and shifted here; with ``aligned`` they are already the
    tokens the logits predict (:func:`predicted_labels`, or the logits of the loss positions only).

    Args:
        logits: shape (B, T, V).
        labels: shape (B, T), -100 where no loss is taken.
        denominator: the number of loss tokens in the whole accumulated / distributed batch, so
            micro-batch losses sum to the global token mean. Defaults to this batch's count.
        aligned: ``labels[t]`` is the token ``logits[t]`` predicts (no shift).
    """
    shift_logits = (logits if aligned else logits[:, :-1, :]).reshape(-1, logits.size(-1))
    shift_labels = (labels if aligned else labels[:, 1:]).reshape(-1)
    nll_sum = F.cross_entropy(shift_logits.float(), shift_labels, ignore_index=-100, reduction="sum")
    count = (shift_labels != -100).sum()
    denom = count.clamp(min=1) if denominator is None else denominator
    loss = nll_sum / denom
    return loss, {"nll_sum": nll_sum.detach(), "loss_tokens": count.detach()}
