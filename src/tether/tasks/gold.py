"""A hidden "gold" reward for arithmetic, and the labelled data of a synthetic InstructGPT pipeline.

InstructGPT's reward model learns from human comparisons; Gao, Schulman and Hilton 2022 replace the
humans with a fixed "gold" reward so the true reward of any policy can be measured while PPO
optimises a learned proxy. Here the gold reward is a function of the completion, known exactly and
never shown to the policy; it gives partial credit for the working, as a marker would:

    gold = 0.5 * [answer correct] + 0.5 * (reference steps reproduced in place) / max(#reference, #written steps)

The reference steps are the column-by-column trace of ``tether.tasks.arithmetic``; a step counts
when it is exactly the reference step at the same position, so a missing, wrong or extra step costs
credit. A completion without ``</think>`` scores 0.

The labelled data, drawn from the task's problems (train or held-out split):

- ``noisy_demonstrations``: SFT demonstrations from imperfect labellers: a share ``noise`` of them
  carries a slip (a dropped carry, or a miscopied answer). The SFT model imitates the slip;
  comparisons, which are easier to give than demonstrations, let RLHF remove it (InstructGPT's
  argument for RL).
- ``gold_comparisons``: pairs of the correct completion and one with an error drawn from
  ``errors`` (weights over ``answer`` and ``dropped_carry``, see
  ``tether.tasks.preferences.wrong_addition``), ordered by the gold reward. Two things can be
  learnt from ``dropped_carry`` pairs: "a carry must follow a column total of 10 or more", or the
  cheaper "a carry is good"; a small reward model picks the cheap one, and that is the proxy
  feature PPO over-optimises (adding carries where none belong).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tether.tasks.arithmetic import TRACES
from tether.tasks.base import (
    THINK_CLOSE,
    THINK_OPEN,
    Task,
    draw_problems,
    extract_answer,
    format_completion,
    is_held_out,
)
from tether.tasks.preferences import wrong_addition

ERROR_KINDS = ("answer", "dropped_carry", "spurious_carry")
_PROBLEM = re.compile(r"\s*(\d+)\s*([-+*])\s*(\d+)\s*=\s*$")


def gold_score(prompt: str, completion: str) -> float | None:
    """The gold reward of one completion in [0, 1] (module docstring); None if the prompt is not ``a op b=``."""
    match = _PROBLEM.search(prompt)
    if match is None:
        return None
    a, op, b = int(match[1]), match[2], int(match[3])
    if THINK_CLOSE not in completion:
        return 0.0
    reference = [s for s in TRACES[op](a, b).split("|") if s]
    work = completion.split(THINK_CLOSE, 1)[0].removeprefix(THINK_OPEN)
    written = [s for s in work.split("|") if s]
    steps = sum(w == r for w, r in zip(written, reference, strict=False)) / max(len(reference), len(written))
    try:
        correct = int(extract_answer(completion)) == {"+": a + b, "-": a - b, "*": a * b}[op]
    except ValueError:
        correct = False
    return 0.5 * float(correct) + 0.5 * steps


def gold_reward(prompts: Sequence[str], completions: Sequence[str], **_columns: Any) -> list[float | None]:
    """``gold_score`` of each completion (the reward-function protocol)."""
    return [gold_score(p, c) for p, c in zip(prompts, completions, strict=True)]


def _operands(prompt: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
    if match is None:
        raise ValueError(f"gold-labelled data is built for addition prompts 'a+b=', got {prompt!r}")
    return int(match[1]), int(match[2])


def spurious_carry(a: int, b: int) -> list[str] | None:
    """The steps of ``a+b`` (then the answer) with a carry into the tens column that the units column
    never made (it wrote ``c0``), carried through; None when the units do carry or there is no tens column."""
    da, db = [int(c) for c in reversed(str(a))], [int(c) for c in reversed(str(b))]
    if max(len(da), len(db)) < 2 or da[0] + db[0] >= 10:
        return None
    steps, digits, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        carry = 1 if i == 1 else carry
        total = x + y + carry
        steps.append(f"{x}+{y}{f'+{carry}' if carry else ''}={total} c{total // 10}")
        digits.append(total % 10)
        carry = total // 10
    return [*steps, str(int("".join(map(str, reversed(digits)))) + carry * 10 ** len(digits))]


def _wrong(a: int, b: int, kind: str, rng: random.Random) -> list[str] | None:
    """A wrong completion's steps with an error of ``kind``; None when the kind does not apply to ``a+b``."""
    if kind == "spurious_carry":
        return spurious_carry(a, b)
    steps, _, used = wrong_addition(a, b, rng, [kind])
    return steps if used == kind else None


