"""Rewards for multi-turn agent episodes (knows trajectories only by their ``outcome`` attribute)."""

from __future__ import annotations

from typing import Any

from tether.rewards.verifiers import REWARD_FUNCTIONS


@REWARD_FUNCTIONS.register("trajectory")
def trajectory_reward(prompts: list[str], completions: list[str], trajectory: list[Any], **_columns
                      ) -> list[float | None]:
    """The environment's verifier score of each episode, ``verify(trajectory, task)``, computed by the
    agent loop when the episode ended (so slow verifiers, such as unit tests in the sandbox, run
    concurrently with the other episodes' tool calls). ``completions`` are the final answers."""
    return [None if t is None else float(t.outcome) for t in trajectory]
