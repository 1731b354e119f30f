"""Figures over a set of completions that say how a model writes, not whether it is right.

Each is ``fn(completions, correct) -> {name: value}`` (``correct``: one 0/1 per completion, from the task's
verifier) registered in ``TEXT_METRICS`` under the name ``eval.metrics`` takes; an evaluation computes
the requested ones on its greedy completions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tether.core.registry import Registry

TEXT_METRICS: Registry = Registry("text metric")

# Words a reasoning model uses when it re-examines its work (the R1 paper's "aha" vocabulary).
REFLECTION_WORDS = ("wait", "check", "verify", "recheck", "mistake", "actually", "hmm", "again")


def distinct_n(completions: Sequence[str], n: int) -> float:
    """distinct-n (Li et al. 2016, "A Diversity-Promoting Objective Function for Neural Conversation
    Models"): the number of distinct n-grams of whitespace tokens over all completions divided by the
    total number of n-grams; 0 when there is none."""
    grams = [tuple(tokens[i:i + n]) for text in completions for tokens in [text.split()]
             for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@TEXT_METRICS.register("distinct")
def distinct(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """distinct-1 and distinct-2 of the completions (:func:`distinct_n`): lexical diversity."""
    return {"distinct_1": distinct_n(completions, 1), "distinct_2": distinct_n(completions, 2)}


@TEXT_METRICS.register("length_by_outcome")
def length_by_outcome(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """Mean length in characters of the correct and of the incorrect completions (NaN for an empty side):
    whether wrong answers run longer, as they do in long-reasoning models."""
    def mean(values: list[int]) -> float:
        return sum(values) / len(values) if values else float("nan")

    right = [len(c) for c, ok in zip(completions, correct, strict=True) if ok > 0]
    wrong = [len(c) for c, ok in zip(completions, correct, strict=True) if ok <= 0]
    return {"length/correct": mean(right), "length/incorrect": mean(wrong)}


@TEXT_METRICS.register("reflection")
def reflection(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """Reflection words per completion (:data:`REFLECTION_WORDS`, whole words, any case), and the share of
    completions with at least one: the "aha moment" count of the DeepSeek-R1 paper."""
    pattern = re.compile(r"\b(" + "|".join(REFLECTION_WORDS) + r")\b", re.IGNORECASE)
    counts = [len(pattern.findall(text)) for text in completions]
    n = max(len(counts), 1)
    return {"reflection/words": sum(counts) / n, "reflection/share": sum(c > 0 for c in counts) / n}


# The task's own number vocabulary and the second one the arithmetic task's ``letter_digits`` option writes
# prompts in (0=A ... 9=J); upper-case, so that the trace's own markers (c1 carry, b1 borrow) never count.
OWN_DIGITS, LETTER_DIGITS = "0123456789", "ABCDEFGHIJ"
# str.translate tables between the two (digits -> letters, letters -> digits)
TO_LETTERS, FROM_LETTERS = str.maketrans(OWN_DIGITS, LETTER_DIGITS), str.maketrans(LETTER_DIGITS, OWN_DIGITS)


def thinking_text(completion: str) -> str | None:
    """The chain of thought: the text between the first ``<think>`` and the last ``</think>`` (to the end when
    the block is never closed); None when there is no ``<think>``."""
    if "<think>" not in completion:
        return None
    inside = completion.split("<think>", 1)[1]
    return inside.rsplit("</think>", 1)[0] if "</think>" in inside else inside


def language_consistency(text: str, *, own: str = OWN_DIGITS, other: str = LETTER_DIGITS) -> float | None:
    """The share of ``text``'s number words written in the task's own vocabulary.

    DeepSeek-R1 (Guo et al. 2025, Sec. 2.3.2), the language-consistency reward: "the proportion of target
    language words in the CoT". Here a *word* is a maximal run of characters of ``own`` or ``other`` (digits,
    and the letter digits A-J by default); it is in the target language when all its characters are in
    ``own``, so a word mixing both (``1B``) counts against it::

        consistency = #(words of own characters only) / #(words)

    None when the text has no number word (nothing to measure), rather than 1: an empty chain of thought is
    not consistent, it is absent. Unlike the paper, which counts natural-language words, the vocabularies
    are two spellings of the digits (``tether.tasks.arithmetic``'s ``letter_digits`` option).
    """
    if set(own) & set(other):
        raise ValueError(f"the two vocabularies share characters {sorted(set(own) & set(other))}; give disjoint ones")
    charset = "".join(sorted(set(own + other)))
    words = re.findall(f"[{re.escape(charset)}]+", text)
    if not words:
        return None
    return sum(all(ch in own for ch in word) for word in words) / len(words)


def cot_consistency(completion: str, *, own: str = OWN_DIGITS, other: str = LETTER_DIGITS) -> float | None:
    """:func:`language_consistency` of a completion's chain of thought (:func:`thinking_text`); None without a
    ``<think>`` block or without a number word in it."""
    thinking = thinking_text(completion)
    return None if thinking is None else language_consistency(thinking, own=own, other=other)


@TEXT_METRICS.register("language_consistency")
def consistency(completions: Sequence[str], correct: Sequence[float]) -> dict[str, float]:
    """The mean :func:`cot_consistency` over the completions that have one (``consistency``; NaN when none
    has), and how many have one (``consistency/n``): whether the reasoning stays in the task's vocabulary."""
    values = [v for v in (cot_consistency(c) for c in completions) if v is not None]
    return {"consistency": sum(values) / len(values) if values else float("nan"), "consistency/n": float(len(values))}
