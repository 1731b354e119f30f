"""Synthetic tasks with verifiers, used by the built-in recipes, tests and benchmarks."""

from tether.tasks import arithmetic, code, multiplication, secret  # noqa: F401  (register the tasks)
from tether.tasks.base import (
    TASKS,
    Problem,
    Task,
    draw_problems,
    eval_records,
    extract_answer,
    get_task,
    pretrain_records,
    reference_records,
    rl_records,
    sft_records,
)

__all__ = [
    "TASKS",
    "Problem",
    "Task",
    "draw_problems",
    "eval_records",
    "extract_answer",
    "get_task",
    "pretrain_records",
    "reference_records",
    "rl_records",
    "sft_records",
]
