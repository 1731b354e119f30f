"""Cascade attention over prefix-shared packed rows: each shared prefix attended once, no dense row mask.

A prefix-shared row (:mod:`tether.data.prefix_sharing`) lays a group out as its common prefix followed by
each member's own suffix. With a dense 4-D mask every query of the row is scored against every column
of it, ``W^2`` pairs for a row of width ``W``, nearly all of them masked out. Cascade attention computes
the same softmax over the same keys in two parts, as shared-prefix inference kernels do (Juravsky et al.
2024, "Hydragen: High-Throughput LLM Inference with Shared Prefixes"; Ye et al. 2024, FlashInfer's
cascade attention):

- the prefix's own causal attention, once per segment: ``softmax(q_p K_p^T / sqrt(d)) V_p`` over its
  ``P`` tokens;
- each suffix token's attention over its segment's prefix and its own earlier suffix tokens,
  ``softmax(q_s [K_p; K_s]^T / sqrt(d)) [V_p; V_s]`` (causal within the suffix).

The keys each query sees are exactly those the dense mask allows, so outputs agree with it up to float
rounding (tested, gradients too), at ``sum P^2 + sum s (P + s)`` scored pairs instead of ``W^2`` per row.
Here the two parts are batched SDPA calls over gathered segments and suffixes (the prefix keys gathered
once per suffix), and their outputs are scattered back to the row layout; padding columns get zeros.

:func:`cascade_forward` runs a model this way: it registers ``tether_cascade`` with transformers'
``AttentionInterface`` and switches the model's attention to it for one forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tether.data.prefix_sharing import PrefixPacked
from tether.models.attention import attention_implementation, matmul_attention, matmul_attention_pays

CASCADE_ATTENTION = "tether_cascade"
UNSUPPORTED_ATTENTION_ARGUMENTS = ("softcap", "s_aux")
"""What some attention layers pass beyond plain softmax attention (Gemma 2's logit soft-capping, gpt-oss's
attention sinks): cascade attention would drop it, so those models share under the dense mask."""


@dataclass
class CascadeLayout:
    """Where the two parts of cascade attention read and write, as flat indices into ``rows * width``.

    ``prefix_tokens`` (S, P): each prefix-sharing segment's prefix (0-padded), ``prefix_mask`` (S, 1, P, P);
    ``suffix_queries`` (M, Q): each suffix's tokens, ``suffix_keys`` (M, P + Q): its segment's prefix, then
    itself, ``suffix_mask`` (M, 1, Q, P + Q); ``prefix_valid`` / ``suffix_valid``: the real query slots;
    ``order`` (rows * width,): for each row position, its output's index among the (S * P) prefix output
    slots, then the (M * Q) suffix output slots, then one zero row (padding).
    """

    prefix_tokens: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_valid: torch.Tensor
    suffix_queries: torch.Tensor
    suffix_keys: torch.Tensor
    suffix_mask: torch.Tensor
    suffix_valid: torch.Tensor
    order: torch.Tensor
    shape: tuple[int, int]

    def to(self, device: torch.device | str) -> CascadeLayout:
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(self).items()}
        return CascadeLayout(**moved)

    def scored_pairs(self) -> int:
        """Query-key pairs the two batched calls score (padding included)."""
        return int(self.prefix_mask[..., 0, :, :].numel() + self.suffix_mask[..., 0, :, :].numel())


def cascade_layout(packed: PrefixPacked) -> CascadeLayout:
    """The cascade layout of ``packed``'s segments (a segment without a shared prefix is one suffix)."""
    n_rows, width = packed.input_ids.shape
    prefixes = [(r * width + start, length) for r, start, length, _ in packed.spans if length > 0]
    suffixes = [(r * width + start, length, r * width + s_start, s_len)
                for r, start, length, members in packed.spans for s_start, s_len in members]
    p_max = max((length for _, length in prefixes), default=0)
    q_max = max(s_len for *_, s_len in suffixes)
    steps_p, steps_q = torch.arange(p_max), torch.arange(q_max)

    p_start = torch.tensor([s for s, _ in prefixes], dtype=torch.long).view(-1, 1)
    p_len = torch.tensor([n for _, n in prefixes], dtype=torch.long).view(-1, 1)
    prefix_valid = steps_p[None, :] < p_len
    prefix_tokens = torch.where(prefix_valid, p_start + steps_p[None, :], 0)
    prefix_mask = (steps_p[None, :, None] >= steps_p[None, None, :]) & prefix_valid[:, None, :]

    seg_start, seg_len, s_start, s_len = (torch.tensor(c, dtype=torch.long).view(-1, 1) for c in zip(*suffixes,
                                                                                                  strict=True))
    suffix_valid = steps_q[None, :] < s_len
    suffix_queries = torch.where(suffix_valid, s_start + steps_q[None, :], 0)
    key_in_prefix = steps_p[None, :] < seg_len
    suffix_keys = torch.cat([torch.where(key_in_prefix, seg_start + steps_p[None, :], 0), suffix_queries], dim=1)
    own = (steps_q[None, :, None] >= steps_q[None, None, :]) & suffix_valid[:, None, :]
    suffix_mask = torch.cat([key_in_prefix[:, None, :].expand(-1, q_max, -1), own], dim=2)

    n_prefix_slots = prefix_valid.numel()
    order = torch.full((n_rows * width,), n_prefix_slots + suffix_valid.numel(), dtype=torch.long)
    order[prefix_tokens[prefix_valid]] = torch.arange(n_prefix_slots).view(prefix_valid.shape)[prefix_valid]
    order[suffix_queries[suffix_valid]] = n_prefix_slots + torch.arange(suffix_valid.numel()).view(
        suffix_valid.shape)[suffix_valid]
    return CascadeLayout(prefix_tokens, prefix_mask[:, None], prefix_valid, suffix_queries, suffix_keys,
                         suffix_mask[:, None], suffix_valid, order, (n_rows, width))


