"""Preference stage configs: reward models, offline DPO-family / KTO, online DPO (OAIF, self-rewarding),
SPIN, the synthetic judge data stage and the judge evaluation stage."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from pydantic import Field, model_validator

from tether.config.base import StrictModel
from tether.config.common import StageConfig, TaskSource
from tether.config.data import PairDataConfig, PreferenceDataConfig, PreferenceTaskSource, PromptDataConfig
from tether.config.rewards import JudgeConfig, PairConfig, RewardSpec, ScorerConfig
from tether.config.sampling import SamplingConfig
from tether.core.preference_losses import (
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    PreferenceInputs,
    mixed_preference_loss,
)
from tether.core.reward import STEP_AGGREGATIONS

REFERENCE_FREE = frozenset({"simpo", "orpo", "slic"})
HPARAMS = ("beta", "label_smoothing", "rpo_alpha", "nll_norm", "simpo_gamma", "length_normalize",
           "desirable_weight", "undesirable_weight", "slic_delta", "slic_lambda", "tdpo_alpha", "dmpo_gamma")


class RewardModelConfig(StageConfig):
    """An outcome reward model (Bradley-Terry on pairs or K-way rankings) or, with ``process``, a process
    reward model."""

    type: Literal["rm"] = Field("rm", description="the stage type")
    data: PairDataConfig = Field(default_factory=lambda: PairDataConfig(task=PreferenceTaskSource()),
                                 description="preference pairs or rankings (data.format: ranking), or stepwise "
                                             "traces for a process RM")
    process: bool = Field(False, description="process reward model on stepwise records")
    step_separator: str = Field("\n", min_length=1, description="appended after every step (process RM)")
    aggregation: str = Field("min", description="step-score aggregation (process RM): min, product, last, mean")
    center_coef: float = Field(0.0, ge=0, description="reward centring weight (outcome RM)")

    @model_validator(mode="after")
    def _consistent(self) -> RewardModelConfig:
        if self.aggregation not in STEP_AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; valid: {', '.join(STEP_AGGREGATIONS)}")
        if self.eval is not None:
            raise ValueError("a reward model stage has no task evaluation ('eval'): it is evaluated on "
                             "held-out pairs (data.task.eval_n, data.eval_path or data.eval_fraction)")
        expected = ("stepwise",) if self.process else ("preference", "ranking")
        if self.data.format not in (None, *expected):
            raise ValueError(f"data.format is {self.data.format!r} but a {'process' if self.process else 'outcome'} "
                             f"reward model trains on {' or '.join(map(repr, expected))} records")
        kind = self.data.task.kind if self.data.task is not None else None
        if kind is not None and (kind == "stepwise") != self.process:
            raise ValueError(f"data.task.kind {kind!r} does not fit process={self.process}: a process reward "
                             "model trains on 'stepwise' records, an outcome one on pairs or rankings")
        if kind is not None and self.data.format is not None and (kind == "ranking") != (self.data.format == "ranking"):
            raise ValueError(f"data.task.kind {kind!r} makes no {self.data.format!r} records; set data.format: ranking "
                             "with data.task.kind: ranking (or leave one unset)")
        return self

    def record_format(self) -> str:
        """The records this stage trains on: ``stepwise`` (process), ``ranking`` (``data.format`` or
        ``data.task.kind`` says so) or ``preference``."""
        if self.process:
            return "stepwise"
        kind = self.data.task.kind if self.data.task is not None else None
        return "ranking" if "ranking" in (self.data.format, kind) else "preference"


class PreferenceLossConfig(StrictModel):
    """The preference-loss fields a stage config shares (offline ``dpo``, ``online_dpo``, ``spin``): which
    loss and its hyperparameters. Hyperparameters left unset take the loss's own default; one the
    selected loss does not take is ignored with a warning, so a recipe tuned for one loss runs after
    ``loss=NAME``."""

    loss: str | dict[str, float] = Field("sigmoid", description="a PREFERENCE_LOSSES name, 'kto', or "
                                                                "{name: weight} for a mix")
    beta: float | None = Field(None, gt=0, description="the implicit reward's scale (DPO's beta)")
    label_smoothing: float | None = Field(None, ge=0, le=0.5, description="cdpo / robust")
    rpo_alpha: float | None = Field(None, ge=0, description="rpo: weight of the chosen NLL")
    nll_norm: Literal["sequence", "token"] | None = Field(
        None, description="rpo / orpo: the chosen NLL as a mean per sequence (the papers; default) or over all "
                          "chosen tokens of the batch (TRL's convention)")
    simpo_gamma: float | None = Field(None, description="simpo: target margin")
    slic_delta: float | None = Field(None, ge=0, description="slic: the calibration margin delta on summed "
                                                              "log-likelihoods")
    slic_lambda: float | None = Field(None, ge=0, description="slic: weight of the chosen sequence NLL")
    tdpo_alpha: float | None = Field(None, ge=0, description="tdpo (TDPO2): weight of the sequential-KL "
                                                              "correction")
    dmpo_gamma: float | None = Field(None, ge=0, le=1, description="dmpo: the turn discount gamma of the "
                                                                   "length-normalised turn weights")
    length_normalize: bool | None = Field(None, description="ipo: per-token log-ratios")
    desirable_weight: float | None = Field(None, gt=0, description="kto")
    undesirable_weight: float | None = Field(None, gt=0, description="kto")
    wpo: bool = Field(False, description="weight pairs by their probability under the policy (WPO)")

    @property
    def loss_names(self) -> list[str]:
        return list(self.loss) if isinstance(self.loss, dict) else [self.loss]

    @property
    def unpaired(self) -> bool:
        return self.loss == "kto"

    @property
    def needs_reference(self) -> bool:
        return not all(name in REFERENCE_FREE for name in self.loss_names)

    @property
    def loss_needs(self) -> frozenset[str]:
        """What the selected losses read beyond summed log-probs (``PREFERENCE_LOSSES.needs``): SPPO's
        ``win_probabilities``, TDPO's ``sequential_kl``, Step-DPO's ``step_pairs``, DMPO's ``turn_logprobs``."""
        return frozenset().union(*(PREFERENCE_LOSSES.needs(n) for n in self.loss_names if n != "kto"))

    def _functions(self) -> list[Callable]:
        return [UNPAIRED_LOSSES.get(n) if n == "kto" else PREFERENCE_LOSSES.get(n) for n in self.loss_names]

    def hparams(self) -> dict[str, Any]:
        """The hyperparameters that are set and taken by one of the selected losses."""
        accepted = {p for fn in self._functions() for p in inspect.signature(fn).parameters}
        return {k: getattr(self, k) for k in HPARAMS if getattr(self, k) is not None and k in accepted}

    def ignored_hparams(self) -> list[str]:
        """Set hyperparameters no selected loss takes (e.g. ``rpo_alpha`` after ``loss=ipo``)."""
        return [k for k in HPARAMS if getattr(self, k) is not None and k not in self.hparams()]

    def paired_loss(self) -> Callable[[PreferenceInputs], tuple[Any, dict]]:
        """The configured paired loss (or mix) with its hyperparameters bound. For a mix, the first
        component's rewards are also logged unprefixed, so logs read the same whatever the loss."""
        if isinstance(self.loss, dict):
            mix = partial(mixed_preference_loss, losses=self.loss, **self.hparams())
            return partial(_with_first_rewards, mix, next(iter(self.loss)))
        return partial(PREFERENCE_LOSSES.get(self.loss), **self.hparams())

    @property
    def implicit_beta(self) -> float:
        """β of the (first) configured loss: the implicit reward's scale."""
        if self.beta is not None:
            return self.beta
        return inspect.signature(self._functions()[0]).parameters["beta"].default

    @model_validator(mode="after")
    def _check_loss_names(self) -> PreferenceLossConfig:
        if isinstance(self.loss, dict) and not self.loss:
            raise ValueError("loss: an empty mix; give {name: weight, ...}")
        for name in self.loss_names:
            if name == "kto" and isinstance(self.loss, dict):
                raise ValueError("'kto' takes unpaired data and cannot be mixed with paired losses")
            if name != "kto" and name not in PREFERENCE_LOSSES:
                valid = ", ".join([*PREFERENCE_LOSSES.names(), "kto"])
                raise ValueError(f"unknown preference loss {name!r}; valid names: {valid}")
        if self.wpo and self.unpaired:
            raise ValueError("wpo weights pairs; it does not apply to kto")
        return self


