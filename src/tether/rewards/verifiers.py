"""Built-in verifiable reward functions, keyed by the name users write in configs.

Every function follows the reward protocol::

    fn(prompts: list[str], completions: list[str], **dataset_columns) -> list[float | None]

one value per completion; ``None`` means "no reward for this sample" (the gold answer is
missing or cannot be read, say). Dataset columns such as ``answer`` arrive as keyword lists
aligned with the completions; options come from the config's ``kwargs`` as plain keyword values::

    rewards:
      - {name: accuracy, weight: 1.0, kwargs: {task: arithmetic}}
      - {name: format, weight: 0.5, kwargs: {partial_credit: 0.5}}

Every built-in ends in ``**_columns`` so that unrelated dataset columns pass through harmlessly;
``RewardComposer`` still rejects option names a built-in does not know, so a typo in a config is
an error rather than a silently ignored option.

Correctness rewards (``accuracy``, ``math``, ``exact_match``) look only at the answer part of a
completion: the text after the last ``</think>``, or all of it when there is none.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Iterator

import tether.tasks  # noqa: F401  (registers the built-in tasks that ``accuracy`` looks up)
from tether.core.registry import Registry
from tether.core.text_metrics import LETTER_DIGITS, OWN_DIGITS, cot_consistency
from tether.tasks.base import THINK_CLOSE, THINK_OPEN, extract_answer, format_completion, get_task

RewardFunction = Callable[..., list[float | None]]

REWARD_FUNCTIONS: Registry[RewardFunction] = Registry("reward function")


@REWARD_FUNCTIONS.register("accuracy", "task")
def task_reward(
    prompts: list[str],
    completions: list[str],
    answer: list[str | None],
    *,
    task: str = "arithmetic",
    task_options: dict | None = None,
    **_columns,
) -> list[float | None]:
    """Task correctness: the registered task's own verifier (``Task.verify``) on each completion.

    ``task`` names a task in ``tether.tasks.TASKS``; ``task_options`` are its constructor options
    (``{"digits": 3}``). They are a dict rather than loose keywords because loose keywords would
    collide with dataset columns, which arrive as keywords too. A row whose ``answer`` is None
    gets None.
    """
    verifier = get_task(task, **(task_options or {}))
    return [
        None if gold is None else float(verifier.verify(completion, str(gold)))
        for completion, gold in zip(completions, answer, strict=True)
    ]


class VerificationTimeout(TimeoutError):
    """math-verify ran out of time on an answer: its score would depend on the machine's load, so it is
    raised rather than scored 0 (a reward composer with ``on_error="zero"`` scores it 0 and counts it in
    ``reward/<label>/timeouts``)."""


class _TimeoutCounter(logging.Handler):
    """Counts math-verify's "Timeout during parsing / comparison" warnings (it returns [] / False on a
    timeout, the same as for an answer that does not parse or does not match)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += str(record.msg).startswith("Timeout during")


@contextlib.contextmanager
def _counting_timeouts() -> Iterator[_TimeoutCounter]:
    logger, counter = logging.getLogger("math_verify"), _TimeoutCounter()
    logger.addHandler(counter)
    try:
        yield counter
    finally:
        logger.removeHandler(counter)


def _parse_gold(gold: str, timeout: int | None) -> list:
    from math_verify import parse

    # Gold answers are often bare LaTeX ("\sqrt{2}") that math_verify only reads inside math delimiters.
    return parse(gold, parsing_timeout=timeout) or parse(f"${gold}$", parsing_timeout=timeout)


