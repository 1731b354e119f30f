"""Rewards: verifiable reward functions, their weighted combination, and reward shaping.

Knows nothing about training: reward functions map text to numbers, the composer turns several
of them into one tensor per batch, and shaping functions map token lengths to penalties.
"""

from tether.config.rewards import RewardSpec
from tether.rewards import cai, code, trajectory  # noqa: F401  (register judge (d-RLAIF), code_tests, trajectory)
from tether.rewards.combine import (
    RewardComposer,
    RewardFunctionError,
    RewardResult,
    as_reward_spec,
    resolve_reward_function,
)
from tether.rewards.scorer import RewardModelScorer
from tether.rewards.shaping import REWARD_SHAPING, RunningMoments, overlong_penalty, shape_scores
from tether.rewards.verifiers import (
    REWARD_FUNCTIONS,
    exact_match_reward,
    format_reward,
    format_score,
    length_reward,
    math_reward,
    normalize_answer,
    regex_reward,
    task_reward,
)

__all__ = [
    "REWARD_FUNCTIONS",
    "REWARD_SHAPING",
    "RewardComposer",
    "RewardFunctionError",
    "RewardModelScorer",
    "RewardResult",
    "RewardSpec",
    "RunningMoments",
    "as_reward_spec",
    "exact_match_reward",
    "format_reward",
    "format_score",
    "length_reward",
    "math_reward",
    "normalize_answer",
    "overlong_penalty",
    "regex_reward",
    "resolve_reward_function",
    "shape_scores",
    "task_reward",
]
