"""Forward + backward time of the SFT benchmark's batches in three layouts of the same examples.

- ``packed``: tether's default, rows of up to ``--row`` tokens holding several sequences; transformers builds
  a block-diagonal causal mask from the restarting position ids, so SDPA runs with an explicit mask.
- ``padded_mask``: one sequence per row, right-padded to the batch's longest, with an attention mask (TRL's).
- ``padded_causal``: the same rows without the mask. Right padding never precedes a real token, so causal
  attention alone gives every real token the same keys, and SDPA takes its ``is_causal`` path, which skips the
  blocks above the diagonal.

The three give the same loss to float rounding (printed). Runs alternate between layouts so background load
hits all alike; the median and min of ``--repeats`` are printed.

    python benchmarks/sft_layouts.py [--model tiny|small] [--threads 2] [--repeats 25] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import workloads as wl

from tether.core.language_modeling import next_token_loss
from tether.data.packing import _packed_rows_batch, model_inputs, pad_examples
from tether.models import build_tiny
from tether.trainers.sft import SFTConfig, SFTTrainer


def batch_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The SFT trainer's loss of the batch: token-mean next-token cross-entropy (``next_token_loss``)."""
    return next_token_loss(model(**model_inputs(batch)).logits, batch["labels"])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--steps", type=int, default=6, help="optimiser steps' worth of batches of 32 examples")
    parser.add_argument("--row", type=int, default=128, help="packed row length (the benchmark's max_length)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = build_tiny(args.model, seed=0)
    spec = wl.Spec(steps=args.steps, batch=32)
    config = SFTConfig.model_validate({**wl._tether_common(spec, args.threads), "data": {
        "task": {"name": "arithmetic"}, "max_length": args.row, "packing": True, "pack_length": args.row}})
    with tempfile.TemporaryDirectory() as scratch:
        examples = SFTTrainer(config, model, tokenizer, scratch, records=wl.sft_data(spec.steps * spec.batch),
                              stage="sft").examples
    chunks = [examples[i * spec.batch:(i + 1) * spec.batch] for i in range(spec.steps)]
    pad = tokenizer.pad_token_id
    layouts = {"packed": [_packed_rows_batch(c, row_tokens=args.row, pad_token_id=pad) for c in chunks],
               "padded_mask": [pad_examples(c, pad_token_id=pad) for c in chunks]}
    layouts["padded_causal"] = [{k: v for k, v in b.items() if k != "attention_mask"} for b in layouts["padded_mask"]]
    lengths = [len(e) for e in examples]
    print(f"{args.model}: {len(examples)} examples of {min(lengths)}-{max(lengths)} tokens, {args.threads} threads")
    for name, batches in layouts.items():
        with torch.no_grad():
            losses = [round(float(batch_loss(model, b)), 6) for b in batches[:3]]
        print(f"{name}: rows {tuple(batches[0]['input_ids'].shape)}, first losses {losses}")
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.repeats):
        for name, batches in layouts.items():
            started = time.perf_counter()
            for batch in batches:
                model.zero_grad(set_to_none=True)
                batch_loss(model, batch).backward()
            seconds[name].append(time.perf_counter() - started)
    for name, values in seconds.items():
        print(f"{name}: median {statistics.median(values):.3f} s, min {min(values):.3f} s")


if __name__ == "__main__":
    main()
