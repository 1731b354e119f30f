"""Synthetic preference / stepwise data: labels known exactly, held-out split disjoint."""

import random
import re

import pytest

from tether.data import validate_records
from tether.tasks import get_task
from tether.tasks.base import extract_answer
from tether.tasks.preferences import (
    completion_steps,
    preference_records,
    ranking_records,
    split_pairs,
    stepwise_records,
    unpaired_records,
    wrong_addition,
)

TASK = get_task("arithmetic", digits=3)


def column_sums_ok(completion: str) -> bool:
    """Every written column ``x+y(+c)=t cK`` is right, and the carries chain into the answer."""
    steps = completion_steps(completion)
    carry = 0
    digits = []
    for step in steps[:-1]:
        m = re.fullmatch(r"(?:<think>)?(\d)\+(\d)(?:\+(\d))?=(\d+) c(\d)", step)
        x, y, c, total, k = int(m[1]), int(m[2]), int(m[3] or 0), int(m[4]), int(m[5])
        if c != carry or x + y + c != total or k != total // 10:
            return False
        carry, digits = k, [*digits, total % 10]
    answer = int("".join(map(str, reversed(digits)))) + carry * 10 ** len(digits)
    return steps[-1] == f"</think>{answer}"


def test_wrong_addition_by_hand():
    # 47+85: columns 7+5=12 c1, 4+8+1=13 c1 -> 132. Every error kind changes the answer and
    # the first wrong step is where the trace first departs from the correct one.
    correct = ["7+5=12 c1", "4+8+1=13 c1", "132"]
    kinds = set()
    for seed in range(40):
        steps, bad, kind = wrong_addition(47, 85, random.Random(seed))
        assert steps[:bad] == correct[:bad] and steps[bad] != correct[bad]
        assert steps[-1] != "132"
        kinds.add(kind)
        if kind == "answer":
            assert bad == 2 and steps[-1] in ("131", "133")
        elif kind == "dropped_carry":
            assert bad == 1 and steps[1:] == ["4+8=12 c1", "122"]
        else:  # a column total off by one, carried through: 7+5=11 c1 -> 121, or 7+5=13 -> 4+8+1=13 -> 133
            assert steps[bad].split("=")[1] != correct[bad].split("=")[1]
    assert kinds == {"answer", "dropped_carry", "slip"}
    # only the allowed kinds; dropped_carry falls back to answer when there is no carry
    assert {wrong_addition(47, 85, random.Random(s), ["answer"])[2] for s in range(10)} == {"answer"}
    assert wrong_addition(12, 34, random.Random(0), ["dropped_carry"])[2] == "answer"


def test_misread_by_hand():
    # 47+85 with one operand digit copied off by one: the column is summed as written and carried through,
    # so the trace is self-consistent (column_sums_ok) but its answer is wrong by one unit of that column
    seen = set()
    for seed in range(60):
        steps, bad, kind = wrong_addition(47, 85, random.Random(seed), ["misread"])
        assert kind == "misread"
        x, y = re.match(r"(\d)\+(\d)", steps[bad]).groups()
        right = ("7", "5") if bad == 0 else ("4", "8")
        assert (x != right[0]) != (y != right[1])  # exactly one digit misread
        assert abs(int(x + y) - int("".join(right))) in (1, 10)  # off by one
        assert abs(int(steps[-1]) - 132) == 10 ** bad
        assert column_sums_ok(_join_trace(steps))
        seen.add((bad, x != right[0]))
    assert seen == {(0, True), (0, False), (1, True), (1, False)}
    # a column only the longer operand reaches: its digit is the one misread (5+97: 0+9 -> 0+8 or 0+10 never)
    for seed in range(20):
        steps, bad, _ = wrong_addition(5, 97, random.Random(seed), ["misread"])
        if bad == 1:
            assert steps[1].startswith("0+8+1=") or steps[1].startswith("0+8=")
    assert "misread" not in {r["error"] for r in preference_records(TASK, 200)}  # not a default kind


def test_answer_digit_by_hand():
    # 85+50 = 135: the trace right, one digit of the answer at any position off by one, never a leading 0
    right = wrong_addition(85, 50, random.Random(0), ["answer"])[0][:-1]
    answers = set()
    for seed in range(80):
        steps, bad, kind = wrong_addition(85, 50, random.Random(seed), ["answer_digit"])
        assert kind == "answer_digit" and bad == 2 and steps[:-1] == right
        answer = steps[-1]
        assert len(answer) == 3 and sum(a != b for a, b in zip(answer, "135", strict=True)) == 1
        assert all(abs(int(a) - int(b)) <= 1 for a, b in zip(answer, "135", strict=True))
        answers.add(answer)
    assert answers == {"235", "125", "145", "134", "136"}  # every position, both ways where a digit allows
    assert {wrong_addition(4, 5, random.Random(s), ["answer_digit"])[0][-1] for s in range(20)} == {"8"}  # 9 -> 8
    assert "answer_digit" not in {r["error"] for r in preference_records(TASK, 200)}  # not a default kind


def _join_trace(steps: list[str]) -> str:
    return "<think>" + "".join(s + "|" for s in steps[:-1]) + "</think>" + steps[-1]


def test_errors_option():
    records = preference_records(TASK, 200, errors=["answer", "dropped_carry"])
    assert {r["error"] for r in records} == {"answer", "dropped_carry"}
    for r in records:
        if r["error"] == "answer":  # the trace is intact
            assert r["chosen"].split("</think>")[0] == r["rejected"].split("</think>")[0]
    with pytest.raises(ValueError, match="errors"):
        preference_records(TASK, 2, errors=["typo"])


