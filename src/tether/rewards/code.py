"""The code verifier as a reward function: a candidate program scored by hidden unit tests in the sandbox.

``code_tests`` is the verifier of verifiable-reward RL on code, as in the unit-test rewards of CodeRL
(Le et al. 2022) and the code verifiers of DeepSeek-R1: the fraction of hidden tests the completion's
program passes, or 1/0 with ``partial=False``. The program is the completion's last fenced block, or
its answer part (:func:`tether.tasks.code.extract_code`); it runs with the tests in one sandboxed
process (:func:`tether.runtime.sandbox.run_tests`, whose harness stops a program from printing a
pass count). A program that kills its interpreter, loops or floods its output passes nothing.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tether.rewards.verifiers import REWARD_FUNCTIONS
from tether.runtime.sandbox import SandboxLimits
from tether.tasks.code import score_program


def _as_tests(value: str | list[str]) -> list[str]:
    return json.loads(value) if isinstance(value, str) else list(value)


@REWARD_FUNCTIONS.register("code_tests")
def code_tests_reward(prompts: list[str], completions: list[str], tests: list[str | list[str] | None] | None = None,
                      answer: list[str | None] | None = None, *, partial: bool = True,
                      limits: dict | None = None, workers: int = 4, **_columns) -> list[float | None]:
    """Fraction of hidden unit tests the completion's program passes (1/0 with ``partial=False``).

    ``tests`` (a dataset column: a list of test statements or its JSON) is read from the ``answer``
    column when there is no ``tests`` column, so a task whose gold answer is its tests works as is.
    A row with no tests gets None. Programs run ``workers`` at a time.
    """
    column = tests if tests is not None else answer
    if column is None:
        raise ValueError("code_tests needs a 'tests' (or 'answer') column holding the hidden tests")
    sandbox = SandboxLimits.model_validate(limits or {})

    def score(pair: tuple[str, str | list[str] | None]) -> float | None:
        completion, value = pair
        if value is None:
            return None
        suite = _as_tests(value)
        return score_program(completion, suite, partial=partial, limits=sandbox) if suite else None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(score, zip(completions, column, strict=True)))
