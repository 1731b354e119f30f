"""The judge stages: ``judge_data`` writes synthetic judge training data with known verdicts, for an SFT stage to
train a judge; ``judge_eval`` measures a judge's held-out verdict accuracy and position consistency."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tether.config.base import ConfigError
from tether.config.preference import JudgeDataConfig, JudgeEvalConfig, PolicyPairsConfig
from tether.core.win_rate import count_swapped_verdicts, verdict_accuracy
from tether.data.files import write_jsonl_atomic
from tether.rewards.judge import PairwiseJudge, PointwiseJudge
from tether.rewards.judge_records import judge_records, sample_judge_records, wrong_step
from tether.tasks import get_task, sft_records
from tether.tasks.base import draw_problems, extract_answer, format_completion
from tether.tasks.preferences import preference_records
from tether.trainers import checkpoint as ckpt


def run_judge_data(cfg: JudgeDataConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    """Write ``STAGE/train.jsonl`` (``judge_records``, with ``policy`` records from that model's own verifier-scored
    samples, mixed with ``sft_n`` task demonstrations) and, with
    ``task.eval_n``, held-out ``STAGE/eval.jsonl``; returns the record counts."""
    source = cfg.task
    task = get_task(source.name, **source.options)
    common = {"kind": cfg.kind, "template": cfg.template, "seed": source.seed, "errors": source.errors,
              "scale": cfg.scale, "solve_first": cfg.solve_first, "answers_only": cfg.responses == "answers",
              "check": cfg.check, "letters": cfg.work_digits == "letters"}
    rows = judge_records(task, source.n, ties=cfg.ties, **common)
    sampled = 0
    if cfg.policy is not None:
        import torch

        torch.set_num_threads(cfg.train.threads)
        own = policy_samples(task, cfg.policy, seed=source.seed)
        rows += sample_judge_records(task, own, template=cfg.template, scale=cfg.scale, solve_first=cfg.solve_first,
                                     check=cfg.check, letters=cfg.work_digits == "letters",
                                     answers_only=cfg.responses == "answers")
        sampled = len(own)
    if cfg.sft_n:
        rows += sft_records(task, cfg.sft_n, seed=source.seed + 1, think=cfg.sft_think)
    if cfg.sft_n or sampled:
        random.Random(f"judge-data:{source.seed}").shuffle(rows)
    stage_dir = run_dir / (cfg.name or cfg.type)
    write_jsonl_atomic(stage_dir / "train.jsonl", rows)
    results = {"records": float(len(rows)), "judge_records": float(len(rows) - cfg.sft_n)}
    if sampled:
        results["policy_records"] = float(sampled)
    if source.eval_n:
        write_jsonl_atomic(stage_dir / "eval.jsonl", judge_records(task, source.eval_n, split="eval", **common))
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results


# ---- judge evaluation ------------------------------------------------------------------------------------

VERDICTS_FILE = "verdicts.jsonl"


def synthetic_pairs(task: Any, source: Any, *, answers_only: bool = False) -> list[tuple[str, str, str]]:
    """``(prompt, right, wrong)`` from the task's eval split: the right completion against one with a single
    error (:func:`tether.tasks.preferences.preference_records`); ``answers_only``: their final answers."""
    records = preference_records(task, source.eval_n, seed=source.seed, split="eval", errors=source.errors)
    shown = extract_answer if answers_only else str
    return [(r["prompt"], shown(r["chosen"]), shown(r["rejected"])) for r in records]


def policy_samples(task: Any, cfg: Any, seed: int) -> list[tuple[str, str, str]]:
    """``(prompt, response, gold answer)`` for ``cfg.samples`` answers of ``cfg.model`` to each of ``cfg.n``
    training prompts (never the eval split the judge is measured on)."""
    from tether.models import load_model
    from tether.stages.cai import sample_responses

    model, tokenizer = load_model(cfg.model)
    problems = draw_problems(task, cfg.n, seed=seed, split="train")
    answers = sample_responses(model, tokenizer, [p.prompt for p in problems], cfg.sampling, n=cfg.samples,
                               seed=seed)
    return [(p.prompt, text, p.answer) for p, texts in zip(problems, answers, strict=True) for text in texts]


def wrong_step_pairs(task: Any, source: Any) -> list[tuple[str, str, str]]:
    """``(prompt, right, wrong)`` from the task's eval split whose wrong trace has the right answer and one step
    digit changed: the pairs only a judge that checks every step gets right."""
    rng = random.Random(f"wrong-step-pairs:{source.seed}")
    records = preference_records(task, source.eval_n, seed=source.seed, split="eval", errors=source.errors)
    return [(r["prompt"], r["chosen"], wrong_step(r["chosen"], rng)) for r in records]


def policy_pairs(task: Any, cfg: PolicyPairsConfig, seed: int, *, steps: bool = False,
                 ) -> tuple[dict[str, list[tuple[str, str, str]]], dict[str, float]]:
    """Pairs from a model's own samples on held-out prompts, and the sample figures. ``"policy"``: each prompt
    with a right and a wrong sample (by the task's verifier; with ``steps``, by the ``worked_solution`` checker
    of every step) gives ``(prompt, right, wrong)``, its first right
    and first wrong one. ``"policy_wrong"``: each prompt with two different wrong samples gives ``(prompt,
    wrong, other wrong)``, pairs a sound judge ties and an online loop would otherwise train on with a wrong
    answer chosen (OAIF's 2 samples per prompt on the prompts the policy finds hard)."""
    from tether.models import load_model
    from tether.stages.cai import sample_responses

    model, tokenizer = load_model(cfg.model)
    problems = draw_problems(task, cfg.n, seed=seed, split="eval")
    samples = sample_responses(model, tokenizer, [p.prompt for p in problems], cfg.sampling, n=cfg.samples,
                               seed=seed)
    pairs: dict[str, list[tuple[str, str, str]]] = {"policy": [], "policy_wrong": []}
    correct = 0
    for problem, texts in zip(problems, samples, strict=True):
        if steps:  # the worked_solution checker's test
            verdicts = [t.strip() == format_completion(problem, think=True) for t in texts]
        else:
            verdicts = [task.verify(t, problem.answer) == 1.0 for t in texts]
        right = [t for t, ok in zip(texts, verdicts, strict=True) if ok]
        wrong = [t for t, ok in zip(texts, verdicts, strict=True) if not ok]
        correct += len(right)
        if right and wrong:
            pairs["policy"].append((problem.prompt, right[0], wrong[0]))
        distinct_wrong = list(dict.fromkeys(wrong))
        if len(distinct_wrong) >= 2:
            pairs["policy_wrong"].append((problem.prompt, distinct_wrong[0], distinct_wrong[1]))
    return pairs, {"sample_accuracy": correct / max(1, sum(map(len, samples))),
                   "pairs": float(len(pairs["policy"])), "wrong_pairs": float(len(pairs["policy_wrong"]))}


def judge_figures(judge: PairwiseJudge | PointwiseJudge, pairs: list[tuple[str, str, str]],
                  rows: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """A judge's figures on ``(prompt, right, wrong)`` pairs. Pairwise: :func:`tether.core.win_rate.verdict_accuracy`
    with the right answer as model A. Pointwise: ``verdict_accuracy`` is the share of pairs whose right answer
    scores higher, ``decisive_rate`` the share of unequal scores, ``decisive_accuracy`` the right share of those.
    ``rows``: a list each pair's record is appended to, ``{"prompt", "responses": [right, wrong], "verdicts"
    (pairwise: the parsed verdict with the right answer shown first, then second) or "scores" (pointwise),
    "replies": what the judge wrote for each}``."""
    prompts, right, wrong = (list(column) for column in zip(*pairs, strict=True))
    judge.transcript = [] if rows is not None else None
    try:
        if isinstance(judge, PairwiseJudge):
            first, second = judge.verdicts(prompts, right, wrong), judge.verdicts(prompts, wrong, right)
            counts = count_swapped_verdicts(first, second)
            out = {**verdict_accuracy(counts), "pairs": float(counts.n)}
            kind, outcomes = "verdicts", list(zip(first, second, strict=True))
        else:
            scored = list(zip(judge.score(prompts, right), judge.score(prompts, wrong), strict=True))
            wins = sum(r is not None and w is not None and r > w for r, w in scored)
            decided = sum(r is not None and w is not None and r != w for r, w in scored)
            out = {"verdict_accuracy": wins / len(scored), "decisive_rate": decided / len(scored),
                   "pairs": float(len(scored))}
            if decided:
                out["decisive_accuracy"] = wins / decided
            kind, outcomes = "scores", scored
        if rows is not None:  # the transcript holds one entry per pair for each of the two calls, in order
            replies = [entry["replies"] for entry in judge.transcript]
            rows.extend({"prompt": p, "responses": [r, w], kind: list(outcome), "replies": [a, b]}
                        for p, r, w, outcome, a, b in zip(prompts, right, wrong, outcomes, replies[:len(pairs)],
                                                           replies[len(pairs):], strict=True))
    finally:
        judge.transcript = None
    return out


def run_judge_eval(cfg: JudgeEvalConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    """Judge the held-out pairs of ``cfg`` (synthetic, and the policy's own with ``cfg.policy``); figures
    ``synthetic/*``, ``wrong_step/*`` (with ``right: steps``), ``policy/*`` and ``policy_wrong/*`` (how often the judge decides between two wrong
    answers) are the stage's results. Every pair's verdicts and the judge's replies go to ``STAGE/verdicts.jsonl``
    (:func:`judge_figures`' rows with their ``source``: the right response first, except ``policy_wrong``'s two
    wrong ones)."""
    import torch

    from tether.scoring import build_judge

    torch.set_num_threads(cfg.train.threads)
    stage_dir = run_dir / (cfg.name or cfg.type)
    stage_dir.mkdir(parents=True, exist_ok=True)
    task = get_task(cfg.task.name, **cfg.task.options)
    sources: dict[str, list[tuple[str, str, str]]] = {}
    results: dict[str, float] = {}
    if cfg.task.eval_n:
        sources["synthetic"] = synthetic_pairs(task, cfg.task, answers_only=cfg.responses == "answers")
        if cfg.right == "steps":
            sources["wrong_step"] = wrong_step_pairs(task, cfg.task)
    if cfg.policy is not None:
        sampled_pairs, sampled = policy_pairs(task, cfg.policy, cfg.task.seed, steps=cfg.right == "steps")
        sources.update(sampled_pairs)
        results.update({f"policy/{k}": v for k, v in sampled.items()})
    if not any(pairs for name, pairs in sources.items() if name != "policy_wrong"):
        raise ConfigError("judge_eval: no pairs to judge (task.eval_n is 0 and the policy gave no right-and-wrong "
                          "prompt)")
    judge = build_judge(cfg.judge, log_dir=stage_dir)
    verdicts: list[dict[str, Any]] = []
    try:
        for name, pairs in sources.items():
            if not pairs:
                continue
            rows: list[dict[str, Any]] = []
            figures = judge_figures(judge, pairs, rows)
            verdicts += [{"source": name, **row} for row in rows]
            if name == "policy_wrong":  # both wrong: "accuracy" means nothing, a decided pair is a judge error
                figures = {k: v for k, v in figures.items() if k in ("decisive_rate", "position_consistency")}
            results.update({f"{name}/{k}": v for k, v in figures.items()})
    finally:
        judge.close()
    write_jsonl_atomic(stage_dir / VERDICTS_FILE, verdicts)
    ckpt.mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results
