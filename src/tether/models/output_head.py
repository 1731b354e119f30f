"""The language-model head applied only at the positions that are scored.

A forward of packed sequences returns logits at every position, (rows, width, V), but a loss or a
log-prob reads only the positions that predict a scored token: completions, never their prompts (a DPO
pair's shared prompt, a group's shared prefix, the padding of a packed row). With a real vocabulary
(32k-256k tokens against a hidden size of 0.5k-8k) the head's product and its logits tensor are the
largest of the step, and every unscored position's share of them is computed and dropped.
:func:`head_at` hooks the model's output embedding (``get_output_embeddings()``, the module a Hugging
Face causal LM calls on its last hidden states) so that, for one forward, it multiplies only the chosen
rows of the flattened hidden states: the model returns logits of shape (1, K, V), in the order of
``positions``. Whatever the model does after its head (soft-capping, scaling) still applies, and wrappers
(DDP, FSDP2, PEFT) are called as usual.

The logits are the same to float rounding (bitwise on the Zen 4 CPU the tests were measured on, where a
matrix product's row does not depend on the other rows), but the head's weight gradient sums over fewer
rows, in another order. :data:`HEAD_GATHER_MIN_VOCAB` keeps the plain head for small vocabularies,
where the saving is nothing (the built-in tiny models have 109 tokens and a head of 14k-56k weights), so
their runs are unchanged to the last bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

HEAD_GATHER_MIN_VOCAB = 1024


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """``model``'s output embedding (its LM head) when the scored-rows head pays: a vocabulary of at least
    :data:`HEAD_GATHER_MIN_VOCAB` tokens; None otherwise or when the model has none (DDP's ``module`` looked through)."""
    inner = getattr(model, "module", model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    return head if weight.shape[0] >= HEAD_GATHER_MIN_VOCAB else None


@contextmanager
def head_at(head: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """While open, ``head`` multiplies only the rows ``positions`` (indices into its input flattened to
    (rows * width, H)) and so returns (1, len(positions), V)."""

    def gather(_module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions.to(hidden.device))
        return (rows[None], *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()
