"""Distillation and rejection-sampling stage configs: generate, filter, self-distillation rounds, best-of-n."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tether.config.base import StrictModel, deep_merge, known_name
from tether.config.common import EvalConfig, StageConfig, TaskSource
from tether.config.data import PromptDataConfig
from tether.config.rewards import FilterConfig, ScoredPairsConfig, ScorerConfig
from tether.config.sampling import SamplingConfig, SamplingParams
from tether.core.reward import STEP_AGGREGATIONS


class CorpusSamplingConfig(SamplingConfig):
    """``n`` samples per prompt, written to a corpus ``engine_batch_size`` at a time."""

    n: int = Field(4, ge=1, description="samples per prompt")
    seed: int | None = Field(0, description="sampling seed; None: not reproducible")
    engine_batch_size: int | None = Field(256, ge=1, description="samples per engine call (and per flush to disk)")

    def corpus_params(self, seed_offset: int = 0) -> SamplingParams:
        """The engine-call parameters, the seed shifted by ``seed_offset`` (a round's own samples)."""
        return self.params(self.n, None if self.seed is None else self.seed + seed_offset)


class EngineConfig(StrictModel):
    """``local``: the stage's model in-process; ``openai``: an OpenAI-compatible endpoint at ``base_url``
    serving ``served_model``, with ``model.name_or_path`` naming the local tokenizer."""

    kind: Literal["local", "openai"] = Field("local", description="where samples come from")
    base_url: str | None = Field(None, description="openai: the server, e.g. http://127.0.0.1:8000/v1")
    served_model: str | None = Field(None, description="model id at the endpoint (default: model.name_or_path)")
    api_key_env: str | None = Field(None, description="openai: the environment variable holding the API key")
    timeout: float = Field(60.0, gt=0, description="openai: seconds per request")
    max_retries: int = Field(4, ge=0, description="openai: retries of a failed request")
    concurrency: int = Field(8, ge=1, description="openai: requests in flight")
    cache_dir: str | None = Field(None, description="openai: keep every reply on disk here")


def _task_prompts() -> PromptDataConfig:
    return PromptDataConfig(task=TaskSource())


class GenerateConfig(StageConfig):
    """Sample K completions per prompt into ``STAGE/corpus.jsonl`` (resumable)."""

    type: Literal["generate"] = Field("generate", description="the stage type")
    prompts: PromptDataConfig = Field(default_factory=_task_prompts, description="the prompts sampled")
    sampling: CorpusSamplingConfig = Field(default_factory=CorpusSamplingConfig, description="how they are sampled")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="which engine samples")
    output: Literal["jsonl", "parquet"] = Field("jsonl", description="the corpus file format")
    verifier: ScorerConfig | None = Field(None, description="reports the share of samples it scores >= 1")


class StepLabelsConfig(StageConfig):
    """A corpus of sampled traces labelled step by step against the task's reference traces
    (:mod:`tether.data.step_labels`): ``STAGE/stepwise.jsonl``, the records of a process reward model
    (``rm`` stage, ``process: true``, ``data: {path: "@STAGE/stepwise.jsonl"}``)."""

    type: Literal["step_labels"] = Field("step_labels", description="the stage type")
    corpus: str = Field(..., description="the samples, a generate stage's corpus (\"@generate/corpus.jsonl\")")
    references: TaskSource = Field(default_factory=TaskSource, description="the problems the corpus was "
                                   "sampled from (the task's train split, n and seed as the generate stage's "
                                   "prompts); their worked solutions are the reference traces")
    separator: str = Field("|", min_length=1, description="the step separator (the process model's)")
    dedupe: bool = Field(True, description="a prompt's identical samples give one record")
    cut_fraction: float = Field(0.0, ge=0, le=1, description="that share of the traces is added again cut before "
                                                             "its last step, the step it ends on labelled as the "
                                                             "end of a solution")
    seed: int = Field(0, description="which traces are cut, and where")
    eval: None = Field(None, description="not used")


class FilterStageConfig(StageConfig):
    """Keep the samples of a corpus worth learning from; optionally pairs for a reward model."""

    type: Literal["filter"] = Field("filter", description="the stage type")
    input: str = Field(description="the corpus to filter, e.g. '@generate/corpus.jsonl'")
    filter: FilterConfig = Field(default_factory=FilterConfig, description="which samples are kept")
    chat: bool = Field(False, description="write chat records (user prompt, assistant completion)")
    pairs: ScoredPairsConfig | None = Field(None, description="also write chosen / rejected pairs")


