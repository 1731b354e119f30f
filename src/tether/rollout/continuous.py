"""Continuous batching for :class:`~tether.rollout.hf_engine.HFEngine` (``continuous=True``, or
``rollout.engine_options: {continuous: true}``).

Without it an engine with ``batch_size`` decodes the samples of one call in chunks, and each chunk runs
until its longest sample is done: the rows that stopped early sit idle (or are dropped, shrinking the
batch) while the next chunk waits. Here the batch stays full: the moment a row finishes, a waiting
sample is prefilled and put into that row of the static KV cache (:meth:`StaticDecoder.insert`), its
keys ending at the current column and everything before them masked, so it decodes exactly as it would
alone. Only once nothing waits do finished rows drop out, as in the chunked path.

Greedy decoding gives the chunked path's tokens (up to float rounding of a different batch); sampled
decoding with a seed is reproducible but draws differ from the chunked path, because each step samples
a batch of a different make-up. That is why it is opt-in: recipe figures measured without it repeat.
Only the static decode path (plain Llama-family models) batches continuously; other models keep the
chunked path.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.rollout import static_decoder
from tether.rollout.base import SamplingParams, sample_tokens

Completion = tuple[list[int], list[float], bool]

# Refill finished rows once this share of the batch is free (every prefill is a full model forward).
REFILL_FRACTION = 0.125


class Outputs:
    """Per sample (rows of the call): sampled tokens, their log-probs, lengths and whether it stopped; the
    bookkeeping of both decode loops (chunked and continuous)."""

    def __init__(self, engine: Any, count: int, steps: int, device: torch.device, params: SamplingParams,
                 vocab: int) -> None:
        self.engine, self.params, self.steps = engine, params, steps
        self.tokens = torch.full((count, steps), engine.pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((count, steps), dtype=torch.float32, device=device)
        self.lengths = torch.full((count,), steps, dtype=torch.long, device=device)
        self.stopped = torch.zeros(count, dtype=torch.bool, device=device)
        self.eos = torch.tensor(engine.eos_ids, dtype=torch.long, device=device)
        self.one_eos = self.eos[0].clone() if len(engine.eos_ids) == 1 else None  # 0-dim: one comparison
        self.stop_filter = engine._stop_filter(params.stop, vocab, device) if params.stop else None

    def accept(self, samples: torch.Tensor, produced: torch.Tensor | int, tok: torch.Tensor, lp: torch.Tensor,
               finished: torch.Tensor | None = None) -> torch.Tensor:
        """Record one new token per sample (``produced`` tokens before it, per sample or one count for all;
        ``finished``: samples already done, whose token is padding and changes nothing); bool per sample: it
        is done now."""
        self.tokens[samples, produced] = tok
        self.logprobs[samples, produced] = lp
        per_sample = isinstance(produced, torch.Tensor)
        stop = torch.isin(tok, self.eos) if self.one_eos is None else torch.eq(tok, self.one_eos)
        running = None if finished is None else ~finished
        if running is not None:
            stop &= running
        if self.stop_filter is not None:
            inactive = stop if finished is None else stop | finished
            counts = produced if per_sample else torch.full_like(samples, produced)
            stop |= self.engine._match_stop(self.tokens, samples, counts, tok, inactive, self.stop_filter,
                                            self.params.stop)
        if per_sample:
            done = stop | (produced + 1 >= self.steps)
        else:  # one count for every sample: the length limit is all or nothing
            done = torch.ones_like(stop) if produced + 1 >= self.steps else stop.clone()
        if running is not None:
            done &= running
        if bool(done.any()):
            self.lengths[samples[done]] = produced[done] + 1 if per_sample else produced + 1
            self.stopped[samples[stop]] = True
        return done


def _prefill(engine: Any, prompts: list[list[int]], steps: int, width: int = 0):
    """Prefill ``prompts`` (running each distinct prompt once); logits (k, V), per-layer keys and values
    (k, kv_heads, w, head_dim), the (k, w) padding mask and each sample's next position (k,)."""
    distinct: dict[tuple[int, ...], int] = {}
    index = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    logits, cache, mask, position = engine._prefill([list(p) for p in distinct], steps, 1, width)
    if not isinstance(getattr(cache, "layers", None), list):
        raise RuntimeError("continuous batching needs a cache with per-layer keys and values (transformers >= 4.56)")
    pick = torch.tensor(index, device=logits.device)
    width = mask.shape[1] - steps
    keys = [layer.keys.index_select(0, pick) for layer in cache.layers]
    values = [layer.values.index_select(0, pick) for layer in cache.layers]
    return logits[pick], keys, values, mask[pick, :width], position[pick, 0]