def _with_first_rewards(mix: Callable, first: str, inputs: PreferenceInputs) -> tuple[Any, dict]:
    value, metrics = mix(inputs)
    metrics.update({k[len(first) + 1:]: v for k, v in list(metrics.items()) if k.startswith(f"{first}/rewards/")})
    return value, metrics


class StepPairsConfig(StrictModel):
    """How Step-DPO finds the first wrong step of each rejected trace (:mod:`tether.data.step_pairs`)."""

    separator: str = Field("|", min_length=1, description="ends every step but the last (the arithmetic traces' |)")
    prm: str | None = Field(None, description="a process reward model (path or @stage): the first step it scores "
                                              "below threshold is the wrong one; unset: where the rejected trace "
                                              "leaves the (correct) chosen one")
    threshold: float = Field(0.5, gt=0, lt=1, description="prm: a step scoring below this is wrong")


class DPOConfig(PreferenceLossConfig, StageConfig):
    """Offline preference optimisation; hyperparameters left unset take the loss's own default.

    A hyperparameter the selected loss does not take is ignored with a warning, so a recipe tuned
    for one loss still runs after ``dpo.loss=NAME``.
    """

    type: Literal["dpo"] = Field("dpo", description="the stage type")
    data: PreferenceDataConfig = Field(default_factory=lambda: PreferenceDataConfig(task=PreferenceTaskSource()),
                                       description="preference pairs (or unpaired records for kto)")
    steps: StepPairsConfig = Field(default_factory=StepPairsConfig, description="step_dpo: how the sequence pairs "
                                                                                "are cut to their first wrong step")

    @model_validator(mode="after")
    def _check_data(self) -> DPOConfig:
        if self.data.task is not None and self.data.task.kind in ("stepwise", "ranking"):
            raise ValueError(f"data.task.kind {self.data.task.kind!r} is for reward models; use correctness, style "
                             "or mixed")
        return self

    def record_format(self) -> str | None:
        """``data.format``, else ``preference`` for paired losses; KTO detects pairs or unpaired records."""
        return self.data.format or (None if self.unpaired else "preference")


