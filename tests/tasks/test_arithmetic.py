import random

import pytest

from tether.tasks import draw_problems, eval_records, get_task, pretrain_records, rl_records, sft_records
from tether.tasks.arithmetic import Arithmetic, addition_trace, subtraction_trace


def test_addition_trace_by_hand():
    # 47+85: 7+5=12 carry 1; 4+8+1=13 carry 1 -> 132
    assert addition_trace(47, 85) == "7+5=12 c1|4+8+1=13 c1|"
    assert addition_trace(5, 3) == "5+3=8 c0|"


def test_subtraction_trace_by_hand():
    # 52-17: 2-7 borrows -> 15-7=8 (written as 2-7=5 with borrow); 5-1-1=3 -> 35
    assert subtraction_trace(52, 17) == "2-7=5 b1|5-1-1=3 b0|"
    assert subtraction_trace(3, 9).startswith("3<9 so -(9-3)|")


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_problems_have_correct_answers(ops):
    task = get_task("arithmetic", digits=3, operators=ops)
    rng = random.Random(0)
    for _ in range(200):
        p = task.sample(rng)
        a, op, b = None, None, None
        for o in "+-*":
            left, sep, right = p.prompt[:-1].partition(o)
            if sep and left:
                a, op, b = int(left), o, int(right)
                break
        assert str(eval(f"{a}{op}{b}")) == p.answer


def test_verify():
    task = get_task("arithmetic")
    assert task.verify("<think>7+5=12 c1|4+8+1=13 c1|</think>132", "132") == 1.0
    assert task.verify("132", "132") == 1.0
    assert task.verify("<think>...</think> 1,32 ", "132") == 1.0
    assert task.verify("<think>132</think>131", "132") == 0.0
    assert task.verify("<think>unfinished", "132") == 0.0
    assert task.verify("", "132") == 0.0


def test_eval_split_is_disjoint_from_every_training_split():
    task = get_task("arithmetic", digits=2)
    held_out = {r["prompt"] for r in eval_records(task, 500)}
    for seed in range(3):
        train = {r["prompt"] for r in sft_records(task, 2000, seed=seed)}
        train |= {r["prompt"] for r in rl_records(task, 2000, seed=seed)}
        train |= {r["text"].split("=")[0] + "=" for r in pretrain_records(task, 2000, seed=seed)}
        assert not held_out & train


def test_records_are_seeded_and_distinct():
    task = get_task("arithmetic", digits=2)
    assert sft_records(task, 50, seed=1) == sft_records(task, 50, seed=1)
    assert sft_records(task, 50, seed=1) != sft_records(task, 50, seed=2)
    prompts = [r["prompt"] for r in rl_records(task, 1000)]
    assert len(set(prompts)) == len(prompts)


def test_record_shapes():
    task = get_task("arithmetic", digits=2)
    chat = sft_records(task, 2, chat=True)[0]["messages"]
    assert [m["role"] for m in chat] == ["user", "assistant"]
    assert chat[1]["content"].startswith("<think>") and "</think>" in chat[1]["content"]
    plain = sft_records(task, 2, think=False)[0]
    assert "<think>" not in plain["completion"]
    assert "<think>" not in pretrain_records(task, 5)[0]["text"]


def test_too_many_problems_is_a_clear_error():
    task = get_task("arithmetic", digits=1, min_digits=1)
    with pytest.raises(ValueError, match="could only supply"):
        draw_problems(task, 500, seed=0, split="train")


def test_bad_options():
    with pytest.raises(ValueError, match="operators"):
        get_task("arithmetic", operators="/")
    with pytest.raises(KeyError, match="valid names: arithmetic"):
        get_task("no-such-task")


def test_worked_pretraining_text_has_the_algorithm_but_no_tags():
    task = get_task("arithmetic", digits=2, pretrain_format="worked")
    text = pretrain_records(task, 1, seed=0)[0]["text"]
    assert " so " in text and "|" in text and "<think>" not in text
    prompt, _, rest = text.partition(": ")
    a, b = prompt.split("+")
    assert rest.endswith(f"so {int(a) + int(b)}")
    with pytest.raises(ValueError, match="pretrain_format"):
        get_task("arithmetic", pretrain_format="nope")


def test_think_pretraining_text_is_the_prompt_then_the_demonstration():
    task = get_task("arithmetic", digits=2, operators="-", pretrain_format="think")
    problem = task.sample(__import__("random").Random(3))
    text = task.pretrain_text(problem)
    assert text == f"{problem.prompt}<think>{problem.reasoning}</think>{problem.answer}"
    assert task.verify(text[len(problem.prompt):], problem.answer) == 1.0


def test_letter_digits_prompts_answers_and_pretraining_text():
    from tether.tasks.base import is_held_out

    task = get_task("arithmetic", digits=3, letter_digits=0.5, pretrain_format="worked")
    problems = draw_problems(task, 400, seed=0, split="train")
    letters = [p for p in problems if p.prompt[0].isalpha()]
    assert 150 < len(letters) < 250  # about half
    for p in problems:
        digit_prompt = p.prompt.translate(str.maketrans("ABCDEFGHIJ", "0123456789"))
        solved = get_task("arithmetic", digits=3).solve(digit_prompt)
        assert p.answer == solved.answer and p.reasoning == solved.reasoning  # answer and steps in digits
        assert task.solve(p.prompt).answer == p.answer
        assert not is_held_out(get_task("arithmetic").solve(digit_prompt), 0.1)  # split by the digit form
    p = task.solve("EH+IF=")
    assert (p.prompt, p.answer, p.reasoning) == ("EH+IF=", "132", "7+5=12 c1|4+8+1=13 c1|")
    assert task.pretrain_text(p) == "EH+IF: H+F=BC cB|E+I+B=BD cB| so BDC"  # letters throughout
    assert task.solve("EH+85=") is None and task.verify("<think>x</think>132", "132") == 1.0
    assert get_task("arithmetic", digits=3, letter_digits=0.0).sample(random.Random(0)).prompt[0].isdigit()
    with pytest.raises(ValueError, match="letter_digits"):
        get_task("arithmetic", letter_digits=1.5)


def test_nonnegative_subtraction_and_its_inverse_check():
    import random

    task = Arithmetic(digits=2, operators="-", nonnegative=True)
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(300)]
    assert all(int(p.answer) >= 0 for p in problems)
    assert any(int(p.answer) < 0 for p in (Arithmetic(digits=2, operators="-").sample(rng) for _ in range(50)))
    for p in problems:
        steps, total, target = task.check(p.prompt, p.answer)
        assert total == target == p.prompt.split("-")[0] and steps.count("|") >= 1
        _, off, _ = task.check(p.prompt, str(int(p.answer) + 1))
        assert off != target
    assert task.check("12-47=", "-35") == ("7-5=2 b0|4-3=1 b0|", "12", "12")  # -35 + 47, as 47 - 35
    assert task.check("12-47=", "35") == ("5+7=12 c1|3+4+1=8 c0|", "82", "12")
    assert task.check("12-47=", "3x") is None
    plus = Arithmetic(digits=2)
    assert plus.check("47+85=", "132") == ("2-5=7 b1|3-8-1=4 b1|1-0-1=0 b0|", "47", "47")
    assert plus.check("47+85=", "-1") is None
    with pytest.raises(ValueError, match="inverse check for"):
        Arithmetic(digits=2, operators="*").check("12*3=", "36")
    with pytest.raises(ValueError, match="not a prompt of this task"):
        plus.check("hello", "1")
