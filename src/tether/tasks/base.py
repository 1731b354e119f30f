"""Synthetic tasks: problem generators with their verifiers.

A task draws problems from a seeded RNG and checks completions. Held-out evaluation
problems are chosen by a hash of the problem itself, so no training split of any seed
can ever contain them. Every task yields the same four kinds of records:

- ``pretrain_records``: raw text (``{"text": ...}``)
- ``sft_records``: demonstrations, ``{"prompt", "completion"}`` or ``{"messages"}``, the
  completion optionally carrying a ``<think>...</think>`` reasoning part before the answer
- ``rl_records``: ``{"prompt", "answer"}`` for verifiable-reward RL
- ``eval_records``: held-out ``{"prompt", "answer"}`` (``reference_records``: with the reference completion)
"""

from __future__ import annotations

import hashlib
import importlib
import random
from dataclasses import dataclass
from typing import Protocol

from tether.core.registry import Registry

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    reasoning: str  # the worked steps that go inside <think>...</think>


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Problem: ...

    def verify(self, completion: str, answer: str) -> float: ...

    def pretrain_text(self, problem: Problem) -> str: ...


TASKS: Registry = Registry("task")


def get_task(name: str, **options) -> Task:
    """Build a task: a registered name (``get_task("arithmetic", digits=2, operators="+")``) or a user's
    factory by import path, ``"package.module:factory"``, called with ``options``; it must return an object
    with ``name``, ``sample(rng)``, ``verify(completion, answer)`` and ``pretrain_text(problem)`` (the
    :class:`Task` protocol), and is then used exactly as a built-in is (data, rewards, evaluation)."""
    if ":" not in name:
        return TASKS.get(name)(**options)
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as err:
        raise ValueError(f"task {name!r}: cannot import module {module_name!r} ({err})") from None
    except AttributeError:
        raise ValueError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    task = factory(**options)
    missing = [m for m in ("name", "sample", "verify", "pretrain_text") if not hasattr(task, m)]
    if missing:
        raise ValueError(f"task {name!r}: the factory returned a {type(task).__name__} without {', '.join(missing)} "
                         "(a task has name, sample(rng), verify(completion, answer) and pretrain_text(problem))")
    return task


def is_held_out(problem: Problem, eval_fraction: float) -> bool:
    """Deterministic split by problem content: the same problem is always on the same side (a problem with a
    ``split_key``, one problem written several ways, is split by that key instead of its prompt)."""
    digest = hashlib.sha256(getattr(problem, "split_key", problem.prompt).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def extract_answer(completion: str) -> str:
    """The text after the last ``</think>`` (the whole completion if there is none), stripped."""
    if THINK_CLOSE in completion:
        completion = completion.rsplit(THINK_CLOSE, 1)[1]
    return completion.strip()


def integer_answer_matches(completion: str, answer: str) -> float:
    """1.0 when the text after ``</think>`` is exactly the integer ``answer`` (commas and spaces ignored), else 0.0."""
    given = extract_answer(completion).replace(",", "").replace(" ", "")
    try:
        return float(int(given) == int(answer))
    except ValueError:
        return 0.0


def format_completion(problem: Problem, think: bool) -> str:
    # A problem whose gold answer is not what a demonstration writes (code: hidden tests) has a solution.
    answer = getattr(problem, "solution", None) or problem.answer
    if think:
        return f"{THINK_OPEN}{problem.reasoning}{THINK_CLOSE}{answer}"
    return answer


def draw_problems(
    task: Task, n: int, *, seed: int, split: str, eval_fraction: float = 0.1, max_tries: int = 100
) -> list[Problem]:
    """Draw ``n`` distinct problems of one split ("train" or "eval").

    Raises if the task's problem space cannot supply ``n`` distinct problems of that split.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    want_eval = split == "eval"
    rng = random.Random(f"{task.name}:{split}:{seed}")
    seen: set[str] = set()
    problems: list[Problem] = []
    misses = 0
    while len(problems) < n:
        problem = task.sample(rng)
        if problem.prompt in seen or is_held_out(problem, eval_fraction) != want_eval:
            misses += 1
            if misses > max_tries * max(n, 1):
                raise ValueError(
                    f"task {task.name!r} could only supply {len(problems)} distinct {split} problems, {n} asked"
                )
            continue
        seen.add(problem.prompt)
        problems.append(problem)
    return problems


def pretrain_records(task: Task, n: int, *, seed: int = 0, eval_fraction: float = 0.1) -> list[dict]:
    return [{"text": task.pretrain_text(p)} for p in draw_problems(task, n, seed=seed, split="train",
                                                                      eval_fraction=eval_fraction)]


def sft_records(
    task: Task, n: int, *, seed: int = 0, think: bool = True, chat: bool = False, eval_fraction: float = 0.1
) -> list[dict]:
    problems = draw_problems(task, n, seed=seed, split="train", eval_fraction=eval_fraction)
    records = []
    for p in problems:
        completion = format_completion(p, think)
        if chat:
            records.append({"messages": [{"role": "user", "content": p.prompt},
                                         {"role": "assistant", "content": completion}]})
        else:
            records.append({"prompt": p.prompt, "completion": completion})
    return records


def rl_records(task: Task, n: int, *, seed: int = 0, eval_fraction: float = 0.1) -> list[dict]:
    problems = draw_problems(task, n, seed=seed, split="train", eval_fraction=eval_fraction)
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems]


def eval_records(task: Task, n: int, *, seed: int = 0, eval_fraction: float = 0.1) -> list[dict]:
    problems = draw_problems(task, n, seed=seed, split="eval", eval_fraction=eval_fraction)
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems]


def reference_records(task: Task, n: int, *, seed: int = 0, think: bool = True, eval_fraction: float = 0.1
                      ) -> list[dict]:
    """The problems of :func:`eval_records` (same ``n`` and ``seed``) with the completion a demonstration
    would write (:func:`format_completion`): ``{"prompt", "answer", "completion"}``, held-out text for
    perplexity."""
    problems = draw_problems(task, n, seed=seed, split="eval", eval_fraction=eval_fraction)
    return [{"prompt": p.prompt, "answer": p.answer, "completion": format_completion(p, think)} for p in problems]
