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

SPIN (Chen et al. 2024, "Self-Play Fine-Tuning Converts Weak Language Models to Strong Language
Models") is :class:`SPINTrainer`: rounds (iterations) whose pairs are (the SFT demonstration, the
model's own generation) with no scorer, and ``reference: round``, so the reference is the previous
iterate θt and the loss is the logistic loss of Eq. 4.7 (DPO's sigmoid loss with β = λ). How it departs:
each iteration uses ``prompts_per_round`` prompts (the paper regenerates for all), the policy trains on
from θt rather than re-initialised, any ``PREFERENCE_LOSSES`` loss can replace the logistic one (``loss:
rpo`` adds the chosen NLL, which the tiny models need), and a generation equal to its demonstration
makes no pair; their share is ``round/match_rate``, which approaches 1 as the model converges to the data.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from tether.config.base import ConfigError
from tether.config.preference import OnlineDPOConfig
from tether.core.pairing import make_pairs, rso_scores, win_probabilities
from tether.core.rollout_correction import mismatch_metrics
from tether.data.files import read_jsonl, torch_save_atomic, write_json_atomic, write_jsonl_atomic
from tether.data.mixing import stream_indices
from tether.data.pairs import tokenize_pairs
from tether.data.schedule import BatchSchedule, chunks
from tether.data.sources import record_columns, training_prompts
from tether.evaluation import Figures
from tether.models.loading import frozen_copy
from tether.models.logprobs import completion_logprobs, preference_inputs
from tether.rollout import HFEngine, Rollout, SamplingParams
from tether.scoring import Scorer, reward_composer
from tether.trainers.loop import Trainer
from tether.trainers.parallel import full_parameters

log = logging.getLogger(__name__)

ROUNDS_DIR = "rounds"
REFERENCE_FILE = "reference_logps.pt"


class OnlinePreferenceTrainer(Trainer):
    """Rounds of generate -> score -> pair -> preference updates, on the shared loop."""

    compares_frozen_passes = True

    def __init__(self, config: OnlineDPOConfig, model: torch.nn.Module, tokenizer: Any, run_dir: str | Path, *,
                 records: list[dict] | None = None, reward_functions: list | None = None, judge: Any = None,
                 stage: str | None = None) -> None:
        super().__init__(config, model, tokenizer, run_dir, stage=stage)
        cfg = self.config
        self.records, self.prompts, self.prompt_ids = training_prompts(cfg.data, records, tokenizer, self.stage)
        self.engine = HFEngine(model, tokenizer, batch_size=cfg.rollout.engine_batch_size,
                             dtype=cfg.train.sampler_dtype)
        self.reward_functions, self.judge = reward_functions, judge
        self.scorer: Scorer | None = None
        self.audit = reward_composer(cfg.audit, defaults=cfg.reward_defaults()) if cfg.audit else None
        self.loss = cfg.paired_loss()
        self.beta = cfg.implicit_beta
        self.ref_model = self._reference_model()
        if "sequential_kl" in cfg.loss_needs and self.ref_model is None and cfg.reference == "initial":
            raise ConfigError(f"loss {cfg.loss!r} needs the reference's full distributions; under LoRA use a full "
                             "fine-tune or reference: round")
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
            return None  # (with reference: round a loss that reads the sequential KL copies it each round)
        return frozen_copy(self.model)

    def extra_state(self) -> dict[str, Any]:
        return {"skipped_updates": self.skipped_updates}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.skipped_updates = state.get("skipped_updates", 0)

    def build_scorer(self) -> Scorer:
        """The round's scorer: the reward functions or judge given, else the config's (a judge with the policy
        as its backend for self-rewarding; its replies cached under the stage)."""
        return Scorer(self.config.scorer, reward_functions=self.reward_functions, judge=self.judge, policy=self.model,
                      tokenizer=self.tokenizer, cache_dir=self.stage_dir / "judge_cache", log_dir=self.stage_dir,
                      defaults=self.config.reward_defaults())

    def train(self, *, resume: bool = False) -> dict[str, float]:
        """The rounds, then the audit over every round's pairs (``audit/chosen_mean`` etc., pairs-weighted; with
        the ``accuracy`` audit 1 - ``audit/chosen_mean`` is the share of all pairs trained toward a wrong answer)."""
        self.scorer = self.build_scorer()
        try:
            results = super().train(resume=resume)
        finally:
            self.scorer.close()
        files = [self.round_dir(r) / "pairs.jsonl" for r in range(self.config.rounds)]
        pairs = [p for f in files if f.exists() for p in read_jsonl(f)]
        if any(p.get("chosen_audit") is not None for p in pairs):
            results.update(pair_audit(pairs))
        return results

    # ---- one round's data --------------------------------------------------------------------------------
    def round_dir(self, r: int) -> Path:
        return self.stage_dir / ROUNDS_DIR / f"round-{r:03d}"

    def round_prompts(self, r: int) -> list[int]:
        """Prompt indices of round ``r``: consecutive slices of per-epoch shuffles (a function of ``r``)."""
        count = self.config.prompts_per_round
        return stream_indices(len(self.records), r * count, count, seed=self.config.train.seed, namespace="online:")

    def sampling_params(self, r: int) -> SamplingParams:
        ro = self.config.rollout
        return ro.params(ro.samples, self.config.train.seed * 1_000_003 + r)

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
        columns = record_columns(rows)
        scores, figures = self.scorer.score_groups(prompts, [row["prompt"] for row in rows], rollout.texts, columns, k)
        audit = self.audit.score(prompts, rollout.texts, columns).total.tolist() if self.audit else None
        samples = self._sample_rows(indices, rollout, scores, audit)
        pairs = []
        for g, index in enumerate(indices):
            group = samples[g * k:(g + 1) * k]
            wins = win_probabilities([s["score"] for s in group], temperature=cfg.pairs.win_temperature,
                                     pairwise=self.scorer.pairwise)
            for sample, win in zip(group, wins, strict=True):
                sample["win_prob"] = win
            group_scores = [s["score"] for s in group]
            if cfg.pairs.rso is not None:  # RSO: pair only samples of the reward-tilted policy
                rso = cfg.pairs.rso
                group_scores = rso_scores(group_scores, beta=rso.beta, num_samples=rso.samples,
                                    rng=random.Random(f"rso:{rso.seed}:{cfg.train.seed}:{r}:{index}"))
            for i, j in make_pairs(group_scores, cfg.pairs.rule, margin=cfg.pairs.margin,
                                   threshold=cfg.pairs.threshold, max_pairs=cfg.pairs.max_per_prompt):
                pairs.append(self._pair_row(index, group[i], group[j]))
        figures.update(round_figures(samples, pairs, indices))
        figures.update({"round/generation_time": generated - start, "round/score_time": time.perf_counter() - generated})
        figures.update(self.mismatch(rollout))
        return samples, pairs, figures

    @torch.no_grad()
    def mismatch(self, rollout: Rollout) -> dict[str, float]:
        """``mismatch/*`` of the round's first ``mismatch_samples`` samples: the sampler's log-probs against the
        trainer's forward pass of the same policy (before this round's updates)."""
        n = min(self.config.mismatch_samples, len(rollout))
        if n == 0:
            return {}
        part = rollout.select(range(n))
        padded = part.to_padded(self.tokenizer.pad_token_id, self.device)
        with self.frozen_pass():
            trainer, _ = completion_logprobs(self.model, part.prompt_ids, part.completion_ids,
                                             temperature=self.config.rollout.temperature or 1.0,
                                             row_tokens=self.config.pack_length,
                                             pad_token_id=self.tokenizer.pad_token_id)
        sampler = padded["logprobs"].masked_fill(padded["completion_mask"] == 0, float("nan"))
        trainer = torch.nn.functional.pad(trainer, (0, sampler.shape[1] - trainer.shape[1]))
        figures = mismatch_metrics(trainer, sampler, padded["completion_mask"].float())
        return {f"mismatch/{k}": float(v) for k, v in figures.items()}

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
               "chosen_score": chosen["score"], "rejected_score": rejected["score"],
               "chosen_win_prob": chosen["win_prob"], "rejected_win_prob": rejected["win_prob"]}
        if "audit" in chosen:
            row.update(chosen_audit=chosen["audit"], rejected_audit=rejected["audit"])
        return row

    def load_or_collect(self, r: int) -> tuple[list[dict], dict[str, float]]:
        """Round ``r``'s pairs from disk when a run already made them, else collected and saved."""
        folder = self.round_dir(r)
        done = folder / "round.json"
        if done.exists():
            return read_jsonl(folder / "pairs.jsonl"), json.loads(done.read_text())["figures"]
        samples, pairs, figures = self.collect(r)
        if self.dist.is_main:
            write_jsonl_atomic(folder / "samples.jsonl", samples)
            write_jsonl_atomic(folder / "pairs.jsonl", pairs)
            # written last: the round's data is complete
            write_json_atomic(done, {"round": r, "step": self.step, "figures": figures})
        return pairs, figures

    # ---- reference log-probs, once per round ---------------------------------------------------------------
    @torch.no_grad()
    def reference_logprobs(self, r: int) -> dict[str, torch.Tensor] | None:
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
        out: dict[str, list[torch.Tensor]] = {"chosen": [], "rejected": []}
        with self.frozen_pass(context, model=model):
            for chunk in chunks(self.pairs, 2 * self.config.train.batch_size):
                inputs = self._inputs(model, chunk, None, None, wpo=False)
                out["chosen"].append(inputs.chosen_logps.cpu())
                out["rejected"].append(inputs.rejected_logps.cpu())
        ref = {k: torch.cat(v) for k, v in out.items()}
        if self.dist.is_main:
            torch_save_atomic(path, ref)
        return ref

    def _inputs(self, model: torch.nn.Module, pairs: list, ref_c: torch.Tensor | None, ref_r: torch.Tensor | None,
                *, wpo: bool) -> Any:
        needs_kl = "sequential_kl" in self.config.loss_needs and model is self.model
        return preference_inputs(model, pairs, ref_c, ref_r, wpo=wpo, row_tokens=self.config.pack_length,
                                 pad_token_id=self.tokenizer.pad_token_id,
                                 reference_model=self.ref_model if needs_kl else None)

    def start_round(self, r: int) -> None:
        cfg = self.config
        records, figures = self.load_or_collect(r)
        self.pairs, stats = tokenize_pairs(records, self.tokenizer, max_length=cfg.max_length)
        self.round = r
        if "sequential_kl" in cfg.loss_needs and cfg.reference == "round":
            self.ref_model = frozen_copy(self.model)
        self.ref = self.reference_logprobs(r)
        n, size = len(self.pairs), cfg.train.batch_size
        self.round_updates = round_updates(n, size * cfg.train.grad_accum * self.dist.world_size,
                                           cfg.steps_per_round, cfg.epochs_per_round)
        if n >= size * cfg.train.grad_accum * self.dist.world_size:
            self.schedule = BatchSchedule(n, batch_size=size, grad_accum=cfg.train.grad_accum,
                                          seed=cfg.train.seed * 1009 + r, rank=self.dist.rank,
                                          world_size=self.dist.world_size)
        else:
            self.schedule = None  # fewer pairs than one step takes: every step uses all of them
        figures.update({f"round/dropped_{k}": v for k, v in stats.items() if v})
        figures["round/updates"] = self.round_updates if n >= cfg.min_pairs else 0
        self.logger.log(self.step, {"round": r, **figures})
        self.results.update({f"round_{r + 1}/{k.removeprefix('round/')}": v for k, v in figures.items()
                             if k in ("round/score_mean", "round/pairs", "judge/consistency", "audit/mean",
                                      "audit/pair_agreement", "audit/chosen_mean")})
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
        loss, metrics = self.loss(inputs)
        return loss * len(idx) / global_pairs, metrics

    def training_step(self) -> dict[str, Any]:
        cfg = self.config
        r, local = divmod(self.step, cfg.steps_per_round)
        if r != self.round:
            self.start_round(r)
        metrics: dict[str, Any] = {"round": r}
        if len(self.pairs) >= cfg.min_pairs and local < self.round_updates:
            groups = self.step_groups(local)
            denominator = self.global_count(sum(len(g) for g in groups))
            metrics.update(self.optimizer_step(groups, lambda g: self.paired_loss(g, denominator)))
        elif len(self.pairs) < cfg.min_pairs:  # an Adam step on one or two pairs is a full-size step on noise
            self.skipped_updates += 1
            log.info("%s round %d: %d pairs (< min_pairs %d); no update", self.stage, r, len(self.pairs), cfg.min_pairs)
        else:  # epochs_per_round passes made: more steps on the same few pairs only push them further apart
            self.skipped_updates += 1
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
        cached = self._eval_cache[1]
        return Figures(cached, outcomes=getattr(cached, "outcomes", {}))  # a copy, with the per-problem outcomes


# ---- SPIN ----------------------------------------------------------------------------------------------


def round_updates(pairs: int, pairs_per_step: int, steps: int, epochs: float | None) -> int:
    """Optimiser steps a round makes on ``pairs`` pairs: ``steps``, or fewer when ``epochs`` passes over the
    pairs take fewer (a step takes ``pairs_per_step``, or every pair when there are fewer); at least one."""
    if epochs is None:
        return steps
    per_step = min(pairs, pairs_per_step)
    return max(1, min(steps, math.ceil(epochs * pairs / max(per_step, 1))))


def spin_pairs(prompts: list[str], demos: list[str], generations: list[str]) -> tuple[list[dict], int]:
    """SPIN pairs: (prompt, chosen = demonstration, rejected = generation) for every generation that differs
    from its demonstration (whitespace-stripped); returns the pairs and how many generations matched."""
    pairs, matched = [], 0
    for k, (prompt, demo, text) in enumerate(zip(prompts, demos, generations, strict=True)):
        if text.strip() == demo.strip():
            matched += 1
            continue
        pairs.append({"sample": k, "prompt": prompt, "chosen": demo, "rejected": text})
    return pairs, matched


class SPINTrainer(OnlinePreferenceTrainer):
    """Online preference rounds whose pairs are (demonstration, own generation)."""

    def collect(self, r: int) -> tuple[list[dict], list[dict], dict[str, float]]:
        indices = self.round_prompts(r)
        start = time.perf_counter()
        with full_parameters(self.model):
            rollout = self.engine.generate([self.prompt_ids[i] for i in indices], self.sampling_params(r))
        prompt_of = [indices[g] for g in rollout.prompt_index]
        demos = [self.records[i]["completion"] for i in prompt_of]
        pairs, matched = spin_pairs([self.prompts[i] for i in prompt_of], demos, rollout.texts)
        for pair in pairs:
            pair["prompt_id"] = prompt_of[pair["sample"]]
        samples = [{"prompt_id": i, "completion": t, "matches_demo": t.strip() == d.strip(), "finish_reason": f}
                   for i, t, d, f in zip(prompt_of, rollout.texts, demos, rollout.finish_reasons, strict=True)]
        figures = {"round/samples": len(samples), "round/pairs": len(pairs), "round/match_rate": matched / len(samples),
                   "round/prompts": len(indices), "round/generation_time": time.perf_counter() - start}
        figures.update(self.mismatch(rollout))
        return samples, pairs, figures

    def start_round(self, r: int) -> None:
        super().start_round(r)
        done = self.round_dir(r) / "round.json"
        if done.exists():
            self.results[f"round_{r + 1}/match_rate"] = json.loads(done.read_text())["figures"]["round/match_rate"]


def round_figures(samples: list[dict], pairs: list[dict], indices: list[int]) -> dict[str, float]:
    """A round's figures: samples, missing scores, pairs, the scorer's mean and pair margin; with an ``audit``
    (rewards that check the scorer), the audit's mean over the samples, over the chosen and over the rejected
    responses (``audit/chosen_mean``: with the ``accuracy`` audit, the share of pairs that train toward a right
    answer; a wrong-vs-wrong pair the scorer decides counts against it, where ``audit/pair_agreement`` leaves it
    out) and, of the pairs the audit tells apart, the share the scorer orders the same way."""
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
        out.update(pair_audit(pairs))
    return out


def pair_audit(pairs: list[dict]) -> dict[str, float]:
    """The audit of ``pairs`` (each with ``chosen_audit`` / ``rejected_audit``): its mean over the chosen and the
    rejected responses, how many pairs it tells apart and, of those, the share the scorer ordered the same way."""
    audited = [p for p in pairs if p.get("chosen_audit") is not None and p.get("rejected_audit") is not None]
    decided = [p for p in audited if p["chosen_audit"] != p["rejected_audit"]]
    out: dict[str, float] = {"audit/pairs_decided": len(decided)}
    if audited:
        out["audit/chosen_mean"] = sum(p["chosen_audit"] for p in audited) / len(audited)
        out["audit/rejected_mean"] = sum(p["rejected_audit"] for p in audited) / len(audited)
    if decided:  # of the pairs the audit tells apart, how often the scorer's chosen is the better one
        out["audit/pair_agreement"] = sum(p["chosen_audit"] > p["rejected_audit"] for p in decided) / len(decided)
    return out