@REWARD_FUNCTIONS.register("math")
def math_reward(
    prompts: list[str],
    completions: list[str],
    answer: list[str | None],
    *,
    timeout: int | None = 5,
    max_answer_chars: int = 512,
    **_columns,
) -> list[float | None]:
    """Mathematical equivalence of the completion's answer and the gold ``answer``, by math-verify.

    math-verify (Kydlíček, Hugging Face 2025) extracts the answer (``\\boxed{}`` first, then LaTeX
    and plain expressions), parses it with SymPy and compares symbolically and numerically, so
    ``\\boxed{\\frac{1}{2}}``, ``1/2`` and ``0.5`` all match a gold ``0.5``. 1.0 on a match, 0.0
    otherwise (including an answer that cannot be parsed); None when the gold answer is None or
    cannot be parsed itself (a data problem, not the policy's).

    A reward must not depend on the machine's load, so the work is bounded by the input, not the
    clock: an extracted answer longer than ``max_answer_chars`` scores 0 without being parsed.
    ``timeout`` seconds remain a guard (math-verify's ``signal.alarm``, main thread only; off it, and
    with ``timeout=None`` or ``0``, there is none): an answer that still runs out of time raises
    :class:`VerificationTimeout` instead of silently scoring 0.
    """
    from math_verify import parse, verify

    if not timeout or threading.current_thread() is not threading.main_thread():
        timeout = None
    golds: dict[str, list] = {}  # K completions per prompt share one gold: parse it once
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)
            continue
        key, extracted = str(gold), extract_answer(completion)
        score: float | None = 0.0
        with _counting_timeouts() as timeouts:
            if key not in golds:
                golds[key] = _parse_gold(key, timeout)
            if not golds[key]:
                score = None
            elif len(extracted) <= max_answer_chars:
                predicted = parse(extracted, parsing_timeout=timeout)
                score = float(bool(predicted) and verify(golds[key], predicted, timeout_seconds=timeout))
        if timeouts.count:
            raise VerificationTimeout(f"math-verify ran out of time ({timeout}s) on an answer of {len(extracted)} "
                                      f"characters against the gold {key[:80]!r}")
        scores.append(score)
    return scores


_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def normalize_answer(text: str) -> str:
    """Lowercase, collapse whitespace, drop trailing periods and thousands separators ("1,234" -> "1234")."""
    text = " ".join(text.lower().split())
    text = text.rstrip(".").rstrip()
    return _THOUSANDS_SEPARATOR.sub("", text)


@REWARD_FUNCTIONS.register("exact_match")
def exact_match_reward(
    prompts: list[str],
    completions: list[str],
    answer: list[str | None],
    *,
    extract: bool = True,
    **_columns,
) -> list[float | None]:
    """1.0 when the answer equals the gold ``answer`` after ``normalize_answer``, else 0.0.

    ``extract=False`` compares the whole completion instead of the text after ``</think>``.
    A row whose ``answer`` is None gets None.
    """
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)
            continue
        given = extract_answer(completion) if extract else completion
        scores.append(float(normalize_answer(given) == normalize_answer(str(gold))))
    return scores


_THINK_BLOCK = re.compile(r"\s*<think>(?P<think>.*?)</think>(?P<rest>.*)", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL)


def format_score(completion: str, *, answer_tags: bool = False, partial_credit: float = 0.0) -> float:
    """Score one completion for the R1 format; see ``format_reward``."""
    block = _THINK_BLOCK.fullmatch(completion)
    if (
        block is None
        or THINK_OPEN in block["think"]
        or THINK_OPEN in block["rest"]
        or THINK_CLOSE in block["rest"]
    ):
        return 0.0
    rest = block["rest"]
    if answer_tags:
        tagged = _ANSWER_BLOCK.fullmatch(rest)
        inner = tagged["answer"] if tagged else ""
        has_answer = bool(inner.strip()) and "<answer>" not in inner and "</answer>" not in inner
    else:
        has_answer = bool(rest.strip())
    return 1.0 if has_answer else partial_credit


@REWARD_FUNCTIONS.register("format")
def format_reward(
    prompts: list[str],
    completions: list[str],
    *,
    answer_tags: bool = False,
    partial_credit: float = 0.0,
    **_columns,
) -> list[float | None]:
    """R1 format reward (DeepSeek-AI 2025, "DeepSeek-R1", sec. 2.2.2): reasoning inside think tags.

    1.0 when the completion is exactly one ``<think>...</think>`` block (leading whitespace
    allowed, empty reasoning allowed) followed by a non-empty answer with no further think tags;
    with ``answer_tags=True`` the answer must instead be one non-empty ``<answer>...</answer>``
    block. When the prompt already ends in ``<think>`` (the R1-Zero template opens the block for
    the model), the completion is read as continuing it.

    ``partial_credit`` (default 0.0, in [0, 1]) is paid for a well-formed, closed think block whose
    answer is missing (or, with ``answer_tags``, not properly tagged): a shaping step for
    models that learn to close the block before they learn to answer. The paper's reward is the
    strict 0/1 one.
    """
    if not 0.0 <= partial_credit <= 1.0:
        raise ValueError(f"partial_credit must be in [0, 1], got {partial_credit}")
    return [format_score(_continued(p, c), answer_tags=answer_tags, partial_credit=partial_credit)
            for p, c in zip(prompts, completions, strict=True)]