class OnlineRolloutConfig(SamplingConfig):
    """How the policy samples its K responses per prompt."""

    samples: int = Field(4, ge=2, description="K responses per prompt")

    @model_validator(mode="after")
    def _sampled(self) -> OnlineRolloutConfig:
        if self.temperature == 0 and self.samples > 1:
            raise ValueError("K greedy responses to one prompt are one response K times: temperature must be > 0")
        return self


class OnlineDPOConfig(PreferenceLossConfig, StageConfig):
    """Online / iterative preference optimisation. ``train.max_steps`` is ``rounds * steps_per_round``;
    ``train.batch_size`` is pairs per micro-batch."""

    type: Literal["online_dpo"] = Field("online_dpo", description="the stage type")
    mode: Literal["iterative", "oaif"] = Field("iterative", description="oaif: 2 samples, 1 step per round")
    data: PromptDataConfig = Field(default_factory=lambda: PromptDataConfig(task=TaskSource()),
                                   description="the prompts (with answers for verifiers)")
    rounds: int = Field(3, ge=1, description="sample -> score -> pair -> train rounds")
    steps_per_round: int = Field(50, ge=1, description="optimiser steps on each round's pairs")
    prompts_per_round: int = Field(64, ge=1, description="prompts sampled each round")
    rollout: OnlineRolloutConfig = Field(default_factory=OnlineRolloutConfig, description="how responses are "
                                                                                          "sampled")
    scorer: ScorerConfig = Field(default_factory=ScorerConfig, description="what scores the responses")
    pairs: PairConfig = Field(default_factory=PairConfig, description="how scored responses become pairs")
    reference: Literal["initial", "round"] = Field("initial", description="round: the policy at each round's start")
    self_rewarding: bool = Field(False, description="the policy judges its own samples (scorer.judge)")
    audit: list[RewardSpec] = Field(default_factory=list, description="rewards logged beside the scorer")
    mismatch_samples: int = Field(256, ge=0, description="compare the sampler's log-probs with the trainer's on "
                                                         "this many of each round's samples (mismatch/*); 0: off")
    eval_every_rounds: int = Field(1, ge=1, description="held-out evaluation every this many rounds")
    min_pairs: int = Field(1, ge=1, description="a round with fewer pairs makes no update (counted)")
    epochs_per_round: float | None = Field(None, gt=0, description="a round stops updating after this many "
                                           "passes over its pairs (the rest of its steps are skipped, counted): "
                                           "a round with few pairs is not trained on them steps_per_round times; "
                                           "None: always steps_per_round steps")
    max_length: int = Field(512, ge=8, description="tokens per prompt + response at most")
    pack_length: int = Field(1024, ge=8, description="tokens per packed row")

    @model_validator(mode="before")
    @classmethod
    def _mode_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("mode") == "oaif":
            data = {**data, "steps_per_round": data.get("steps_per_round", 1)}
            data["rollout"] = {"samples": 2, **(data.get("rollout") or {})}
        scorer = data.get("scorer")
        if data.get("self_rewarding") and isinstance(scorer, dict) and isinstance(scorer.get("judge"), dict):
            data = {**data, "scorer": {**scorer, "judge": {**scorer["judge"], "backend": "policy"}}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> OnlineDPOConfig:
        if self.unpaired:
            raise ValueError("online_dpo builds pairs; 'kto' is not available here")
        if "turn_logprobs" in self.loss_needs:
            raise ValueError(f"loss {self.loss!r} compares multi-turn agent trajectories offline; use a 'dpo' stage "
                             "on pairs of episodes (tether.data.episode_pairs)")
        if self.mode == "oaif" and (self.rollout.samples != 2 or self.steps_per_round != 1):
            raise ValueError("mode 'oaif' samples 2 responses per prompt and makes one update per round "
                             "(rollout.samples: 2, steps_per_round: 1)")
        if self.self_rewarding:
            if self.scorer.kind != "judge" or self.scorer.judge.backend != "policy":
                raise ValueError("self_rewarding needs scorer.kind 'judge' with a judge block (the policy is the "
                                 "judge: its backend is 'policy')")
        elif self.scorer.kind == "judge" and self.scorer.judge.backend == "policy":
            raise ValueError("judge backend 'policy' is self-rewarding: set self_rewarding: true")
        self.train.max_steps = self.rounds * self.steps_per_round
        if self.train.save_every is None:  # a checkpoint at every round boundary (OAIF: every eval)
            self.train.save_every = self.steps_per_round if self.mode == "iterative" else self.eval_every_rounds
        return self


NOT_FOR_SPIN = ("scorer", "pairs", "self_rewarding", "mode", "audit")


class SPINRolloutConfig(OnlineRolloutConfig):
    """How SPIN's opponent (the model itself) answers the SFT prompts."""

    samples: int = Field(1, ge=1, description="generations per prompt, each paired with the demonstration")
    temperature: float = Field(1.0, ge=0, description="0: greedy, the model's most likely answer")


class SPINConfig(OnlineDPOConfig):
    """SPIN. ``data``: SFT demonstrations (``prompt`` + ``completion`` file, or a task with ``think``);
    ``rounds``: SPIN iterations; ``loss`` / ``beta``: the preference loss and λ."""

    type: Literal["spin"] = Field("spin", description="the stage type")
    data: PromptDataConfig = Field(default_factory=lambda: PromptDataConfig(task=TaskSource()),
                                   description="the SFT demonstrations (prompt + completion)")
    rollout: SPINRolloutConfig = Field(default_factory=SPINRolloutConfig, description="how the model answers")
    reference: Literal["initial", "round"] = Field("round", description="round: the previous iterate (SPIN)")

    @model_validator(mode="after")
    def _spin_only(self) -> SPINConfig:
        unused = sorted(set(NOT_FOR_SPIN) & self.model_fields_set)
        if unused:
            raise ValueError(f"spin takes no {', '.join(unused)}: chosen is the SFT demonstration and rejected the "
                             "model's generation, with no scorer")
        if self.data.chat:
            raise ValueError("spin works on prompt / completion text; data.chat is not supported")
        return self


class PolicySamplesConfig(StrictModel):
    """A policy's own answers to training prompts, labelled by the task's verifier, as judge training records."""

    model: str = Field(..., description="the checkpoint whose samples the judge learns to score (e.g. @sft)")
    n: int = Field(1000, ge=1, description="training prompts sampled")
    samples: int = Field(2, ge=1, description="answers sampled per prompt (each one record)")
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=0.3, max_new_tokens=48),
                                     description="how the answers are sampled (as the online loop samples)")