def test_correctness_pairs():
    records = preference_records(TASK, 300, seed=1)
    validate_records(records, "preference", "<gen>")
    for r in records:
        assert r["chosen"] != r["rejected"]
        answer = str(eval(r["prompt"][:-1]))
        assert TASK.verify(r["chosen"], answer) == 1.0
        assert TASK.verify(r["rejected"], answer) == 0.0
        assert column_sums_ok(r["chosen"])


def test_style_pairs_are_both_correct_and_chosen_is_shorter():
    for r in preference_records(TASK, 100, kind="style"):
        answer = str(eval(r["prompt"][:-1]))
        assert extract_answer(r["chosen"]) == answer
        assert r["rejected"].rstrip(".").endswith(answer) and len(r["rejected"]) > len(r["chosen"])
    kinds = [r["kind"] for r in preference_records(TASK, 10, kind="mixed")]
    assert kinds == ["correctness", "style"] * 5


def test_train_and_eval_pairs_never_share_a_problem():
    train = {r["prompt"] for r in preference_records(TASK, 500, split="train")}
    held = {r["prompt"] for r in preference_records(TASK, 200, split="eval")}
    assert len(train) == 500 and len(held) == 200 and not train & held


def test_stepwise_labels():
    records = stepwise_records(TASK, 400, wrong_fraction=0.5)
    validate_records(records, "stepwise", "<gen>")
    wrong = 0
    for r in records:
        labels = r["labels"]
        completion = "|".join(r["steps"])
        assert completion.startswith("<think>") and "|</think>" in completion
        # once a step is wrong every later one is: labels are 1...1 0...0
        assert labels == sorted(labels, reverse=True)
        assert all(labels) == column_sums_ok(completion)
        wrong += not all(labels)
    assert 150 < wrong < 250
    assert all(all(r["labels"]) for r in stepwise_records(TASK, 50, wrong_fraction=0.0))


def test_stepwise_stop_traces_end_before_the_answer_with_their_last_step_wrong():
    records = stepwise_records(TASK, 600, wrong_fraction=0.5, errors=["answer", "dropped_carry", "stop"])
    validate_records(records, "stepwise", "<gen>")
    stopped = [r for r in records if "</think>" not in r["steps"][-1]]
    assert 60 < len(stopped) < 140  # a third of the ~300 wrong traces
    for r in stopped:
        completion = "|".join(r["steps"])
        assert r["labels"] == [1] * (len(r["steps"]) - 1) + [0]
        assert completion.startswith("<think>")
    # every step of a stopped trace is a prefix of the correct trace's steps
    solved = {r["prompt"]: r["steps"] for r in stepwise_records(TASK, 600, wrong_fraction=0.0)}
    assert all(r["steps"] == solved[r["prompt"]][:len(r["steps"])] for r in stopped)
    assert all("</think>" not in r["steps"][-1] for r in stepwise_records(TASK, 50, wrong_fraction=1.0, errors=["stop"]))
    # without 'stop' the records are those drawn before it existed
    assert stepwise_records(TASK, 50, errors=["answer", "dropped_carry"]) == stepwise_records(
        TASK, 50, errors=("answer", "dropped_carry"))
    with pytest.raises(ValueError, match="errors must be"):
        preference_records(TASK, 5, errors=["stop"])


@pytest.mark.parametrize("operators", ["-", "*"])
def test_other_operators_get_a_wrong_step(operators):
    task = get_task("arithmetic", digits=2, operators=operators)
    for r in stepwise_records(task, 50, wrong_fraction=1.0):
        assert 0 in r["labels"] and r["labels"][-1] == 0
    for r in preference_records(task, 50):
        assert task.verify(r["rejected"], str(eval(r["prompt"][:-1]))) == 0.0


def test_unpaired_split():
    pairs = preference_records(TASK, 3)
    unpaired = split_pairs(pairs)
    assert [u["label"] for u in unpaired] == [True, False] * 3
    assert unpaired[1]["completion"] == pairs[0]["rejected"]
    assert len(unpaired_records(TASK, 5)) == 5
    validate_records(unpaired, "unpaired", "<gen>")


def test_chat_pairs():
    r = preference_records(TASK, 1, chat=True)[0]
    assert r["prompt"][0]["role"] == "user" and r["chosen"][0]["role"] == "assistant"
    validate_records([r], "preference", "<gen>")


def answer_of(completion: str) -> str:
    """The number a (possibly padded) completion ends on."""
    return re.findall(r"\d+", extract_answer(completion))[-1]


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_ranking_records_rank_by_correctness_then_conciseness(k):
    records = ranking_records(TASK, 60, completions=k, seed=2)
    assert validate_records(records, "ranking", "<gen>")  # distinct answers, dense ranks
    for r in records:
        answer = str(eval(r["prompt"][:-1]))
        assert r["ranks"] == (sorted([0, 1, 2, 3, 2, 3][:k]) if k > 4 else list(range(k)))
        for completion, rank in zip(r["completions"], r["ranks"], strict=True):
            assert (answer_of(completion) == answer) == (rank < 2)  # correct first
            padded = rank % 2 == 1  # then concise before padded
            assert (extract_answer(completion) != answer_of(completion)) == padded
    train = {r["prompt"] for r in records}
    assert not train & {r["prompt"] for r in ranking_records(TASK, 30, completions=k, split="eval")}


def test_ranking_records_chat_and_bad_k():
    r = ranking_records(TASK, 1, completions=3, chat=True)[0]
    assert r["prompt"][0]["role"] == "user" and [c[0]["role"] for c in r["completions"]] == ["assistant"] * 3
    validate_records([r], "ranking", "<gen>")
    with pytest.raises(ValueError, match="2 to 6"):
        ranking_records(TASK, 1, completions=7)
