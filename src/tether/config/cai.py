"""Constitutional AI / RLAIF stage configs: SL-CAI, AI preference labels, RL against the preference model."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tether.config.base import StrictModel, deep_merge
from tether.config.common import StageConfig, TaskSource
from tether.config.data import PromptDataConfig
from tether.config.preference import OnlineDPOConfig
from tether.config.rewards import JudgeConfig, RewardSpec
from tether.config.rl import PPOConfig
from tether.config.sampling import SamplingConfig


def _secret_prompts() -> PromptDataConfig:
    return PromptDataConfig(task=TaskSource(name="secret", n=512))


def _policy_judge() -> JudgeConfig:
    return JudgeConfig(backend="policy")


class CorpusConfig(StrictModel):
    """How the SL-CAI corpus is kept and tokenised for its SFT."""

    keep: Literal["all", "revised"] = Field("all", description="all: every prompt's final response (the "
                                            "helpfulness samples Bai et al. mix in); revised: only changed ones")
    max_length: int = Field(512, ge=8, description="tokens per example at most")
    overflow: Literal["truncate", "drop"] = Field("truncate", description="what happens to a longer example")
    packing: bool = Field(True, description="pack examples padding-free into rows")
    pack_length: int = Field(512, ge=8, description="tokens per packed row")


class SLCAIConfig(StageConfig):
    """SL-CAI: answer -> (critique -> revise) x ``rounds`` -> SFT on the revisions."""

    type: Literal["sl_cai"] = Field("sl_cai", description="the stage type")
    data: PromptDataConfig = Field(default_factory=_secret_prompts, description="the prompts answered")
    constitution: str = Field("default", description="a built-in constitution or a file")
    judge: JudgeConfig = Field(default_factory=_policy_judge, description="default: the model critiques itself")
    rounds: int = Field(1, ge=1, description="critique -> revision rounds per response")
    critique_template: str = Field("cai-critique", description="the critique request template")
    revision_template: str = Field("cai-revision", description="the revision request template")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="how the model answers "
                                                                                 "(temperature 0: greedy)")
    corpus: CorpusConfig = Field(default_factory=CorpusConfig, description="the corpus and its SFT")
    sft_from: str | None = Field(None, description="the model fine-tuned on the corpus (default: model)")


class AILabelsConfig(StageConfig):
    """Two samples per prompt -> a position-swapped pairwise judge against a sampled principle -> pairs."""

    type: Literal["ai_labels"] = Field("ai_labels", description="the stage type")
    data: PromptDataConfig = Field(default_factory=_secret_prompts, description="the prompts answered")
    constitution: str = Field("default", description="a built-in constitution or a file")
    judge: JudgeConfig = Field(default_factory=_policy_judge, description="the pairwise judge")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="how the two responses are "
                                                                                 "sampled")
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="share of pairs held out (by prompt) for the RM")
    audit: list[RewardSpec] = Field(default_factory=list, description="rewards that check the labels "
                                    "(e.g. the task verifier): how often the judge's chosen scores higher")

    @model_validator(mode="after")
    def _pairwise(self) -> AILabelsConfig:
        if self.judge.kind != "pairwise":
            raise ValueError("ai_labels compares two responses: judge.kind must be 'pairwise'")
        if self.sampling.temperature == 0:
            raise ValueError("ai_labels samples two responses per prompt: sampling.temperature must be > 0 "
                             "(two greedy responses are the same)")
        return self


class RLAIFConfig(StageConfig):
    """RL against the preference model: ``ppo`` (PPOConfig fields in ``ppo``) or online ``dpo`` (OnlineDPOConfig
    fields in ``dpo``). ``model``, ``data``, ``train``, ``optim`` and ``eval`` are shared; a block's own
    ``train`` / ``optim`` keys win."""

    type: Literal["rlaif"] = Field("rlaif", description="the stage type")
    algorithm: Literal["ppo", "dpo"] = Field("ppo", description="PPO, or online DPO ranked by the preference model")
    preference_model: str = Field(description="the preference model (an rm stage's output, e.g. '@capm')")
    data: PromptDataConfig = Field(default_factory=_secret_prompts, description="the prompts")
    ppo: dict[str, Any] = Field(default_factory=dict, description="algorithm ppo: PPOConfig fields")
    dpo: dict[str, Any] = Field(default_factory=dict, description="algorithm dpo: OnlineDPOConfig fields")

    @model_validator(mode="after")
    def _inner_is_valid(self) -> RLAIFConfig:
        self.inner()
        return self

    def inner(self) -> PPOConfig | OnlineDPOConfig:
        """The ``ppo`` or ``online_dpo`` stage config this stage runs."""
        common = {"name": self.name, "model": self.model.model_dump(), "optim": self.optim.model_dump(),
                  "train": self.train.model_dump(), "eval": self.eval.model_dump() if self.eval else None,
                  "report_to": list(self.report_to), "data": self.data.model_dump()}
        if self.algorithm == "ppo":
            reward = {"rewards": [{"name": "reward_model", "kwargs": {"path": self.preference_model}}]}
            return PPOConfig.model_validate(deep_merge({**common, **reward}, {**self.ppo, "type": "ppo"}))
        scorer = {"scorer": {"kind": "reward_model", "path": self.preference_model}}
        return OnlineDPOConfig.model_validate(deep_merge({**common, **scorer}, {**self.dpo, "type": "online_dpo"}))
