"""Online and iterative preference optimisation: DPO kept on-policy by regenerating and re-scoring its data.

A round reads: sample K responses per prompt from the current policy -> score them (a verifier or
any reward functions, a reward model, or an LLM judge) -> pairs by a ``PAIR_RULES`` rule -> N steps
of a ``PREFERENCE_LOSSES`` loss against a reference frozen at the initial (SFT) model -> the updated
policy samples the next round. Each round's samples and pairs are saved as jsonl under
``<stage>/rounds/round-NNN/`` (with the reference log-probs of its pairs), so a run resumes at any
round and the data can be reused.

- Iterative DPO (Xiong et al. 2024, "Iterative Preference Learning from Human Feedback"; the Llama 3
  recipe): rounds of hundreds of steps, best-vs-worst of K samples under a reward model or checker.
- Iterative RPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization"): a verifier as
  the scorer, correct vs incorrect reasoning traces, ``loss: rpo`` (DPO + NLL of the chosen).
- OAIF (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"): ``mode: oaif``
  makes every step a round: two samples per prompt, a fresh pairwise judge label, one update.
- Self-rewarding (Yuan et al. 2024, "Self-Rewarding Language Models"): ``self_rewarding: true``
  makes the policy its own judge (LLM-as-a-judge prompt, pointwise scores, best vs worst).

How it departs from the papers: the reference stays the initial model unless ``reference: round``
(then it is the policy at the start of each round, as Yuan et al. and Pang et al. retrain M_{t+1}
against M_t), and the policy is not re-initialised between rounds. The completions are re-tokenised
from their text (exact for the tiny models' character tokenizer) and every completion gets EOS,
also one cut at ``max_new_tokens``. With a pairwise judge and K > 2, all K(K-1)/2 pairs are judged
and the samples ranked by their mean win probability (a Borda count) before the pair rule applies.
Per-round figures: score mean, pair count, the judge's consistency and unparseable rate, an optional
``audit`` reward logged beside the scorer (e.g. the verifier, to see how often a judge's chosen is
really better), and the held-out task metric of ``eval``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from tether.config import StageConfig, StrictModel
from tether.pipeline import register_stage
from tether.rewards import RewardComposer, RewardSpec
from tether.rewards.judge import JudgeConfig, PairwiseJudge, build_judge, judge_records
from tether.rewards.pairing import PAIR_RULES, make_pairs, pairwise_scores
from tether.rollout import HFEngine, Rollout, SamplingParams
from tether.trainers.checkpoint import mark_done
from tether.trainers.loop import Trainer
from tether.trainers.parallel import full_parameters
from tether.trainers.preference import PreferenceLossConfig, loss_beta, pair_inputs, pair_loss, paired_loss_fn
from tether.trainers.reward import BatchSchedule, PreferenceTaskSource, chunks, tokenize_pairs
from tether.trainers.rl import RewardConfig, RLDataConfig, SamplingConfig, training_prompts

log = logging.getLogger(__name__)

ROUNDS_DIR = "rounds"
REFERENCE_FILE = "reference_logps.pt"


class OnlineRolloutConfig(SamplingConfig):
    samples: int = Field(4, ge=2, description="K responses per prompt")


class ScorerConfig(StrictModel):
    """``rewards`` (a weighted sum of reward functions: the task verifier, ``reward_model``, ...),
    ``reward_model`` (``path``) or ``judge``."""

    type: Literal["rewards", "reward_model", "judge"] = "rewards"
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(name="accuracy")])
    path: str | None = Field(None, description="reward_model: the trained reward model")
    judge: JudgeConfig | None = None

    @model_validator(mode="after")
    def _complete(self) -> ScorerConfig:
        if self.type == "reward_model" and not self.path:
            raise ValueError("scorer type 'reward_model' needs path")
        if self.type == "judge" and self.judge is None:
            raise ValueError("scorer type 'judge' needs a judge block")
        return self


class PairConfig(StrictModel):
    rule: str = Field("best_vs_worst", description="best_vs_worst | all_pairs | threshold")
    margin: float = Field(0.0, ge=0, description="smallest score gap that makes a pair")
    threshold: float | None = Field(None, description="threshold rule: good at or above it")
    max_per_prompt: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _known(self) -> PairConfig:
        if self.rule not in PAIR_RULES:
            raise ValueError(f"unknown pair rule {self.rule!r}; valid names: {', '.join(PAIR_RULES.names())}")
        if self.rule == "threshold" and self.threshold is None:
            raise ValueError("pair rule 'threshold' needs pairs.threshold")
        return self


class OnlineDPOConfig(PreferenceLossConfig, StageConfig):
    """Online / iterative preference optimisation. ``train.max_steps`` is ``rounds * steps_per_round``;
    ``train.batch_size`` is pairs per micro-batch."""

    type: Literal["online_dpo"] = "online_dpo"
    mode: Literal["iterative", "oaif"] = Field("iterative", description="oaif: 2 samples, 1 step per round")
    data: RLDataConfig = Field(default_factory=lambda: RLDataConfig(task={"name": "arithmetic"}))
    rounds: int = Field(3, ge=1)
    steps_per_round: int = Field(50, ge=1)
    prompts_per_round: int = Field(64, ge=1)
    rollout: OnlineRolloutConfig = Field(default_factory=OnlineRolloutConfig)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    pairs: PairConfig = Field(default_factory=PairConfig)
    reference: Literal["initial", "round"] = Field("initial", description="round: the policy at each round's start")
    self_rewarding: bool = Field(False, description="the policy judges its own samples (scorer.judge)")
    audit: list[RewardConfig] = Field(default_factory=list, description="rewards logged beside the scorer")
    eval_every_rounds: int = Field(1, ge=1)
    min_pairs: int = Field(1, ge=1, description="a round with fewer pairs makes no update (counted)")
    max_length: int = Field(512, ge=8)
    pack_length: int = Field(1024, ge=8)

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
        if self.mode == "oaif" and (self.rollout.samples != 2 or self.steps_per_round != 1):
            raise ValueError("mode 'oaif' samples 2 responses per prompt and makes one update per round "
                             "(rollout.samples: 2, steps_per_round: 1)")
        if self.self_rewarding:
            if self.scorer.type != "judge" or self.scorer.judge.backend != "policy":
                raise ValueError("self_rewarding needs scorer.type 'judge' with a judge block (the policy is the "
                                 "judge: its backend is 'policy')")
        elif self.scorer.type == "judge" and self.scorer.judge.backend == "policy":
            raise ValueError("judge backend 'policy' is self-rewarding: set self_rewarding: true")
        self.train.max_steps = self.rounds * self.steps_per_round
        if self.train.save_every is None:  # a checkpoint at every round boundary (OAIF: every eval)
            self.train.save_every = self.steps_per_round if self.mode == "iterative" else self.eval_every_rounds
        return self


# ---- scoring ---------------------------------------------------------------------------------------------


class Scorer:
    """Scores of K samples per prompt: reward functions, a pointwise judge, or a pairwise judge ranked by
    mean win probability. ``__call__`` returns the scores (None = missing) and the judge's figures."""

    def __init__(self, cfg: ScorerConfig, *, reward_functions: list | None = None, judge: Any = None) -> None:
        self.judge, self.rewards = judge, None
        if judge is None:
            if reward_functions is not None:
                specs = [f if isinstance(f, RewardSpec | dict) else RewardSpec(f) for f in reward_functions]
            elif cfg.type == "reward_model":
                specs = [RewardSpec("reward_model", 1.0, {"path": cfg.path})]
            else:
                specs = [RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in cfg.rewards]
            self.rewards = RewardComposer(specs)

    def __call__(self, prompts: list[str], questions: list[str], texts: list[str], columns: dict[str, list],
                 k: int) -> tuple[list[float | None], dict[str, float]]:
        if self.rewards is not None:
            total = self.rewards.score(prompts, texts, columns).total
            return [None if v != v else float(v) for v in total.tolist()], {}
        if not isinstance(self.judge, PairwiseJudge):
            return self.judge.score(questions, texts), self.judge.take_metrics()
        pairs = [(g * k + i, g * k + j) for g in range(len(texts) // k) for i in range(k) for j in range(i + 1, k)]
        verdicts = self.judge.compare([questions[a] for a, _ in pairs], [texts[a] for a, _ in pairs],
                                      [texts[b] for _, b in pairs])
        scores: list[float | None] = []
        for g in range(len(texts) // k):
            group = {(a - g * k, b - g * k): v for (a, b), v in zip(pairs, verdicts, strict=True) if a // k == g}
            scores.extend(pairwise_scores(k, group))
        return scores, self.judge.take_metrics()

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- the trainer -----------------------------------------------------------------------------------------


class OnlinePreferenceTrainer(Trainer):
    """Rounds of generate -> score -> pair -> preference updates, on the shared loop."""

    def __init__(self, config: OnlineDPOConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, reward_functions: list | None = None, judge: Any = None,
                 stage: str | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        self.records, self.prompts, self.prompt_ids = training_prompts(cfg.data, records, tokenizer, self.stage)
        self.engine = HFEngine(model, tokenizer, batch_size=cfg.rollout.engine_batch_size)
        self.reward_functions, self.judge = reward_functions, judge
        self.scorer: Scorer | None = None
        self.audit = RewardComposer([RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in cfg.audit]) \
            if cfg.audit else None
        self.loss = paired_loss_fn(cfg)
        self.beta = loss_beta(cfg)
        self.ref_model = self._reference_model()
        self.round = -1
        self.pairs: list = []
        self.ref: dict[str, torch.Tensor] | None = None
        self.schedule: BatchSchedule | None = None
        self._eval_cache: tuple[int, dict[str, float]] | None = None
        self.skipped_updates = 0
        if cfg.ignored_hparams():
            log.warning("%s: %s not used by loss %r; ignored", self.stage, ", ".join(cfg.ignored_hparams()), cfg.loss)

    def _reference_model(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy (taken before a resume loads later weights); none when the
        loss needs no reference, under LoRA (the adapter is disabled instead) or with ``reference: round``
        (the round's reference log-probs come from the policy itself at the round's start)."""
        cfg = self.config
        if not cfg.needs_reference or cfg.reference == "round" or hasattr(self.model, "disable_adapter"):
            return None
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def extra_state(self) -> dict[str, Any]:
        return {"skipped_updates": self.skipped_updates}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.skipped_updates = state.get("skipped_updates", 0)

    def _build_scorer(self) -> Scorer:
        cfg = self.config
        judge = self.judge
        if judge is None and self.reward_functions is None and cfg.scorer.type == "judge":
            judge = build_judge(cfg.scorer.judge, policy=self.model, tokenizer=self.tokenizer,
                                cache_dir=self.stage_dir / "judge_cache", log_dir=self.stage_dir)
        return Scorer(cfg.scorer, reward_functions=self.reward_functions, judge=judge)

    def train(self, *, resume: bool = False) -> dict[str, float]:
        self.scorer = self._build_scorer()
        try:
            return super().train(resume=resume)
        finally:
            self.scorer.close()

    # ---- one round's data --------------------------------------------------------------------------------
    def round_dir(self, r: int) -> Path:
        return self.stage_dir / ROUNDS_DIR / f"round-{r:03d}"

    def round_prompts(self, r: int) -> list[int]:
        """Prompt indices of round ``r``: consecutive slices of per-epoch shuffles (a function of ``r``)."""
        n, count = len(self.records), self.config.prompts_per_round
        out = []
        for cursor in range(r * count, (r + 1) * count):
            epoch, offset = divmod(cursor, n)
            order = list(range(n))
            random.Random(f"online:{self.config.train.seed}:{epoch}").shuffle(order)
            out.append(order[offset])
        return out

    def sampling_params(self, r: int) -> SamplingParams:
        ro = self.config.rollout
        return SamplingParams(n=ro.samples, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                              max_new_tokens=ro.max_new_tokens, stop=list(ro.stop),
                              seed=self.config.train.seed * 1_000_003 + r)

    def collect(self, r: int) -> tuple[list[dict], list[dict], dict[str, float]]:
        """Sample, score and pair round ``r``: returns (samples, pairs, figures)."""
        cfg, k = self.config, self.config.rollout.samples
        indices = self.round_prompts(r)
        start = time.perf_counter()
        with full_parameters(self.model):  # FSDP2: whole weights while this rank decodes
            rollout = self.engine.generate([self.prompt_ids[i] for i in indices], self.sampling_params(r))
        generated = time.perf_counter()
        rows = [self.records[indices[g]] for g in rollout.prompt_index]
        prompts = [self.prompts[indices[g]] for g in rollout.prompt_index]
        columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"}
        scores, figures = self.scorer(prompts, [row["prompt"] for row in rows], rollout.texts, columns, k)
        audit = self.audit.score(prompts, rollout.texts, columns).total.tolist() if self.audit else None
        samples = self._sample_rows(indices, rollout, scores, audit)
        pairs = []
        for g, index in enumerate(indices):
            group = samples[g * k:(g + 1) * k]
            for i, j in make_pairs([s["score"] for s in group], cfg.pairs.rule, margin=cfg.pairs.margin,
                                   threshold=cfg.pairs.threshold, max_pairs=cfg.pairs.max_per_prompt):
                pairs.append(self._pair_row(index, group[i], group[j]))
        figures.update(self._round_figures(samples, pairs, indices))
        figures.update({"round/generation_time": generated - start, "round/score_time": time.perf_counter() - generated})
        return samples, pairs, figures

    def _sample_rows(self, indices: list[int], rollout: Rollout, scores: list[float | None],
                     audit: list[float] | None) -> list[dict]:
        rows = []
        for i, text in enumerate(rollout.texts):
            row = {"prompt_id": indices[rollout.prompt_index[i]], "sample": i % self.config.rollout.samples,
                   "completion": text, "score": scores[i], "finish_reason": rollout.finish_reasons[i]}
            if audit is not None:
                row["audit"] = None if audit[i] != audit[i] else audit[i]
            rows.append(row)
        return rows

    def _pair_row(self, index: int, chosen: dict, rejected: dict) -> dict:
        prompt: Any = self.prompts[index]
        good, bad = chosen["completion"], rejected["completion"]
        if self.config.data.chat:
            prompt = [{"role": "user", "content": prompt}]
            good, bad = [{"role": "assistant", "content": good}], [{"role": "assistant", "content": bad}]
        row = {"prompt_id": index, "prompt": prompt, "chosen": good, "rejected": bad,
               "chosen_score": chosen["score"], "rejected_score": rejected["score"]}
        if "audit" in chosen:
            row.update(chosen_audit=chosen["audit"], rejected_audit=rejected["audit"])
        return row

    def _round_figures(self, samples: list[dict], pairs: list[dict], indices: list[int]) -> dict[str, float]:
        scores = [s["score"] for s in samples if s["score"] is not None]
        out = {"round/samples": len(samples), "round/score_missing": len(samples) - len(scores),
               "round/pairs": len(pairs), "round/prompts_with_pairs": len({p["prompt_id"] for p in pairs}),
               "round/prompts": len(indices)}
        if scores:
            out["round/score_mean"] = sum(scores) / len(scores)
        if pairs:
            out["round/pair_margin"] = sum(p["chosen_score"] - p["rejected_score"] for p in pairs) / len(pairs)
        audits = [s["audit"] for s in samples if s.get("audit") is not None]
        if audits:
            out["audit/mean"] = sum(audits) / len(audits)
            decided = [p for p in pairs if p.get("chosen_audit") is not None and p.get("rejected_audit") is not None
                       and p["chosen_audit"] != p["rejected_audit"]]
            out["audit/pairs_decided"] = len(decided)
            if decided:  # of the pairs the audit tells apart, how often the scorer's chosen is the better one
                out["audit/pair_agreement"] = sum(p["chosen_audit"] > p["rejected_audit"] for p in decided) / len(decided)
        return out

    def load_or_collect(self, r: int) -> tuple[list[dict], dict[str, float]]:
        """Round ``r``'s pairs from disk when a run already made them, else collected and saved."""
        folder = self.round_dir(r)
        done = folder / "round.json"
        if done.exists():
            return _read_jsonl(folder / "pairs.jsonl"), json.loads(done.read_text())["figures"]
        samples, pairs, figures = self.collect(r)
        if self.dist.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            _write_jsonl(folder / "samples.jsonl", samples)
            _write_jsonl(folder / "pairs.jsonl", pairs)
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps({"round": r, "step": self.step, "figures": figures}, indent=2))
            os.replace(tmp, done)  # written last: the round's data is complete
        return pairs, figures

    # ---- reference log-probs, once per round ---------------------------------------------------------------
    @torch.no_grad()
    def reference_logps(self, r: int) -> dict[str, torch.Tensor] | None:
        if not self.config.needs_reference or not self.pairs:
            return None
        path = self.round_dir(r) / REFERENCE_FILE
        if path.exists():
            return torch.load(path, map_location="cpu", weights_only=True)
        model, context = self.model, nullcontext()
        if self.config.reference == "initial":
            model = self.ref_model if self.ref_model is not None else self.model
            if self.ref_model is None:
                context = self.model.disable_adapter()
        was_training = self.model.training
        model.eval()
        out: dict[str, list[torch.Tensor]] = {"chosen": [], "rejected": []}
        with context:
            for chunk in chunks(self.pairs, 2 * self.config.train.batch_size):
                inputs = self._inputs(model, chunk, None, None, wpo=False)
                out["chosen"].append(inputs.chosen_logps.cpu())
                out["rejected"].append(inputs.rejected_logps.cpu())
        self.model.train(was_training)
        ref = {k: torch.cat(v) for k, v in out.items()}
        if self.dist.is_main:
            tmp = path.with_suffix(".tmp")
            torch.save(ref, tmp)
            os.replace(tmp, path)
        return ref

    def _inputs(self, model: torch.nn.Module, pairs: list, ref_c: torch.Tensor | None, ref_r: torch.Tensor | None,
                *, wpo: bool) -> Any:
        return pair_inputs(model, pairs, ref_c, ref_r, wpo=wpo, row_tokens=self.config.pack_length,
                           pad_token_id=self.tokenizer.pad_token_id)

    def start_round(self, r: int) -> None:
        cfg = self.config
        records, figures = self.load_or_collect(r)
        self.pairs, stats = tokenize_pairs(records, self.tokenizer, max_length=cfg.max_length)
        self.round = r
        self.ref = self.reference_logps(r)
        n, size = len(self.pairs), cfg.train.batch_size
        if n >= size * cfg.train.grad_accum * self.dist.world_size:
            self.schedule = BatchSchedule(n, batch_size=size, grad_accum=cfg.train.grad_accum,
                                          seed=cfg.train.seed * 1009 + r, rank=self.dist.rank,
                                          world_size=self.dist.world_size)
        else:
            self.schedule = None  # fewer pairs than one step takes: every step uses all of them
        figures.update({f"round/dropped_{k}": v for k, v in stats.items() if v})
        self.logger.log(self.step, {"round": r, **figures})
        self.results.update({f"round_{r + 1}/{k.removeprefix('round/')}": v for k, v in figures.items()
                             if k in ("round/score_mean", "round/pairs", "judge/consistency", "audit/mean",
                                      "audit/pair_agreement")})
        log.info("%s round %d: %s", self.stage, r, figures)

    def step_groups(self, local_step: int) -> list[list[int]]:
        if self.schedule is not None:
            return self.schedule.for_step(local_step)
        order = list(range(len(self.pairs)))
        random.Random(f"online-step:{self.config.train.seed}:{self.round}:{local_step}").shuffle(order)
        return [list(c) for c in chunks(order, self.config.train.batch_size)]

    # ---- the step ------------------------------------------------------------------------------------------
    def paired_loss(self, idx: list[int], global_pairs: float) -> tuple[torch.Tensor, dict]:
        device = self.device
        ref_c = self.ref["chosen"][idx].to(device) if self.ref is not None else None
        ref_r = self.ref["rejected"][idx].to(device) if self.ref is not None else None
        inputs = self._inputs(self.model, [self.pairs[i] for i in idx], ref_c, ref_r, wpo=self.config.wpo)
        loss, metrics = pair_loss(self.loss, self.config.loss, inputs)
        return loss * len(idx) / global_pairs, metrics

    def training_step(self) -> dict[str, Any]:
        cfg = self.config
        r, local = divmod(self.step, cfg.steps_per_round)
        if r != self.round:
            self.start_round(r)
        metrics: dict[str, Any] = {"round": r}
        if len(self.pairs) >= cfg.min_pairs:
            groups = self.step_groups(local)
            denominator = self.global_count(sum(len(g) for g in groups))
            metrics.update(self.optimizer_step(groups, lambda g: self.paired_loss(g, denominator)))
        else:  # an Adam step on one or two pairs is a full-size step on noise
            self.skipped_updates += 1
            log.info("%s round %d: %d pairs (< min_pairs %d); no update", self.stage, r, len(self.pairs), cfg.min_pairs)
        metrics["skipped_updates"] = self.skipped_updates
        if local == cfg.steps_per_round - 1:
            self.end_round(r)
        return metrics

    def end_round(self, r: int) -> None:
        """Held-out figures after round ``r`` (every ``eval_every_rounds`` and after the last), printed."""
        cfg = self.config
        if cfg.eval is None or ((r + 1) % cfg.eval_every_rounds and r + 1 < cfg.rounds):
            return
        figures = self.evaluate(step=self.step + 1)
        self.logger.log(self.step + 1, {"round": r + 1, **{f"eval/{k}": v for k, v in figures.items()}})
        self.results.update({f"round_{r + 1}/{k}": v for k, v in figures.items()})
        if self.dist.is_main and "accuracy" in figures:
            from rich import get_console

            get_console().print(f"[bold]{self.stage}[/] round {r + 1}/{cfg.rounds}: held-out accuracy "
                                f"{figures['accuracy']:.1%}")

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """The task evaluation, computed once per step (the last round's figures are the final ones)."""
        step = self.step if step is None else step
        if self._eval_cache is None or self._eval_cache[0] != step:
            self._eval_cache = (step, super().evaluate())
        return dict(self._eval_cache[1])


# ---- the one-call API and the stages ---------------------------------------------------------------------


def train_online_dpo(config: OnlineDPOConfig | dict, *, out: str | Path, model: Any = None, tokenizer: Any = None,
                     dataset: Any = None, reward_functions: list | None = None, judge: Any = None,
                     resume: bool = False) -> dict[str, float]:
    """Online / iterative DPO, OAIF or self-rewarding (chosen by the config).

    ``dataset``: prompt records (``prompt`` and, for verifiers, ``answer``) as a file, list of dicts
    or ``datasets.Dataset``, replacing ``config.data``. ``reward_functions``: plain callables
    ``fn(prompts, completions, **columns) -> list[float | None]`` as the scorer; ``judge``: a
    :class:`PointwiseJudge` / :class:`PairwiseJudge` as the scorer. Writes the policy to
    ``out/<stage>`` and each round's data to ``out/<stage>/rounds/``; returns the figures.
    """
    from tether.models.loading import resolve_model

    cfg = config if isinstance(config, OnlineDPOConfig) else OnlineDPOConfig.model_validate(config)
    model, tokenizer = resolve_model(model, tokenizer, cfg.model)
    records = None
    if dataset is not None:
        from tether.data import load_records

        records = load_records(dataset)
    trainer = OnlinePreferenceTrainer(cfg, model, tokenizer, out, records=records,
                                      reward_functions=reward_functions, judge=judge, stage=cfg.name or cfg.type)
    return trainer.fit(resume=resume)


@register_stage("online_dpo", OnlineDPOConfig, "online / iterative DPO: rounds of sample -> score (verifier, RM or "
                                               "judge) -> pair -> preference loss; OAIF; self-rewarding")
def run_online_dpo(cfg: OnlineDPOConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    return train_online_dpo(cfg, out=run_dir, resume=resume)


class JudgeDataConfig(StageConfig):
    """Synthetic judge training data (``judge_records``) written to ``<stage>/train.jsonl`` for an SFT
    stage, optionally mixed with ``sft_n`` task demonstrations (self-rewarding's IFT + EFT seed data)."""

    type: Literal["judge_data"] = "judge_data"
    task: PreferenceTaskSource = Field(default_factory=PreferenceTaskSource)
    kind: Literal["pointwise", "pairwise"] = "pairwise"
    template: str = "compact-pairwise"
    scale: tuple[float, float] = (0.0, 1.0)
    sft_n: int = Field(0, ge=0, description="task demonstrations mixed in")
    solve_first: bool = Field(False, description="the judge works the problem out before its verdict")


@register_stage("judge_data", JudgeDataConfig, "synthetic judge training data (known verdicts) for an SFT stage")
def run_judge_data(cfg: JudgeDataConfig, run_dir: Path, resume: bool) -> dict[str, float]:
    from tether.tasks import get_task, sft_records

    source = cfg.task
    task = get_task(source.name, **source.options)
    rows = judge_records(task, source.n, kind=cfg.kind, template=cfg.template, seed=source.seed,
                         errors=source.errors, scale=cfg.scale, solve_first=cfg.solve_first)
    if cfg.sft_n:
        rows += sft_records(task, cfg.sft_n, seed=source.seed + 1)
        random.Random(f"judge-data:{source.seed}").shuffle(rows)
    stage_dir = run_dir / (cfg.name or cfg.type)
    stage_dir.mkdir(parents=True, exist_ok=True)
    _write_jsonl(stage_dir / "train.jsonl", rows)
    results = {"records": float(len(rows)), "judge_records": float(len(rows) - cfg.sft_n)}
    if source.eval_n:
        _write_jsonl(stage_dir / "eval.jsonl", judge_records(task, source.eval_n, kind=cfg.kind, template=cfg.template,
                                                             seed=source.seed, split="eval", errors=source.errors,
                                                             scale=cfg.scale, solve_first=cfg.solve_first))
    mark_done(stage_dir, {"stage": cfg.name, "type": cfg.type, "results": results})
    return results
