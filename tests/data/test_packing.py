"""Packing and padding: packed rows compute exactly what separate sequences compute."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tether.data import (
    IGNORE_INDEX,
    TokenizedExample,
    make_batches,
    model_inputs,
    pack_bins,
    pack_examples,
    pad_examples,
    tokenize_dataset,
)
from tether.models.tiny import build_tiny
from tether.tasks import get_task, sft_records


@pytest.fixture(scope="module")
def tiny():
    model, tok = build_tiny("tiny", seed=0)
    return model.eval(), tok


@pytest.fixture(scope="module")
def examples(tiny):
    _, tok = tiny
    task = get_task("arithmetic")
    records = sft_records(task, 12, seed=1) + sft_records(task, 12, seed=2, chat=True, think=False)
    out, _ = tokenize_dataset(records, tok, kind="sft", max_length=64)
    assert len({len(e) for e in out}) > 3  # mixed lengths, so padding and packing differ
    return out


def fake_examples(lengths):
    """Example i is the token i repeated, so any batch tells which examples it holds."""
    return [TokenizedExample([i] * n, [IGNORE_INDEX] + [i] * (n - 1)) for i, n in enumerate(lengths)]


def ids_in(batch):
    if batch["num_sequences"] == 0:
        return []
    if "attention_mask" in batch:
        return batch["input_ids"][:, 0].tolist()
    starts = (batch["position_ids"][0] == 0).nonzero().flatten()
    return batch["input_ids"][0, starts].tolist()


def summed_loss(model, batches):
    total = torch.zeros(())
    for batch in batches:
        logits = model(**model_inputs(batch)).logits
        total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total


# ---------------------------------------------------------------- packed attention


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_logits_equal_separate_forwards(tiny, examples, attn):
    model, _ = tiny
    model.set_attn_implementation(attn)
    try:
        batch = pack_examples(examples[:5], max_tokens=512)[0]
        assert batch["input_ids"].shape[0] == 1 and batch["num_sequences"] == 5
        assert "attention_mask" not in batch
        with torch.no_grad():
            packed = model(**model_inputs(batch)).logits[0]
            starts = [*(batch["position_ids"][0] == 0).nonzero().flatten().tolist(), batch["num_tokens"]]
            for a, b in itertools.pairwise(starts):
                alone = model(input_ids=batch["input_ids"][:, a:b]).logits[0]
                torch.testing.assert_close(packed[a:b], alone, atol=1e-5, rtol=1e-5)
    finally:
        model.set_attn_implementation("sdpa")


def test_packing_needs_use_cache_false(tiny, examples):
    """Documents the trap model_inputs avoids: with the default cache, the block-diagonal
    mask is not built. If this starts failing, transformers changed; update packing.py's docstring."""
    model, _ = tiny
    batch = pack_examples(examples[:3], max_tokens=512)[0]
    with torch.no_grad():
        right = model(**model_inputs(batch)).logits
        wrong = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert not torch.allclose(right, wrong, atol=1e-3)


def test_packed_and_padded_losses_and_gradients_agree(tiny, examples):
    model, _ = tiny
    packed = make_batches(examples, batch_tokens=160, packing=True, seed=0, epoch=0)
    padded = make_batches(examples, batch_size=5, packing=False, seed=0, epoch=0, pad_to_multiple_of=8)
    assert len(packed) < len(examples) and all(b["input_ids"].shape[1] <= 160 for b in packed)
    n_loss = sum(e.num_loss_tokens for e in examples)
    assert sum(b["num_loss_tokens"] for b in packed) == sum(b["num_loss_tokens"] for b in padded) == n_loss
    assert sum(b["num_tokens"] for b in packed) == sum(b["num_tokens"] for b in padded) == sum(map(len, examples))

    grads = []
    for batches in (packed, padded):
        model.zero_grad()
        loss = summed_loss(model, batches)
        (loss / n_loss).backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-6)
    for g_packed, g_padded in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(g_packed, g_padded, atol=1e-6, rtol=1e-4)
    model.zero_grad()


# ---------------------------------------------------------------- collation


def test_packed_batch_layout():
    batch = pack_examples(fake_examples([3, 2, 4]), max_tokens=9)[0]
    assert batch["input_ids"].tolist() == [[2, 2, 2, 2, 0, 0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 2, 2, 2, -100, 0, 0, -100, 1]]
    assert (batch["num_loss_tokens"], batch["num_tokens"], batch["num_sequences"]) == (6, 9, 3)


