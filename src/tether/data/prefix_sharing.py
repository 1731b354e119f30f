"""Packing with shared prefixes: sequences that start alike are laid out once as a tree.

A DPO pair's chosen and rejected share the prompt (and often the start of the answer); a GRPO
group's completions share the prompt. Computing those tokens once per group is the prefix sharing
of Wang et al. 2024 ("Accelerating Direct Preference Optimization with Prefix Sharing"): a
group's *segment* is its common prefix followed by each member's own suffix,

    [ p_1 .. p_P | a_{P+1} .. a_n | b_{P+1} .. b_m | ... ]

with position ids ``0..P-1`` on the prefix and ``P, P+1, ...`` again on each suffix, and a
4-D attention mask in which a suffix token sees the prefix and the earlier tokens of its own
suffix, nothing else. Every token's hidden state is then exactly what the separate sequence
would give it (the same keys, values and rotary positions), so log-probs agree with one forward
pass per sequence up to float rounding (tested), at ``P * (members - 1)`` fewer tokens per group.

Segments are packed several to a row (best-fit decreasing, rows capped as in
:func:`tether.data.packing.row_capacity`); pads attend only to themselves. The mask needs an
attention implementation that takes a custom 4-D mask (``sdpa``, ``eager`` or ``tether_matmul``, the
one bf16-mixed training switches to on a CPU); with another
(flash-attention's varlen kernels) :func:`supports_custom_masks` is False and callers fall back
to plain packing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tether.data.packing import pack_bins, row_capacity

MASKABLE_ATTENTION = ("sdpa", "eager", "tether_matmul")  # the last: tether.models.attention.MATMUL_ATTENTION


def supports_custom_masks(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention takes a custom 4-D mask (transformers passes one through as is)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in MASKABLE_ATTENTION


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens shared at the start of every sequence, leaving each at least one token of its own."""
    if len(sequences) < 2:
        return 0
    shared = 0
    for column in zip(*sequences, strict=False):  # stops at the shortest
        if any(t != column[0] for t in column):
            break
        shared += 1
    return max(0, min(shared, min(len(s) for s in sequences) - 1))


@dataclass
class PrefixPacked:
    """Sequences packed as prefix trees.

    ``input_ids`` / ``position_ids``: (R, L); ``rows`` (N,) and ``columns`` (N, T): token t of sequence
    i sits at ``(rows[i], columns[i, t])`` (-1 past its end); ``shared_tokens``: the tokens saved;
    ``spans``: each segment as ``(row, prefix start, prefix length, [(suffix start, suffix length), ...])``
    in columns of its row (what cascade attention, :mod:`tether.models.cascade_attention`, reads);
    ``segment`` / ``branch`` (R, L): each token's segment (a pad is a segment of its own) and member (0 on
    a prefix, ``b`` on member ``b``'s suffix). :attr:`allowed`, the dense mask, is built on first use:
    a cascade forward never needs it.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    shared_tokens: int
    spans: list[tuple[int, int, int, list[tuple[int, int]]]]
    segment: torch.Tensor
    branch: torch.Tensor

    @cached_property
    def allowed(self) -> torch.Tensor:
        """(R, L, L) bool, ``allowed[r, q, k]`` when token q may attend to token k: same segment, causal,
        and k on the prefix or on q's own suffix."""
        width = self.input_ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.segment.device).tril()
        same_segment = self.segment[:, :, None] == self.segment[:, None, :]
        same_branch = (self.branch[:, None, :] == 0) | (self.branch[:, :, None] == self.branch[:, None, :])
        return same_segment & causal & same_branch

    def model_inputs(self, model: torch.nn.Module) -> dict[str, Any]:
        """``model(**...)`` arguments: the 4-D mask in the form ``model``'s attention expects."""
        mask = self.allowed[:, None].to(self.input_ids.device)
        if getattr(model.config, "_attn_implementation", None) == "eager":
            dtype = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": mask,
                "use_cache": False}