def generate(engine: Any, prompts: list[list[int]], rows: list[int], params: SamplingParams,
             generator: torch.Generator | None, slots: int) -> list[Completion]:
    """Decode every sample of ``rows`` (prompt indices, ``n`` per prompt) with at most ``slots`` rows at a
    time, refilling a finished row with the next waiting sample; per sample (ids, log-probs, stopped)."""
    steps, count = params.max_new_tokens, len(rows)
    width = max(len(p) for p in prompts)  # the first batch starts at the widest prompt, so any later one fits
    first = min(slots, count)
    logits, cache, mask, position = engine._prefill([prompts[r] for r in rows[:first]], steps,
                                                    params.n if first % params.n == 0 else 1, width)
    device = logits.device
    decoder = static_decoder.StaticDecoder(engine.model, cache, mask[:, :width], steps, capacity=width + 2 * steps)
    del cache
    out = Outputs(engine, count, steps, device, params, logits.shape[-1])
    sample = torch.arange(first, device=device)  # batch row -> sample being decoded there
    produced = torch.zeros(first, dtype=torch.long, device=device)
    idle = torch.zeros(first, dtype=torch.bool, device=device)
    position = position[:, 0].clone()
    waiting, reported, finished = first, 0, 0
    refill = max(1, int(first * REFILL_FRACTION))
    while True:
        tok, lp = sample_tokens(logits, params, generator)
        live = (~idle).nonzero().squeeze(-1)
        free = idle.clone()
        free[live] = out.accept(sample[live], produced[live], tok[live], lp[live])
        finished += int(free[live].sum())
        produced[live] += 1
        while int(free.sum()) >= min(refill, count - waiting) and waiting < count:  # a refilled sample can stop at once
            into = free.nonzero().squeeze(-1)[: count - waiting]
            new = torch.arange(waiting, waiting + len(into), device=device)
            waiting += len(into)
            new_logits, keys, values, new_mask, new_position = _prefill(engine, [prompts[rows[i]] for i in new.tolist()],
                                                                        steps)
            decoder.insert(into, keys, values, new_mask)
            sample[into], produced[into], position[into] = new, 0, new_position
            new_tok, new_lp = sample_tokens(new_logits, params, generator)
            tok[into] = new_tok
            free[into] = out.accept(new, produced[into], new_tok, new_lp)
            finished += int(free[into].sum())
            produced[into] += 1
        idle = free
        if engine.on_batch is not None and finished - reported >= slots:
            reported = finished
            engine.on_batch(reported)
        running = int((~idle).sum())
        if running == 0:
            break
        if (waiting >= count and len(idle) >= static_decoder.COMPACT_MIN_BATCH
                and running <= static_decoder.COMPACT_FRACTION * len(idle)):
            keep = (~idle).nonzero().squeeze(-1)
            decoder.select(keep)
            sample, produced, idle, position, tok = sample[keep], produced[keep], idle[keep], position[keep], tok[keep]
        decoder.make_room(~idle, width)
        logits = decoder.step(tok.masked_fill(idle, engine.pad_id), position)
        position += 1
    if engine.on_batch is not None:
        engine.on_batch(count)
    return engine._unpack(out.tokens, out.logprobs, out.lengths, out.stopped)
