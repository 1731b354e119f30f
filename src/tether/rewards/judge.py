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

import itertools
import random
import re
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tether.config.rewards import JudgeSamplingConfig
from tether.config.sampling import SamplingConfig
from tether.core.text_metrics import FROM_LETTERS, TO_LETTERS

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
    values = {"prompt": prompt, "principle": principle, "min": _number(low), "max": _number(high), **responses}
    for key in PLACEHOLDERS:  # one pass per placeholder, in a fixed order: a response holding "{prompt}" stays
        if values.get(key) is not None:
            template = template.replace("{" + key + "}", str(values[key]))
    return template


def _number(x: float | None) -> str | None:
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
                 closer: Callable[[], None] | None = None) -> None:
        self.backend = as_backend(backend)
        self.template = load_template(template) if "{" not in template else template
        self.principle = principle
        self.stats: dict[str, int] = {}
        self._closer = closer

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
                 samples: int = 1, principle: str | None = None, closer: Callable[[], None] | None = None) -> None:
        super().__init__(backend, template, principle, closer)
        if samples < 1 or scale[0] >= scale[1]:
            raise ValueError(f"need samples >= 1 and scale low < high; got samples={samples}, scale={scale}")
        self.scale, self.samples = (float(scale[0]), float(scale[1])), samples

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float | None]:
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts for {len(responses)} responses")
        if not prompts:
            return []
        texts = [render_template(self.template, prompt=p, response=r, principle=self.principle, scale=self.scale)
                 for p, r in zip(prompts, responses, strict=True)]
        out: list[float | None] = []
        for replies in self.backend(texts, self.samples):
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
                 principle: str | None = None, closer: Callable[[], None] | None = None) -> None:
        super().__init__(backend, template, principle, closer)
        self.swap = swap

    def _ask(self, prompts: Sequence[str], first: Sequence[str], second: Sequence[str]) -> list[str | None]:
        texts = [render_template(self.template, prompt=p, response_a=a, response_b=b, principle=self.principle)
                 for p, a, b in zip(prompts, first, second, strict=True)]
        verdicts = [parse_verdict(replies[0]) for replies in self.backend(texts, 1)]
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


# ---- synthetic judgments, to train a small judge --------------------------------------------------------


def answer_check(own: str, seen: str) -> str:
    """The judge's check of an answer ``seen`` against its ``own``, digit by digit from the left, then the
    mark: ``"8/8= 8/9x wrong"``. Each digit pair is written before its sign (``=`` same, ``x`` different;
    ``_`` pads the shorter), so every sign depends only on the two characters just before it and the mark
    only on the signs: a comparison a small model can learn, where one mark after both whole numbers is not.
    ``own`` may be written in the letter digits (``"BDC"`` is 132): a letter equals the digit it stands for."""
    value = own.translate(FROM_LETTERS)
    pairs = itertools.zip_longest(own, seen, fillvalue="_")
    digits = " ".join(f"{o}/{s}{'=' if o.translate(FROM_LETTERS) == s else 'x'}" for o, s in pairs)
    return f"{digits} {'right' if value == seen else 'wrong'}"


def inverse_check(task: Any, prompt: str, seen: str) -> str:
    """The judge's work on an answer ``seen`` by the task's inverse check (``task.check``) instead of solving:
    ``Answer:85 <think>5+7=12 c1|8+4+1=13 c1|</think>132 1/1= 3/3= 2/2= right`` for ``132-47=`` (85 plus 47,
    column by column, gives 132, compared digit by digit with the prompt's 132). A judge that checks this way
    can be right about answers it could not produce itself (Yuan et al.'s self-rewarding needs a judge at
    least as good as the policy). An answer that is not a number is marked ``not a number wrong``."""
    from tether.tasks.base import THINK_CLOSE, THINK_OPEN

    checked = task.check(prompt, seen)
    if checked is None:
        return f"Answer:{seen} not a number wrong"
    steps, result, target = checked
    return f"Answer:{seen} {THINK_OPEN}{steps}{THINK_CLOSE}{result} {answer_check(target, result)}"


