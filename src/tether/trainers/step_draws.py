"""What an RL step draws: its prompts and its sampling seed, each a function of the step (and the rank).

Mixed into :class:`~tether.trainers.rl.RLTrainer`, which owns ``config``, ``records``, ``dist``, ``step``
and ``prompt_cursor``. Both are pure functions of what a checkpoint holds, so a resumed run draws what an
uninterrupted one drew.
"""

from __future__ import annotations

from typing import Any

from tether.data.mixing import stream_indices
from tether.rollout import SamplingParams

# Under torchrun each rank samples its own prompts. With one seed for all of them, row j of every rank drew
# the same noise, so the ranks sampled the same tokens wherever their prompts' next-token distributions
# agree (as at the start of a completion): fewer distinct samples than the batch has rows.
RANK_SEED_STRIDE = 1_000_000_007


class StepDraws:
    """The prompt order and the sampling seeds of the RL trainers."""

    config: Any
    records: list[dict]
    dist: Any
    step: int
    prompt_cursor: int

    def next_prompts(self, count: int) -> list[int]:
        """The next ``count`` prompt indices of a per-epoch shuffled order (seeded, resumable).

        Under torchrun the order is shared and dealt round-robin: a draw takes ``count * world_size``
        positions and rank r the r-th of every ``world_size``, so the ranks' prompts together are
        the single-process batch and ``prompt_cursor`` (positions used) is the same on every rank.
        """
        out = self.prompts_at(self.prompt_cursor, count)
        self.prompt_cursor += count * self.dist.world_size
        return out

    def prompts_at(self, cursor: int, count: int) -> list[int]:
        """This rank's ``count`` prompt indices of the draw that starts at position ``cursor`` of the order."""
        world = self.dist.world_size
        drawn = stream_indices(len(self.records), cursor, count * world, seed=self.config.train.seed, namespace="")
        return drawn[self.dist.rank :: world]

    def sampling_params(self, round_index: int, step: int | None = None) -> SamplingParams:
        """The engine parameters of a generation round: ``group_size`` samples per prompt and a seed that is a
        function of the run's seed, the step, the round and the rank (rank 0's is a single process's)."""
        seed = (self.config.train.seed * 1_000_003 + (self.step if step is None else step) * 101 + round_index
                + self.dist.rank * RANK_SEED_STRIDE)
        return self.config.rollout.params(self.config.rollout.group_size, seed)
