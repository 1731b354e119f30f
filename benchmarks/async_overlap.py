"""Wall time of the synchronous loop against a producer process K policy versions behind (async RL).

    python benchmarks/async_overlap.py --runs 3            # GRPO and the agent trainer, K = 0 and 1

Each row is a fresh trainer on the tiny model (1 torch thread each side), timed over its whole run (the
producer's start-up included, as a user pays it); the runs of a row alternate between the settings so a
change of machine load hits them alike. The load average is read before and after each run and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def digit_fraction(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def generated_digits(prompts, completions, trajectory, **columns):
    texts = ["".join(turn.text for turn in t.turns) for t in trajectory]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def grpo(k: int, steps: int, tokens: int, run_dir: Path) -> dict:
    from tether.config.rl import GRPOConfig
    from tether.models import build_tiny
    from tether.trainers.rl import RLTrainer

    cfg = GRPOConfig(name="rl", data={"task": {"name": "arithmetic", "n": 256}},
                     rollout={"group_size": 8, "max_new_tokens": tokens},
                     train={"max_steps": steps, "batch_size": 16, "log_every": 1, "progress": False},
                     optim={"lr": 1e-4, "schedule": "constant"}, report_to=[],
                     rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": k}})
    model, tokenizer = build_tiny("tiny", seed=0)
    return _time(RLTrainer(cfg, model, tokenizer, run_dir, reward_functions=[digit_fraction]), steps)


def agent(k: int, steps: int, tokens: int, run_dir: Path) -> dict:
    from tether.config.agent import AgentConfig
    from tether.models import build_tiny
    from tether.trainers.agent import AgentRLTrainer

    cfg = AgentConfig(name="agent", environment={"task": {"name": "multiplication", "options": {"digits": 2},
                                                          "n": 256}, "tools": ["calculator"]},
                      agent={"max_turns": 3, "max_tokens": 3 * tokens, "max_tokens_per_turn": tokens},
                      rollout={"group_size": 8}, row_tokens=512,
                      train={"max_steps": steps, "batch_size": 8, "log_every": 1, "progress": False},
                      optim={"lr": 1e-4, "schedule": "constant"}, report_to=[],
                      rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": k}})
    model, tokenizer = build_tiny("tiny", seed=0)
    return _time(AgentRLTrainer(cfg, model, tokenizer, run_dir, reward_functions=[generated_digits]), steps)


def _time(trainer, steps: int) -> dict:
    start, busy = time.perf_counter(), []
    for _ in range(steps):
        metrics = trainer.training_step()
        trainer.step += 1
        if "async/generation_busy" in metrics:
            busy.append(float(metrics["async/generation_busy"]))
    return {"seconds": time.perf_counter() - start, "generation_busy": statistics.mean(busy) if busy else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per completion (per turn, agents)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--trainers", nargs="+", default=["grpo", "agent"], choices=["grpo", "agent"])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.out is not None and args.out.is_dir():  # written at the end: refused before the work, not after
        parser.error(f"--out names the JSON file to write, not the folder {str(args.out)!r}")
    import torch

    torch.set_num_threads(1)
    rows = []
    for name in args.trainers:
        times: dict[int, list[float]] = {k: [] for k in args.staleness}
        busy: dict[int, list[float]] = {k: [] for k in args.staleness}
        for run in range(args.runs):
            for k in args.staleness:
                before = os.getloadavg()[0]
                with tempfile.TemporaryDirectory() as tmp:
                    result = {"grpo": grpo, "agent": agent}[name](k, args.steps, args.tokens, Path(tmp))
                after = os.getloadavg()[0]
                times[k].append(result["seconds"])
                if result["generation_busy"] is not None:
                    busy[k].append(result["generation_busy"])
                print(f"{name} K={k} run {run + 1}: {result['seconds']:.1f} s (load {before:.2f} -> {after:.2f})",
                      flush=True)
        for k in args.staleness:
            rows.append({"trainer": name, "max_staleness": k, "seconds": times[k],
                         "median_s": statistics.median(times[k]),
                         "generation_busy": statistics.mean(busy[k]) if busy[k] else None})
            print(f"{name} K={k}: median {rows[-1]['median_s']:.1f} s over {args.runs} runs "
                  f"({' / '.join(f'{t:.1f}' for t in times[k])})")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
