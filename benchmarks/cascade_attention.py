"""Forward + backward time of one scored batch of prefix-shared groups in three layouts.

* ``plain``: every sequence packed on its own (rows capped at twice the longest sequence), attention
  through transformers' block-diagonal mask from the position ids;
* ``shared-dense``: groups share their common prefix, attention through the dense 4-D row mask;
* ``shared-cascade``: the same layout with cascade attention (:mod:`tether.models.cascade_attention`).

Workloads: ``groups`` groups of ``members`` sequences, each a random ``prompt``-token prefix and a
suffix of ``suffix`` tokens (a range ``lo-hi``). Runs alternate between layouts so background load hits
all alike; the median and best of ``--repeats`` are printed, with the logits' largest difference from
``plain``.

    python benchmarks/cascade_attention.py [--model tiny|small] [--groups 8] [--members 8]
        [--prompt 6] [--suffix 16-40] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from tether.data.packing import pack_sequences
from tether.data.prefix_sharing import pack_prefix_groups
from tether.models.cascade_attention import cascade_forward, cascade_layout
from tether.models.tiny import tiny_config


def workload(groups: int, members: int, prompt: int, suffix: tuple[int, int], vocab: int, seed: int = 0):
    rng = random.Random(seed)
    sequences, ids = [], []
    for g in range(groups):
        prefix = [rng.randrange(3, vocab) for _ in range(prompt)]
        for _ in range(members):
            sequences.append(prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(*suffix))])
            ids.append(g)
    return sequences, ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=6)
    parser.add_argument("--suffix", default="16-40")
    parser.add_argument("--row-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lo, hi = (int(x) for x in args.suffix.split("-"))
    config = tiny_config(args.model)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    sequences, groups = workload(args.groups, args.members, args.prompt, (lo, hi), config.vocab_size)
    plain = pack_sequences(sequences, row_tokens=args.row_tokens, pad_token_id=0)
    shared = pack_prefix_groups(sequences, groups, row_tokens=args.row_tokens, pad_token_id=0)
    layout = cascade_layout(shared)

    def gather(logits, rows, columns):
        return torch.cat([logits[rows[i], columns[i][columns[i] >= 0]] for i in range(len(sequences))])

    plain_columns = [torch.arange(len(s)) + int(plain.starts[i]) for i, s in enumerate(sequences)]
    runs = {
        "plain": lambda: gather(model(**plain.model_inputs()).logits, plain.rows, plain_columns),
        "shared-dense": lambda: gather(model(**shared.model_inputs(model)).logits, shared.rows, shared.columns),
        "shared-cascade": lambda: gather(cascade_forward(model, shared).logits, shared.rows, shared.columns),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            logits = run()
            logits.float().logsumexp(-1).sum().backward()
            times[name].append(time.perf_counter() - start)
            outputs[name] = logits.detach()
    tokens = sum(len(s) for s in sequences)
    print(f"{args.model}: {args.groups} groups x {args.members}, prompt {args.prompt}, suffix {args.suffix}; "
          f"{tokens} tokens; plain {tuple(plain.input_ids.shape)}, shared {tuple(shared.input_ids.shape)} "
          f"({shared.shared_tokens} saved); dense pairs {shared.allowed.numel()}, cascade {layout.scored_pairs()}")
    base = statistics.median(times["plain"][1:])
    for name, values in times.items():
        median = statistics.median(values[1:])
        diff = (outputs[name] - outputs["plain"]).abs().max().item()
        print(f"  {name:15s} median {1000 * median:8.1f} ms  best {1000 * min(values[1:]):8.1f} ms  "
              f"x{base / median:.2f} of plain  max|logits - plain| {diff:.1e}")


if __name__ == "__main__":
    main()
