"""LLM-as-a-judge: pointwise scores and pairwise verdicts from prompt templates kept as files.

- **Templates** live in ``tether/judges/*.txt`` (``pointwise``, ``pairwise``, ``self-rewarding``, and
  ``compact-pointwise`` / ``compact-pairwise`` short enough for the tiny models' 512-token context);
  a path to your own file works the same. Placeholders: ``{prompt}``, ``{response}`` (pointwise),
  ``{response_a}`` / ``{response_b}`` (pairwise), ``{min}`` / ``{max}`` (the score scale) and
  ``{principle}``; a line holding ``{principle}`` is kept only when a principle is given (a
  constitution's rule, say). Nothing else in a template is special, so braces in its text are safe.
- **Pointwise** (Zheng et al. 2023, "Judging LLM-as-a-Judge", single-answer grading): a score on
  ``[min, max]``, read from ``Score: N`` (the last one), ``N/10``, or a reply that is only a
  number. ``samples > 1`` averages several sampled replies (Yuan et al. 2024 average three).
- **Pairwise** with position-bias control (Zheng et al. 2023, Sec. 3.4; Wang et al. 2023, "Large
  Language Models are not Fair Evaluators"): each pair is judged in both orders; two verdicts that
  agree give 1 (A better) or 0 (B better); disagreement, or an explicit tie, gives 0.5, which the
  caller can keep or drop. The share of pairs whose two orders agree is the consistency rate.
  Verdicts are read from ``[[A]]`` / ``[[B]]`` / ``[[C]]`` (tie), ``verdict: A``-like phrases, or a
  reply that is only ``A`` or ``B``.
- **Answer only** (``answer_only``): the judge sees each response's final answer, the text after the last
  ``</think>`` (DeepSeek-R1 Sec. 2.3.4 judges general answers by their summary), so its own work cannot
  copy a step of the response's reasoning.
- **Backends**: anything with the generation-engine protocol (:class:`EngineJudgeBackend`: token ids
  in, a rollout out; a local model), anything with the completion protocol
  (:class:`EndpointJudgeBackend`: ``complete(prompts, params)``; an OpenAI-compatible endpoint with its
  timeouts, retries, concurrency limit and on-disk cache), or a Python function from judge prompts
  to reply texts. This module builds no engine: :func:`tether.scoring.build_judge` makes the judge a
  :class:`~tether.config.JudgeConfig` describes, engine included.
- A reply that cannot be parsed is counted (``judge/unparseable``) and scored missing (``None``),
  never a crash; an endpoint that stays down raises :class:`EndpointError` after its retries, with
  every reply received so far in the endpoint's cache.

Judges follow the reward protocol, ``judge(prompts, completions, **columns) -> list[float | None]``
(pointwise), so a pointwise judge goes wherever a reward function goes. Knows nothing about training.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tether.config.rewards import JudgeSamplingConfig
from tether.config.sampling import SamplingConfig

Backend = Callable[[list[str], int], list[list[str]]]
PLACEHOLDERS = ("prompt", "response", "response_a", "response_b", "principle", "min", "max")


# ---- templates -----------------------------------------------------------------------------------------


def template_names() -> list[str]:
    """The built-in templates (file stems of ``tether/judges/*.txt``)."""
    folder = resources.files("tether") / "judges"
    return sorted(Path(str(p)).stem for p in folder.iterdir() if str(p).endswith(".txt"))


def load_template(name_or_path: str) -> str:
    """A built-in template by name, or the text of a template file."""
    if name_or_path in template_names():
        return (resources.files("tether") / "judges" / f"{name_or_path}.txt").read_text()
    path = Path(name_or_path)
    if path.is_file():
        return path.read_text()
    raise ValueError(f"no judge template {name_or_path!r}: not a file, and not a built-in "
                     f"({', '.join(template_names())})")


def render_template(template: str, *, prompt: str, principle: str | None = None,
                    scale: tuple[float, float] | None = None, **responses: str) -> str:
    """Fill the placeholders; drop the lines holding ``{principle}`` when there is no principle."""
    if principle is None:
        template = "\n".join(line for line in template.split("\n") if "{principle}" not in line)
    low, high = scale or (None, None)
    values = {"prompt": prompt, "principle": principle, "min": format_number(low), "max": format_number(high), **responses}
    for key in PLACEHOLDERS:  # one pass per placeholder, in a fixed order: a response holding "{prompt}" stays
        if values.get(key) is not None:
            template = template.replace("{" + key + "}", str(values[key]))
    return template


def format_number(x: float | None) -> str | None:
    """``3.0`` -> ``"3"``, ``0.5`` -> ``"0.5"``: a score as a judge writes it."""
    return None if x is None else (str(int(x)) if float(x).is_integer() else str(x))


# ---- parsing ---------------------------------------------------------------------------------------------

_NUM = r"(-?\d+(?:\.\d+)?)"
_SCORE = re.compile(rf"(?:score|rating)\**\s*(?:is|of)?\s*[:=]?\s*\**\s*\[*{_NUM}\]*(?:\s*/\s*\d+)?", re.I)
_ONLY_NUMBER = re.compile(rf"^\s*\**\[*{_NUM}\]*(?:\s*/\s*\d+)?\**\s*[.!]?\s*$")
_BRACKETS = re.compile(r"\[\[\s*(A|B|C|tie)\s*\]\]", re.I)
_LABELLED = re.compile(r"(?:verdict|winner|better|choice|preferred)\**\s*(?:response|answer)?\s*(?:is)?\s*[:=]?"
                       r"\s*\**\s*\(?\s*(?:assistant|response|answer|output)?\s*\(?\s*\b(A|B|tie)\b", re.I)
