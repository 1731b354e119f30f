"""Held-out evaluation through the rollout engine: task accuracy and pass@k, and agent episodes."""

from __future__ import annotations

import math
from typing import Any

import torch

from tether.config.agent import AgentEvalConfig, AgentLoopConfig, EnvironmentConfig
from tether.config.common import EvalConfig
from tether.data.tokenize import tokenize_prompts
from tether.rewards.verifiers import format_reward
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.agent import AgentLoop, environment_renderer, trajectory_metrics
from tether.rollout.environment import environment_records
from tether.tasks import eval_records, get_task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021, eq. 1): ``1 - C(n-c, k) / C(n, k)`` from ``c`` correct of ``n``."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@torch.no_grad()
def evaluate_task(model: torch.nn.Module, tokenizer: Any, cfg: EvalConfig,
                  records: list[dict] | None = None) -> dict[str, float]:
    """Greedy exact-match accuracy on held-out problems; with ``samples`` = k > 1 also pass@k.

    Returns ``{"accuracy": ..., "format": ..., "pass@k": ...}`` (fractions in [0, 1]).
    """
    task = get_task(cfg.task, **cfg.options)
    records = records or eval_records(task, cfg.n, seed=cfg.seed)
    prompts = [cfg.prompt_template.format(prompt=r["prompt"]) for r in records]
    answers = [r["answer"] for r in records]
    ids = tokenize_prompts(prompts, tokenizer, chat=cfg.chat)
    engine = HFEngine(model, tokenizer, batch_size=cfg.batch_size)
    greedy = engine.generate(ids, SamplingParams(greedy=True, max_new_tokens=cfg.max_new_tokens))
    correct = [task.verify(text, answer) for text, answer in zip(greedy.texts, answers, strict=True)]
    results = {
        "accuracy": sum(correct) / len(correct),
        "format": sum(format_reward(prompts, greedy.texts)) / len(prompts),
        "mean_length": sum(len(c) for c in greedy.completion_ids) / len(greedy.completion_ids),
    }
    if hasattr(task, "metrics"):  # a task's own figures on the greedy completions (e.g. a violation rate)
        results.update(task.metrics(records, greedy.texts))
    if cfg.samples > 1:
        sampled = engine.generate(ids, SamplingParams(n=cfg.samples, temperature=cfg.temperature,
                                                      max_new_tokens=cfg.max_new_tokens, seed=cfg.seed))
        hits = [0] * len(records)
        for text, index in zip(sampled.texts, sampled.prompt_index, strict=True):
            hits[index] += int(task.verify(text, answers[index]) > 0)
        k = cfg.samples
        results[f"pass@{k}"] = sum(pass_at_k(k, c, k) for c in hits) / len(hits)
        results[f"mean@{k}"] = sum(hits) / (k * len(hits))
    return results


@torch.no_grad()
def evaluate_agent(model: torch.nn.Module, tokenizer: Any, env: EnvironmentConfig, loop: AgentLoopConfig,
                   eval_cfg: AgentEvalConfig | None = None) -> dict[str, float]:
    """Greedy episodes on held-out tasks: ``success`` rate, mean verifier ``score`` and the loop metrics
    (and the same for sampled episodes, prefixed ``sampled/``, when ``eval_cfg.samples`` > 0)."""
    eval_cfg = eval_cfg or AgentEvalConfig()
    make_env, renderer = environment_renderer(env, tokenizer)
    engine = HFEngine(model, tokenizer, batch_size=eval_cfg.batch_size)
    records = environment_records(env, split="eval", n=eval_cfg.n, seed=eval_cfg.seed)
    agent = AgentLoop(engine, tokenizer, make_env, renderer, loop)
    results = trajectory_metrics(agent.run(records, SamplingParams(n=1, greedy=True)), loop.success_threshold)
    if eval_cfg.samples:
        sampled = agent.run(records, SamplingParams(n=eval_cfg.samples, temperature=eval_cfg.temperature,
                                                    seed=eval_cfg.seed))
        results.update({f"sampled/{k}": v for k, v in trajectory_metrics(sampled, loop.success_threshold).items()})
    return results
