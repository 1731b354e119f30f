"""Step rewards for process-supervised RL: a process reward model scores every step of every sample.

DeepSeekMath's process supervision (Shao et al. 2024, section 4.1.3) needs, per sample, the PRM's score
of each reasoning step and the token each step ends at; ``grpo_process`` (``tether.core.advantages``)
turns them into per-token advantages. The steps are the completion's text cut at the PRM's own step
separator (the one it was trained with), so a sample is scored exactly as the PRM learned; the step ends
are found by :func:`~tether.data.tokenize.step_end_tokens` from the decoded completion tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.config.rl import ProcessRewardConfig
from tether.data.tokenize import step_end_tokens
from tether.rewards.scorer import RewardModelScorer
from tether.rollout import Rollout


class ProcessRewards:
    """A process reward model as step rewards ``(B, S)`` and step ends ``(B, S)`` (-1: no such step)."""

    def __init__(self, config: ProcessRewardConfig, tokenizer: Any) -> None:
        self.scorer = RewardModelScorer(config.path, batch_size=config.batch_size, process=True)
        self.tokenizer = tokenizer

    @torch.no_grad()
    def __call__(self, prompts: list[Any], rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        scores = self.scorer.step_scores(prompts, rollout.texts)
        separator = self.scorer.step_separator
        ends = [step_end_tokens([self.tokenizer.decode([t], skip_special_tokens=True) for t in ids], separator)
                for ids in rollout.completion_ids]
        # the PRM may read fewer steps than the text has (its length limit): the first ones pair up
        counts = [min(len(s), len(e)) for s, e in zip(scores, ends, strict=True)]
        width = max(max(counts, default=0), 1)
        rewards = torch.zeros(len(scores), width)
        step_ends = torch.full((len(scores), width), -1, dtype=torch.long)
        for i, n in enumerate(counts):
            rewards[i, :n] = torch.tensor(scores[i][:n])
            step_ends[i, :n] = torch.tensor(ends[i][:n])
        present = step_ends >= 0
        figures = {"process/steps_mean": float(present.sum(1).float().mean()),
                   "process/step_score_mean": float(rewards[present].mean()) if bool(present.any()) else 0.0,
                   "process/first_bad_step_rate": float(((rewards < 0.5) & present).any(1).float().mean())}
        return rewards, step_ends, figures
