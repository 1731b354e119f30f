"""Environments: ``reset(task) -> observation``, ``step(action) -> (observation, done, info)``, and a verifier.

An environment holds the state of one episode. ``reset`` takes a task record (``{"prompt",
"answer", ...}``) and returns the first observation (the user's message); ``step`` takes the text
of one policy turn, acts on it and returns what the policy sees next, whether the episode is
over, and an ``info`` dict (``kind``: ``tool`` / ``final`` / ``malformed``, ``tools`` called,
``tool_errors``, ``limits`` hit, the final ``answer``, an optional per-step ``reward``);
``verify(trajectory, task) -> float`` scores a finished trajectory.

:class:`ToolEnvironment` is the built-in one: a task from ``tether.tasks`` (its verifier scores the
final answer), a set of tools, and an action format. ``state_key`` names the environment state
(the observations so far) for GiGPO's anchor-state grouping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tether.config.agent import EnvironmentConfig
from tether.core.registry import Registry
from tether.rollout.actions import ACTION_FORMATS, Action, ActionFormat, ToolCall, get_action_format
from tether.rollout.tools import Tool, ToolExecutionError, build_tools
from tether.tasks import Task, draw_problems, get_task


class Environment(Protocol):
    def reset(self, task: dict) -> str: ...

    def step(self, action: str) -> tuple[str | None, bool, dict[str, Any]]: ...

    def verify(self, trajectory: Any, task: dict) -> float: ...

    def state_key(self) -> str: ...


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment")


@ENVIRONMENTS.register("tools")
class ToolEnvironment:
    """Tools + a task verifier + an action format; one instance per episode (see the module docstring)."""

    def __init__(self, task: Task, tools: dict[str, Tool], action_format: ActionFormat, *,
                 max_observation_chars: int = 256) -> None:
        self.task, self.tools, self.format = task, tools, action_format
        self.max_observation_chars = max_observation_chars
        self.record: dict | None = None
        self.observations: list[str] = []

    def reset(self, task: dict) -> str:
        self.record, self.observations = task, []
        return task["prompt"]

    def call(self, calls: list[ToolCall]) -> tuple[str, dict[str, Any]]:
        """Run tool calls; an exception becomes an ``Error: ...`` observation, counted in ``tool_errors``."""
        outputs, errors, limits = [], 0, []
        for call in calls:
            try:
                outputs.append(self.tools[call.name](call.arguments))
            except ToolExecutionError as err:
                errors += 1
                limits += [err.limit] if err.limit else []
                outputs.append(f"Error: {err}" + (f"\n{err.output}" if err.output else ""))
            except Exception as err:
                errors += 1
                outputs.append(f"Error: {type(err).__name__}: {err}")
        text = "\n".join(o.strip() or "(no output)" for o in outputs)[: self.max_observation_chars]
        return text, {"tools": [c.name for c in calls], "tool_errors": errors, "limits": limits}

    def step(self, action: str) -> tuple[str | None, bool, dict[str, Any]]:
        parsed = self.format.parse(action, list(self.tools))
        if parsed.kind == "final":
            return None, True, {"kind": "final", "answer": parsed.answer}
        if parsed.kind == "malformed":
            observation = f"Error: {parsed.error}"[: self.max_observation_chars]
            info: dict[str, Any] = {"kind": "malformed", "error": parsed.error}
        else:
            observation, info = self.call(parsed.calls)
            info["kind"] = "tool"
        self.observations.append(observation)
        return observation, False, info

    def verify(self, trajectory: Any, task: dict) -> float:
        """The task's verifier on the final answer; 0 when the episode ended without one."""
        answer = getattr(trajectory, "answer", None)
        return 0.0 if answer is None else float(self.task.verify(answer, str(task["answer"])))

    def state_key(self) -> str:
        return "\x1e".join(self.observations)

    def demonstration(self, task: dict) -> list[tuple[str, str | None]]:
        """A scripted episode for SFT from the record's ``plan`` and ``solution``: (action text,
        observation) per turn, the tools executed for real so observations match what RL will see."""
        self.reset(task)
        turns = []
        for call in task.get("plan") or []:
            text = self.format.render(Action("tool", calls=[ToolCall(call["name"], call["arguments"])]))
            observation, _, _ = self.step(text)
            turns.append((text, observation))
        turns.append((self.format.render(Action("final", answer=str(task.get("solution", task["answer"])))), None))
        return turns


def environment_factory(cfg: EnvironmentConfig) -> Callable[[], Environment]:
    """A function making a fresh environment per episode (tools and task are built once and shared)."""
    task = get_task(cfg.task.name, **cfg.task.options)
    tools = build_tools(cfg.tools)
    action_format = get_action_format(cfg.action_format)
    cls = ENVIRONMENTS.get(cfg.name)
    return lambda: cls(task, tools, action_format, max_observation_chars=cfg.max_observation_chars)


def environment_records(cfg: EnvironmentConfig, *, split: str, n: int | None = None, seed: int | None = None
                        ) -> list[dict]:
    """Task records of one split: ``{"prompt", "answer", "plan", "solution"}``. ``plan`` lists the tool
    calls (``{"name", "arguments"}``) a demonstration makes, from the task's ``tool_plan(problem)`` when
    it has one; ``solution`` is what a demonstration answers (the task's ``solution`` attribute of a
    problem when its gold ``answer`` is not itself an answer, as for hidden unit tests)."""
    task = get_task(cfg.task.name, **cfg.task.options)
    n = n if n is not None else (cfg.task.n if split == "train" else cfg.eval_n)
    seed = cfg.task.seed if seed is None else seed
    records = []
    for problem in draw_problems(task, n, seed=seed, split=split, eval_fraction=cfg.eval_fraction):
        plan = task.tool_plan(problem) if hasattr(task, "tool_plan") else []
        solution = getattr(problem, "solution", None)
        records.append({"prompt": problem.prompt, "answer": problem.answer, "plan": plan,
                        "solution": problem.answer if solution is None else solution})
    return records


__all__ = ["ACTION_FORMATS", "ENVIRONMENTS", "Environment", "EnvironmentConfig", "ToolEnvironment",
           "environment_factory", "environment_records"]
