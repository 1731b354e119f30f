"""Micro-batches for the shared training loop: padding-free packing or plain padding.

A batch is a dict:

- ``input_ids``, ``labels``, ``position_ids``: long tensors of shape (R, L). Labels follow the
  Hugging Face convention (aligned with ``input_ids``, -100 = no loss); the trainer shifts,
  so logits at t are scored against ``labels[t + 1]``.
- ``attention_mask`` (R, L): padded batches only.
- ``num_loss_tokens`` (int): targets after the shift, ``(labels[:, 1:] != -100).sum()``, for
  normalising a token-mean loss over the global batch; ``num_tokens`` (int): real, non-pad
  tokens; ``num_sequences`` (int): examples in the batch.

Packed batches are one row (R = 1) of several sequences laid end to end; position ids restart
at 0 at each sequence start and the first label of each sequence is -100, so no loss crosses a
boundary. There is no attention mask: with ``attention_mask=None``, ``use_cache=False`` and
no cache, transformers (>= 4.56; checked on 5.x for Llama with sdpa and eager) finds the
sequence starts in ``position_ids`` and builds a block-diagonal causal mask. With the model's
default ``use_cache=True`` a cache object exists and that detection is skipped, and every
token silently attends across boundaries; so call the model as ``model(**model_inputs(batch))``.
flash-attention-2 uses the same position ids for its varlen kernels.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tether.data.tokenize import IGNORE_INDEX, TokenizedExample


def model_inputs(batch: dict) -> dict[str, Any]:
    """The keyword arguments for ``model(...)``: ids, positions, mask if padded, ``use_cache=False``."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if "attention_mask" in batch:
        inputs["attention_mask"] = batch["attention_mask"]
    return inputs


def _count_loss_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


# ---------------------------------------------------------------- packing