def _continued(prompt: str, completion: str) -> str:
    """The completion as the model wrote it: after a prompt that ends in ``<think>``, it continues that block."""
    return THINK_OPEN + completion if prompt.rstrip().endswith(THINK_OPEN) else completion


@REWARD_FUNCTIONS.register("language_consistency")
def language_consistency_reward(
    prompts: list[str],
    completions: list[str],
    *,
    own: str = OWN_DIGITS,
    other: str = LETTER_DIGITS,
    **_columns,
) -> list[float | None]:
    """DeepSeek-R1's language-consistency reward (Guo et al. 2025, Sec. 2.3.2): the proportion of target-language
    words in the chain of thought, here the share of the ``<think>`` block's number words written in the task's
    own digits ``own`` rather than the second vocabulary ``other`` (the letter digits A-J by default;
    ``tether.core.text_metrics.language_consistency``). None for a completion with no ``<think>`` block or no
    number word in it: no reward from this function (the format reward is the one that asks for the block).
    When the prompt ends in ``<think>`` the completion is read as continuing it."""
    return [cot_consistency(_continued(p, c), own=own, other=other) for p, c in zip(prompts, completions, strict=True)]


@REWARD_FUNCTIONS.register("regex")
def regex_reward(
    prompts: list[str],
    completions: list[str],
    *,
    pattern: str,
    mode: str = "search",
    ignore_case: bool = False,
    dotall: bool = True,
    **_columns,
) -> list[float | None]:
    """1.0 when the completion matches ``pattern``, else 0.0.

    ``mode="search"`` matches anywhere, ``mode="fullmatch"`` the whole completion. ``dotall``
    (default on) lets ``.`` cross newlines, which multi-line completions usually need.
    """
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"mode must be 'search' or 'fullmatch', got {mode!r}")
    flags = (re.IGNORECASE if ignore_case else 0) | (re.DOTALL if dotall else 0)
    matcher = getattr(re.compile(pattern, flags), mode)
    return [float(matcher(completion) is not None) for completion in completions]


@REWARD_FUNCTIONS.register("length")
def length_reward(
    prompts: list[str],
    completions: list[str],
    *,
    target: int,
    unit: str = "chars",
    scale: float = 1.0,
    **_columns,
) -> list[float | None]:
    """``-scale * |len(completion) - target|``: 0 at the target length, lower the further away.

    Length is counted in characters (``unit="chars"``) or whitespace-separated words
    (``unit="words"``), never tokens, so it needs no tokenizer. Meant for tests and toy runs,
    where "the policy moves its length toward the target" is an effect easy to see in a few
    steps; for token-length shaping of real runs see ``tether.rewards.shaping``.
    """
    if unit not in ("chars", "words"):
        raise ValueError(f"unit must be 'chars' or 'words', got {unit!r}")
    lengths = [len(c) if unit == "chars" else len(c.split()) for c in completions]
    return [-scale * abs(length - target) for length in lengths]


@REWARD_FUNCTIONS.register("worked_solution")
def worked_solution_reward(
    prompts: list[str],
    completions: list[str],
    *,
    task: str = "arithmetic",
    task_options: dict | None = None,
    **_columns,
) -> list[float | None]:
    """Process-level correctness: 1.0 when the completion is the task's worked solution of its prompt,
    every step of the ``<think>`` trace and the answer (for arithmetic: every column sum and carry),
    else 0.0; None for a prompt the task cannot read. Needs a task with ``solve(prompt)``.

    Stricter than ``accuracy``, which reads only the answer. A small model sampled at a temperature
    often reaches the right answer through wrong steps (measured: 38% of the right answers of the
    250-step SFT model of ``online-dpo-arithmetic`` at temperature 0.3), and training on those as
    "correct" teaches wrong steps.
    """
    verifier = get_task(task, **(task_options or {}))
    solve = getattr(verifier, "solve", None)
    if solve is None:
        raise ValueError(f"task {task!r} cannot check worked solutions (it has no solve(prompt))")
    scores: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        problem = solve(prompt) if isinstance(prompt, str) else None
        expected = None if problem is None else format_completion(problem, think=True)
        scores.append(None if expected is None else float(completion.strip() == expected))
    return scores
