"""A judge that sees only each response's final answer (``answer_only``): what it is sent, and that the
judge records it is trained on show it the same text."""

import sys
import types

import pytest

from tether.config.preference import JudgeDataConfig
from tether.rewards.judge import PairwiseJudge, PointwiseJudge
from tether.rewards.judge_records import sample_judge_records
from tether.scoring import build_judge
from tether.tasks import get_task

TRACE = "<think>0+8=8 c0|3+3=6 c0|</think>78"


def _recording(reply):
    sent = []

    def backend(prompts):
        sent.extend(prompts)
        return [reply] * len(prompts)

    return backend, sent


def test_a_pointwise_judge_with_answer_only_is_sent_the_final_answers():
    backend, sent = _recording("Score: 1")
    judge = PointwiseJudge(backend, template="solve-pointwise", scale=(0, 1), answer_only=True)
    assert judge.score(["30+38=", "30+38=", "30+38="], [TRACE, "<think>0+8=8 c0|", "68"]) == [1.0, 1.0, 1.0]
    # the answer after </think>; nothing of a thinking block that never closes; a bare answer as it is
    assert sent == ["Judge\n30+38=78\n30+38=", "Judge\n30+38=\n30+38=", "Judge\n30+38=68\n30+38="]
    backend, whole = _recording("Score: 1")
    PointwiseJudge(backend, template="solve-pointwise", scale=(0, 1)).score(["30+38="], [TRACE])
    assert whole == [f"Judge\n30+38={TRACE}\n30+38="]


def test_a_pairwise_judge_with_answer_only_is_sent_the_final_answers_in_both_orders():
    backend, sent = _recording("[[A]]")
    judge = PairwiseJudge(backend, template="compact-pairwise", answer_only=True)
    assert judge.compare(["q"], ["<think>a</think>12"], ["<think>b</think>13"]) == [0.5]
    assert len(sent) == 2 and all("<think>" not in p for p in sent)
    assert "A:12\nB:13" in sent[0] and "A:13\nB:12" in sent[1]


def test_answer_only_reaches_the_judge_from_its_config(monkeypatch):
    module = types.ModuleType("answer_only_judges")
    module.sent = []
    module.judge = lambda prompts: module.sent.extend(prompts) or ["Score: 0"] * len(prompts)
    monkeypatch.setitem(sys.modules, "answer_only_judges", module)
    judge = build_judge({"kind": "pointwise", "backend": "callable", "model": "answer_only_judges:judge",
                         "template": "solve-pointwise", "scale": [0, 1], "answer_only": True})
    assert judge.score(["30+38="], [TRACE]) == [0.0] and module.sent == ["Judge\n30+38=78\n30+38="]


def test_own_sample_records_show_the_judge_what_an_answer_only_judge_is_sent():
    task = get_task("arithmetic", digits=2)
    samples = [("30+38=", TRACE, "68"), ("30+38=", "<think>0+8=8 c0|3+3=6 c0|</think>68", "68")]
    traces = sample_judge_records(task, samples, template="solve-pointwise", solve_first=True, letters=True)
    answers = sample_judge_records(task, samples, template="solve-pointwise", solve_first=True, letters=True,
                                   answers_only=True)
    backend, sent = _recording("Score: 1")
    PointwiseJudge(backend, template="solve-pointwise", scale=(0, 1), answer_only=True).score(
        [p for p, _, _ in samples], [r for _, r, _ in samples])
    assert [r["prompt"] for r in answers] == sent  # trained on exactly the prompts it is asked at run time
    # the verdict is the verifier's and the judge's own work is unchanged: only what it reads differs
    assert [r["completion"] for r in answers] == [r["completion"] for r in traces]
    assert answers[0]["completion"].endswith("wrong Score: 0") and answers[1]["completion"].endswith("Score: 1")


def test_a_step_check_cannot_judge_answers_alone():
    with pytest.raises(ValueError, match="responses: traces"):
        JudgeDataConfig(kind="pointwise", template="solve-pointwise", solve_first=True, check="steps",
                        responses="answers")
