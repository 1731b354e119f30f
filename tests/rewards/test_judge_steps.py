"""The judge that checks every step (``check: steps``): its digit-by-digit step check by hand, its training
records scored as the ``worked_solution`` checker scores them, and ``judge_eval`` with ``right: steps``."""

import re
import sys
import types

import pytest

from tether.config.preference import JudgeDataConfig, JudgeEvalConfig
from tether.core.text_metrics import FROM_LETTERS, TO_LETTERS
from tether.rewards.judge_records import judge_records, sample_judge_records, steps_check, wrong_step
from tether.rewards.verifiers import worked_solution_reward
from tether.stages.judge_data import run_judge_eval
from tether.tasks import get_task

RIGHT = "<think>7+5=12 c1|4+8+1=13 c1|</think>132"  # 47+85=
OWN = RIGHT.translate(TO_LETTERS)
ERRORS = ["slip", "dropped_carry", "answer", "misread"]


def test_steps_check_by_hand():
    assert OWN == "<think>H+F=BC cB|E+I+B=BD cB|</think>BDC"
    assert steps_check(OWN, RIGHT) == "H/7= F/5= B/1= C/2= B/1=|E/4= I/8= B/1= B/1= D/3= B/1=|B/1= D/3= C/2= right"
    # the right answer through a miscounted first column: the answer check passes it, the step check does not
    assert steps_check(OWN, "<think>7+5=11 c1|4+8+1=13 c1|</think>132") == (
        "H/7= F/5= B/1= C/1x B/1=|E/4= I/8= B/1= B/1= D/3= B/1=|B/1= D/3= C/2= wrong")
    # a dropped carry shifts the step's digits: everything after it is marked
    assert steps_check(OWN, "<think>7+5=12 c1|4+8=12 c1|</think>122") == (
        "H/7= F/5= B/1= C/2= B/1=|E/4= I/8= B/1= B/2x D/1x B/_x|B/1= D/2x C/2= wrong")
    # a bare answer is one group: compared with the first step, the other steps missing
    assert steps_check("<think>2+3=5 c0|</think>5", "5") == "2/5x 3/_x 5/_x 0/_x|5/_x wrong"
    # an extra step shifts the answer; a group with no digits on either side is marked too
    assert steps_check("<think>2+3=5 c0|</think>5", "<think>2+3=5 c0|x|</think>5") == (
        "2/2= 3/3= 5/5= 0/0=|5/_x|_/5x wrong")
    assert steps_check("<think>2+3=5 c0|</think>5", "<think>2+3=5 c0|x|</think>") == (
        "2/2= 3/3= 5/5= 0/0=|5/_x|_/_x wrong")
    assert steps_check(RIGHT, RIGHT).endswith(" right")  # the judge's work may be in digits too


def test_wrong_step_keeps_the_answer_and_changes_one_step_digit():
    import random

    rng = random.Random(0)
    for _ in range(50):
        bad = wrong_step(RIGHT, rng)
        assert bad.endswith("</think>132") and len(bad) == len(RIGHT)
        assert sum(a != b for a, b in zip(bad, RIGHT, strict=True)) == 1
        assert steps_check(OWN, bad).endswith(" wrong")


def test_step_records_score_as_the_worked_solution_checker_does():
    task = get_task("arithmetic", digits=2)
    records = judge_records(task, 300, kind="pointwise", template="solve-pointwise", solve_first=True,
                            check="steps", letters=True, errors=ERRORS)
    wrong_steps = 0
    for record in records:
        _, shown, problem = record["prompt"].split("\n")  # "Judge\n47+85=<trace>\n47+85="
        response = shown.removeprefix(problem)
        exact = worked_solution_reward([problem], [response])[0]
        assert record["completion"].endswith(f"Score: {int(exact)}")
        assert record["completion"].endswith(f"{'right' if exact else 'wrong'} Score: {int(exact)}")
        work = re.match(r"<think>(.*)</think>([A-J]+) ", record["completion"])
        assert not re.search(r"\d", work[1])  # the judge works in letters
        a, b = map(int, problem[:-1].split("+"))
        assert int(work[2].translate(FROM_LETTERS)) == a + b
        wrong_steps += task.verify(response, str(a + b)) == 1.0 and not exact
    # about one wrong completion in three is a right answer reached through a wrong step
    assert 30 <= wrong_steps <= 70
    samples = [("47+85=", RIGHT, "132"), ("47+85=", "<think>7+5=11 c1|4+8+1=13 c1|</think>132", "132"),
               ("47+85=", "<think>7+5=12 c1|4+8+1=13 c1|</think>133", "132")]
    scores = [r["completion"][-1] for r in sample_judge_records(task, samples, template="solve-pointwise",
                                                                solve_first=True, check="steps", letters=True)]
    assert scores == ["1", "0", "0"]  # the verifier passes the second; the step check does not


def test_step_check_needs_a_pointwise_judge_that_solves_first():
    task = get_task("arithmetic", digits=2)
    with pytest.raises(ValueError, match="pointwise"):
        judge_records(task, 4, kind="pairwise", template="solve-pairwise", solve_first=True, check="steps")
    with pytest.raises(ValueError, match="solve_first"):
        judge_records(task, 4, kind="pointwise", template="solve-pointwise", check="steps")
    with pytest.raises(ValueError, match="check 'steps' needs"):
        JudgeDataConfig(kind="pointwise", check="steps")
    assert JudgeDataConfig(kind="pointwise", solve_first=True, check="steps", work_digits="letters")
    with pytest.raises(ValueError, match="right"):
        JudgeEvalConfig(judge={"backend": "callable", "model": "m:f"}, right="process")


def exact_judge(prompts: list[str]) -> list[str]:
    """Scores 1 exactly when the judged trace is the worked solution (the worked_solution checker)."""
    out = []
    for prompt in prompts:
        _, shown, problem = prompt.split("\n")
        out.append(f"Score: {int(worked_solution_reward([problem], [shown.removeprefix(problem)])[0])}")
    return out


def answer_judge(prompts: list[str]) -> list[str]:
    """Scores 1 when the judged trace's answer is right, whatever its steps."""
    out = []
    for prompt in prompts:
        _, shown, problem = prompt.split("\n")
        a, b = map(int, problem[:-1].split("+"))
        out.append(f"Score: {int(shown.rsplit('</think>', 1)[-1] == str(a + b))}")
    return out


def test_judge_eval_with_right_steps_measures_the_wrong_step_pairs(monkeypatch, tmp_path):
    module = types.ModuleType("step_judges")
    module.exact_judge, module.answer_judge = exact_judge, answer_judge
    monkeypatch.setitem(sys.modules, "step_judges", module)
    figures = {}
    for name in ("exact_judge", "answer_judge"):
        cfg = JudgeEvalConfig(name=name, right="steps", task={"name": "arithmetic", "options": {"digits": 2},
                                                              "eval_n": 30},
                              judge={"kind": "pointwise", "backend": "callable", "model": f"step_judges:{name}",
                                     "template": "solve-pointwise", "scale": [0, 1]})
        figures[name] = run_judge_eval(cfg, tmp_path, resume=False)
    assert figures["exact_judge"]["synthetic/verdict_accuracy"] == 1.0
    assert figures["exact_judge"]["wrong_step/verdict_accuracy"] == 1.0
    assert figures["answer_judge"]["synthetic/verdict_accuracy"] == 1.0
    # the answer-only judge cannot tell a right answer through a wrong step from the worked solution
    assert figures["answer_judge"]["wrong_step/decisive_rate"] == 0.0
    assert figures["exact_judge"]["wrong_step/pairs"] == 30
