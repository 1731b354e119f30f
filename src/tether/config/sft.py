"""Next-token stages: supervised fine-tuning (prompt masked), pretraining (raw text), and evaluation alone."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tether.config.common import EvalConfig, StageConfig, TaskSource
from tether.config.data import DataConfig


class SFTConfig(StageConfig):
    """Supervised fine-tuning: the next-token loss on completion tokens, prompts masked."""

    type: Literal["sft", "pretrain"] = Field("sft", description="the stage type")
    data: DataConfig = Field(default_factory=lambda: DataConfig(task=TaskSource()),
                             description="demonstrations (pretrain: raw text)")


class PretrainConfig(SFTConfig):
    """Pretraining: the next-token loss on every token of raw text."""

    type: Literal["sft", "pretrain"] = Field("pretrain", description="the stage type")


class EvalStageConfig(StageConfig):
    """A held-out task evaluation of a model, with no training."""

    type: Literal["eval"] = Field("eval", description="the stage type")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="what is evaluated")
