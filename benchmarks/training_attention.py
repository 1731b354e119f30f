"""Forward (+ backward) time of packed training rows under each attention kernel a CPU forward can run.

One batch of ``--sequences`` random sequences of ``--lengths lo-hi`` tokens, packed into rows of ``--row``
tokens, goes through the model and back (``logits.log_softmax(-1).mean()``) with its attention set to
``sdpa`` (the fused kernel), ``eager`` (transformers: two matrix products and a float32 softmax) and
``tether_matmul`` (:func:`tether.models.attention.matmul_attention`: the softmax in the scores' precision),
in float32 and under bfloat16 autocast, with gradients and without (a frozen pass). Runs alternate between
kernels so background load hits all alike; the median and min of ``--repeats`` are printed.

    python benchmarks/training_attention.py [--model tiny|small] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time

import torch

from tether.data.packing import pack_sequences
from tether.models import build_tiny
from tether.models.attention import MATMUL_ATTENTION

KERNELS = ("sdpa", "eager", MATMUL_ATTENTION)


def step_seconds(model: torch.nn.Module, inputs: dict, kernel: str, bf16: bool, backward: bool) -> float:
    """One forward (and backward) with ``kernel``, in seconds."""
    model.config._attn_implementation = kernel
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    with torch.set_grad_enabled(backward):
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            logits = model(**inputs).logits
        if backward:
            logits.float().log_softmax(-1).mean().backward()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--lengths", default="30-90")
    parser.add_argument("--row", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.lengths.split("-"))
    g = torch.Generator().manual_seed(0)
    model, tokenizer = build_tiny(args.model, seed=0)
    sequences = [torch.randint(3, len(tokenizer), (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(args.sequences)]
    inputs = pack_sequences(sequences, row_tokens=args.row, pad_token_id=tokenizer.pad_token_id).model_inputs()
    for backward, bf16 in itertools.product((True, False), (False, True)):
        seconds: dict[str, list[float]] = {k: [] for k in KERNELS}
        for kernel in KERNELS:  # warm-up
            step_seconds(model, inputs, kernel, bf16, backward)
        for _ in range(args.repeats):
            for kernel in KERNELS:
                seconds[kernel].append(step_seconds(model, inputs, kernel, bf16, backward))
        for kernel, times in seconds.items():
            print(f"{args.model} {'bf16-autocast' if bf16 else 'float32'} "
                  f"{'forward+backward' if backward else 'forward'} {kernel:14s} median "
                  f"{statistics.median(times) * 1e3:8.1f} ms  min {min(times) * 1e3:8.1f} ms", flush=True)


if __name__ == "__main__":
    main()