class JudgeDataConfig(StageConfig):
    """Synthetic judge training data (``judge_records``) written to ``<stage>/train.jsonl`` for an SFT
    stage, optionally mixed with ``sft_n`` task demonstrations (self-rewarding's IFT + EFT seed data)."""

    type: Literal["judge_data"] = Field("judge_data", description="the stage type")
    task: PreferenceTaskSource = Field(default_factory=PreferenceTaskSource,
                                       description="the task whose correctness pairs become verdicts")
    kind: Literal["pointwise", "pairwise"] = Field("pairwise", description="scores or pairwise verdicts")
    template: str = Field("compact-pairwise", description="the judge template (built-in name or file)")
    scale: tuple[float, float] = Field((0.0, 1.0), description="pointwise: the scores of wrong and right")
    sft_n: int = Field(0, ge=0, description="task demonstrations mixed in")
    sft_think: bool = Field(True, description="the demonstrations with their worked <think> trace; false: the bare "
                                              "answer (a policy that answers directly)")
    policy: PolicySamplesConfig | None = Field(None, description="pointwise: also records from this policy's own "
                                                                 "samples, scored by the verifier")
    responses: Literal["traces", "answers"] = Field("traces", description="what the judged responses show: whole "
                                                                          "worked traces, or only their final answers "
                                                                          "(a policy that answers directly, or a "
                                                                          "judge with answer_only)")
    solve_first: bool = Field(False, description="the judge works the problem out, marks each response's answer "
                                                 "right or wrong, then gives its verdict")
    ties: float = Field(0.0, ge=0, lt=1, description="pairwise with solve_first: share of records whose verdict is "
                                                     "a tie (both responses right, or both wrong)")
    check: Literal["solve", "inverse", "steps"] = Field("solve", description="with solve_first, how the judge "
                                                        "tests a response: solve the problem and compare answers; "
                                                        "'steps': compare every step of the worked solution too "
                                                        "(pointwise); 'inverse': work the answer back through the "
                                                        "inverse operation (pointwise; the task needs "
                                                        "check(prompt, answer))")
    work_digits: Literal["digits", "letters"] = Field("digits", description="pointwise with solve_first: the "
                                                      "judge's own worked solution in digits, or in the letter "
                                                      "digits A-J so that judge training does not teach the "
                                                      "digit answers (self-rewarding)")

    @model_validator(mode="after")
    def _ties_need_reasoning(self) -> JudgeDataConfig:
        if self.work_digits == "letters" and not (self.solve_first and self.kind == "pointwise"
                                                   and self.check in ("solve", "steps")):
            raise ValueError("judge_data: work_digits 'letters' needs kind: pointwise, solve_first: true and "
                             "check: solve or steps")
        if self.check in ("inverse", "steps") and not (self.solve_first and self.kind == "pointwise"):
            raise ValueError(f"judge_data: check {self.check!r} needs kind: pointwise and solve_first: true")
        if self.check == "steps" and self.responses == "answers":
            raise ValueError("judge_data: check 'steps' compares the steps of a worked trace; it needs "
                             "responses: traces")
        if self.ties and not (self.solve_first and self.kind == "pairwise"):
            raise ValueError("judge_data: ties needs kind: pairwise and solve_first: true")
        if self.policy is not None and self.kind != "pointwise":
            raise ValueError("judge_data: policy samples make pointwise records (kind: pointwise)")
        return self