def pointwise_reply(task: Any, prompt: str, seen: str, value: float, *, check: str = "solve",
                    work: str | None = None, letters: bool = False) -> str:
    """A pointwise judge's reply on the answer ``seen``: the bare score; with the judge's own ``work``
    (``<think>worked solution</think>answer``) the answer read, that work, the digit check against its answer
    and the score (``Answer:133 <think>...</think>132 1/1= 3/3= 2/3x wrong Score: 0``); with ``check="inverse"``
    the :func:`inverse_check` of ``seen`` and the score. ``letters``: the judge's work is written in the letter
    digits A-J (``<think>H+F=BC cB|E+I+B=BD cB|</think>BDC B/1= D/3= C/3x wrong``), so that learning to judge
    does not teach the digit-written answers a policy gives (see ``judge_records``)."""
    from tether.tasks.base import extract_answer

    if check == "inverse":
        return f"{inverse_check(task, prompt, seen)} Score: {_number(value)}"
    if work is None:
        return _number(value)
    if letters:
        work = work.translate(TO_LETTERS)
    return f"Answer:{seen} {work} {answer_check(extract_answer(work), seen)} Score: {_number(value)}"


def _check_judge_task(task: Any, solve_first: bool, check: str, kind: str, letters: bool = False) -> None:
    if letters and not (solve_first and check == "solve" and kind == "pointwise"):
        raise ValueError("work in letters is the pointwise judge's own solution: it needs kind pointwise, "
                         "solve_first and check 'solve'")
    if check not in ("solve", "inverse"):
        raise ValueError(f"check must be 'solve' or 'inverse', got {check!r}")
    if check == "inverse" and kind != "pointwise":
        raise ValueError("check 'inverse' judge records are pointwise (each answer is checked on its own)")
    if check == "inverse" and not (solve_first and hasattr(task, "check")):
        raise ValueError(f"check 'inverse' needs solve_first and a task with an inverse check (check(prompt, "
                         f"answer)); {getattr(task, 'name', task)!r} has none")


def _another_wrong(correct: str, wrong: str, rng: random.Random) -> str | None:
    """An integer answer that is neither ``correct`` nor ``wrong`` (None when the answers are not integers)."""
    if not (correct.isdigit() and wrong.lstrip("-").isdigit()):
        return None
    choices = [int(correct) + d for d in (-10, -2, 2, 10) if int(correct) + d >= 0 and str(int(correct) + d) != wrong]
    return str(rng.choice(choices))


def sample_judge_records(task: Any, samples: Sequence[tuple[str, str, str]], *, template: str,
                         scale: tuple[float, float] = (0.0, 1.0), solve_first: bool = False,
                         check: str = "solve", letters: bool = False) -> list[dict]:
    """Pointwise judge records from a policy's own ``(prompt, response, gold answer)`` samples, each scored by
    the task's verifier (``scale[1]`` right, ``scale[0]`` wrong): the judge learns the errors the policy it will
    judge makes, which synthetic negatives may miss. With ``solve_first`` the reply is
    ``Answer:<seen> <think>the task's worked solution</think><answer> <digit check> Score: N`` as in
    :func:`judge_records` (the task needs ``solve(prompt)``); ``check="inverse"``: :func:`inverse_check`;
    ``letters``: the judge's work in the letter digits (:func:`pointwise_reply`)."""
    from tether.tasks.base import THINK_CLOSE, THINK_OPEN, extract_answer

    _check_judge_task(task, solve_first, check, "pointwise", letters)
    template_text = load_template(template)
    solve = getattr(task, "solve", None)
    if solve_first and solve is None:
        raise ValueError("solve_first judge records need a task that can solve its prompts (solve(prompt))")
    out = []
    for prompt, response, answer in samples:
        seen = extract_answer(response)
        value = scale[1] if task.verify(response, answer) == 1.0 else scale[0]
        work = None
        if solve_first and check == "solve":
            problem = solve(prompt)
            work = f"{THINK_OPEN}{problem.reasoning}{THINK_CLOSE}{problem.answer}"
        out.append({"prompt": render_template(template_text, prompt=prompt, response=response, scale=scale),
                    "completion": pointwise_reply(task, prompt, seen, value, check=check, work=work,
                                                  letters=letters)})
    return out