class CorpusDataConfig(StrictModel):
    """How each round's corpus is tokenised for SFT (see ``DataConfig``)."""

    max_length: int = Field(512, ge=8, description="tokens per example at most")
    overflow: Literal["truncate", "drop"] = Field("truncate", description="what happens to a longer example")
    packing: bool = Field(True, description="pack examples padding-free into rows")
    pack_length: int = Field(512, ge=8, description="tokens per packed row")


PRESETS: dict[str, dict[str, Any]] = {
    "star": {"restart": "base", "step_growth": 1.2},
    "rest": {"restart": "previous", "step_growth": 1.0},
    "raft": {"restart": "previous", "step_growth": 1.0, "filter": {"max_per_prompt": 1}},
}


class SelfDistillConfig(StageConfig):
    """Rounds of generate -> filter -> SFT with the model as its own teacher; ``train`` / ``optim`` are
    each round's SFT, ``eval`` runs after every round."""

    type: Literal["self_distill"] = Field("self_distill", description="the stage type")
    algorithm: Literal["star", "rest", "raft"] = Field("rest", description="a preset: STaR, ReST or RAFT")
    iterations: int = Field(2, ge=1, description="generate -> filter -> SFT rounds")
    prompts: PromptDataConfig = Field(default_factory=_task_prompts, description="the prompts sampled")
    sampling: CorpusSamplingConfig = Field(default_factory=CorpusSamplingConfig, description="how they are sampled")
    filter: FilterConfig = Field(default_factory=FilterConfig, description="which samples each round keeps")
    restart: Literal["base", "previous"] = Field("previous", description="each round trains from the base "
                                                                         "model or the last round's")
    step_growth: float = Field(1.0, gt=0, description="train.max_steps is multiplied by this every round")
    data: CorpusDataConfig = Field(default_factory=CorpusDataConfig, description="tokenisation of the corpus")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):  # the verifier filter is on unless set to null explicitly
            defaults = deep_merge({"filter": {"verifier": {}}}, PRESETS.get(data.get("algorithm") or "rest", {}))
            return deep_merge(defaults, data)
        return data


def _verifier() -> dict[str, ScorerConfig]:
    return {"verifier": ScorerConfig()}


class SearchConfig(StrictModel):
    """A step-level search at inference, run at every n of a best-of-n stage on the same problems:
    ``prm_beam`` is beam search over steps scored by a process reward model (Snell et al. 2024, sec. 5),
    ``beam_width x expansions = n`` candidates a round (``tether.rollout.step_search``)."""

    kind: Literal["prm_beam"] = Field("prm_beam", description="the search: prm_beam (PRM-guided beam search)")
    prm: str = Field(..., description="the process reward model directory (an rm stage with process: true)")
    expansions: int = Field(4, ge=1, description="next steps sampled per beam (M); at each n the beam keeps n / M "
                                                 "traces (n < M: one beam expanded n times)")
    aggregation: str = Field("last", description="a prefix's score from its step scores: last (Snell et al.), min, "
                                                 "product or mean")
    max_steps: int = Field(16, ge=1, description="rounds of expand -> score -> prune at most")
    batch_size: int = Field(32, ge=1, description="sequences per PRM forward pass")

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, value: str) -> str:
        return known_name(STEP_AGGREGATIONS, value)

    def shape(self, n: int) -> tuple[int, int]:
        """``(beam_width, expansions)`` at compute ``n``: ``M = min(expansions, n)``, ``beam_width = n / M``."""
        m = min(self.expansions, n)
        if n % m:
            raise ValueError(f"n = {n} is not a multiple of search expansions = {m}; use ns that are")
        return n // m, m


class BestOfNConfig(StageConfig):
    """Best-of-n accuracy on ``eval.n`` held-out problems, sampled at ``eval.temperature``, and step-level
    searches at the same n."""

    type: Literal["best_of_n"] = Field("best_of_n", description="the stage type")
    ns: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16], description="the n values of the curve")
    scorers: dict[str, ScorerConfig] = Field(default_factory=_verifier, description="what picks the best, by "
                                                                                    "label")
    search: dict[str, SearchConfig] = Field(default_factory=dict, description="step-level searches at the same n "
                                                                              "(beam_width x expansions = n), by label")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="the held-out problems and sampling")

    @model_validator(mode="after")
    def _positive(self) -> BestOfNConfig:
        if not self.ns or min(self.ns) < 1:
            raise ValueError("ns must be a non-empty list of positive sample counts")
        for label, search in self.search.items():
            if label in self.scorers:
                raise ValueError(f"search label {label!r} is also a scorer label; give the search another name")
            for n in self.ns:
                search.shape(n)
        return self
