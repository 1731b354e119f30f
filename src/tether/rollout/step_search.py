"""Step-level beam search guided by a process reward model (PRM), a test-time search beside best-of-n.

Snell et al. 2024, "Scaling LLM Test-Time Compute Optimally can be More Effective than Scaling Model
Parameters", sec. 5.1 (beam search against a PRM; the PRMs of Lightman et al. 2023, "Let's Verify Step
by Step", and Wang et al. 2024, Math-Shepherd). With ``N = beam_width * expansions`` candidates per round:

1. round 0 samples ``N`` first steps for each prompt (one empty trace expanded ``N`` times);
2. every candidate prefix (the trace so far plus its new step) is scored by the PRM, and the
   ``beam_width`` highest-scored candidates of each prompt are kept (ties: the earlier candidate);
3. a kept candidate that is finished -- its step ended on EOS, or the trace used up ``max_new_tokens``
   -- leaves the beam for the prompt's finished pool, so the live beam narrows as traces finish;
4. each live trace is expanded by ``expansions`` sampled next steps (sampling stops at the step
   separator or EOS) and the search goes back to 2, for at most ``max_steps`` rounds;
5. the answer is the highest-scored finished trace; a prompt with none (every kept trace still open
   after ``max_steps`` rounds) answers with its highest-scored open trace (``finished=False``).

A prefix's score is an aggregation of its per-step PRM scores (``STEP_AGGREGATIONS``): ``last`` by
default, the PRM's verdict at the newest step, which Snell et al. found the best way to read their
PRM; ``min`` and ``product`` are the aggregations Lightman et al. and Wang et al. use for whole solutions.

Compute: ``tokens`` counts every sampled token of every candidate, kept or pruned (the PRM's forward
passes are not counted), so a search at ``N = beam_width * expansions`` compares with best-of-n at
``n = N``: both sample ``N`` continuations of everything still open, best-of-n whole traces at once,
the search one step at a time with pruning in between.

The search itself (:func:`prm_beam_search`) is pure bookkeeping over two callables, a step
proposer and a prefix scorer; :class:`EngineStepProposer` samples steps with a generation engine
and :func:`prm_prefix_scorer` reads a :class:`~tether.rewards.scorer.RewardModelScorer`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.core.reward import STEP_AGGREGATIONS
from tether.rollout.base import GenerationEngine, SamplingParams


@dataclass(frozen=True)
class Step:
    """One sampled step: its token ids, its text, and whether the trace ends with it (EOS)."""

    ids: list[int]
    text: str
    done: bool = False


@dataclass
class Trace:
    """A partial (or finished) trace of prompt ``prompt``: the completion so far, ids and text."""

    prompt: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    steps: int = 0
    score: float = float("-inf")
    done: bool = False


@dataclass
class SearchResult:
    """The answer of one prompt: the chosen trace, and the compute spent on the prompt.

    ``tokens``: sampled tokens over every candidate of every round; ``candidates``: how many steps
    were sampled; ``finished``: whether the answer is a finished trace (else the best open one)."""

    text: str
    ids: list[int]
    score: float
    steps: int
    finished: bool
    tokens: int
    candidates: int


# propose(traces, k, budgets, round) -> k next steps per trace, each at most budgets[i] tokens long
Propose = Callable[[list[Trace], int, list[int], int], list[list[Step]]]
# score(candidate traces) -> one score per trace (higher is better)
ScorePrefixes = Callable[[list[Trace]], list[float]]


def _check(beam_width: int, expansions: int, max_steps: int, max_new_tokens: int) -> None:
    for name, value in (("beam_width", beam_width), ("expansions", expansions), ("max_steps", max_steps),
                        ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def prm_beam_search(num_prompts: int, propose: Propose, score: ScorePrefixes, *, beam_width: int, expansions: int,
                    max_steps: int, max_new_tokens: int) -> list[SearchResult]:
    """Beam search over steps (see the module docstring); one :class:`SearchResult` per prompt, in order."""
    _check(beam_width, expansions, max_steps, max_new_tokens)
    beams: list[list[Trace]] = [[Trace(p)] for p in range(num_prompts)]
    finished: list[list[Trace]] = [[] for _ in range(num_prompts)]
    tokens, candidates = [0] * num_prompts, [0] * num_prompts
    for round_ in range(max_steps):
        live = [trace for beam in beams for trace in beam]
        if not live:
            break
        k = beam_width * expansions if round_ == 0 else expansions
        proposals = propose(live, k, [max_new_tokens - len(t.ids) for t in live], round_)
        if len(proposals) != len(live) or any(len(steps) != k for steps in proposals):
            raise ValueError(f"the step proposer must return {k} steps for each of {len(live)} traces")
        grown: list[list[Trace]] = [[] for _ in range(num_prompts)]
        for trace, steps in zip(live, proposals, strict=True):
            for step in steps:
                tokens[trace.prompt] += len(step.ids)
                candidates[trace.prompt] += 1
                ids = trace.ids + step.ids
                grown[trace.prompt].append(Trace(trace.prompt, ids, trace.text + step.text, trace.steps + 1,
                                                 done=step.done or not step.ids or len(ids) >= max_new_tokens))
        flat = [t for group in grown for t in group]
        scores = score(flat)
        if len(scores) != len(flat):
            raise ValueError(f"the prefix scorer returned {len(scores)} scores for {len(flat)} traces")
        for trace, value in zip(flat, scores, strict=True):
            trace.score = float(value)
        for p, group in enumerate(grown):
            kept = sorted(group, key=lambda t: -t.score)[:beam_width]  # stable: ties keep proposal order
            finished[p].extend(t for t in kept if t.done)
            beams[p] = [t for t in kept if not t.done]
    results = []
    for p in range(num_prompts):
        pool = finished[p] or beams[p]
        best = max(pool, key=lambda t: t.score) if pool else Trace(p)  # max: the first of equal scores
        results.append(SearchResult(best.text, best.ids, best.score, best.steps, bool(finished[p]), tokens[p],
                                    candidates[p]))
    return results


def aggregate_step_scores(step_scores: Sequence[Sequence[float]], aggregation: str) -> list[float]:
    """One score per prefix from its per-step scores, by a ``STEP_AGGREGATIONS`` entry (no steps: 0)."""
    aggregate = STEP_AGGREGATIONS.get(aggregation)
    width = max([len(s) for s in step_scores] + [1])
    padded = torch.zeros(len(step_scores), width)
    mask = torch.zeros(len(step_scores), width, dtype=torch.bool)
    for i, scores in enumerate(step_scores):
        padded[i, :len(scores)] = torch.tensor(list(scores), dtype=padded.dtype)
        mask[i, :len(scores)] = True
    return aggregate(padded, mask).tolist()


def prm_prefix_scorer(prm: Any, prompts: Sequence[Any], aggregation: str = "last") -> ScorePrefixes:
    """Score candidate traces with a process reward model: ``prm.step_scores(prompts, completions, finished)``
    (a :class:`~tether.rewards.scorer.RewardModelScorer`) aggregated by ``aggregation``."""
    STEP_AGGREGATIONS.get(aggregation)  # an unknown name fails here, before any sampling

    def score(traces: list[Trace]) -> list[float]:
        steps = prm.step_scores([prompts[t.prompt] for t in traces], [t.text for t in traces],
                                finished=[t.done for t in traces])
        return aggregate_step_scores(steps, aggregation)

    return score


class EngineStepProposer:
    """Sample next steps with a generation engine: each trace's prompt ids + completion ids so far are
    continued ``k`` times until the step separator or EOS (the engine's ``stop`` strings).

    ``params``: temperature / top-p / top-k; its ``n``, ``max_new_tokens`` and ``stop`` are set per
    call and its seed is shifted by ``1_000_003 * round`` (None: unseeded). A step is the sampled ids
    and the engine's text (cut right after the separator); rows sampled past their own token budget
    (a call decodes up to the largest budget) are cut to it, and only the kept tokens are counted.
    """

    def __init__(self, engine: GenerationEngine, tokenizer: Any, prompt_ids: Sequence[Sequence[int]],
                 separator: str, params: SamplingParams | None = None) -> None:
        if not separator:
            raise ValueError("the step separator must be a non-empty string, e.g. '|'")
        self.engine, self.tokenizer = engine, tokenizer
        self.prompt_ids = [list(p) for p in prompt_ids]
        self.separator = separator
        self.params = params or SamplingParams()
        eos = getattr(engine, "eos_ids", None) or [tokenizer.eos_token_id]
        self.eos = {int(i) for i in eos if i is not None}

    def __call__(self, traces: list[Trace], k: int, budgets: list[int], round_: int) -> list[list[Step]]:
        seed = None if self.params.seed is None else self.params.seed + 1_000_003 * round_
        params = SamplingParams(**{**vars(self.params), "n": k, "max_new_tokens": max(budgets), "stop": [self.separator],
                                   "seed": seed})
        rollout = self.engine.generate([self.prompt_ids[t.prompt] + t.ids for t in traces], params)
        out: list[list[Step]] = []
        for i, budget in enumerate(budgets):
            steps = []
            for j in range(i * k, (i + 1) * k):
                ids, text = list(rollout.completion_ids[j]), rollout.texts[j]
                if len(ids) > budget:
                    ids = ids[:budget]
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                steps.append(Step(ids, text, done=bool(ids) and ids[-1] in self.eos))
            out.append(steps)
        return out
