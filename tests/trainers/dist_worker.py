"""One tiny SFT, DPO, GRPO (synchronous or async) or PPO run, the same in one process and under ``torchrun``
(used by test_parallel.py).

``python dist_worker.py OUT TRAINER:STRATEGY[,...] [--steps N] [--save-every N] [--resume]`` in one
process, or ``torchrun --nproc_per_node=2 dist_worker.py ...``; each job writes ``OUT/<strategy>``.
The global batch is fixed whatever the number of ranks W: each rank takes ``GLOBAL_MICRO_BATCHES / W``
micro-batches (grad_accum), or for GRPO and PPO ``PROMPTS / W`` prompts. RL rollouts come from a
scripted engine, so that the samples do not depend on how the prompts are split over ranks
(HFEngine draws from one generator per call); ``grpo_async``'s producers sample with the real engine. After training, rank 0 writes
``OUT/<strategy>/<trainer>/placements.json``: how the parameters are laid out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

GLOBAL_MICRO_BATCHES = 2
PROMPTS = 4


class ScriptedEngine:
    """Completion j of a prompt "a+b=" is a fixed guess at the sum: right for some j, wrong for others."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        from tether.rollout import Rollout

        texts, index = [], []
        for i, p in enumerate(prompts):
            text = self.tokenizer.decode(p, skip_special_tokens=True)
            a, _, b = text.split("=")[0].partition("+")
            total = int(a) + int(b) if a.strip().isdigit() and b.strip().isdigit() else 0
            for j in range(params.n):
                wrong = j % 3 == 1  # wrong answers run longer, so the token-mean loss is not ~0 at ratio 1
                texts.append(f"<think>ok</think>{total + wrong * (j + 1)}" + "?" * (3 * wrong * j))
                index.append(i)
        eos = self.tokenizer.eos_token_id
        ids = [[*self.tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in texts]
        return Rollout(prompt_ids=[list(prompts[i]) for i in index], completion_ids=ids,
                       completion_logprobs=[[0.0] * len(c) for c in ids], finish_reasons=["stop"] * len(ids),
                       prompt_index=index, texts=texts)


def build(trainer: str, strategy: str, out: Path, steps: int, save_every: int | None, world: int):
    from tether.models import build_tiny

    model, tokenizer = build_tiny("tiny", seed=0)
    accum = GLOBAL_MICRO_BATCHES // world
    train = {"max_steps": steps, "log_every": 1, "progress": False, "seed": 0, "threads": 1,
             "strategy": strategy, "save_every": save_every, "grad_accum": accum}
    common = {"name": trainer, "optim": {"lr": 3e-3, "schedule": "linear"}, "report_to": []}
    if trainer == "sft":
        from tether.trainers.sft import SFTConfig, SFTTrainer

        cfg = SFTConfig(**common, data={"task": {"name": "arithmetic", "n": 48}, "pack_length": 128},
                        train={**train, "batch_size": 4})
        return SFTTrainer(cfg, model, tokenizer, out, stage=trainer)
    if trainer == "dpo":
        from tether.trainers.preference import DPOConfig, PreferenceTrainer

        cfg = DPOConfig(**common, loss="sigmoid", beta=0.5,
                        data={"task": {"n": 24, "eval_n": 4}, "pack_length": 256}, train={**train, "batch_size": 2})
        return PreferenceTrainer(cfg, model, tokenizer, out, stage=trainer)
    rl = {"data": {"task": {"name": "arithmetic", "n": 32}}, "train": {**train, "grad_accum": 1, "batch_size": PROMPTS // world},
          "rewards": [{"name": "accuracy", "kwargs": {"task": "arithmetic"}}]}
    if trainer == "ppo_async":  # a producer per rank, one version behind, with the real engine (see grpo_async)
        from tether.config.rl import PPOConfig
        from tether.trainers.ppo import PPOTrainer

        cfg = PPOConfig(**common, **{**rl, "rewards": [{"name": "length", "kwargs": {"target": 4}}]},
                        critic={"init": "policy"}, rollout={"group_size": 2, "max_new_tokens": 8},
                        rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": 1, "threads": 1}})
        return PPOTrainer(cfg, model, tokenizer, out, stage=trainer)
    if trainer == "ppo":
        from tether.config.rl import PPOConfig
        from tether.trainers.ppo import PPOTrainer

        # batch-normalised scores, whitened GAE advantages and an adaptive beta: all over the whole job's batch;
        # the first of the 3 steps trains the critic alone (critic.warmup_steps).
        # AdamW with eps 1: an update linear in the gradient, so float noise is not amplified (as Adam's
        # g / sqrt(v) does for near-zero gradients) and the final weights can be compared too
        common = {**common, "optim": {"lr": 0.05, "eps": 1.0, "schedule": "constant"}}
        cfg = PPOConfig(**common, **rl, critic={"init": "policy", "coef": 0.5, "warmup_steps": 1},
                        rollout={"group_size": 2, "max_new_tokens": 8}, reward_norm="batch", entropy={"coef": 0.01},
                        num_iterations=2,
                        kl={"coef": 0.05, "controller": "adaptive", "target": 0.5, "horizon": 8})
        trainer_ = PPOTrainer(cfg, model, tokenizer, out, stage=trainer)
        trainer_.engine = ScriptedEngine(tokenizer)
        return trainer_
    from tether.config.rl import GRPOConfig
    from tether.trainers.rl import RLTrainer

    if trainer == "grpo_async":  # each rank's producer samples with the real engine, one version behind; a reward
        # every sample varies in (the random model earns no accuracy reward, and all-zero advantages train nothing)
        cfg = GRPOConfig(**common, algorithm="grpo", rollout={"group_size": 4, "max_new_tokens": 8},
                         rollout_correction={"mode": "tis"}, **{"async": {"max_staleness": 1, "threads": 1}},
                         data={"task": {"name": "arithmetic", "n": 32}}, train={**train, "grad_accum": 1,
                         "batch_size": PROMPTS // world}, rewards=[{"name": "length", "kwargs": {"target": 4}}])
        return RLTrainer(cfg, model, tokenizer, out, stage=trainer)
    cfg = GRPOConfig(**common, algorithm="grpo", loss_agg="token-mean", kl={"coef": 0.1, "estimator": "k3"},
                     data={"task": {"name": "arithmetic", "n": 32}}, rollout={"group_size": 4, "max_new_tokens": 8},
                     rewards=[{"name": "accuracy", "kwargs": {"task": "arithmetic"}}],
                     train={**train, "grad_accum": 1, "batch_size": PROMPTS // world})
    trainer_ = RLTrainer(cfg, model, tokenizer, out, stage=trainer)
    trainer_.engine = ScriptedEngine(tokenizer)
    return trainer_


def placements(model: torch.nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "placements"):
            out[name] = {"placements": [type(x).__name__ for x in p.placements], "local": list(p.to_local().shape),
                         "global": list(p.shape)}
        else:
            out[name] = {"placements": [], "local": list(p.shape), "global": list(p.shape)}
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("jobs", help="trainer:strategy[,trainer:strategy...]; each writes OUT/<strategy>/<trainer>")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        for job in args.jobs.split(","):
            name, strategy = job.split(":")
            out = args.out / strategy
            trainer = build(name, strategy, out, args.steps, args.save_every, world)
            trainer.fit(resume=args.resume)
            if trainer.dist.is_main:
                (out / name / "placements.json").write_text(json.dumps(placements(trainer.model)))
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main(sys.argv[1:])