def pack_bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= ``capacity``, best-fit decreasing.

    Items are placed longest first (ties in input order), each into the fullest bin it still
    fits. Best-fit decreasing shares first-fit decreasing's worst case (11/9 OPT + 6/9 bins)
    and runs in O(n log n) plus list inserts.
    """
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"example {i} has {n} tokens, more than the packing budget of {capacity}; "
                             "tokenise with max_length <= the token budget")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            bins.append([i])
            b, left = len(bins) - 1, capacity - lengths[i]
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            left -= lengths[i]
        bisect.insort(room, (left, b))
    return bins


# Packed rows are at most the configured length, and shorter when the sequences are short: attention costs
# the square of the row length, so a row is capped at ROW_FACTOR x the longest sequence (at least ROW_FLOOR).
# Measured on the tiny and small models, forward + backward of 128 / 32 sequences of 25-57 tokens (1 thread):
# rows of 1024 tokens took 2.3x as long as rows of 128, rows of 256 1.1-1.2x, rows of 64 1.2-1.3x.
ROW_FLOOR = 128
ROW_FACTOR = 2


def row_capacity(lengths: Sequence[int], row_tokens: int) -> int:
    """The packed row length used for sequences of ``lengths`` under a budget of ``row_tokens``."""
    longest = max(lengths, default=0)
    return max(longest, min(row_tokens, max(ROW_FLOOR, ROW_FACTOR * longest)))


def _packed_batch(examples: Sequence[TokenizedExample]) -> dict:
    ids, labels, positions = [], [], []
    for example in examples:
        ids.extend(example.input_ids)
        labels.extend([IGNORE_INDEX, *example.labels[1:]])
        positions.extend(range(len(example)))
    label_tensor = torch.tensor([labels], dtype=torch.long)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": label_tensor,
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "num_loss_tokens": _count_loss_tokens(label_tensor),
        "num_tokens": len(ids),
        "num_sequences": len(examples),
    }


def _packed_rows_batch(examples: Sequence[TokenizedExample], *, row_tokens: int, pad_token_id: int) -> dict:
    """Several packed rows of <= ``row_tokens`` tokens, right-padded to one length.

    Keeping rows short bounds attention cost (quadratic in the row length) while staying
    nearly padding-free. Trailing pads form their own block (positions restart at 0, no loss),
    so they never affect a real token.
    """
    lengths = [len(e) for e in examples]
    rows = [_packed_batch([examples[i] for i in b]) for b in pack_bins(lengths, row_capacity(lengths, row_tokens))]
    length = max(r["input_ids"].shape[1] for r in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), length), dtype=torch.long)
    for r, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        input_ids[r, :n], labels[r, :n], positions[r, :n] = row["input_ids"][0], row["labels"][0], row["position_ids"][0]
        positions[r, n:] = torch.arange(length - n)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": positions,
        "num_loss_tokens": sum(r["num_loss_tokens"] for r in rows),
        "num_tokens": sum(r["num_tokens"] for r in rows),
        "num_sequences": len(examples),
    }


def pack_examples(examples: Sequence[TokenizedExample], *, max_tokens: int) -> list[dict]:
    """Padding-free packing: each batch is one row of at most ``max_tokens`` tokens."""
    bins = pack_bins([len(e) for e in examples], max_tokens)
    return [_packed_batch([examples[i] for i in b]) for b in bins]


# ---------------------------------------------------------------- padding


def pad_examples(examples: Sequence[TokenizedExample], *, pad_token_id: int,
                 pad_to_multiple_of: int | None = None) -> dict:
    """Right-padded batch (R = len(examples)) with ``attention_mask``; labels -100 on pads."""
    if not examples:
        raise ValueError("cannot pad an empty list of examples")
    length = max(len(e) for e in examples)
    if pad_to_multiple_of:
        length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
    rows = len(examples)
    input_ids = torch.full((rows, length), pad_token_id, dtype=torch.long)
    labels = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    for r, example in enumerate(examples):
        n = len(example)
        input_ids[r, :n] = torch.tensor(example.input_ids)
        labels[r, :n] = torch.tensor(example.labels)
        attention_mask[r, :n] = 1
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": torch.arange(length).expand(rows, length).clone(),
        "attention_mask": attention_mask,
        "num_loss_tokens": _count_loss_tokens(labels),
        "num_tokens": int(attention_mask.sum()),
        "num_sequences": rows,
    }


def _empty_batch(packing: bool, pad_token_id: int) -> dict:
    """A one-token batch with no loss: keeps every rank stepping the same number of times."""
    batch = {
        "input_ids": torch.full((1, 1), pad_token_id, dtype=torch.long),
        "labels": torch.full((1, 1), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((1, 1), dtype=torch.long),
        "num_loss_tokens": 0,
        "num_tokens": 0,
        "num_sequences": 0,
    }
    if not packing:
        batch["attention_mask"] = torch.ones((1, 1), dtype=torch.long)
    return batch


# ---------------------------------------------------------------- epochs


def _group(lengths: list[int], order: list[int], *, batch_tokens: int | None, batch_size: int | None,
           packing: bool, rng: random.Random) -> list[list[int]]:
    if packing:
        bins = [[order[j] for j in b] for b in pack_bins([lengths[i] for i in order], batch_tokens)]
        rng.shuffle(bins)  # packing sorts by length; this undoes the long-first order
        return bins
    if batch_size is not None:
        return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    groups: list[list[int]] = []
    longest = 0
    for i in order:  # padded token budget: rows * longest row <= batch_tokens
        if lengths[i] > batch_tokens:
            raise ValueError(f"example {i} has {lengths[i]} tokens, more than batch_tokens={batch_tokens}")
        if groups and max(longest, lengths[i]) * (len(groups[-1]) + 1) <= batch_tokens:
            groups[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            groups.append([i])
            longest = lengths[i]
    return groups


def make_batches(examples: Sequence[TokenizedExample], *, batch_tokens: int | None = None,
                 batch_size: int | None = None, packing: bool = False, seed: int = 0, epoch: int = 0,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False, pad_token_id: int = 0,
                 pad_to_multiple_of: int | None = None, indices: bool = False) -> list[dict]:
    """This rank's micro-batches for one epoch (with ``indices``, each also holds ``indices``: the positions in
    ``examples`` of its sequences).

    With ``packing`` and ``batch_size`` both given, each micro-batch is ``batch_size`` examples
    packed into several rows of <= ``batch_tokens`` tokens (a fixed number of examples per step,
    short rows for cheap attention); with ``packing`` alone, one row of <= ``batch_tokens``.

    All ranks shuffle identically by ``(seed, epoch)``, group the whole epoch into
    micro-batches (packed rows of <= ``batch_tokens`` tokens when ``packing``; otherwise
    ``batch_size`` examples, or as many as fit ``batch_tokens`` once padded), then deal the
    micro-batches round-robin: rank r takes numbers r, r + W, ... So no example is seen twice
    in an epoch, and every rank gets the same number of micro-batches, which collective ops
    need. The ranks that come up one short get an empty batch (``num_loss_tokens == 0``)
    unless ``drop_last``, which instead drops the last micro-batches (and a final
    partial ``batch_size`` group), so a few examples miss this epoch.
    """
    if packing and batch_tokens is None:
        raise ValueError("packing needs batch_tokens (the packed row length)")
    if not packing and (batch_tokens is None) == (batch_size is None):
        raise ValueError("give exactly one of batch_size and batch_tokens")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    rng = random.Random(f"tether-batches:{seed}:{epoch}")
    order = list(range(len(examples)))
    rng.shuffle(order)
    lengths = [len(e) for e in examples]
    rows_mode = packing and batch_size is not None
    groups = _group(lengths, order, batch_tokens=batch_tokens, batch_size=batch_size,
                    packing=packing and not rows_mode, rng=rng)
    if drop_last and batch_size is not None and groups and len(groups[-1]) < batch_size:
        groups.pop()
    per_rank = len(groups) // world_size if drop_last else math.ceil(len(groups) / world_size)
    mine = groups[rank::world_size][:per_rank]
    batches = []
    for group in mine:
        chosen = [examples[i] for i in group]
        if rows_mode:
            batches.append(_packed_rows_batch(chosen, row_tokens=batch_tokens, pad_token_id=pad_token_id))
        elif packing:
            batches.append(_packed_batch(chosen))
        else:
            batches.append(pad_examples(chosen, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of))
        if indices:
            batches[-1]["indices"] = list(group)
    batches.extend({**_empty_batch(packing, pad_token_id), **({"indices": []} if indices else {})}
                   for _ in range(per_rank - len(mine)))
    return batches


# ---------------------------------------------------------------- token sequences (RL)


@dataclass
class PackedSequences:
    """Whole token sequences packed padding-free into rows, with where each one landed.

    ``input_ids`` / ``position_ids``: shape (R, L); ``rows`` / ``starts``: shape (N,), the row
    and offset of sequence i. Call the model with ``use_cache=False`` (see the module docstring).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    starts: torch.Tensor

    def model_inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}


def pack_sequences(sequences: Sequence[Sequence[int]], *, row_tokens: int, pad_token_id: int) -> PackedSequences:
    """Pack token sequences into rows of <= ``row_tokens`` (or the longest sequence, if longer; see
    :func:`row_capacity` for why rows of short sequences are kept shorter)."""
    lengths = [len(s) for s in sequences]
    capacity = row_capacity(lengths, row_tokens)
    bins = pack_bins(lengths, capacity)
    width = max(sum(lengths[i] for i in b) for b in bins)
    input_ids = torch.full((len(bins), width), pad_token_id, dtype=torch.long)
    positions = torch.zeros((len(bins), width), dtype=torch.long)
    rows = torch.zeros(len(sequences), dtype=torch.long)
    starts = torch.zeros(len(sequences), dtype=torch.long)
    for r, members in enumerate(bins):
        offset = 0
        for i in sorted(members):
            n = lengths[i]
            input_ids[r, offset:offset + n] = torch.as_tensor(sequences[i], dtype=torch.long)
            positions[r, offset:offset + n] = torch.arange(n)
            rows[i], starts[i] = r, offset
            offset += n
        positions[r, offset:] = torch.arange(width - offset)
    return PackedSequences(input_ids, positions, rows, starts)
