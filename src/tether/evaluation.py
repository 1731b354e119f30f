"""Held-out evaluation through the rollout engine: task accuracy and pass@k, and agent episodes.

Every rate over problems comes with the number of problems (``n``) and its 95% Wilson interval
(``<figure>_ci95_low`` / ``_ci95_high``); the per-problem outcomes ride along on the returned
:class:`Figures` so that a stage evaluated before and after training reports its gain on the same
problems with a paired interval (:func:`paired_gains`).

``eval.metrics`` adds text metrics of the greedy completions (``TEXT_METRICS``) and likelihood metrics
(``LIKELIHOOD_METRICS``: held-out ``perplexity``, and with ``samples`` > 1 the
``likelihood_reward_agreement`` of the sampled completions), each registry entry computed from the
inputs it declares."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich import get_console

from tether.config.agent import AgentEvalConfig, AgentLoopConfig, EnvironmentConfig
from tether.config.common import EvalConfig
from tether.core.likelihood_metrics import LIKELIHOOD_METRICS, SequenceLikelihoods
from tether.core.statistics import paired_bootstrap_interval, wilson_interval
from tether.core.text_metrics import TEXT_METRICS
from tether.data import load_records, tokenize_sft, tokenize_text
from tether.data.tokenize import tokenize_prompts
from tether.models.logprobs import completion_logprobs, example_logprobs
from tether.rewards.verifiers import format_reward
from tether.rollout import HFEngine, Rollout, SamplingParams
from tether.rollout.agent import AgentLoop, environment_renderer, trajectory_metrics
from tether.rollout.environment import environment_records
from tether.runtime.progress import ProgressLines
from tether.tasks import eval_records, get_task, reference_records
from tether.tasks.base import THINK_OPEN, extract_answer

RewardFunction = Callable[..., Sequence[float]]  # fn(prompts, completions, **columns) -> one reward per completion


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021, eq. 1): ``1 - C(n-c, k) / C(n, k)`` from ``c`` correct of ``n``."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_answer(completions: list[str]) -> str:
    """The completion whose final answer (the text after ``</think>``, whitespace-normalised) is the most
    common among ``completions``; ties go to the answer seen first. Self-consistency (Wang et al. 2023,
    "Self-Consistency Improves Chain of Thought Reasoning in Language Models"): maj@k scores this one."""
    if not completions:
        raise ValueError("majority_answer needs at least one completion")
    keys = [" ".join(extract_answer(c).split()) for c in completions]
    counts = Counter(keys)
    best = max(counts.values())
    winner = next(k for k in keys if counts[k] == best)
    return completions[keys.index(winner)]


class Figures(dict):
    """Held-out figures (name -> float), and in ``outcomes`` the per-problem 0/1 outcomes behind each rate
    (name -> one value per problem, in the evaluation's fixed problem order)."""

    def __init__(self, *args: Any, outcomes: dict[str, list[float]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, list[float]] = dict(outcomes or {})


def with_intervals(figures: dict[str, float], outcomes: dict[str, list[float]], *,
                   count: str | None = "n") -> Figures:
    """``figures`` plus, for every rate in ``outcomes``, its 95% Wilson interval and its number of problems:
    in ``count`` (``n``, shared by the rates of one evaluation), or with ``count=None`` in ``<rate>_n``."""
    out = Figures(figures, outcomes=outcomes)
    for name, values in outcomes.items():
        low, high = wilson_interval(sum(v > 0 for v in values), len(values))
        out[f"{name}_ci95_low"], out[f"{name}_ci95_high"] = low, high
        out[count or f"{name}_n"] = float(len(values))
    return out


def paired_gains(before: dict[str, list[float]], after: dict[str, list[float]], *,
                 seed: int = 0) -> dict[str, float]:
    """``gain/<rate>`` (after minus before, same problems) with its paired-bootstrap 95% interval
    (``gain/<rate>_ci95_low`` / ``_high``) for every rate both evaluations have on equally many problems."""
    gains: dict[str, float] = {}
    for name, values in after.items():
        if name in before and len(before[name]) == len(values) and values:
            gain, low, high = paired_bootstrap_interval(before[name], values, seed=seed)
            gains.update({f"gain/{name}": gain, f"gain/{name}_ci95_low": low, f"gain/{name}_ci95_high": high})
    return gains


def held_out_texts(cfg: EvalConfig, task: Any) -> list[dict]:
    """The texts ``perplexity`` scores: the records of ``cfg.perplexity_data``, else the evaluated problems
    (``cfg.n``, ``cfg.seed``) with their reference completions, prompted as the evaluation prompts them
    (template, chat); a reference whose prompt template already opened ``<think>`` does not repeat it."""
    if cfg.perplexity_data:
        return load_records(cfg.perplexity_data)
    rows = []
    for record in reference_records(task, cfg.n, seed=cfg.seed):
        prompt, completion = cfg.prompt_template.format(prompt=record["prompt"]), record["completion"]
        if prompt.endswith(THINK_OPEN) and completion.startswith(THINK_OPEN):
            completion = completion[len(THINK_OPEN):]
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "completion": [{"role": "assistant", "content": completion}]} if cfg.chat
                    else {"prompt": prompt, "completion": completion})
    return rows


