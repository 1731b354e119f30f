"""The synthetic InstructGPT study stages: gold-labelled data, and the reward over-optimisation sweep."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tether.config.common import StageConfig, TaskSpec
from tether.config.rl import PPOConfig


def _two_digit_sums() -> TaskSpec:
    return TaskSpec(name="arithmetic", options={"digits": 2, "operators": "+"})


class GoldDataConfig(StageConfig):
    """Demonstrations and comparisons labelled by the gold reward (``tether.tasks.gold``)."""

    type: Literal["gold_data"] = Field("gold_data", description="the stage type")
    task: TaskSpec = Field(default_factory=_two_digit_sums, description="the task the gold reward judges")
    sft_n: int = Field(4000, ge=0, description="demonstrations (train split)")
    noise: float = Field(0.0, ge=0, le=1, description="share of demonstrations with a labeller's slip")
    noise_error: Literal["answer", "dropped_carry"] = Field("dropped_carry", description="the slip")
    pairs_n: int = Field(6000, ge=1, description="comparisons (train split)")
    eval_pairs_n: int = Field(200, ge=0, description="held-out comparisons (eval split)")
    errors: dict[Literal["answer", "dropped_carry", "spurious_carry"], float] = Field(
        default_factory=lambda: {"answer": 1.0, "dropped_carry": 1.0},
        description="weights of the error kinds in the rejected completions")
    seed: int = Field(0, description="which records are drawn")


class OverOptimizationConfig(PPOConfig):
    """A PPO stage run once per KL coefficient in ``betas`` (everything else shared), and best-of-n."""

    type: Literal["overoptimization"] = Field("overoptimization", description="the stage type")
    betas: list[float] = Field(default_factory=lambda: [0.3, 0.1, 0.03, 0.0], min_length=1,
                               description="the KL coefficients, one PPO run each")
    best_of_n: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32],
                                 description="n values of the best-of-n curve from the starting model ([] = off)")

    @model_validator(mode="after")
    def _measurable(self) -> OverOptimizationConfig:
        if self.eval is None or self.gold is None:
            raise ValueError("an over-optimisation sweep needs 'eval' (held-out prompts) and 'gold' (the true reward)")
        if any(b < 0 for b in self.betas) or any(n < 1 for n in self.best_of_n):
            raise ValueError(f"betas must be >= 0 and best_of_n >= 1, got {self.betas}, {self.best_of_n}")
        return self

    def run_name(self, beta: float) -> str:
        """The PPO run of one beta: its folder in the run directory."""
        return f"{self.name or self.type}-beta{beta:g}"

    def ppo_config(self, beta: float, *, first: bool) -> PPOConfig:
        """The PPO stage of one beta; the first run also evaluates the starting (SFT) policy."""
        data = self.model_dump(exclude={"betas", "best_of_n", "type", "name"})
        data["kl"].update(coef=beta, controller="fixed")
        data["eval"]["before"] = first
        return PPOConfig.model_validate({**data, "type": "ppo", "name": self.run_name(beta)})