def _segments(sequences: Sequence[Sequence[int]], groups: Sequence[Any]
              ) -> tuple[list[list[int]], list[int], list[int]]:
    """The groups' members (in first-seen order), their common prefix lengths and segment sizes."""
    members: dict[Any, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    segments = list(members.values())
    prefixes = [common_prefix_length([sequences[i] for i in seg]) for seg in segments]
    sizes = [p + sum(len(sequences[i]) - p for i in seg) for seg, p in zip(segments, prefixes, strict=True)]
    return segments, prefixes, sizes


def attention_pair_cost(model: torch.nn.Module) -> float:
    """FLOPs of one query-key pair of attention per FLOP of one token through a layer's weights:
    ``4 * heads * head_dim / (2 * weights per layer)`` (scores and weighted values against the
    matrix products). Small on wide models, large on narrow ones."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", 1) or 1
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embeddings = model.get_input_embeddings().weight.numel() if hasattr(model, "get_input_embeddings") else 0
    per_layer = max(sum(p.numel() for p in model.parameters()) - 2 * embeddings, 1) / layers
    return 2 * heads * head_dim / per_layer


def layout_cost(sizes: Sequence[int], row_tokens: int, pair_cost: float) -> float:
    """The relative cost of a forward over items of ``sizes`` packed into rows: every row position
    through the weights (padding included) plus ``pair_cost`` per query-key pair of its dense mask."""
    bins = pack_bins(sizes, row_capacity(sizes, row_tokens))
    width = max(sum(sizes[i] for i in b) for b in bins)
    return len(bins) * (width + pair_cost * width**2)


def sharing_pays(sequences: Sequence[Sequence[int]], groups: Sequence[Any], *, row_tokens: int,
                 pair_cost: float) -> bool:
    """Whether the prefix-shared layout is cheaper than plain packing. Sharing saves ``P * (members -
    1)`` tokens per group but makes one dense attention block of the whole tree: with short prefixes
    on a narrow model (a GRPO group on the tiny model) the larger attention costs more than it saves."""
    _, _, shared_sizes = _segments(sequences, groups)
    plain_sizes = [len(s) for s in sequences]
    return layout_cost(shared_sizes, row_tokens, pair_cost) < layout_cost(plain_sizes, row_tokens, pair_cost)


def pack_prefix_groups(sequences: Sequence[Sequence[int]], groups: Sequence[int] | None, *, row_tokens: int,
                       pad_token_id: int) -> PrefixPacked:
    """Pack ``sequences``; those with the same ``groups`` id share their common prefix (None: no sharing)."""
    if not sequences:
        raise ValueError("no sequences to pack")
    if groups is None:
        groups = range(len(sequences))
    if len(groups) != len(sequences):
        raise ValueError(f"{len(groups)} group ids for {len(sequences)} sequences")
    segments, prefixes, sizes = _segments(sequences, groups)
    bins = pack_bins(sizes, row_capacity(sizes, row_tokens))
    width = max(sum(sizes[s] for s in b) for b in bins)
    n_rows = len(bins)
    input_ids = torch.full((n_rows, width), pad_token_id, dtype=torch.long)
    positions = torch.zeros((n_rows, width), dtype=torch.long)
    segment = torch.arange(n_rows * width).view(n_rows, width) + len(segments)  # pads: a segment each
    branch = torch.zeros((n_rows, width), dtype=torch.long)
    rows = torch.zeros(len(sequences), dtype=torch.long)
    columns = torch.full((len(sequences), max(len(s) for s in sequences)), -1, dtype=torch.long)
    spans = []
    for r, segs in enumerate(bins):
        offset = 0
        for s in sorted(segs):
            p = prefixes[s]
            first = sequences[segments[s][0]]
            input_ids[r, offset:offset + p] = torch.as_tensor(first[:p], dtype=torch.long)
            positions[r, offset:offset + p] = torch.arange(p)
            prefix_cols = torch.arange(offset, offset + p)
            cursor = offset + p
            suffixes = []
            for b, i in enumerate(segments[s], start=1):
                own = len(sequences[i]) - p
                input_ids[r, cursor:cursor + own] = torch.as_tensor(sequences[i][p:], dtype=torch.long)
                positions[r, cursor:cursor + own] = torch.arange(p, p + own)
                branch[r, cursor:cursor + own] = b
                rows[i] = r
                columns[i, :p + own] = torch.cat([prefix_cols, torch.arange(cursor, cursor + own)])
                suffixes.append((cursor, own))
                cursor += own
            spans.append((r, offset, p, suffixes))
            segment[r, offset:cursor] = s
            offset = cursor
    shared = sum(p * (len(seg) - 1) for seg, p in zip(segments, prefixes, strict=True))
    return PrefixPacked(input_ids, positions, rows, columns, shared, spans, segment, branch)
