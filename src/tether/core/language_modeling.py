"""Next-token prediction loss for pretraining and SFT."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def next_token_loss(logits: Tensor, labels: Tensor, *, denominator: float | Tensor | None = None
                    ) -> tuple[Tensor, dict[str, Tensor]]:
    """Summed next-token negative log-likelihood divided by a (global) token count.

    ``loss = sum_t -log p(labels[t+1] | x_<=t) / denominator`` over positions whose label is
    not -100 (Radford et al. 2018, the language-modelling objective). Labels are aligned with
    the inputs (Hugging Face convention) and shifted here.

    Args:
        logits: shape (B, T, V).
        labels: shape (B, T), -100 where no loss is taken.
        denominator: the number of loss tokens in the whole accumulated / distributed batch, so
            micro-batch losses sum to the global token mean. Defaults to this batch's count.
    """
    shift_logits = logits[:, :-1, :].reshape(-1, logits.size(-1))
    shift_labels = labels[:, 1:].reshape(-1)
    nll_sum = F.cross_entropy(shift_logits.float(), shift_labels, ignore_index=-100, reduction="sum")
    count = (shift_labels != -100).sum()
    denom = count.clamp(min=1) if denominator is None else denominator
    loss = nll_sum / denom
    return loss, {"nll_sum": nll_sum.detach(), "loss_tokens": count.detach()}
