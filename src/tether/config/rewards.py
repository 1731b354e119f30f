"""What scores a completion: reward specs, judges, scorers, pair rules and corpus filters.

- :class:`RewardSpec`: one entry of a reward list (``{name, weight, kwargs}``), the one reward-spec
  type of every stage and of :class:`~tether.rewards.RewardComposer`;
- :class:`RewardRoutes`: reward lists chosen per sample by a record column (``kind``: reasoning / general);
- :class:`JudgeConfig`: an LLM-as-a-judge and the engine behind it;
- :class:`ScorerConfig`: *the* scorer concept, one number per (prompt, completion): reward functions
  (a verifier), a trained reward model, or a judge (:func:`tether.scoring.build_scorer`);
- :class:`PairConfig`: how scored samples of one prompt become (chosen, rejected) pairs;
- :class:`FilterConfig`: which samples of a generated corpus to keep.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tether.config.base import StrictModel, known_name
from tether.config.sampling import SamplingConfig
from tether.core.pairing import PAIR_RULES


class RewardSpec(StrictModel):
    """One reward function of a stage: ``{name: accuracy, weight: 1.0, kwargs: {...}}``.

    ``name`` is a registered reward function, an import path ``package.module:function``, or (from
    Python) a callable. ``RewardSpec(fn)`` and ``RewardSpec("format", 0.1)`` also work positionally.
    """

    name: str | Callable[..., Any] = Field(description="a registered reward function, an import path "
                                                       "'package.module:function', or a callable")
    weight: float = Field(1.0, description="weight in the sum; 0: logged only")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="options passed to the function")

    @field_validator("weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"weight must be finite, got {value}")
        return value

    def __init__(self, name: Any = None, weight: float = 1.0, kwargs: dict[str, Any] | None = None,
                 **data: Any) -> None:
        if name is not None:
            data["name"] = name
        super().__init__(weight=weight, kwargs={} if kwargs is None else kwargs, **data)


class RewardRoute(StrictModel):
    """The rewards of one kind of prompt, and whether they see the whole completion or its final answer."""

    rewards: list[RewardSpec] = Field(min_length=1, description="the reward functions, summed with their weights")
    answer_only: bool = Field(False, description="score only the final answer: the text after the last </think> "
                                                 "(none when the block is never closed), the thinking stripped")


class RewardRoutes(StrictModel):
    """Rewards routed by prompt type (DeepSeek-R1 Sec. 2.3.4): each sample is scored by the route its record's
    ``by`` column names (``kind: reasoning`` -> verifiers, ``kind: general`` -> a judge on the answer only)."""

    by: str = Field("kind", description="the record column whose value picks a sample's route")
    routes: dict[str, RewardRoute] = Field(min_length=1, description="column value -> that kind's rewards")


class JudgeSamplingConfig(SamplingConfig):
    """How a judge replies: greedy by default, up to 256 tokens."""

    temperature: float = Field(0.0, ge=0, description="softmax temperature; 0: greedy")
    max_new_tokens: int = Field(256, ge=1, description="tokens per reply at most")
    seed: int = Field(0, description="the judge's sampling seed (shifted by the recipe's seed)")


class JudgeConfig(StrictModel):
    """A judge in a config. ``backend``: ``endpoint`` (``base_url`` + ``model``), ``serve`` (``tether
    serve`` started on a free loopback port for ``model``, a checkpoint, and stopped with the stage),
    ``model`` (a checkpoint loaded in this process), ``policy`` (the model being trained:
    self-rewarding) or ``callable`` (``model`` is ``package.module:function``, prompts -> replies)."""

    kind: Literal["pointwise", "pairwise"] = Field("pairwise", description="a score per response, or a verdict "
                                                                           "per pair")
    backend: Literal["endpoint", "serve", "model", "policy", "callable"] = Field(
        "endpoint", description="where the judge's replies come from (see the class description)")
    model: str | None = Field(None, description="endpoint: the served model id; serve / model: a checkpoint; "
                                                "callable: package.module:function")
    base_url: str | None = Field(None, description="endpoint: the OpenAI-compatible server, e.g. "
                                                   "http://127.0.0.1:8000/v1")
    api_key_env: str | None = Field(None, description="endpoint: the environment variable holding the API key")
    template: str | None = Field(None, description="built-in name or file; default: the kind's own")
    principle: str | None = Field(None, description="a principle the judge applies (the template's {principle})")
    scale: tuple[float, float] = Field((1.0, 10.0), description="pointwise: the score range (low, high)")
    samples: int = Field(1, ge=1, description="pointwise: replies averaged per response")
    swap: bool = Field(True, description="pairwise: judge both orders, inconsistent -> tie")
    answer_only: bool = Field(False, description="the judge sees each response's final answer (the text after "
                                                 "the last </think>; empty when the thinking never closes), not "
                                                 "its reasoning")
    sampling: JudgeSamplingConfig = Field(default_factory=JudgeSamplingConfig, description="how the judge "
                                          "replies (temperature 0: greedy; max_new_tokens per reply)")
    chat: bool = Field(False, description="chat endpoint / chat template for the judge prompt")
    timeout: float = Field(60.0, gt=0, description="endpoint / serve: seconds per request")
    max_retries: int = Field(4, ge=0, description="endpoint / serve: retries of a failed request")
    backoff: float = Field(0.5, ge=0, description="endpoint / serve: first retry delay, doubled each time")
    concurrency: int = Field(8, ge=1, description="endpoint / serve: requests in flight")
    prompts_per_request: int = Field(1, ge=1, description="endpoint / serve: judge prompts sent as one "
                                                          "/completions request (a server batches them)")
    cache: bool = Field(True, description="endpoint / serve: keep every reply on disk, keyed by the request")
    serve_args: list[str] = Field(default_factory=list, description="serve: extra `tether serve` options, "
                                                                    "e.g. [--device, cuda] or [--threads, 1]")

    @model_validator(mode="after")
    def _needs(self) -> JudgeConfig:
        if self.backend == "endpoint" and not (self.base_url and self.model):
            raise ValueError("judge backend 'endpoint' needs base_url and model")
        if self.backend in ("serve", "model", "callable") and not self.model:
            raise ValueError(f"judge backend {self.backend!r} needs model")
        if self.scale[0] >= self.scale[1]:
            raise ValueError(f"judge scale must be (low, high) with low < high, got {self.scale}")
        return self


def _accuracy() -> list[RewardSpec]:
    return [RewardSpec("accuracy")]


class ScorerConfig(StrictModel):
    """What scores a completion, one number each: ``rewards`` (a weighted sum of reward functions: the
    task verifier by default), ``reward_model`` (the trained model at ``path``) or ``judge``."""

    kind: Literal["rewards", "reward_model", "judge"] = Field("rewards", description="which scorer")
    rewards: list[RewardSpec] = Field(default_factory=_accuracy, description="rewards: the reward functions")
    path: str | None = Field(None, description="reward_model: the reward model directory")
    batch_size: int = Field(32, ge=1, description="reward_model: sequences per forward pass")
    judge: JudgeConfig | None = Field(None, description="judge: the judge")

    @model_validator(mode="after")
    def _complete(self) -> ScorerConfig:
        if self.kind == "reward_model" and not self.path:
            raise ValueError("scorer kind 'reward_model' needs path (the reward model directory)")
        if self.kind == "judge" and self.judge is None:
            raise ValueError("scorer kind 'judge' needs a judge block")
        return self

    @property
    def label(self) -> str:
        """The scorer's name in figures (``score/<label>``, ``best_of_4/<label>``)."""
        return {"rewards": "verifier", "reward_model": "reward_model", "judge": "judge"}[self.kind]