def test_pad_examples():
    batch = pad_examples(fake_examples([3, 1, 5]), pad_token_id=9, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[0, 0, 0, 9, 9, 9, 9, 9], [1, 9, 9, 9, 9, 9, 9, 9],
                                           [2, 2, 2, 2, 2, 9, 9, 9]]
    assert batch["labels"][0].tolist() == [-100, 0, 0, -100, -100, -100, -100, -100]
    assert batch["attention_mask"].sum(1).tolist() == [3, 1, 5]
    assert batch["position_ids"][2].tolist() == list(range(8))
    assert (batch["num_loss_tokens"], batch["num_tokens"]) == (2 + 0 + 4, 9)


def test_pack_bins_fills_bins_and_keeps_every_item():
    lengths = [7, 5, 5, 4, 3, 3, 2, 2, 1]  # 32 tokens: fits exactly in 4 bins of 8
    bins = pack_bins(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins)
    assert len(bins) == 4
    with pytest.raises(ValueError, match="example 0 has 7 tokens, more than the packing budget of 6"):
        pack_bins(lengths, 6)


# ---------------------------------------------------------------- epochs and ranks


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_cover_every_example_once(packing, world_size):
    examples = fake_examples([(7 * i) % 13 + 2 for i in range(37)])
    kwargs = dict(batch_tokens=20, packing=True) if packing else dict(batch_size=4)
    per_rank = [make_batches(examples, seed=3, epoch=1, rank=r, world_size=world_size, **kwargs)
                for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1  # every rank steps the same number of times
    seen = [i for batches in per_rank for batch in batches for i in ids_in(batch)]
    assert sorted(seen) == list(range(37))

    dropped = [make_batches(examples, seed=3, epoch=1, rank=r, world_size=world_size, drop_last=True, **kwargs)
               for r in range(world_size)]
    assert len({len(b) for b in dropped}) == 1
    seen = [i for batches in dropped for batch in batches for i in ids_in(batch)]
    assert len(seen) == len(set(seen)) and all(b["num_sequences"] > 0 for bs in dropped for b in bs)
    if not packing:
        assert all(b["num_sequences"] == 4 for bs in dropped for b in bs)


def test_padding_batches_carry_no_loss():
    examples = fake_examples([3] * 5)
    last = make_batches(examples, batch_size=1, rank=2, world_size=3)  # 5 batches over 3 ranks: 2, 2, 1
    assert len(last) == 2 and last[1]["num_loss_tokens"] == 0 and last[1]["num_sequences"] == 0
    assert (last[1]["labels"] == IGNORE_INDEX).all() and last[1]["num_tokens"] == 0


def test_shuffling_is_deterministic_by_seed_and_epoch():
    examples = fake_examples([(5 * i) % 11 + 2 for i in range(30)])

    def order(**kw):
        return [i for b in make_batches(examples, batch_size=3, **kw) for i in ids_in(b)]

    assert order(seed=0, epoch=0) == order(seed=0, epoch=0)
    assert order(seed=0, epoch=0) != order(seed=0, epoch=1)
    assert order(seed=0, epoch=0) != order(seed=1, epoch=0)
    assert sorted(order(seed=0, epoch=2)) == list(range(30))
    packed = [[i for b in make_batches(examples, batch_tokens=24, packing=True, seed=0, epoch=e) for i in ids_in(b)]
              for e in (0, 0, 1)]
    assert packed[0] == packed[1] != packed[2]


def test_make_batches_argument_errors():
    examples = fake_examples([3, 3])
    with pytest.raises(ValueError, match="packing needs batch_tokens"):
        make_batches(examples, batch_size=2, packing=True)
    with pytest.raises(ValueError, match="exactly one of batch_size and batch_tokens"):
        make_batches(examples)
    with pytest.raises(ValueError, match="rank must be in"):
        make_batches(examples, batch_size=1, rank=2, world_size=2)


def test_padded_token_budget():
    examples = fake_examples([5, 5, 2, 9, 1, 4])
    batches = make_batches(examples, batch_tokens=10, seed=0)
    assert all(b["input_ids"].numel() <= 10 for b in batches)
    assert sorted(i for b in batches for i in ids_in(b)) == list(range(6))


def test_packed_rows_mode_fixes_examples_per_batch_and_keeps_the_loss():
    """packing + batch_size: each micro-batch has batch_size examples in rows of <= batch_tokens."""
    examples = fake_examples([5, 5, 2, 9, 1, 4, 7, 3])
    batches = make_batches(examples, batch_size=4, batch_tokens=10, packing=True, seed=0, pad_token_id=99)
    assert [b["num_sequences"] for b in batches] == [4, 4]
    assert all(b["input_ids"].shape[1] <= 10 for b in batches)
    assert sum(b["num_tokens"] for b in batches) == sum(len(e) for e in examples)
    for b in batches:  # trailing pads restart positions and carry no loss
        pads = b["input_ids"] == 99
        assert (b["labels"][pads] == -100).all()
