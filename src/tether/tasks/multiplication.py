"""Multi-digit multiplication to be solved with a tool: ``417*823=`` -> ``343191``.

Three-digit products are beyond what the ~1M-parameter tiny model computes in its head (its
direct-answer accuracy is ~0 after SFT on them), but copying operands into a tool call and the
tool's result into the answer is easy, so the task isolates learning to *use* tools (Toolformer,
Schick et al. 2023). ``tool_plan`` is the scripted call a demonstration makes: the calculator
(``417*823``) or the python tool (``print(417*823)``), chosen per problem by a hash so the
demonstrations mix both tools deterministically. With ``direct_fraction`` > 0 that share of the
demonstrations (again by hash) answers at once, with no tool: a warm-up whose policy sometimes
skips the tool and then, being unable to multiply, answers wrongly, so RL has to learn *when* to
call a tool, not only how.
"""

from __future__ import annotations

import hashlib
import random

from tether.tasks.arithmetic import multiplication_trace
from tether.tasks.base import TASKS, Problem, integer_answer_matches

TOOL_ARGUMENTS = {"calculator": lambda a, b: {"expression": f"{a}*{b}"},
                  "python": lambda a, b: {"code": f"print({a}*{b})"}}


class Multiplication:
    """``a*b`` with ``min_digits``..``digits``-digit operands; verifier: exact integer match of the answer."""

    name = "multiplication"

    def __init__(self, digits: int = 3, min_digits: int | None = None,
                 tools: tuple[str, ...] | list[str] = ("calculator", "python"), direct_fraction: float = 0.0) -> None:
        min_digits = digits if min_digits is None else min_digits
        if not 1 <= min_digits <= digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= digits <= 9, got min_digits={min_digits}, digits={digits}")
        unknown = sorted(set(tools) - set(TOOL_ARGUMENTS))
        if unknown or not tools:
            raise ValueError(f"tools must be a non-empty subset of {sorted(TOOL_ARGUMENTS)}, got {list(tools)}")
        if not 0.0 <= direct_fraction <= 1.0:
            raise ValueError(f"direct_fraction must be in [0, 1], got {direct_fraction}")
        self.digits, self.min_digits, self.tools = digits, min_digits, list(tools)
        self.direct_fraction = direct_fraction

    def _operand(self, rng: random.Random) -> int:
        n = rng.randint(self.min_digits, self.digits)
        return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        return Problem(prompt=f"{a}*{b}=", answer=str(a * b), reasoning=multiplication_trace(a, b))

    def verify(self, completion: str, answer: str) -> float:
        return integer_answer_matches(completion, answer)

    def pretrain_text(self, problem: Problem) -> str:
        return f"{problem.prompt}{problem.answer}"

    def tool_plan(self, problem: Problem) -> list[dict]:
        """One call computing the product with a tool picked by a hash of the problem, or no call for
        the ``direct_fraction`` of problems answered at once."""
        a, b = problem.prompt.rstrip("=").split("*")
        digest = hashlib.sha256(problem.prompt.encode()).digest()
        if digest[1] / 256 < self.direct_fraction:
            return []
        tool = self.tools[digest[0] % len(self.tools)]
        return [{"name": tool, "arguments": TOOL_ARGUMENTS[tool](a, b)}]


TASKS.register("multiplication")(Multiplication)