def _completion(steps: list[str]) -> str:
    """Column steps + answer -> ``<think>s1|s2|</think>answer``."""
    return f"{THINK_OPEN}{''.join(s + '|' for s in steps[:-1])}{THINK_CLOSE}{steps[-1]}"


def noisy_demonstrations(task: Task, n: int, *, noise: float, error: str = "answer", seed: int = 0) -> list[dict]:
    """``n`` SFT records ``{prompt, completion}``; of the problems where ``error`` applies, a share ``noise``
    carries it (``answer``: miscopied off by one; ``dropped_carry``: a carry left out and carried through)."""
    if not 0.0 <= noise <= 1.0 or error not in ("answer", "dropped_carry"):
        raise ValueError(f"noise must be in [0, 1] and error 'answer' or 'dropped_carry', got {noise}, {error!r}")
    rng = random.Random(f"noisy-demonstrations:{seed}")
    records = []
    for problem in draw_problems(task, n, seed=seed, split="train"):
        completion = format_completion(problem, think=True)
        if rng.random() < noise:
            steps, _, used = wrong_addition(*_operands(problem.prompt), rng, [error])
            completion = _completion(steps) if used == error else completion
        records.append({"prompt": problem.prompt, "completion": completion})
    return records


def gold_comparisons(task: Task, n: int, *, errors: Mapping[str, float], seed: int = 0, split: str = "train",
                     eval_fraction: float = 0.1) -> list[dict]:
    """``n`` pairs ``{prompt, chosen, rejected, error, gold_chosen, gold_rejected}`` on distinct problems of
    ``split``: the correct completion against one with an error of a kind drawn by the ``errors`` weights
    (a problem where the drawn kind does not apply, no carry to drop, is skipped), chosen and rejected
    ordered by the gold reward."""
    kinds, weights = list(errors), list(errors.values())
    if not kinds or any(k not in ERROR_KINDS for k in kinds) or min(weights) < 0 or not sum(weights):
        raise ValueError(f"errors must weigh some of {', '.join(ERROR_KINDS)} (>= 0, not all 0), got {dict(errors)}")
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"gold-comparisons:{split}:{seed}")
    problems = random.Random(f"{task.name}:{split}:{seed}")
    seen: set[str] = set()
    pairs = []
    for _ in range(200 * n):
        if len(pairs) == n:
            break
        problem = task.sample(problems)
        if problem.prompt in seen or is_held_out(problem, eval_fraction) != (split == "eval"):
            continue
        seen.add(problem.prompt)
        kind = rng.choices(kinds, weights)[0]
        steps = _wrong(*_operands(problem.prompt), kind, rng)
        if steps is None:  # e.g. no carry to drop in this problem
            continue
        a, b = format_completion(problem, think=True), _completion(steps)
        ga, gb = gold_score(problem.prompt, a), gold_score(problem.prompt, b)
        chosen, rejected = (a, b) if ga >= gb else (b, a)
        pairs.append({"prompt": problem.prompt, "chosen": chosen, "rejected": rejected, "error": kind,
                      "gold_chosen": max(ga, gb), "gold_rejected": min(ga, gb)})
    if len(pairs) < n:
        raise ValueError(f"task {task.name!r} supplied only {len(pairs)} distinct {split} problems with "
                         f"{sorted(errors)} errors, {n} asked")
    return pairs