_ONLY_LETTER = re.compile(r"^\s*\**\s*\(?\[*\s*(A|B)\s*\]*\)?\**\s*[.!]?\s*$")


def parse_score(text: str, low: float, high: float) -> float | None:
    """The score of a pointwise reply, or None if there is none in ``[low, high]``."""
    matches = _SCORE.findall(text)
    if matches:
        value = float(matches[-1])
    else:
        only = _ONLY_NUMBER.match(text)
        if only is None:
            return None
        value = float(only[1])
    return value if low <= value <= high else None


def parse_verdict(text: str) -> Literal["A", "B", "tie"] | None:
    """``"A"``, ``"B"`` or ``"tie"`` from a pairwise reply (the last verdict given), else None."""
    for pattern in (_BRACKETS, _LABELLED):
        matches = pattern.findall(text)
        if matches:
            verdict = matches[-1].upper()
            return "tie" if verdict in ("C", "TIE") else verdict
    only = _ONLY_LETTER.match(text)
    return only[1] if only else None  # type: ignore[return-value]


# ---- backends --------------------------------------------------------------------------------------------




class EngineJudgeBackend:
    """Judge replies from a generation engine (token ids in, a rollout out): a local model, which may be
    the live policy (self-rewarding)."""

    def __init__(self, engine: Any, tokenizer: Any, *, sampling: SamplingConfig | None = None, chat: bool = False,
                 seed: int = 0) -> None:
        self.engine, self.tokenizer, self.chat, self.seed = engine, tokenizer, chat, seed
        self.sampling = sampling or JudgeSamplingConfig()

    def __call__(self, prompts: list[str], n: int = 1) -> list[list[str]]:
        from tether.data import tokenize_prompts

        rollout = self.engine.generate(tokenize_prompts(prompts, self.tokenizer, chat=self.chat),
                                       self.sampling.params(n, self.seed))
        return _group(rollout.texts, rollout.prompt_index, len(prompts))


class EndpointJudgeBackend:
    """Judge replies from anything with the completion protocol, ``complete(prompts, params)``: an
    OpenAI-compatible endpoint's client."""

    def __init__(self, engine: Any, *, sampling: SamplingConfig | None = None, seed: int = 0) -> None:
        self.engine, self.seed = engine, seed
        self.sampling = sampling or JudgeSamplingConfig()

    def __call__(self, prompts: list[str], n: int = 1) -> list[list[str]]:
        out = self.engine.complete(prompts, self.sampling.params(n, self.seed))
        return _group(out.texts, out.prompt_index, len(prompts))


def _group(texts: list[str], index: list[int], count: int) -> list[list[str]]:
    grouped: list[list[str]] = [[] for _ in range(count)]
    for text, i in zip(texts, index, strict=True):
        grouped[i].append(text)
    return grouped


def as_backend(fn: Callable) -> Backend:
    """A function ``fn(judge_prompts) -> list[str]`` (one reply each) as a backend."""
    if isinstance(fn, EngineJudgeBackend | EndpointJudgeBackend) or getattr(fn, "is_judge_backend", False):
        return fn

    def backend(prompts: list[str], n: int = 1) -> list[list[str]]:
        replies = [list(fn(prompts)) for _ in range(n)]
        for r in replies:
            if len(r) != len(prompts):
                raise ValueError(f"judge function returned {len(r)} replies for {len(prompts)} prompts")
        return [[r[i] for r in replies] for i in range(len(prompts))]

    backend.is_judge_backend = True  # type: ignore[attr-defined]
    return backend


# ---- judges ----------------------------------------------------------------------------------------------


