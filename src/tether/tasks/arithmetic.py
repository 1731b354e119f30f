"""Integer arithmetic with digit-by-digit worked steps.

The reasoning trace does the schoolbook algorithm one column at a time, least significant
digit first, with the carry (or borrow) written out, e.g. for ``47+85=``::

    <think>7+5=12 c1|4+8+1=13 c1|</think>132

so a ~1M-parameter model only ever has to add two digits and a carry at each step.

With ``letter_digits`` > 0 that share of the problems states its operands in a second vocabulary, the letter
digits (0=A ... 9=J: ``EH+IF=`` is ``47+85=``), while the task's own vocabulary stays the digits: the answer,
and the worked steps of a demonstration, are in digits. The pretraining text of such a problem is written in
letters throughout, as a corpus in a second language would be, so a base model has seen reasoning in both and
may mix them; ``language_consistency`` (``tether.core.text_metrics``) measures how much it does.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tether.core.text_metrics import FROM_LETTERS, LETTER_DIGITS, TO_LETTERS
from tether.tasks.base import TASKS, THINK_CLOSE, THINK_OPEN, Problem, integer_answer_matches

OPERATORS = "+-*"


def _digits(n: int) -> list[int]:
    """Decimal digits of a non-negative int, least significant first."""
    return [int(c) for c in reversed(str(n))]


def addition_trace(a: int, b: int) -> str:
    da, db = _digits(a), _digits(b)
    carry, steps = 0, []
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        total = x + y + carry
        steps.append(f"{x}+{y}{f'+{carry}' if carry else ''}={total} c{total // 10}|")
        carry = total // 10
    return "".join(steps)


def subtraction_trace(a: int, b: int) -> str:
    if a < b:
        return f"{a}<{b} so -({b}-{a})|" + subtraction_trace(b, a)
    da, db = _digits(a), _digits(b)
    borrow, steps = 0, []
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        value = x - borrow - y
        new_borrow = 1 if value < 0 else 0
        steps.append(f"{x}-{y}{f'-{borrow}' if borrow else ''}={value + 10 * new_borrow} b{new_borrow}|")
        borrow = new_borrow
    return "".join(steps)


def multiplication_trace(a: int, b: int) -> str:
    partials = [f"{a}*{d}{'0' * i}={a * d * 10**i}" for i, d in enumerate(_digits(b))]
    return "|".join(partials) + "|"


TRACES = {"+": addition_trace, "-": subtraction_trace, "*": multiplication_trace}


@dataclass(frozen=True)
class LetterProblem(Problem):
    """A problem stated in letter digits; ``split_key`` is its digit prompt, so that both spellings of one
    problem fall on the same side of the held-out split."""

    split_key: str = ""


class Arithmetic:
    """``a op b`` with operands of ``min_digits``..``digits`` digits; verifier: exact integer match.
    ``letter_digits``: the share of prompts written in the letter digits A-J (see the module docstring).
    ``nonnegative``: a subtraction's larger operand comes first, so no answer is negative."""

    name = "arithmetic"

    def __init__(self, digits: int = 2, min_digits: int = 1, operators: str = "+",
                 pretrain_format: str = "equation", letter_digits: float = 0.0, nonnegative: bool = False) -> None:
        if not 1 <= min_digits <= digits <= 12:
            raise ValueError(f"need 1 <= min_digits <= digits <= 12, got min_digits={min_digits}, digits={digits}")
        if not operators or any(op not in OPERATORS for op in operators):
            raise ValueError(f"operators must be a non-empty string of {OPERATORS!r}, got {operators!r}")
        if pretrain_format not in ("equation", "worked", "think"):
            raise ValueError(f"pretrain_format must be 'equation', 'worked' or 'think', got {pretrain_format!r}")
        if not 0.0 <= letter_digits <= 1.0:
            raise ValueError(f"letter_digits is the share of prompts in letter digits, in [0, 1]; got {letter_digits}")
        self.digits, self.min_digits, self.operators = digits, min_digits, operators
        self.pretrain_format, self.letter_digits, self.nonnegative = pretrain_format, letter_digits, nonnegative

    def _operand(self, rng: random.Random) -> int:
        n_digits = rng.randint(self.min_digits, self.digits)
        low = 0 if n_digits == 1 else 10 ** (n_digits - 1)
        return rng.randint(low, 10**n_digits - 1)

    def sample(self, rng: random.Random) -> Problem:
        a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.operators)
        if op == "-" and self.nonnegative and a < b:
            a, b = b, a
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = f"{a}{op}{b}="
        if self.letter_digits and rng.random() < self.letter_digits:  # no draw at 0: the same problems as before
            return LetterProblem(prompt.translate(TO_LETTERS), str(result), TRACES[op](a, b), split_key=prompt)
        return Problem(prompt=prompt, answer=str(result), reasoning=TRACES[op](a, b))

    def solve(self, prompt: str) -> Problem | None:
        """The problem a prompt such as ``47+85=`` (or ``EH+IF=`` in letter digits) states, with its answer and
        worked steps (in digits); None when the prompt is not one this task writes."""
        parsed = self._parse(prompt)
        if parsed is None:
            return None
        a, op, b, in_letters = parsed
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        canonical = f"{a}{op}{b}="
        return Problem(prompt=canonical.translate(TO_LETTERS) if in_letters else canonical,
                       answer=str(result), reasoning=TRACES[op](a, b))

    def _parse(self, prompt: str) -> tuple[int, str, int, bool] | None:
        """``(a, op, b, in letter digits)`` of a prompt this task writes; None for any other text."""
        match = re.fullmatch(r"\s*(\d+|[A-J]+)([+*-])(\d+|[A-J]+)=\s*", prompt)
        if match is None or match[2] not in self.operators or match[1].isdigit() != match[3].isdigit():
            return None
        return int(match[1].translate(FROM_LETTERS)), match[2], int(match[3].translate(FROM_LETTERS)), \
            not match[1].isdigit()

    def check(self, prompt: str, answer: str) -> tuple[str, str, str] | None:
        """The inverse check of a candidate ``answer`` to ``prompt``, the check that is easier than solving
        when answering needs another procedure: for ``a-b=`` the answer plus ``b`` worked out column by column
        must give ``a``; for ``a+b=`` the answer minus ``b``. Returns ``(worked steps, what they give, a)``;
        the answer is right exactly when the last two agree. None when the answer is not an integer (a wrong
        answer). ``*`` has no such check here (long division is not easier than the product): ValueError."""
        parsed = self._parse(prompt)
        if parsed is None:
            raise ValueError(f"arithmetic check: not a prompt of this task: {prompt!r}")
        a, op, b, _ = parsed
        if op == "*":
            raise ValueError("arithmetic check: no inverse check for '*' (use the judge that solves the problem)")
        given = answer.replace(",", "").replace(" ", "")
        if not re.fullmatch(r"-?\d+", given):
            return None
        value = int(given)
        if op == "-":  # value + b, worked as a subtraction when value is negative
            steps = addition_trace(value, b) if value >= 0 else subtraction_trace(b, -value)
            return steps, str(value + b), str(a)
        if value < 0:  # a sum of non-negative operands: a negative answer is wrong, and value - b has no trace
            return None
        return subtraction_trace(value, b), str(value - b), str(a)

    def verify(self, completion: str, answer: str) -> float:
        """1.0 when the text after ``</think>`` is exactly the integer answer, else 0.0."""
        return integer_answer_matches(completion, answer)

    def pretrain_text(self, problem: Problem) -> str:
        """Raw text without the ``<think>`` protocol: plain equations (``47+85=132``), or with
        ``pretrain_format="worked"`` the column work in prose-like form
        (``47+85: 7+5=12 c1|4+8+1=13 c1| so 132``), so a base model can know the algorithm
        while never having seen the reasoning tags; ``"think"`` writes the problem in the reasoning
        protocol (``47+85=<think>...</think>132``), for a pretraining mix in which some other problems
        (another operator, say) carry the tags. A letter-digit problem's text is in letter digits
        throughout (``EH+IF: H+F=BC cB|...``)."""
        if self.pretrain_format == "worked":
            text = f"{problem.prompt[:-1]}: {problem.reasoning} so {problem.answer}"
        elif self.pretrain_format == "think":
            text = f"{problem.prompt}{THINK_OPEN}{problem.reasoning}{THINK_CLOSE}{problem.answer}"
        else:
            text = f"{problem.prompt}{problem.answer}"
        return text.translate(TO_LETTERS) if _in_letters(problem.prompt) else text


def _in_letters(prompt: str) -> bool:
    return any(ch in LETTER_DIGITS for ch in prompt)


TASKS.register("arithmetic")(Arithmetic)
