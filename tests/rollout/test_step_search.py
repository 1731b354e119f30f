"""PRM-guided step-level beam search: the bookkeeping on a stub proposer and stub PRM with hand-set
scores, the step-score aggregation, and the engine proposer's cutting at budgets and EOS."""

from __future__ import annotations

import math

import pytest

from tether.rollout.base import Rollout, SamplingParams
from tether.rollout.step_search import (
    EngineStepProposer,
    Step,
    Trace,
    aggregate_step_scores,
    prm_beam_search,
    prm_prefix_scorer,
)


def _step(text: str, tokens: int, done: bool = False) -> Step:
    return Step(list(range(1, tokens + 1)), text, done)


# (prompt, trace text so far) -> the steps the stub samples from it, in order
PROPOSALS = {
    (0, ""): [_step("a|", 2), _step("b|", 1), _step("c", 3, done=True), _step("d|", 1)],
    (0, "a|"): [_step("e", 1, done=True), _step("f|", 2)],
    (0, "a|f|"): [_step("g", 1, done=True), _step("h", 2, done=True)],
    (1, ""): [_step("p|", 1), _step("q|", 1), _step("r|", 1), _step("s|", 1)],
    (1, "q|"): [_step("x|", 1), _step("y|", 2)],
    (1, "p|"): [_step("z|", 1), _step("w|", 1)],
    (1, "q|y|"): [_step("1|", 1), _step("2|", 1)],
    (1, "p|z|"): [_step("3|", 1), _step("4|", 1)],
}
# the stub PRM's score of each candidate prefix
SCORES = {
    (0, "a|"): 0.9, (0, "b|"): 0.5, (0, "c"): 0.8, (0, "d|"): 0.1,
    (0, "a|e"): 0.7, (0, "a|f|"): 0.6,
    (0, "a|f|g"): 0.85, (0, "a|f|h"): 0.2,
    (1, "p|"): 0.3, (1, "q|"): 0.4, (1, "r|"): 0.2, (1, "s|"): 0.1,
    (1, "q|x|"): 0.5, (1, "q|y|"): 0.7, (1, "p|z|"): 0.7, (1, "p|w|"): 0.6,
    (1, "q|y|1|"): 0.4, (1, "q|y|2|"): 0.3, (1, "p|z|3|"): 0.45, (1, "p|z|4|"): 0.9,
}


class StubProposer:
    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[int, str]], int, list[int]]] = []

    def __call__(self, traces: list[Trace], k: int, budgets: list[int], round_: int) -> list[list[Step]]:
        self.calls.append(([(t.prompt, t.text) for t in traces], k, budgets))
        out = [PROPOSALS[(t.prompt, t.text)] for t in traces]
        assert all(len(steps) == k for steps in out)
        return out


def stub_prm(traces: list[Trace]) -> list[float]:
    return [SCORES[(t.prompt, t.text)] for t in traces]


def test_beam_search_keeps_the_top_candidates_and_answers_with_the_best_finished_trace():
    proposer = StubProposer()
    results = prm_beam_search(2, proposer, stub_prm, beam_width=2, expansions=2, max_steps=3, max_new_tokens=100)
    # round 0: each prompt's empty trace expanded beam_width x expansions = 4 times
    # prompt 0 keeps a| (.9) and c (.8); c ended on EOS and leaves the beam, so only a| is expanded
    # prompt 1 keeps q| (.4) and p| (.3), in score order
    assert proposer.calls[0] == ([(0, ""), (1, "")], 4, [100, 100])
    # round 1: prompt 0 keeps a|e (.7, finished) and a|f| (.6); prompt 1 has a tie at .7: q|y| (proposed
    # first) and p|z| both stay, ahead of p|w| (.6)
    assert proposer.calls[1] == ([(0, "a|"), (1, "q|"), (1, "p|")], 2, [98, 99, 99])
    # round 2 (the last): prompt 0's two steps both finish; prompt 1 keeps p|z|4| (.9), p|z|3| (.45), still open
    assert proposer.calls[2] == ([(0, "a|f|"), (1, "q|y|"), (1, "p|z|")], 2, [96, 97, 98])
    assert len(proposer.calls) == 3

    first, second = results
    # finished pool of prompt 0: c .8, a|e .7, a|f|g .85, a|f|h .2 -> a|f|g (its ids: a| + f| + g)
    assert (first.text, first.score, first.steps, first.finished) == ("a|f|g", 0.85, 3, True)
    assert first.ids == [1, 2, 1, 2, 1]
    # every sampled token counts, pruned candidates included: (2+1+3+1) + (1+2) + (1+2)
    assert (first.tokens, first.candidates) == (13, 8)
    # prompt 1 never finished within max_steps: the best open trace answers
    assert (second.text, second.score, second.steps, second.finished) == ("p|z|4|", 0.9, 3, False)
    assert (second.tokens, second.candidates) == (4 + 5 + 4, 4 + 4 + 4)