class _Judge:
    def __init__(self, backend: Backend | Callable, template: str, principle: str | None,
                 closer: Callable[[], None] | None = None, answer_only: bool = False) -> None:
        self.backend = as_backend(backend)
        self.answer_only = answer_only
        self.template = load_template(template) if "{" not in template else template
        self.principle = principle
        self.stats: dict[str, int] = {}
        self._closer = closer
        # None, or a list that every judge prompt and its replies are appended to: what the judge wrote, to read
        self.transcript: list[dict[str, Any]] | None = None

    def _replies(self, texts: list[str], n: int) -> list[list[str]]:
        """The backend's ``n`` replies to each judge prompt, recorded in :attr:`transcript` when it is a list."""
        replies = self.backend(texts, n)
        if self.transcript is not None:
            self.transcript.extend({"prompt": t, "replies": list(r)} for t, r in zip(texts, replies, strict=True))
        return replies

    def _shown(self, responses: Sequence[str]) -> list[str]:
        """The responses as the judge sees them: whole, or (``answer_only``) their final answers."""
        from tether.rewards.routing import final_answer

        return [final_answer(r) for r in responses] if self.answer_only else list(responses)

    def _count(self, key: str, amount: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + amount

    def take_metrics(self) -> dict[str, float]:
        """``judge/*`` figures since the last call (the counts, and rates where defined); resets them."""
        stats, self.stats = self.stats, {}
        out = {f"judge/{k}": float(v) for k, v in stats.items()}
        if stats.get("replies"):
            out["judge/unparseable_rate"] = stats.get("unparseable", 0) / stats["replies"]
        if stats.get("judged"):
            out["judge/consistency"] = stats.get("consistent", 0) / stats["judged"]
        return out

    def close(self) -> None:
        """Stop what the judge started (a server process, for ``backend: serve``); ``closer`` does it."""
        if self._closer is not None:
            self._closer()
            self._closer = None


class PointwiseJudge(_Judge):
    """A score on ``scale`` per (prompt, response); None when no reply could be parsed."""

    def __init__(self, backend: Backend | Callable, *, template: str = "pointwise", scale: tuple[float, float] = (1, 10),
                 samples: int = 1, principle: str | None = None, closer: Callable[[], None] | None = None,
                 answer_only: bool = False) -> None:
        super().__init__(backend, template, principle, closer, answer_only)
        if samples < 1 or scale[0] >= scale[1]:
            raise ValueError(f"need samples >= 1 and scale low < high; got samples={samples}, scale={scale}")
        self.scale, self.samples = (float(scale[0]), float(scale[1])), samples

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float | None]:
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses")
        if not prompts:
            return []
        texts = [render_template(self.template, prompt=p, response=r, principle=self.principle, scale=self.scale)
                 for p, r in zip(prompts, self._shown(responses), strict=True)]
        out: list[float | None] = []
        for replies in self._replies(texts, self.samples):
            scores = [parse_score(reply, *self.scale) for reply in replies]
            self._count("replies", len(scores))
            self._count("unparseable", sum(s is None for s in scores))
            kept = [s for s in scores if s is not None]
            out.append(sum(kept) / len(kept) if kept else None)
        self._count("scored", len(out))
        self._count("missing", sum(s is None for s in out))
        return out

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float | None]:
        return self.score(prompts, completions)


class PairwiseJudge(_Judge):
    """``P(a beats b)`` per pair: 1, 0, 0.5 (a tie or orders that disagree), or None (unparseable)."""

    def __init__(self, backend: Backend | Callable, *, template: str = "pairwise", swap: bool = True,
                 principle: str | None = None, closer: Callable[[], None] | None = None,
                 answer_only: bool = False) -> None:
        super().__init__(backend, template, principle, closer, answer_only)
        self.swap = swap

    def _ask(self, prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> list[str | None]:
        texts = [render_template(self.template, prompt=p, response_a=a, response_b=b, principle=self.principle)
                 for p, a, b in zip(prompts, self._shown(first), self._shown(second), strict=True)]
        verdicts = [parse_verdict(replies[0]) for replies in self._replies(texts, 1)]
        self._count("replies", len(verdicts))
        self._count("unparseable", sum(v is None for v in verdicts))
        return verdicts

    def verdicts(self, prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> list[str | None]:
        """The verdict of one order per pair as parsed, ``"A"`` (``first``), ``"B"``, ``"tie"`` or None; no
        swapping (:mod:`tether.core.win_rate` counts both orders)."""
        if not len(prompts) == len(first) == len(second):
            raise ValueError("verdicts() needs as many prompts as first and second responses")
        return self._ask(prompts, first, second) if prompts else []

    def compare(self, prompts: Sequence[str], responses_a: Sequence[str], responses_b: Sequence[str]
                ) -> list[float | None]:
        if not len(prompts) == len(responses_a) == len(responses_b):
            raise ValueError("compare() needs as many prompts as responses_a and responses_b")
        if not prompts:
            return []
        if self.swap:  # both orders in one batch, so an endpoint sees them concurrently
            both = self._ask([*prompts, *prompts], [*responses_a, *responses_b], [*responses_b, *responses_a])
            forward, backward = both[: len(prompts)], both[len(prompts):]
        else:
            forward = self._ask(prompts, responses_a, responses_b)
            backward = forward
        values = [self._combine(f, b) for f, b in zip(forward, backward, strict=True)]
        self._count("pairs", len(values))
        self._count("missing", sum(v is None for v in values))
        self._count("ties", sum(v == 0.5 for v in values))
        return values

    def _combine(self, forward: str | None, backward: str | None) -> float | None:
        """A's win probability from the verdict in the order (a, b) and the one in the order (b, a)."""
        if forward is None or backward is None:
            return None
        first = {"A": 1.0, "B": 0.0, "tie": 0.5}[forward]
        if not self.swap:
            return first
        second = {"A": 0.0, "B": 1.0, "tie": 0.5}[backward]  # in the swapped order "A" is b
        self._count("judged")
        if first == second:
            self._count("consistent")
            return first
        return 0.5