class RSOConfig(StrictModel):
    """RSO's statistical rejection sampling before pairing (Liu et al. 2023): keep ``samples`` of each
    prompt's scored samples, drawn from the reward-tilted policy pi_sft exp(r / beta)."""

    beta: float = Field(0.5, gt=0, description="the tilt's temperature: small keeps the top rewards, large is "
                                                "uniform over the samples")
    samples: int = Field(2, ge=2, description="samples kept per prompt (then paired by the rule)")
    seed: int = Field(0, description="the acceptance draws' seed (with the prompt's position)")


class PairConfig(StrictModel):
    """How the scored samples of one prompt become (chosen, rejected) pairs (``tether.core.pairing``)."""

    rule: str = Field("best_vs_worst", description="best_vs_worst | all_pairs | threshold")
    margin: float = Field(0.0, ge=0, description="smallest score gap that makes a pair")
    threshold: float | None = Field(None, description="threshold rule: good at or above it")
    max_per_prompt: int | None = Field(None, ge=1, description="pairs kept per prompt at most (largest gaps)")
    rso: RSOConfig | None = Field(None, description="RSO rejection sampling before the rule pairs; None: off")
    win_temperature: float | None = Field(None, gt=0, description="SPPO's win probabilities from scalar scores: "
                                                                   "sigmoid(gap / this); unset: win 1, tie 1/2, loss 0")

    @field_validator("rule")
    @classmethod
    def _known_rule(cls, value: str) -> str:
        return known_name(PAIR_RULES, value)

    @model_validator(mode="after")
    def _threshold_given(self) -> PairConfig:
        if self.rule == "threshold" and self.threshold is None:
            raise ValueError("pair rule 'threshold' needs threshold")
        return self


class ScoredPairsConfig(PairConfig):
    """Pairs among each prompt's samples in a corpus, scored by ``scorer``."""

    scorer: ScorerConfig = Field(default_factory=ScorerConfig, description="what ranks the samples")
    rule: str = Field("all_pairs", description="best_vs_worst | all_pairs | threshold")
    max_per_prompt: int | None = Field(4, ge=1, description="pairs kept per prompt at most (largest gaps)")


class VerifierFilter(ScorerConfig):
    """Keep samples whose verifier score is at least ``min_score``."""

    min_score: float = Field(1.0, description="the lowest score kept")


class RewardFilter(ScorerConfig):
    """Keep samples by reward-model score: at least ``threshold`` and / or the ``top_k`` of their prompt."""

    kind: Literal["rewards", "reward_model", "judge"] = Field("reward_model", description="which scorer")
    threshold: float | None = Field(None, description="the lowest score kept")
    top_k: int | None = Field(None, ge=1, description="keep the k best of each prompt")


class FilterConfig(StrictModel):
    """Which samples of a corpus to keep; every check is off unless set (empty completions always go)."""

    drop_truncated: bool = Field(True, description="drop samples cut at max_new_tokens (finish_reason length)")
    min_tokens: int | None = Field(None, ge=0, description="drop completions shorter than this")
    max_tokens: int | None = Field(None, ge=1, description="drop completions longer than this")
    format: Literal["r1"] | None = Field(None, description="r1: one <think>...</think> block, then an answer")
    format_pattern: str | None = Field(None, description="a regex the whole completion must match")
    dedup: bool = Field(True, description="drop repeated (prompt, completion) pairs, whitespace-normalised")
    verifier: VerifierFilter | None = Field(None, description="keep samples the verifier passes")
    reward_model: RewardFilter | None = Field(None, description="keep samples a reward model ranks well")
    max_per_prompt: int | None = Field(None, ge=1, description="keep at most this many per prompt (best first)")
