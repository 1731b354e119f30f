"""Synthetic preference and process-supervision data whose labels are known exactly.

Built from a task's problems (``draw_problems``), so the train and held-out splits never share a
problem: pass ``split="eval"`` for evaluation records.

- ``preference_records``: ``{prompt, chosen, rejected}`` pairs of one of three kinds:

  * ``correctness``: chosen is the correct completion with its ``<think>`` trace; rejected is a
    plausible wrong one, with an error of a kind drawn from ``errors``: for addition made inside
    the trace and carried through consistently (``slip``: a column sum off by one;
    ``dropped_carry``), or the trace right and the answer miscopied (``answer``); for other
    operators and tasks a number in one step and the answer nudged by one (the later steps
    left as they were), or the answer alone.
  * ``style``: both completions are correct; rejected pads the answer with filler words. The
    preference (concise over padded) is known exactly.
  * ``mixed``: alternately one of each.

- ``unpaired_records``: the same pairs split into ``{prompt, completion, label}`` (KTO).
- ``ranking_records``: ``{prompt, completions, ranks}`` with K = 2..6 answers ranked by correctness,
  then conciseness: the correct completion (rank 0) > it padded with filler words (1) > a wrong one
  (an error as in ``correctness``; 2) > that one padded (3); a fifth and sixth answer are a second,
  different wrong one and it padded, tied with ranks 2 and 3 (ties make no pair).
- ``stepwise_records``: ``{prompt, steps, labels}`` for a process reward model. The steps are the
  completion cut at ``|``, the separator the arithmetic traces already use, so a generated
  completion split the same way is scored exactly as the model was trained:
  ``<think>7+5=12 c1|4+8+1=13 c1|</think>132`` -> ``["<think>7+5=12 c1", "4+8+1=13 c1",
  "</think>132"]``. A share ``wrong_fraction`` of traces has one wrong step injected (as in
  ``correctness``); its label and every later one are 0, the ones before it 1 (the labelling of
  Math-Shepherd, Wang et al. 2024: a step is good if the solution can still be completed from it).
  With ``stop`` among ``errors`` a wrong trace may instead stop after one of its column steps, before
  the answer (``<think>7+5=12 c1``): the steps it has are right and labelled 1 but its last, where it
  ends, 0, since a solution that ends there has no answer. A process model reads the last step of a
  trace at eos (``tether.data.tokenize.step_sequence``), so it can learn that ending is wrong; without
  such traces a policy can stop after one plausible step and be scored as right.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Literal

from tether.tasks.base import THINK_CLOSE, THINK_OPEN, Problem, Task, draw_problems, format_completion

STEP_SEPARATOR = "|"
FILLERS = (
    "Well, let me see. The answer is ",
    "After careful thought, I believe the answer is ",
    "OK so, um, basically it is ",
    "Hmm, the final result would be ",
)
Kind = Literal["correctness", "style", "mixed"]
ERRORS = ("slip", "dropped_carry", "answer")  # the default kinds
ALL_ERRORS = (*ERRORS, "misread", "answer_digit")
STEPWISE_ERRORS = (*ALL_ERRORS, "stop")

_NUMBER = re.compile(r"\d+")


def _addition_operands(problem: Problem) -> tuple[int, int] | None:
    match = re.fullmatch(r"(\d+)\+(\d+)=", problem.prompt)
    return (int(match[1]), int(match[2])) if match else None


def _nudge(value: int, rng: random.Random) -> int:
    """``value`` +- 1, never negative and never ``value`` itself."""
    return value + 1 if value == 0 or rng.random() < 0.5 else value - 1


def _miscopied_digit(number: str, rng: random.Random) -> str:
    """``number`` with one digit, at a uniformly drawn position, off by one (0-9; a leading digit never 0)."""
    i = rng.randrange(len(number))
    digit = int(number[i])
    options = [d for d in (digit - 1, digit + 1) if 0 <= d <= 9 and not (d == 0 and i == 0 and len(number) > 1)]
    return number[:i] + str(rng.choice(options)) + number[i + 1:]


def wrong_addition(a: int, b: int, rng: random.Random, errors: Sequence[str] = ERRORS) -> tuple[list[str], int, str]:
    """The steps of ``a+b`` (one per column, then the answer) with one error carried through.

    Returns ``(steps, index of the first wrong step, error kind)``. The kind is drawn uniformly
    from those of ``errors`` that apply: ``slip``, a column total off by one; ``dropped_carry``,
    a column that has a carry-in written without it (weighted twice, as it only applies to some
    problems); ``answer``, the trace right but the answer miscopied, off by one; ``misread`` (not a
    default), one operand digit of a column copied off by one from the prompt and summed as written, the
    error a small policy makes most (``33+82=`` -> ``3+2=5 c0|2+8=10 c1|``); ``answer_digit`` (not a
    default), the trace right but one digit of the answer, at any position, copied off by one
    (``85+50=`` -> ``...|8+5=13 c1|</think>125``), where ``answer``'s +-1 on the value almost always moves
    the last digit only: a judge trained without it can check the trace's digits instead of the answer's.
    Columns after a wrong one are computed correctly from the wrong carry, and the answer is read off the
    wrong trace. When no allowed kind applies (only ``dropped_carry`` and no carry), ``answer`` is used.
    """
    da = [int(c) for c in reversed(str(a))]
    db = [int(c) for c in reversed(str(b))]
    width = max(len(da), len(db))
    correct = _addition_steps(da, db, None, "")
    carried = [i for i, step in enumerate(correct[:width]) if step.count("+") == 2]  # "x+y+1=..."
    options = [k for k in errors if k != "dropped_carry"] + (["dropped_carry"] * 2 if carried and
                                                              "dropped_carry" in errors else [])
    kind = rng.choice(options) if options else "answer"
    if kind == "answer":
        return [*correct[:width], str(_nudge(a + b, rng))], width, kind
    if kind == "answer_digit":
        return [*correct[:width], _miscopied_digit(str(a + b), rng)], width, kind
    bad = rng.choice(carried) if kind == "dropped_carry" else rng.randrange(width)
    if kind == "misread":  # past the shorter operand's last digit only the longer one has a digit to misread
        first = bad < len(da) and (bad >= len(db) or rng.random() < 0.5)
        digits = da if first else db
        digits = [*digits[:bad], _nudge(digits[bad], rng) if digits[bad] < 9 else 8, *digits[bad + 1:]]
        da, db = (digits, db) if first else (da, digits)
    return _addition_steps(da, db, bad, kind, rng), bad, kind


def _addition_steps(da: list[int], db: list[int], bad: int | None, kind: str,
                    rng: random.Random | None = None) -> list[str]:
    steps, digits, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        if i == bad and kind == "dropped_carry":
            carry = 0
        total = x + y + carry
        if i == bad and kind == "slip":
            total = _nudge(total, rng)
        steps.append(f"{x}+{y}{f'+{carry}' if carry else ''}={total} c{total // 10}")
        digits.append(total % 10)
        carry = total // 10
    answer = int("".join(map(str, reversed(digits)))) + carry * 10 ** len(digits)
    return [*steps, str(answer)]


def _wrong_completion(problem: Problem, rng: random.Random, errors: Sequence[str]) -> tuple[list[str], int, str]:
    """The completion's steps (cut at ``|``, answer last) with one wrong step, its index and kind.

    Addition: ``wrong_addition``. Anything else: ``answer`` nudges the answer by one; ``slip``
    nudges the last number of one step and the answer (later steps unchanged).
    """
    operands = _addition_operands(problem)
    if operands is not None:
        return wrong_addition(*operands, rng, errors)
    steps = [s for s in problem.reasoning.split(STEP_SEPARATOR) if s]
    try:
        answer = str(_nudge(int(problem.answer), rng))
    except ValueError:
        answer = problem.answer + problem.answer[-1:]
    numbered = [i for i, s in enumerate(steps) if _NUMBER.search(s)]
    if "slip" not in errors or not numbered or ("answer" in errors and rng.random() < 0.5):
        return [*steps, answer], len(steps), "answer"
    bad = rng.choice(numbered)
    last = list(_NUMBER.finditer(steps[bad]))[-1]
    steps[bad] = steps[bad][: last.start()] + str(_nudge(int(last[0]), rng)) + steps[bad][last.end():]
    return [*steps, answer], bad, "slip"


def _correct_steps(problem: Problem) -> list[str]:
    """The problem's own worked steps (cut at ``|``) and its answer last: the correct completion's steps."""
    return [*[s for s in problem.reasoning.split(STEP_SEPARATOR) if s], problem.answer]


def _join(steps: list[str]) -> str:
    """Column steps + answer -> ``<think>s1|s2|</think>answer`` (the SFT completion layout)."""
    return f"{THINK_OPEN}{''.join(s + STEP_SEPARATOR for s in steps[:-1])}{THINK_CLOSE}{steps[-1]}"


def completion_steps(completion: str, separator: str = STEP_SEPARATOR) -> list[str]:
    """A completion cut into steps at ``separator``; empty pieces are dropped."""
    return [s for s in completion.split(separator) if s.strip()]


def _pair(problem: Problem, kind: str, rng: random.Random, errors: Sequence[str]) -> dict:
    chosen = format_completion(problem, think=True)
    if kind == "style":
        rejected = f"{THINK_OPEN}{problem.reasoning}{THINK_CLOSE}{rng.choice(FILLERS)}{problem.answer}."
        error = "filler"
    else:
        steps, _, error = _wrong_completion(problem, rng, errors)
        rejected = _join(steps)
    return {"prompt": problem.prompt, "chosen": chosen, "rejected": rejected, "kind": kind, "error": error}


def _chat(record: dict, fields: tuple[str, ...]) -> dict:
    out = dict(record)
    out["prompt"] = [{"role": "user", "content": record["prompt"]}]
    for f in fields:
        value = record[f]
        out[f] = ([[{"role": "assistant", "content": v}] for v in value] if isinstance(value, list)
                  else [{"role": "assistant", "content": value}])
    return out


def _check_errors(errors: Sequence[str], allowed: Sequence[str] = ALL_ERRORS) -> None:
    unknown = sorted(set(errors) - set(allowed))
    if unknown or not errors:
        raise ValueError(f"errors must be a non-empty list of {', '.join(allowed)}; got {list(errors)}")


def preference_records(task: Task, n: int, *, seed: int = 0, split: str = "train", kind: Kind = "correctness",
                       errors: Sequence[str] = ERRORS, chat: bool = False, eval_fraction: float = 0.1) -> list[dict]:
    """``n`` preference pairs ``{prompt, chosen, rejected, kind, error}``, one per distinct problem of ``split``.

    ``errors``: the kinds of mistake a ``correctness`` rejected completion may carry (see
    ``wrong_addition``); ``error`` names the one it got (``filler`` for style pairs).
    """
    if kind not in ("correctness", "style", "mixed"):
        raise ValueError(f"kind must be 'correctness', 'style' or 'mixed', got {kind!r}")
    _check_errors(errors)
    problems = draw_problems(task, n, seed=seed, split=split, eval_fraction=eval_fraction)
    rng = random.Random(f"preference:{task.name}:{kind}:{split}:{seed}")
    records = []
    for i, problem in enumerate(problems):
        pair_kind = kind if kind != "mixed" else ("correctness", "style")[i % 2]
        record = _pair(problem, pair_kind, rng, errors)
        records.append(_chat(record, ("chosen", "rejected")) if chat else record)
    return records


def split_pairs(records: list[dict]) -> list[dict]:
    """Preference pairs -> unpaired records: chosen with ``label=True``, rejected with ``label=False``."""
    out = []
    for r in records:
        extra = {k: v for k, v in r.items() if k not in ("prompt", "chosen", "rejected")}
        out.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True, **extra})
        out.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False, **extra})
    return out


def unpaired_records(task: Task, n: int, *, seed: int = 0, split: str = "train", kind: Kind = "correctness",
                     errors: Sequence[str] = ERRORS, chat: bool = False, eval_fraction: float = 0.1) -> list[dict]:
    """``n`` unpaired records ``{prompt, completion, label}`` (from ``n // 2`` pairs, plus one if odd)."""
    pairs = preference_records(task, (n + 1) // 2, seed=seed, split=split, kind=kind, errors=errors, chat=chat,
                               eval_fraction=eval_fraction)
    return split_pairs(pairs)[:n]


def stepwise_records(task: Task, n: int, *, seed: int = 0, split: str = "train", wrong_fraction: float = 0.5,
                     errors: Sequence[str] = ERRORS, eval_fraction: float = 0.1) -> list[dict]:
    """``n`` stepwise records ``{prompt, steps, labels}``; see the module docstring for the labels."""
    if not 0.0 <= wrong_fraction <= 1.0:
        raise ValueError(f"wrong_fraction must be in [0, 1], got {wrong_fraction}")
    _check_errors(errors, STEPWISE_ERRORS)
    problems = draw_problems(task, n, seed=seed, split=split, eval_fraction=eval_fraction)
    rng = random.Random(f"stepwise:{task.name}:{split}:{seed}")
    mistakes = [e for e in errors if e != "stop"]
    records = []
    for problem in problems:
        if rng.random() >= wrong_fraction:
            steps = _correct_steps(problem)
            labels = [1] * len(steps)
        elif "stop" in errors and (not mistakes or rng.random() < 1 / len(errors)):
            columns = _correct_steps(problem)[:-1] or [problem.answer]
            kept = rng.randrange(1, len(columns) + 1)
            records.append({"prompt": problem.prompt,
                            "steps": completion_steps(THINK_OPEN + STEP_SEPARATOR.join(columns[:kept])),
                            "labels": [1] * (kept - 1) + [0]})
            continue
        else:
            steps, bad, _ = _wrong_completion(problem, rng, mistakes)
            labels = [int(i < bad) for i in range(len(steps))]
        # the tags ride on the first and last step, so joining the steps with "|" gives the completion
        text_steps = completion_steps(_join(steps))
        records.append({"prompt": problem.prompt, "steps": text_steps, "labels": labels})
    return records


def _padded(steps: list[str], rng: random.Random) -> str:
    """Column steps + answer -> the ``_join`` layout with the answer padded by filler words."""
    return f"{THINK_OPEN}{''.join(st + STEP_SEPARATOR for st in steps[:-1])}{THINK_CLOSE}{rng.choice(FILLERS)}{steps[-1]}."


def ranking_records(task: Task, n: int, *, seed: int = 0, split: str = "train", completions: int = 4,
                    errors: Sequence[str] = ERRORS, chat: bool = False, eval_fraction: float = 0.1) -> list[dict]:
    """``n`` ranking records ``{prompt, completions, ranks, kind}``, best first; see the module docstring.

    ``completions``: K, 2 to 6. A second wrong answer (K >= 5) is drawn until it differs from the
    first; a task whose problem admits no second one gets a record with fewer answers.
    """
    if not 2 <= completions <= 6:
        raise ValueError(f"completions must be 2 to 6 answers per prompt, got {completions}")
    _check_errors(errors)
    problems = draw_problems(task, n, seed=seed, split=split, eval_fraction=eval_fraction)
    rng = random.Random(f"ranking:{task.name}:{completions}:{split}:{seed}")
    records = []
    for problem in problems:
        correct = _correct_steps(problem)
        answers = [(format_completion(problem, think=True), 0), (_padded(correct, rng), 1)]
        wrong: list[list[str]] = []
        for _ in range(20 if completions > 2 else 0):
            steps = _wrong_completion(problem, rng, errors)[0]
            if steps not in wrong:
                wrong.append(steps)
            if len(wrong) == (2 if completions > 4 else 1):
                break
        for steps in wrong:
            answers += [(_join(steps), 2), (_padded(steps, rng), 3)]
        answers = sorted(answers[:completions], key=lambda a: a[1])
        record = {"prompt": problem.prompt, "completions": [a for a, _ in answers], "ranks": [r for _, r in answers],
                  "kind": "ranking"}
        records.append(_chat(record, ("completions",)) if chat else record)
    return records