def _pad_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


@torch.no_grad()
def text_likelihoods(model: torch.nn.Module, tokenizer: Any, texts: Sequence[dict], *,
                     batch_size: int) -> SequenceLikelihoods:
    """Summed log-likelihood and scored tokens of each held-out text, scored as SFT trains on it: a
    prompt+completion (or chat) record's completion tokens and EOS, a ``text`` record's every token but
    BOS (a text longer than the model's context in chunks)."""
    max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2048
    examples = []
    for record in texts:
        examples += (tokenize_text(record, tokenizer, max_length=max_length) if "text" in record
                     else [tokenize_sft(record, tokenizer, max_length=max_length)])
    examples = [e for e in examples if e is not None]
    if not examples:
        raise ValueError("perplexity has no held-out text to score: every record was empty")
    logprob, tokens = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        logps, mask = example_logprobs(model, chunk, row_tokens=max(len(e) for e in chunk), pad_token_id=_pad_id(tokenizer))
        logprob.append(logps.double().sum(1).cpu())
        tokens.append(mask.sum(1).cpu())
    return SequenceLikelihoods(torch.cat(logprob), torch.cat(tokens))


@torch.no_grad()
def sample_likelihoods(model: torch.nn.Module, tokenizer: Any, sampled: Rollout, rewards: Sequence[float], *,
                       batch_size: int) -> SequenceLikelihoods:
    """The policy's own (temperature 1) summed log-likelihood of each sampled completion given its prompt,
    recomputed in a forward pass (the sampler's log-probs are temperature-scaled), with its reward and
    prompt index."""
    logprob = []
    for start in range(0, len(sampled.completion_ids), batch_size):
        rows = range(start, min(start + batch_size, len(sampled.completion_ids)))
        prompts, completions = [sampled.prompt_ids[i] for i in rows], [sampled.completion_ids[i] for i in rows]
        logps, _ = completion_logprobs(model, prompts, completions, temperature=1.0, pad_token_id=_pad_id(tokenizer),
                                       row_tokens=max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)))
        logprob.append(logps.double().sum(1).cpu())
    return SequenceLikelihoods(torch.cat(logprob), torch.tensor([len(c) for c in sampled.completion_ids]),
                               torch.tensor(list(rewards), dtype=torch.float64), torch.tensor(sampled.prompt_index))


