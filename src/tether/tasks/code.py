"""Short programming tasks scored by hidden unit tests run in the sandbox.

A problem asks for a one-line function (``Write f(x) that returns x plus 7.``); its gold
``answer`` is the JSON list of hidden ``assert`` tests (never shown in the prompt), and its
``solution`` the reference program a demonstration writes. ``verify`` runs a completion's program
and the tests in :mod:`tether.runtime.sandbox` and returns the fraction of tests passed
(``partial=False``: 1 only when all pass). The families are small on purpose: the tiny model must
read a constant and an operation from the prompt and write them into a function body.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from tether.runtime.sandbox import SandboxLimits, run_tests
from tether.tasks.base import TASKS, Problem, extract_answer

_FENCE = re.compile(r"```(?:python|py)?\s*\n(?P<code>.*?)```", re.DOTALL)

# family -> (prompt text, solution body, reference function, probe inputs around the constant k), so a
# program with the wrong constant fails at least one probe.
FAMILIES: dict[str, tuple[str, str, Callable[[int, int], object], Callable[[int], tuple[int, ...]]]] = {
    "add": ("returns x plus {k}", "x + {k}", lambda x, k: x + k, lambda k: (0, 3, -5, k)),
    "sub": ("returns x minus {k}", "x - {k}", lambda x, k: x - k, lambda k: (0, 4, k, -1)),
    "mul": ("returns x times {k}", "x * {k}", lambda x, k: x * k, lambda k: (0, 1, 7, -3)),
    "mod": ("returns x modulo {k}", "x % {k}", lambda x, k: x % k, lambda k: (k - 1, k, k + 3, 2 * k + 1)),
    "gt": ("returns whether x is greater than {k}", "x > {k}", lambda x, k: x > k, lambda k: (k - 1, k, k + 1, 0)),
    "eq": ("returns whether x equals {k}", "x == {k}", lambda x, k: x == k, lambda k: (k, k + 1, k - 1, 0)),
}


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced block if there is one, else the answer part
    (the text after ``</think>``, or all of it)."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else extract_answer(completion)


def score_program(completion: str, tests: list[str], *, partial: bool = True,
                  limits: SandboxLimits | dict | None = None) -> float:
    """The completion's program against ``tests`` in the sandbox: the fraction passed, or 1/0 without
    ``partial``. ``tests`` must not be empty."""
    passed, _ = run_tests(extract_code(completion), tests, limits=limits)
    return passed / len(tests) if partial else float(passed == len(tests))


@dataclass(frozen=True)
class CodeProblem(Problem):
    solution: str = ""


class CodeTask:
    """``Write f(x) that ...`` problems with hidden tests; see the module docstring."""

    name = "code"

    def __init__(self, families: list[str] | tuple[str, ...] = tuple(FAMILIES), max_constant: int = 999,
                 partial: bool = False, limits: dict | None = None) -> None:
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown or not families:
            raise ValueError(f"families must be a non-empty subset of {sorted(FAMILIES)}, got {list(families)}")
        self.families, self.max_constant, self.partial = list(families), max_constant, partial
        self.limits = {"cpu_s": 1.0, "wall_s": 5.0, **(limits or {})}

    def sample(self, rng: random.Random) -> CodeProblem:
        family = rng.choice(self.families)
        k = rng.randint(1, self.max_constant)
        text, body, reference, probes = FAMILIES[family]
        solution = f"def f(x):\n    return {body.format(k=k)}"
        tests = [f"assert f({x}) == {reference(x, k)!r}" for x in probes(k)]
        return CodeProblem(prompt=f"Write f(x) that {text.format(k=k)}.", answer=json.dumps(tests),
                           reasoning="", solution=solution)

    def verify(self, completion: str, answer: str) -> float:
        """Fraction of the hidden tests (``answer``, JSON) the completion's program passes (1/0 without
        ``partial``); 0 when there are none."""
        tests = json.loads(answer)
        return score_program(completion, tests, partial=self.partial, limits=self.limits) if tests else 0.0

    def pretrain_text(self, problem: CodeProblem) -> str:
        return f"# {problem.prompt}\n{problem.solution}"


TASKS.register("code")(CodeTask)