class PolicyPairsConfig(StrictModel):
    """On-policy held-out pairs: ``model`` samples ``samples`` answers per held-out prompt; each prompt with a
    right and a wrong answer (by the task's verifier) gives one pair, the first right against the first wrong."""

    model: str = Field(..., description="the checkpoint whose samples are judged (e.g. @sft)")
    n: int = Field(200, ge=1, description="held-out prompts sampled")
    samples: int = Field(4, ge=2, description="answers sampled per prompt")
    sampling: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=1.0, max_new_tokens=48),
                                     description="how the answers are sampled")


class JudgeEvalConfig(StageConfig):
    """A judge's held-out verdicts: on ``task.eval_n`` synthetic pairs of the task's eval split (a right answer
    against one with a single error) and, with ``policy``, on pairs of a model's own right and wrong samples.
    A pairwise judge is asked both orders (position consistency); a pointwise judge scores each answer."""

    type: Literal["judge_eval"] = Field("judge_eval", description="the stage type")
    judge: JudgeConfig = Field(..., description="the judge (any backend: model, serve, endpoint, callable)")
    task: PreferenceTaskSource = Field(default_factory=lambda: PreferenceTaskSource(eval_n=200),
                                       description="the task; eval_n synthetic held-out pairs (0: none)")
    policy: PolicyPairsConfig | None = Field(None, description="also judge a model's own right and wrong samples")
    responses: Literal["traces", "answers"] = Field("traces", description="the synthetic pairs' responses: whole "
                                                                          "worked traces or only their final answers")
    right: Literal["answer", "steps"] = Field("answer", description="which responses count as right: a right "
                                                                   "answer (the task's verifier), or 'steps': the "
                                                                   "whole worked solution, every step and the "
                                                                   "answer (a judge trained with check: steps); "
                                                                   "'steps' also judges synthetic pairs whose wrong "
                                                                   "trace has the right answer and one wrong step")