def likelihood_figures(names: Sequence[str], inputs: dict[str, Callable[[], SequenceLikelihoods]]
                       ) -> dict[str, float]:
    """The ``LIKELIHOOD_METRICS`` entries ``names``, each given the inputs it declares (``inputs``: name ->
    a function computing it, called at most once)."""
    ready: dict[str, SequenceLikelihoods] = {}
    out: dict[str, float] = {}
    for name in names:
        for need in LIKELIHOOD_METRICS.needs(name):
            if need not in ready:
                ready[need] = inputs[need]()
        out.update({k: float(v) for k, v in LIKELIHOOD_METRICS.get(name)(**ready).items()})
    return out


@torch.no_grad()
def evaluate_task(model: torch.nn.Module, tokenizer: Any, cfg: EvalConfig,
                  records: list[dict] | None = None, *, progress: bool = True, label: str = "eval",
                  texts: list[dict] | None = None, reward_fn: RewardFunction | None = None) -> Figures:
    """Greedy exact-match accuracy on held-out problems; with ``samples`` = k > 1 also pass@k, maj@k
    (the majority answer of the k samples, :func:`majority_answer`) and mean@k.

    Returns ``{"accuracy": ..., "format": ..., "pass@k": ..., "n": ...}`` (fractions in [0, 1]) with the
    Wilson interval of accuracy and pass@k, and their per-problem outcomes in ``.outcomes``. With
    ``progress``, a line ``label: done/total samples ...`` every 30 s (:class:`ProgressLines`). The
    metrics in ``cfg.metrics`` are added; ``texts`` (records) replaces the held-out texts of
    ``perplexity`` and ``reward_fn`` (``fn(prompts, completions, **columns)``) the task's verifier as the
    reward ``likelihood_reward_agreement`` ranks by.
    """
    task = get_task(cfg.task, **cfg.options)
    records = records or eval_records(task, cfg.n, seed=cfg.seed)
    prompts = [cfg.prompt_template.format(prompt=r["prompt"]) for r in records]
    answers = [r["answer"] for r in records]
    ids = tokenize_prompts(prompts, tokenizer, chat=cfg.chat)
    sampled_rows = len(records) * cfg.samples if cfg.samples > 1 else 0
    lines = ProgressLines(label, len(records) + sampled_rows, "samples", enabled=progress, console=get_console())
    engine = HFEngine(model, tokenizer, batch_size=cfg.batch_size, on_batch=lines.update)
    greedy = engine.generate(ids, SamplingParams(greedy=True, max_new_tokens=cfg.max_new_tokens))
    engine.on_batch = lambda done: lines.update(len(records) + done)
    correct = [float(task.verify(text, answer)) for text, answer in zip(greedy.texts, answers, strict=True)]
    outcomes = {"accuracy": correct}
    results = {
        "accuracy": sum(correct) / len(correct),
        "format": sum(format_reward(prompts, greedy.texts)) / len(prompts),
        "mean_length": sum(len(c) for c in greedy.completion_ids) / len(greedy.completion_ids),
    }
    if hasattr(task, "metrics"):  # a task's own figures on the greedy completions (e.g. a violation rate)
        results.update(task.metrics(records, greedy.texts))
    for name in (m for m in cfg.metrics if m in TEXT_METRICS):  # text metrics asked for (eval.metrics)
        results.update(TEXT_METRICS.get(name)(greedy.texts, correct))
    inputs = {"reference": lambda: text_likelihoods(model, tokenizer, texts or held_out_texts(cfg, task),
                                                    batch_size=cfg.batch_size)}
    if cfg.samples > 1:
        sampled = engine.generate(ids, SamplingParams(n=cfg.samples, temperature=cfg.temperature,
                                                      max_new_tokens=cfg.max_new_tokens, seed=cfg.seed))
        verified = [float(task.verify(text, answers[i])) for text, i in zip(sampled.texts, sampled.prompt_index, strict=True)]
        hits = [0] * len(records)
        per_problem: list[list[str]] = [[] for _ in records]
        for text, index, reward in zip(sampled.texts, sampled.prompt_index, verified, strict=True):
            hits[index] += int(reward > 0)
            per_problem[index].append(text)
        k = cfg.samples
        outcomes[f"pass@{k}"] = [pass_at_k(k, c, k) for c in hits]  # 0 or 1 when k = n
        outcomes[f"maj@{k}"] = [float(task.verify(majority_answer(texts), answer) > 0)
                                for texts, answer in zip(per_problem, answers, strict=True)]
        results[f"pass@{k}"] = sum(outcomes[f"pass@{k}"]) / len(hits)
        results[f"maj@{k}"] = sum(outcomes[f"maj@{k}"]) / len(hits)
        results[f"mean@{k}"] = sum(hits) / (k * len(hits))
        inputs["samples"] = lambda: sample_likelihoods(
            model, tokenizer, sampled, verified if reward_fn is None else sampled_rewards(reward_fn, records, prompts, sampled),
            batch_size=cfg.batch_size)
    results.update(likelihood_figures([m for m in cfg.metrics if m in LIKELIHOOD_METRICS], inputs))
    return with_intervals(results, outcomes)