def _gather(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Token states ``flat`` (tokens, H, D) at flat token ``index`` (N, K): (N, H, K, D)."""
    return flat.index_select(0, index.reshape(-1)).view(*index.shape, *flat.shape[1:]).transpose(1, 2)


def _matmul_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, attn_mask: torch.Tensor,
                 scale: float | None, dropout_p: float, enable_gqa: bool) -> torch.Tensor:
    """:func:`~tether.models.attention.matmul_attention` in ``F.scaled_dot_product_attention``'s signature."""
    return matmul_attention(query, key, value, attn_mask, scale, dropout_p)[0]


def cascade_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      cascade: CascadeLayout | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A transformers attention function: cascade attention when given a ``cascade`` layout, SDPA otherwise.
    ``query`` (B, H, L, D), ``key`` / ``value`` (B, H_kv, L, D); returns (B, L, H, D)."""
    if cascade is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    for name in UNSUPPORTED_ATTENTION_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(f"cascade attention does not apply {name} (logit soft-capping / attention sinks); "
                             "use prefix_sharing: mask for this model")
    options = {"scale": scaling, "dropout_p": dropout if module.training else 0.0,
               "enable_gqa": query.shape[1] != key.shape[1]}
    heads, dim = query.shape[1], query.shape[3]
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], dim) for t in (query, key, value))
    device = query.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else query.dtype
    attend = _matmul_sdpa if matmul_attention_pays(device, dtype) else F.scaled_dot_product_attention
    parts = []
    for queries, keys, mask in ((cascade.prefix_tokens, cascade.prefix_tokens, cascade.prefix_mask),
                                (cascade.suffix_queries, cascade.suffix_keys, cascade.suffix_mask)):
        if queries.numel():
            out = attend(_gather(q, queries), _gather(k, keys), _gather(v, keys), attn_mask=mask, **options)
            parts.append(out.transpose(1, 2).reshape(-1, heads, dim))
    parts.append(query.new_zeros((1, heads, dim)))
    rows, width = cascade.shape
    return torch.cat(parts).index_select(0, cascade.order).view(rows, width, heads, dim), None


AttentionInterface.register(CASCADE_ATTENTION, cascade_attention)


def supports_cascade(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs its attention through transformers' ``AttentionInterface`` (so the cascade
    layout reaches every layer) as plain softmax attention: a transformers model that declares it, with an
    unwrapped config, and without logit soft-capping (Gemma 2) or attention sinks (gpt-oss)."""
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", lambda: model)()
    if not (getattr(base, "_supports_attention_backend", False) and hasattr(config, "_attn_implementation")):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not getattr(text, "attn_logit_softcapping", None) and not any(
        getattr(m, "sinks", None) is not None for m in base.modules())


def cascade_pays(device: torch.device, members_per_group: float) -> bool:
    """Whether cascade attention beats the dense row mask (the default ``prefix_sharing: true`` asks): on a
    CPU for groups of more than two sequences. Measured (``benchmarks/cascade_attention.py``, docs/performance.md):
    whole GRPO runs (groups of 8) 1.2-1.3x faster than the dense mask on both built-in sizes, while DPO's
    pairs run 3-5% slower (the gathers and the many small attention calls cost more than a pair's masked
    block); on a GPU, without a fused kernel, cascade is slower than the dense mask at these sizes."""
    return torch.device(device).type == "cpu" and members_per_group > 2


def cascade_inputs(packed: PrefixPacked) -> dict[str, Any]:
    """``model(**...)`` arguments for a cascade forward of ``packed`` (no mask: the layout replaces it)."""
    return {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
            "cascade": cascade_layout(packed), "use_cache": False}


def cascade_forward(model: torch.nn.Module, packed: PrefixPacked) -> Any:
    """``model``'s output on ``packed`` with cascade attention in every layer."""
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in cascade_inputs(packed).items() if k != "use_cache"}
    with attention_implementation(model, CASCADE_ATTENTION):
        return model(**inputs, use_cache=False)