def test_a_search_stops_when_every_beam_has_finished():
    proposer = StubProposer()
    (first,) = prm_beam_search(1, proposer, stub_prm, beam_width=2, expansions=2, max_steps=10, max_new_tokens=100)
    assert len(proposer.calls) == 3 and first.text == "a|f|g"


def test_a_trace_that_uses_up_its_token_budget_is_finished():
    proposer = StubProposer()
    # max_new_tokens 3: a| (2 tokens) stays open with budget 1; c (3 tokens, EOS anyway) is finished;
    # in round 1, a|f| reaches 4 >= 3 tokens and is finished too (a stub ignores its budget)
    (first,) = prm_beam_search(1, proposer, stub_prm, beam_width=2, expansions=2, max_steps=10, max_new_tokens=3)
    assert proposer.calls[1][2] == [1]
    assert len(proposer.calls) == 2
    assert (first.text, first.score, first.finished) == ("c", 0.8, True)


def test_bad_arguments_and_bad_callables_fail_clearly():
    with pytest.raises(ValueError, match="beam_width must be >= 1"):
        prm_beam_search(1, StubProposer(), stub_prm, beam_width=0, expansions=2, max_steps=1, max_new_tokens=8)
    with pytest.raises(ValueError, match="must return 2 steps"):
        prm_beam_search(1, lambda traces, k, budgets, r: [[_step("a|", 1)] for _ in traces], stub_prm,
                        beam_width=1, expansions=2, max_steps=1, max_new_tokens=8)
    with pytest.raises(ValueError, match="returned 0 scores for 4"):
        prm_beam_search(1, StubProposer(), lambda traces: [], beam_width=2, expansions=2, max_steps=1,
                        max_new_tokens=8)


def test_aggregate_step_scores_by_hand():
    steps = [[0.9, 0.2, 0.5], [0.4], []]
    assert aggregate_step_scores(steps, "last") == pytest.approx([0.5, 0.4, 0.0])
    assert aggregate_step_scores(steps, "min") == pytest.approx([0.2, 0.4, 0.0])
    assert aggregate_step_scores(steps, "product") == pytest.approx([0.09, 0.4, 0.0])
    with pytest.raises(KeyError):
        aggregate_step_scores(steps, "median")


def test_prm_prefix_scorer_reads_step_scores_of_the_trace_text_and_whether_it_finished():
    class StubPRM:
        def step_scores(self, prompts, completions, finished):
            self.seen = list(zip(prompts, completions, finished, strict=True))
            return [[0.5] * c.count("|") + ([0.25] if not c.endswith("|") else []) for c in completions]

    prm = StubPRM()
    score = prm_prefix_scorer(prm, ["P0", "P1"], "min")
    assert score([Trace(1, [1], "a|b", done=True), Trace(0, [1], "a|")]) == pytest.approx([0.25, 0.5])
    assert prm.seen == [("P1", "a|b", True), ("P0", "a|", False)]


class FakeEngine:
    """Returns fixed completions (k per prompt), recording the prompts and parameters it was given."""

    eos_ids = [2]

    def __init__(self, completions: list[tuple[list[int], str]]) -> None:
        self.completions = completions

    def generate(self, prompts, params):
        self.prompts, self.params = prompts, params
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        return Rollout(prompt_ids=[prompts[r] for r in rows], completion_ids=[c[0] for c in self.completions],
                       completion_logprobs=[[0.0] * len(c[0]) for c in self.completions],
                       finish_reasons=["stop"] * len(rows), prompt_index=rows, texts=[c[1] for c in self.completions])


class CharTokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids if not (skip_special_tokens and i == 2))


def test_engine_proposer_continues_traces_and_cuts_steps_at_their_budget():
    engine = FakeEngine([([5, 6, 7], "efg"), ([5, 2], "e"), ([8], "h"), ([9, 9, 9, 9], "iiii")])
    propose = EngineStepProposer(engine, CharTokenizer(), [[11, 12], [13]], "|", SamplingParams(temperature=0.7,
                                                                                                  seed=5))
    steps = propose([Trace(0, [3], "c"), Trace(1)], 2, [2, 8], 3)
    assert engine.prompts == [[11, 12, 3], [13]]
    p = engine.params
    assert (p.n, p.max_new_tokens, p.stop, p.temperature, p.seed) == (2, 8, ["|"], 0.7, 5 + 3 * 1_000_003)
    # row 0's budget is 2: its first step is cut to two tokens and re-decoded; [5, 2] ends on EOS
    assert steps[0] == [Step([5, 6], "ef", False), Step([5, 2], "e", True)]
    assert steps[1] == [Step([8], "h", False), Step([9, 9, 9, 9], "iiii", False)]
    with pytest.raises(ValueError, match="separator"):
        EngineStepProposer(engine, CharTokenizer(), [[1]], "")
    assert math.isinf(Trace(0).score)
