"""The tool-use multiplication task: exact verifier, tool plans mixing both tools, direct answers by hash."""

import random

from tether.rollout.tools import build_tools
from tether.tasks import draw_problems, get_task


def test_problems_and_verifier():
    task = get_task("multiplication", digits=3)
    problem = task.sample(random.Random(0))
    a, b = map(int, problem.prompt.rstrip("=").split("*"))
    assert 100 <= a <= 999 and 100 <= b <= 999 and problem.answer == str(a * b)
    assert task.verify(f"{a * b}", problem.answer) == 1.0
    assert task.verify(f"{a * b + 1}", problem.answer) == 0.0 and task.verify("lots", problem.answer) == 0.0


def test_tool_plans_compute_the_answer_with_either_tool():
    task = get_task("multiplication", digits=2, tools=["calculator", "python"])
    tools = build_tools(["calculator", "python"])
    problems = draw_problems(task, 40, seed=0, split="train")
    plans = [task.tool_plan(p) for p in problems]
    names = {plan[0]["name"] for plan in plans}
    assert names == {"calculator", "python"}
    for problem, plan in list(zip(problems, plans, strict=True))[:6]:
        assert tools[plan[0]["name"]](plan[0]["arguments"]) == problem.answer


def test_direct_fraction_answers_some_problems_without_a_tool():
    problems = draw_problems(get_task("multiplication"), 400, seed=0, split="train")
    half = get_task("multiplication", direct_fraction=0.5)
    direct = sum(not half.tool_plan(p) for p in problems)
    assert 160 < direct < 240
    assert all(get_task("multiplication").tool_plan(p) for p in problems)