def sampled_rewards(reward_fn: RewardFunction, records: list[dict], prompts: list[str], sampled: Rollout) -> list[float]:
    """``reward_fn`` on the sampled completions, with each record's other fields (``answer``, ...) as columns."""
    index = sampled.prompt_index
    columns = {key: [records[i].get(key) for i in index] for key in records[0] if key != "prompt"}
    rewards = [float(r) for r in reward_fn([prompts[i] for i in index], list(sampled.texts), **columns)]
    if len(rewards) != len(index):
        raise ValueError(f"the reward function returned {len(rewards)} rewards for {len(index)} completions; "
                         "return one per completion")
    return rewards


@torch.no_grad()
def evaluate_agent(model: torch.nn.Module, tokenizer: Any, env: EnvironmentConfig, loop: AgentLoopConfig,
                   eval_cfg: AgentEvalConfig | None = None, *, progress: bool = True,
                   label: str = "eval") -> dict[str, float]:
    """Greedy episodes on held-out tasks: ``success`` rate, mean verifier ``score`` and the loop metrics
    (and the same for sampled episodes, prefixed ``sampled/``, when ``eval_cfg.samples`` = k > 0, with
    ``pass@k``: the share of tasks that at least one of their k sampled episodes solves). With
    ``progress``, a line ``label: done/total episodes ...`` every 30 s."""
    eval_cfg = eval_cfg or AgentEvalConfig()
    make_env, renderer = environment_renderer(env, tokenizer)
    engine = HFEngine(model, tokenizer, batch_size=eval_cfg.batch_size)
    records = environment_records(env, split="eval", n=eval_cfg.n, seed=eval_cfg.seed)
    agent = AgentLoop(engine, tokenizer, make_env, renderer, loop)
    lines = ProgressLines(label, len(records) * (1 + eval_cfg.samples), "episodes", enabled=progress,
                          console=get_console())
    greedy = agent.run(records, SamplingParams(n=1, greedy=True), on_progress=lines.update)
    figures = trajectory_metrics(greedy, loop.success_threshold)
    outcomes = {"success": [float(t.outcome >= loop.success_threshold) for t in greedy]}
    if eval_cfg.samples:
        k = eval_cfg.samples
        sampled = agent.run(records, SamplingParams(n=k, temperature=eval_cfg.temperature, seed=eval_cfg.seed),
                            on_progress=lambda done: lines.update(len(records) + done))
        figures.update({f"sampled/{name}": v for name, v in trajectory_metrics(sampled, loop.success_threshold).items()})
        wins = [sum(t.outcome >= loop.success_threshold for t in sampled[i * k:(i + 1) * k]) for i in range(len(records))]
        outcomes[f"pass@{k}"] = [pass_at_k(k, c, k) for c in wins]  # a task's k episodes are contiguous
        figures[f"pass@{k}"] = sum(outcomes[f"pass@{k}"]) / len(wins)
    return with_intervals(figures, outcomes)
