"""``tether compare MODEL_A MODEL_B --judge JUDGE``: a pairwise judge's win rate between two models.

Each model answers every prompt once (greedy by default); the judge sees each pair of answers in both
orders, A's first and B's first (Zheng et al. 2023, Sec. 3.4), and :mod:`tether.core.win_rate` counts A
wins, B wins and ties (both orders tie, the orders disagree, or a reply gave no verdict). Reported: A's
win rate ``(wins + ties / 2) / n`` with its 95% interval, the judge's position consistency and
first-position rate, and, when the prompts have answers the task can verify, the verifier's win rate of
A (only one answer correct: it wins; otherwise half), the judge's agreement with the verifier on the
prompts both decide, and, when the judge is one of the two models, its self-preference bias (Panickssery
et al. 2024): its win rate for itself minus the verifier's.

A model is a local checkpoint (a path, a hub id, ``tether/tiny``) or a served one: an OpenAI-compatible
endpoint, ``http://HOST:PORT/v1`` (the one model it serves) or ``http://HOST:PORT/v1#MODEL_ID``. A judge
is any pairwise judge of :func:`tether.scoring.build_judge`: ``self:A`` / ``self:B`` (one of the two
models judges: self-judging), a checkpoint, an endpoint (as above), ``package.module:function`` (judge
prompts -> replies), a :class:`~tether.config.JudgeConfig` (or its dict), or from Python a built
:class:`~tether.rewards.judge.PairwiseJudge` or a function. A judge given as the same string as a model
is that model judging (``self:``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich import get_console

from tether.config.base import ConfigError, describe_validation_error
from tether.config.rewards import JudgeConfig
from tether.core.win_rate import (
    count_swapped_verdicts,
    first_position_rate,
    judge_verifier_agreement,
    outcome_value,
    position_consistency,
    self_preference_bias,
    swapped_outcome,
    verifier_outcome,
    win_rate,
    win_rate_interval,
)
from tether.data import tokenize_prompts
from tether.data.files import write_json_atomic
from tether.data.sources import read_prompt_records
from tether.rewards.judge import PairwiseJudge
from tether.rollout import HFEngine, SamplingParams
from tether.runtime.progress import ProgressLines
from tether.tasks import eval_records, get_task

ENDPOINT = re.compile(r"^https?://")
FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
SIDES = ("A", "B")


def is_endpoint(spec: str) -> bool:
    """Whether a model string names a served model (``http(s)://...``) rather than a checkpoint."""
    return bool(ENDPOINT.match(spec))


class Side:
    """One model of a comparison: a checkpoint loaded here (an :class:`HFEngine`) or an endpoint (an
    :class:`~tether.rollout.openai_engine.OpenAIEngine`), checked to be up and to serve the model asked for."""

    def __init__(self, spec: str, *, api_key_env: str | None = None, timeout: float = 60.0, batch_size: int = 32,
                 chat: bool = False) -> None:
        self.spec, self.chat, self.batch_size, self.api_key_env = spec, chat, batch_size, api_key_env
        self.model = self.tokenizer = self.base_url = None
        if is_endpoint(spec):
            from tether.rollout.openai_engine import OpenAIEngine

            self.base_url, _, wanted = spec.partition("#")
            self.engine: Any = OpenAIEngine(self.base_url, wanted, api_key_env=api_key_env, timeout=timeout,
                                            chat=chat)
            served = self.engine.model_ids()
            if not wanted and len(served) != 1:
                raise ValueError(f"{self.base_url} serves {len(served)} models ({', '.join(served)}); name one: "
                                 f"{self.base_url}#MODEL_ID")
            if wanted and wanted not in served:
                raise ValueError(f"{self.base_url} does not serve {wanted!r}; it serves: {', '.join(served)}")
            self.engine.model = wanted or served[0]
            return
        from tether.models import load_model

        self.model, self.tokenizer = load_model(spec)
        self.model.eval()
        self.engine = HFEngine(self.model, self.tokenizer, batch_size=batch_size)

    @property
    def model_id(self) -> str:
        """The endpoint's model id (served), else the checkpoint string."""
        return self.engine.model if self.base_url else self.spec

    def answer(self, prompts: Sequence[str], params: SamplingParams, on_done: Callable[[int], None]) -> list[str]:
        """One completion per prompt, in prompt order; ``on_done(k)`` after each batch (k answered so far)."""
        if self.base_url is None:
            self.engine.on_batch = on_done
            rollout = self.engine.generate(tokenize_prompts(list(prompts), self.tokenizer, chat=self.chat), params)
            return _in_prompt_order(rollout.texts, rollout.prompt_index, len(prompts))
        texts: list[str] = []
        for start in range(0, len(prompts), self.batch_size):  # in chunks, to report progress
            out = self.engine.complete(list(prompts[start:start + self.batch_size]), params)
            texts += _in_prompt_order(out.texts, out.prompt_index, len(out.texts))
            on_done(len(texts))
        return texts


def _in_prompt_order(texts: Sequence[str], index: Sequence[int], count: int) -> list[str]:
    out = [""] * count
    for text, i in zip(texts, index, strict=True):
        out[i] = text
    return out


# ---- the judge ---------------------------------------------------------------------------------------


def _self_side(judge: Any, sides: dict[str, Side]) -> str | None:
    """``"A"`` / ``"B"`` when the judge string names one of the two models (``self:A``, or the same string)."""
    if not isinstance(judge, str):
        return None
    if judge.startswith("self:"):
        side = judge[len("self:"):].upper()
        if side not in SIDES:
            raise ValueError(f"judge {judge!r}: write self:A or self:B (the model that judges)")
        return side
    same = [s for s in SIDES if sides[s].spec == judge]
    return same[0] if len(same) == 1 else None


def judge_config(judge: str, sides: dict[str, Side], options: dict[str, Any] | None = None) -> JudgeConfig:
    """The :class:`JudgeConfig` a judge string names (see the module docstring), ``options`` (its other
    fields: ``template``, ``sampling``, ``chat``, ...) on top; a judge that is not pairwise is an error."""
    own = _self_side(judge, sides)
    side = sides[own] if own else None
    if side is not None and side.base_url is None:
        where: dict[str, Any] = {"backend": "policy"}
    elif side is not None:
        where = {"backend": "endpoint", "base_url": side.base_url, "model": side.model_id,
                 "api_key_env": side.api_key_env}
    elif is_endpoint(judge):
        where = {"backend": "endpoint", "base_url": judge.partition("#")[0], "model": judge.partition("#")[2] or None}
        if where["model"] is None:
            from tether.rollout.openai_engine import OpenAIEngine

            served = OpenAIEngine(where["base_url"], "", api_key_env=(options or {}).get("api_key_env")).model_ids()
            if len(served) != 1:
                raise ValueError(f"judge {judge} serves {len(served)} models ({', '.join(served)}); name one: "
                                 f"{judge}#MODEL_ID")
            where["model"] = served[0]
    elif FUNCTION.match(judge):
        where = {"backend": "callable", "model": judge}
    else:
        where = {"backend": "model", "model": judge}
    try:
        cfg = JudgeConfig.model_validate({"kind": "pairwise", **(options or {}), **where})
    except ValidationError as err:
        raise ConfigError(f"judge option {describe_validation_error(err)}") from None
    if cfg.kind != "pairwise":
        raise ValueError(f"tether compare needs a pairwise judge (one verdict per pair of answers); got kind "
                         f"{cfg.kind!r}: drop kind=pointwise")
    return cfg


def resolve_judge(judge: Any, sides: dict[str, Side], options: dict[str, Any] | None = None
                  ) -> tuple[PairwiseJudge, bool, str | None]:
    """``(judge, built_here, self_side)``: a :class:`PairwiseJudge` from any judge form of the module docstring;
    ``built_here``: close it when done; ``self_side``: ``"A"`` / ``"B"`` when a judge string names a model."""
    from tether.scoring import build_judge

    if isinstance(judge, PairwiseJudge):
        return judge, False, None
    if callable(judge) and not isinstance(judge, str):
        return PairwiseJudge(judge, template=(options or {}).get("template") or "pairwise"), True, None
    if isinstance(judge, dict | JudgeConfig):
        cfg = JudgeConfig.model_validate(judge) if isinstance(judge, dict) else judge
        if cfg.kind != "pairwise":
            raise ValueError(f"tether compare needs a pairwise judge; got kind {cfg.kind!r}")
        return build_judge(cfg), True, None  # type: ignore[return-value]
    if not isinstance(judge, str) or not judge:
        raise ValueError(f"a judge is self:A, self:B, a checkpoint, an endpoint URL or package.module:function; "
                         f"got {judge!r}")
    own = _self_side(judge, sides)
    cfg = judge_config(judge, sides, options)
    side = sides[own] if own else None
    built = build_judge(cfg, policy=side.model if side else None, tokenizer=side.tokenizer if side else None)
    return built, True, own  # type: ignore[return-value]


# ---- the comparison ----------------------------------------------------------------------------------


def prompt_set(prompts: str | Path | Sequence[str | dict] | None, task: Any, n: int, seed: int) -> list[dict]:
    """Prompt records: a task's held-out problems (``prompts`` None), a prompts file, or a list of prompts or
    records (``prompt`` and, for the verifier, ``answer``); at most ``n``."""
    if prompts is None:
        if task is None:
            raise ValueError("give a task (its held-out problems are the prompts) or a prompts file")
        return eval_records(task, n, seed=seed)
    records = read_prompt_records(prompts) if isinstance(prompts, str | Path) else [
        p if isinstance(p, dict) else {"prompt": p} for p in prompts]
    if not records:
        raise ValueError("the prompt set is empty; give at least one prompt")
    return records[:n]


def pairwise_win_rate(model_a: str, model_b: str, judge: Any, *, task: str | None = "arithmetic",
                      task_options: dict[str, Any] | None = None,
                      prompts: str | Path | Sequence[str | dict] | None = None, n: int = 100, seed: int = 0,
                      prompt_template: str = "{prompt}", max_new_tokens: int = 64, temperature: float = 0.0,
                      chat: bool = False, judge_options: dict[str, Any] | None = None, judge_is: str | None = None,
                      api_key_env: str | None = None, timeout: float = 60.0, batch_size: int = 32,
                      out: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Model A against model B, judged in both orders (see the module docstring). Returns the figures
    (``win_rate_a`` with ``_ci95_low`` / ``_high``, ``a_wins``, ``b_wins``, ``ties``, ``position_consistency``,
    ``first_position_rate``; with a verifier ``accuracy_a`` / ``_b``, ``verifier_win_rate_a``,
    ``judge_verifier_agreement``; with a self-judge ``self_preference_bias``) and under ``pairs`` every
    prompt's answers and verdicts; writes them as JSON to ``out``. ``prompt_template`` turns a problem into
    the models' prompt (the judge sees the bare problem); ``judge_is``: ``"A"`` / ``"B"`` when a judge given
    as an object is one of the two models."""
    if n < 1 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"need n, max_new_tokens and batch_size >= 1; got {n}, {max_new_tokens}, {batch_size}")
    if judge_is is not None and judge_is not in SIDES:
        raise ValueError(f"judge_is is 'A' or 'B' (the model that judges), got {judge_is!r}")
    task_obj = get_task(task, **(task_options or {})) if task else None
    records = prompt_set(prompts, task_obj, n, seed)
    sides = {"A": Side(model_a, api_key_env=api_key_env, timeout=timeout, batch_size=batch_size, chat=chat)}
    sides["B"] = sides["A"] if model_b == model_a else Side(model_b, api_key_env=api_key_env, timeout=timeout,
                                                             batch_size=batch_size, chat=chat)
    pairwise, built, own = resolve_judge(judge, sides, judge_options)
    own = judge_is or own
    try:
        figures = _compare(records, sides, pairwise, task_obj, prompt_template, progress, batch_size,
                           SamplingParams(temperature=temperature, greedy=temperature == 0,
                                          max_new_tokens=max_new_tokens, seed=seed))
    finally:
        if built:
            pairwise.close()
    if own is not None and "verifier_win_rate_a" in figures:
        sign = 1.0 if own == "A" else -1.0  # B's win rates are 1 - A's, by judge and by verifier alike
        figures["self_preference_bias"] = sign * self_preference_bias(figures["win_rate_a"],
                                                                      figures["verifier_win_rate_a"])
    result = {"model_a": model_a, "model_b": model_b, "judge": judge if isinstance(judge, str) else repr(judge),
              "judge_is": own, "task": task, **figures}
    if out is not None:
        write_json_atomic(out, result)
    return result


def _compare(records: list[dict], sides: dict[str, Side], judge: PairwiseJudge, task: Any, template: str,
             progress: bool, batch_size: int, params: SamplingParams) -> dict[str, Any]:
    count = len(records)
    questions = [str(r["prompt"]) for r in records]
    prompts = [template.format(prompt=q) for q in questions]
    lines = ProgressLines("compare", 4 * count, "generations", enabled=progress, console=get_console())
    answers_a = sides["A"].answer(prompts, params, lines.update)
    answers_b = sides["B"].answer(prompts, params, lambda k: lines.update(count + k))
    forward: list[Any] = []
    backward: list[Any] = []
    for start in range(0, count, batch_size):  # both orders of a chunk in one call, so an endpoint sees them together
        q, a, b = (x[start:start + batch_size] for x in (questions, answers_a, answers_b))
        both = judge.verdicts([*q, *q], [*a, *b], [*b, *a])
        forward += both[:len(q)]
        backward += both[len(q):]
        lines.update(2 * count + 2 * len(forward))
    counts = count_swapped_verdicts(forward, backward)
    outcomes = [swapped_outcome(f, b) for f, b in zip(forward, backward, strict=True)]
    low, high = win_rate_interval(counts.a_wins, counts.ties, count)
    figures: dict[str, Any] = {
        "n": count, **counts.as_dict(), "win_rate_a": win_rate(counts.a_wins, counts.ties, count),
        "win_rate_a_ci95_low": low, "win_rate_a_ci95_high": high,
        "position_consistency": position_consistency(counts), "first_position_rate": first_position_rate(counts)}
    pairs = [{"prompt": q, "answer_a": a, "answer_b": b, "verdict_a_first": f, "verdict_b_first": k, "outcome": o}
             for q, a, b, f, k, o in zip(questions, answers_a, answers_b, forward, backward, outcomes, strict=True)]
    if task is not None and all(r.get("answer") is not None for r in records):
        correct_a = [bool(task.verify(t, r["answer"])) for t, r in zip(answers_a, records, strict=True)]
        correct_b = [bool(task.verify(t, r["answer"])) for t, r in zip(answers_b, records, strict=True)]
        by_verifier = [verifier_outcome(x, y) for x, y in zip(correct_a, correct_b, strict=True)]
        only_a, only_b = by_verifier.count(1.0), by_verifier.count(0.0)
        v_low, v_high = win_rate_interval(only_a, count - only_a - only_b, count)
        agreement, decided = judge_verifier_agreement([outcome_value(o) for o in outcomes], by_verifier)
        figures.update({
            "accuracy_a": sum(correct_a) / count, "accuracy_b": sum(correct_b) / count,
            "verifier_win_rate_a": win_rate(only_a, count - only_a - only_b, count),
            "verifier_win_rate_a_ci95_low": v_low, "verifier_win_rate_a_ci95_high": v_high,
            "verifier_decided": only_a + only_b, "judge_verifier_agreement": agreement,
            "judge_verifier_decided": decided})
        for pair, x, y in zip(pairs, correct_a, correct_b, strict=True):
            pair.update({"correct_a": x, "correct_b": y})
    figures["pairs"] = pairs
    return figures