def judge_records(task: Any, n: int, *, kind: Literal["pointwise", "pairwise"], template: str, seed: int = 0,
                  split: str = "train", errors: Sequence[str] | None = None,
                  scale: tuple[float, float] = (0.0, 1.0), solve_first: bool = False, ties: float = 0.0,
                  answers_only: bool = False, check: str = "solve", letters: bool = False) -> list[dict]:
    """``n`` SFT records ``{prompt: judge prompt, completion: verdict}`` whose verdicts are known exactly.

    Built from ``tether.tasks.preferences`` correctness pairs. Pairwise: the correct completion is
    shown as A in half the records and as B in the other half (so no position is favoured), the
    verdict is the bare letter. Pointwise: the correct and the wrong completion of a pair each make a
    record, scored ``scale[1]`` and ``scale[0]``.

    ``solve_first``: a reference-guided judge (Zheng et al. 2023, Sec. 3.4) that reasons before its
    verdict: it reads off each response's answer, works the problem out itself, checks each answer against
    its own digit by digit (:func:`answer_check`), then gives the verdict: ``A:133 B:132
    <think>...</think>132 A 1/1= 3/3= 2/3x wrong B 1/1= 3/3= 2/2= right [[B]]`` (pointwise
    ``Answer:133 <think>...</think>132 1/1= 3/3= 2/3x wrong Score: 0``). Its verdict is a comparison of
    answers, each step one a small model can learn, not a re-check of every step of a trace. The answers
    are read first, while the only ``</think>`` in sight are the responses' (read after its own work, a
    small judge copies its own answer instead).

    ``ties`` (pairwise, with ``solve_first``): the share of records whose verdict is a tie, ``[[C]]``:
    half show the correct completion twice, half two different wrong answers, so the judge learns to
    decide only where exactly one response agrees with its own answer.

    ``answers_only``: the judged responses are the completions' final answers, not their worked traces (the
    judge of a policy that answers directly); the judge's own work is unchanged.

    ``check="inverse"`` (pointwise, with ``solve_first``): the judge does not solve the problem but checks each
    answer by the task's inverse operation (:func:`inverse_check`), where checking is easier than answering.

    ``letters`` (pointwise, with ``solve_first``): the judge works the problem out in the letter digits A-J and
    compares that answer with the response's digits (:func:`pointwise_reply`). The worked solution is then not
    a demonstration of the digit-written answer, so a model trained to judge this way and to answer (self-
    rewarding's seed model) does not learn to answer from its judge training: its judging can stay ahead of
    its answering, the room self-rewarding learns from.
    """
    from tether.tasks.base import THINK_CLOSE, extract_answer
    from tether.tasks.preferences import ERRORS, preference_records

    if not 0.0 <= ties < 1.0:
        raise ValueError(f"ties must be in [0, 1), got {ties}")
    _check_judge_task(task, solve_first, check, kind, letters)
    template_text = load_template(template)
    pairs = preference_records(task, n if kind == "pairwise" else (n + 1) // 2, seed=seed, split=split,
                               errors=errors or ERRORS)
    rng = random.Random(f"judge-records:{seed}:{split}")
    out = []
    for i, pair in enumerate(pairs):
        own = extract_answer(pair["chosen"])
        if kind == "pairwise":
            first = i % 2 == 0
            a, b = (pair["chosen"], pair["rejected"]) if first else (pair["rejected"], pair["chosen"])
            verdict = "A" if first else "B"
            if solve_first and ties and rng.random() < ties:
                other = _another_wrong(own, extract_answer(pair["rejected"]), rng)
                if i % 4 < 2 or other is None:
                    a = b = pair["chosen"]
                else:
                    a, b = pair["rejected"], pair["chosen"].rsplit(THINK_CLOSE, 1)[0] + THINK_CLOSE + other
                verdict = "C"
            if answers_only:
                a, b = extract_answer(a), extract_answer(b)
            reply = verdict
            if solve_first:
                seen_a, seen_b = extract_answer(a), extract_answer(b)
                reply = (f"A:{seen_a} B:{seen_b} {pair['chosen']} A {answer_check(own, seen_a)} "
                         f"B {answer_check(own, seen_b)} [[{verdict}]]")
            out.append({"prompt": render_template(template_text, prompt=pair["prompt"], response_a=a, response_b=b),
                        "completion": reply})
            continue
        for response, value in ((pair["chosen"], scale[1]), (pair["rejected"], scale[0])):
            seen = extract_answer(response)
            response = seen if answers_only else response
            reply = pointwise_reply(task, pair["prompt"], seen, value, check=check,
                                    work=pair["chosen"] if solve_first else None, letters=letters)
            out.append({"prompt": render_template(template_text, prompt=pair["prompt"], response=response,
                                                  scale=scale),
                        "completion": reply})
    if kind == "pointwise":
        rng.shuffle(out)
    return out[:n]
