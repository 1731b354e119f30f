"""The hidden gold reward (hand-worked values) and the data it labels."""

import pytest

from tether.tasks import get_task
from tether.tasks.gold import gold_comparisons, gold_reward, gold_score, noisy_demonstrations

TASK = get_task("arithmetic", digits=2, operators="+")


def test_gold_score_hand_values():
    # 47+85: reference steps "7+5=12 c1", "4+8+1=13 c1", answer 132
    right = "<think>7+5=12 c1|4+8+1=13 c1|</think>132"
    assert gold_score("47+85=", right) == 1.0
    assert gold_score("47+85=", right.replace("132", "131")) == 0.5  # steps right, answer wrong
    # a dropped carry carried through: step 2 wrong, answer wrong -> 0.5 * 1/2
    assert gold_score("47+85=", "<think>7+5=12 c1|4+8=12 c1|</think>122") == 0.25
    # an extra step: 2 of 3 written steps match, answer right -> 0.5 + 0.5 * 2/3
    assert gold_score("47+85=", "<think>7+5=12 c1|4+8+1=13 c1|0+0+1=1 c0|</think>132") == pytest.approx(5 / 6)
    assert gold_score("47+85=", "<think>7+5=12 c1|4+8+1=13 c1|132") == 0.0  # no </think>
    assert gold_score("hello", right) is None
    assert gold_reward(["47+85=", "7+5="], [right, "<think>7+5=12 c1|</think>12"]) == [1.0, 1.0]


def test_noisy_demonstrations_carry_the_slip_at_the_asked_rate():
    demos = noisy_demonstrations(TASK, 2000, noise=0.5, error="dropped_carry", seed=0)
    scores = [gold_score(d["prompt"], d["completion"]) for d in demos]
    # only problems with a carry into the tens column can drop one; about half of those do
    operands = [tuple(map(int, d["prompt"][:-1].split("+"))) for d in demos]
    applicable = [a % 10 + b % 10 >= 10 and max(a, b) >= 10 for a, b in operands]
    slipped = [s < 1 for s in scores]
    assert not any(s and not ok for s, ok in zip(slipped, applicable, strict=True))
    assert sum(slipped) / sum(applicable) == pytest.approx(0.5, abs=0.06)
    assert noisy_demonstrations(TASK, 50, noise=0.0) == noisy_demonstrations(TASK, 50, noise=0.0, error="answer")
    with pytest.raises(ValueError):
        noisy_demonstrations(TASK, 5, noise=1.5)


def test_gold_comparisons_are_ordered_by_the_gold_reward():
    pairs = gold_comparisons(TASK, 300, errors={"answer": 1.0, "dropped_carry": 1.0}, seed=1)
    assert all(p["gold_chosen"] == 1.0 > p["gold_rejected"] for p in pairs)
    assert all(gold_score(p["prompt"], p["chosen"]) == p["gold_chosen"] for p in pairs)
    assert {p["error"] for p in pairs} == {"answer", "dropped_carry"}
    held = gold_comparisons(TASK, 50, errors={"answer": 1.0}, seed=1, split="eval")
    assert not {p["prompt"] for p in held} & {p["prompt"] for p in pairs}
    with pytest.raises(ValueError, match="errors must weigh"):
        gold_comparisons(TASK, 5, errors={"slip": 1.0})
