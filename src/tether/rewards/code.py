"""The code verifier: a candidate program scored by hidden unit tests run in the sandbox.

``run_tests(code, tests)`` runs the candidate and then each test (an ``assert`` statement, or any
code that raises on failure) in one sandboxed process (:mod:`tether.rewards.sandbox`) and counts
the tests that pass; ``code_tests`` is the reward function built on it (the verifier of
verifiable-reward RL on code, as in the unit-test rewards of CodeRL, Le et al. 2022, and the
code verifiers of DeepSeek-R1): the fraction of tests passed, or 1/0 with ``partial=False``.

The candidate runs first, inside a harness that then runs the tests and prints a summary line
tagged with a random nonce passed on stdin, so a program cannot simply print a pass count. A
program that kills its interpreter, loops or floods its output passes nothing. The tests are
hidden from the prompt, not from the process: a program that inspects the harness's frames could
find the nonce, so the nonce stops reward hacking by printing, not by introspection.
"""

from __future__ import annotations

import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from tether.rewards.sandbox import SandboxLimits, SandboxResult, run_python
from tether.rewards.verifiers import REWARD_FUNCTIONS
from tether.tasks.base import extract_answer

_FENCE = re.compile(r"```(?:python|py)?\s*\n(?P<code>.*?)```", re.DOTALL)

HARNESS = r'''
import sys as _sys
_nonce, _tests = _sys.stdin.readline().strip(), __import__("json").loads(_sys.stdin.readline())
_namespace = {"__name__": "solution"}
_passed = 0
try:
    exec(compile(%(code)r, "solution.py", "exec"), _namespace)
except BaseException as _error:
    print(f"solution failed: {type(_error).__name__}: {_error}", file=_sys.stderr)
else:
    for _test in _tests:
        try:
            exec(compile(_test, "test.py", "exec"), dict(_namespace))
            _passed += 1
        except BaseException as _error:
            print(f"test failed: {_test!r}: {type(_error).__name__}: {_error}", file=_sys.stderr)
print("\n" + _nonce, _passed, len(_tests), flush=True)
'''


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced block if there is one, else the answer part
    (the text after ``</think>``, or all of it)."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else extract_answer(completion)


def run_tests(code: str, tests: list[str], *, limits: SandboxLimits | dict | None = None
              ) -> tuple[int, SandboxResult]:
    """Run ``code`` then ``tests`` in one sandboxed process; returns (tests passed, the sandbox result)."""
    nonce = secrets.token_hex(16)
    result = run_python(HARNESS % {"code": code}, limits=limits, stdin=f"{nonce}\n{json.dumps(tests)}\n")
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == str(len(tests)) and result.limit is None:
            return int(parts[1]), result
    return 0, result


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
        if not suite:
            return None
        passed, _ = run_tests(extract_code(completion), suite, limits=sandbox)
        return passed / len(suite) if partial else float(passed == len(suite))

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(score, zip(completions, column, strict=True)))
