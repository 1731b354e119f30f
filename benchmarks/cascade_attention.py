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
        [--prompt 6] [--suffix 16-40] [--threads 1] [--repeats 5] [--device cpu] [--dtype float32]

``--device cuda --dtype bfloat16`` times the same on a GPU (the timer synchronises the device); the
logits' largest difference from ``plain`` is then the check that cascade attention is right there.

With ``--trainer grpo|dpo`` it times whole training runs instead: the GRPO / DPO workloads of
``benchmarks/run.py`` (arithmetic, same sizes) with ``prefix_sharing`` false, mask and cascade,
alternating, printing the median wall time of ``train()`` and the last loss (or reward) of each.

    python benchmarks/cascade_attention.py --trainer grpo [--model tiny] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from tether.data.packing import pack_sequences
from tether.data.prefix_sharing import pack_prefix_groups
from tether.models.cascade_attention import cascade_forward, cascade_layout
from tether.models.tiny import save_tiny, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads as wl
from run import SPECS


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
    parser.add_argument("--trainer", choices=["grpo", "dpo"], help="time whole training runs (see above)")
    parser.add_argument("--device", default="cpu", help="forward + backward mode only")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="likewise")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.trainer:
        time_trainer(args)
        return
    torch.manual_seed(0)
    lo, hi = (int(x) for x in args.suffix.split("-"))
    config = tiny_config(args.model)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype))
    sequences, groups = workload(args.groups, args.members, args.prompt, (lo, hi), config.vocab_size)
    plain = pack_sequences(sequences, row_tokens=args.row_tokens, pad_token_id=0)
    shared = pack_prefix_groups(sequences, groups, row_tokens=args.row_tokens, pad_token_id=0)
    layout = cascade_layout(shared)

    def gather(logits, rows, columns):
        return torch.cat([logits[rows[i], columns[i][columns[i] >= 0]] for i in range(len(sequences))])

    def on_device(inputs: dict) -> dict:
        return {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in inputs.items()}

    plain_columns = [torch.arange(len(s)) + int(plain.starts[i]) for i, s in enumerate(sequences)]
    runs = {
        "plain": lambda: gather(model(**on_device(plain.model_inputs())).logits, plain.rows, plain_columns),
        "shared-dense": lambda: gather(model(**on_device(shared.model_inputs(model))).logits, shared.rows,
                                       shared.columns),
        "shared-cascade": lambda: gather(cascade_forward(model, shared).logits, shared.rows, shared.columns),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            wl.synchronize(args.device)
            start = time.perf_counter()
            logits = run()
            logits.float().logsumexp(-1).sum().backward()
            wl.synchronize(args.device)
            times[name].append(time.perf_counter() - start)
            outputs[name] = logits.detach()
    tokens = sum(len(s) for s in sequences)
    print(f"{args.model} ({args.device}, {args.dtype}): {args.groups} groups x {args.members}, prompt {args.prompt}, suffix {args.suffix}; "
          f"{tokens} tokens; plain {tuple(plain.input_ids.shape)}, shared {tuple(shared.input_ids.shape)} "
          f"({shared.shared_tokens} saved); dense pairs {shared.allowed.numel()}, cascade {layout.scored_pairs()}")
    print_times(times, 1000, "ms", {name: f"max|logits - plain| {(out - outputs['plain']).abs().max().item():.1e}"
                                    for name, out in outputs.items()})


def print_times(times: dict[str, list[float]], scale: float, unit: str, extra: dict[str, str]) -> None:
    """Each layout's median and best (the warm-up round left out), its speed over ``plain`` and ``extra``."""
    base = statistics.median(times["plain"][1:])
    for name, values in times.items():
        median = statistics.median(values[1:])
        print(f"  {name:15s} median {scale * median:8.2f} {unit}  best {scale * min(values[1:]):8.2f} {unit}  "
              f"x{base / median:.2f} of plain  {extra[name]}")


def time_trainer(args: argparse.Namespace) -> None:
    """Whole GRPO / DPO runs of ``benchmarks/run.py``'s sizes in each sharing mode, alternating."""
    spec = SPECS[args.model][args.trainer][0]
    run = {"grpo": wl.tether_grpo, "dpo": wl.tether_dpo}[args.trainer]
    modes = {"plain": False, "shared-dense": "mask", "shared-cascade": "cascade"}
    times: dict[str, list[float]] = {name: [] for name in modes}
    last: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny(Path(tmp) / args.model, args.model, seed=0)
        for repeat in range(args.repeats + 1):  # the first round warms up
            for name, mode in modes.items():
                scratch = Path(tmp) / f"{name}-{repeat}"
                measured = run(model_dir, dataclasses.replace(spec, prefix_sharing=mode), scratch, args.threads)
                times[name].append(measured.seconds)
                last[name] = measured.trajectory[-1]
    print(f"{args.trainer} on the {args.model} model ({spec.steps} steps of {spec.batch}), {args.threads} thread(s)")
    print_times(times, 1, "s", {name: f"last loss/reward {value:.4f}" for name, value in last.items()})


if __name__ == "__main__":
    main()
