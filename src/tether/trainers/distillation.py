"""On-policy distillation in the RL machinery: a teacher scores the student's own samples.

The student (the RL policy) samples as in any RL step; the teacher never generates. With the sampled-token
``reverse_kl`` (on-policy distillation, Lu and Thinking Machines Lab 2025) the teacher returns the log-prob
of each sampled token and every token's advantage gains ``-coef * (log π_old(y_t) - log π_T(y_t))``
(discount 0), added to the rewards' advantage when there are rewards (``distill.coef`` beside the verifier),
so the clipped policy-gradient update lowers the reverse KL to the teacher. With ``forward_kl`` / ``jsd``
(GKD, Agarwal et al. 2024) the teacher's whole next-token distributions are compared with the student's
at every sampled position and ``coef`` x the divergence joins the loss, differentiated through π_S (a
second student forward in the update, on the same rows).

Teachers (``distill.teacher``):

- ``local``: a causal LM (path or ``@stage``) sharing the student's tokenizer (checked: same vocabulary);
- ``served``: an OpenAI-compatible ``/completions`` endpoint asked for the prompt's log-probs (``echo``
  with ``logprobs``, the token ids sent as the prompt, so no re-tokenisation), e.g. ``tether serve`` or vLLM;
- ``self``: the student itself (its current weights, no gradient) given a privileged prompt: a template of
  the record's fields (``"Answer {answer}. {prompt}"``), the self-distillation of context distillation.

``privileged_prompt`` applies to every kind: the teacher scores the student's completion after its own
prompt. Figures: ``distill/reverse_kl`` (mean sampled-token estimate), ``distill/divergence`` (the loss
term), ``distill/teacher_tokens`` (tokens the teacher read this step) and ``distill/teacher_tokens_total``
(since the stage began, resumed with its checkpoints).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tether.config.base import ConfigError
from tether.config.rl import DistillConfig, TeacherConfig
from tether.core.aggregation import agg_loss
from tether.core.distillation import DISTILLATION_DIVERGENCES, top_k_restricted
from tether.data.tokenize import tokenize_prompt
from tether.models.loading import load_model, load_tokenizer
from tether.models.logprobs import completion_logprobs, scored_forward
from tether.rollout.openai_engine import OpenAIEngine


def check_same_vocabulary(student_tokenizer: Any, teacher_tokenizer: Any, name: str) -> None:
    """A teacher's log-probs are read at the student's token ids: its tokenizer must map text to the same ids."""
    if student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise ConfigError(f"teacher {name!r} does not share the student's tokenizer (vocabularies of "
                         f"{len(student_tokenizer)} and {len(teacher_tokenizer)} tokens differ): on-policy "
                         "distillation scores the student's token ids under the teacher")


class LocalTeacher:
    """A causal LM in this process: the student's tokens scored by one packed forward per batch."""

    def __init__(self, model: torch.nn.Module, *, temperature: float, row_tokens: int, pad_token_id: int,
                 batch_size: int) -> None:
        self.model, self.temperature, self.row_tokens = model, temperature, row_tokens
        self.pad_token_id, self.batch_size = pad_token_id, batch_size

    @torch.no_grad()
    def token_logprobs(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """``log π_T(y_t | prompt, y_<t)`` of every completion token, (N, C) padded with 0."""
        was_training = self.model.training
        self.model.eval()
        width = max(len(c) for c in completions)
        out = []
        for start in range(0, len(prompts), self.batch_size):
            logps, _ = completion_logprobs(self.model, prompts[start:start + self.batch_size],
                                           completions[start:start + self.batch_size], temperature=self.temperature,
                                           row_tokens=self.row_tokens, pad_token_id=self.pad_token_id)
            out.append(torch.nn.functional.pad(logps, (0, width - logps.shape[1])))
        self.model.train(was_training)
        return torch.cat(out)

    @torch.no_grad()
    def log_distributions(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """``log π_T(· | prompt, y_<t)`` at every completion position, (number of completion tokens, V)."""
        was_training = self.model.training
        self.model.eval()
        scored = scored_forward(self.model, [p + c for p, c in zip(prompts, completions, strict=True)],
                                first_targets=[len(p) for p in prompts], row_tokens=self.row_tokens,
                                pad_token_id=self.pad_token_id)
        self.model.train(was_training)
        return scored.log_distributions(self.temperature)


class ServedTeacher:
    """An OpenAI-compatible endpoint: ``/completions`` with the token ids as the prompt, ``echo`` and
    ``logprobs: 0``, one generated token (ignored); the echoed prompt log-probs of the completion's
    positions are the teacher's. The server scores at temperature 1."""

    def __init__(self, cfg: TeacherConfig) -> None:
        self.client = OpenAIEngine(cfg.base_url, cfg.served_model or "default", api_key_env=cfg.api_key_env,
                                   timeout=cfg.timeout, concurrency=cfg.concurrency)
        self.concurrency = cfg.concurrency

    def _one(self, prompt: list[int], completion: list[int]) -> list[float]:
        body = {"model": self.client.model, "prompt": prompt + completion, "max_tokens": 1, "echo": True,
                "logprobs": 0, "temperature": 1.0}
        choice = self.client.request("/completions", body)["choices"][0]
        values = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(values) < len(prompt) + len(completion):
            raise ValueError(f"the served teacher returned {len(values)} prompt log-probs for a prompt of "
                             f"{len(prompt) + len(completion)} tokens: it must echo the prompt with logprobs")
        return [float(v) for v in values[len(prompt):len(prompt) + len(completion)]]

    def token_logprobs(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        with ThreadPoolExecutor(self.concurrency) as pool:
            rows = list(pool.map(self._one, prompts, completions))
        width = max(len(c) for c in completions)
        return torch.tensor([r + [0.0] * (width - len(r)) for r in rows])

    def log_distributions(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        raise ConfigError("a served teacher returns sampled tokens' log-probs only: use distill.divergence: "
                         "reverse_kl")


def build_teacher(cfg: TeacherConfig, policy: torch.nn.Module, tokenizer: Any, *, temperature: float,
                  row_tokens: int) -> LocalTeacher | ServedTeacher:
    """The teacher of ``cfg``: a local model (its tokenizer checked against the student's), a served one, or
    the student itself (``self``)."""
    if cfg.kind == "served":
        if cfg.path is not None:
            check_same_vocabulary(tokenizer, load_tokenizer(cfg.path), cfg.path)
        return ServedTeacher(cfg)
    if cfg.kind == "self":
        model = policy
    else:
        model, teacher_tokenizer = load_model(cfg.path, device=str(next(policy.parameters()).device))
        check_same_vocabulary(tokenizer, teacher_tokenizer, cfg.path)
        model.eval().requires_grad_(False)
    return LocalTeacher(model, temperature=temperature, row_tokens=row_tokens,
                        pad_token_id=tokenizer.pad_token_id, batch_size=cfg.batch_size)


class Distillation:
    """The distillation signal of one RL trainer: teacher prompts, the per-token advantage or loss term."""

    def __init__(self, cfg: DistillConfig, policy: torch.nn.Module, tokenizer: Any, *, temperature: float,
                 row_tokens: int) -> None:
        self.cfg, self.tokenizer, self.temperature, self.row_tokens = cfg, tokenizer, temperature, row_tokens
        self.teacher = build_teacher(cfg.teacher, policy, tokenizer, temperature=temperature, row_tokens=row_tokens)
        self.divergence = DISTILLATION_DIVERGENCES.get(cfg.divergence)
        self.whole = "distributions" in DISTILLATION_DIVERGENCES.needs(cfg.divergence)
        self.teacher_tokens_total = 0  # every token the teacher has read in this stage (kept in checkpoints)

    def teacher_prompts(self, records: Sequence[dict], prompt_ids: Sequence[list[int]]) -> list[list[int]]:
        """Each sample's teacher prompt: its own, or the privileged template filled with its record's fields."""
        template = self.cfg.teacher.privileged_prompt
        if template is None:
            return [list(p) for p in prompt_ids]
        try:
            return [tokenize_prompt(template.format(**record), self.tokenizer) for record in records]
        except KeyError as err:
            raise ConfigError(f"distill.teacher.privileged_prompt names {err} but the records have the fields "
                             f"{sorted(records[0]) if records else []}") from None

    def advantages(self, teacher_prompts: list[list[int]], completions: list[list[int]],
                   student_logprobs: torch.Tensor | None, mask: torch.Tensor
                   ) -> tuple[torch.Tensor | None, dict[str, float]]:
        """The sampled-token signal ``-coef * (log π_S - log π_T)`` per token (masked), or None for the
        whole-distribution divergences (a loss term instead); and the step's figures."""
        read = sum(len(p) + len(c) for p, c in zip(teacher_prompts, completions, strict=True))
        self.teacher_tokens_total += read
        figures = {"distill/teacher_tokens": float(read), "distill/teacher_tokens_total": float(self.teacher_tokens_total)}
        if self.whole or student_logprobs is None:
            return None, figures
        teacher = self.teacher.token_logprobs(teacher_prompts, completions).to(student_logprobs.device)
        estimate = DISTILLATION_DIVERGENCES.get("reverse_kl")(student_logprobs, teacher[:, :student_logprobs.shape[1]])
        figures["distill/reverse_kl"] = float((estimate * mask).sum() / mask.sum().clamp(min=1))
        return -self.cfg.coef * estimate * mask, figures

    def loss(self, student: torch.nn.Module, prompts: list[list[int]], teacher_prompts: list[list[int]],
             completions: list[list[int]], mask: torch.Tensor, loss_agg: str, agg: dict[str, Any]
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``coef`` x the aggregated per-token divergence between the teacher's and the student's whole
        next-token distributions over the rows' completions (gradient through the student only)."""
        scored = scored_forward(student, [p + c for p, c in zip(prompts, completions, strict=True)],
                                first_targets=[len(p) for p in prompts], row_tokens=self.row_tokens,
                                pad_token_id=self.tokenizer.pad_token_id)
        student_dist = scored.log_distributions(self.temperature)
        teacher_dist = self.teacher.log_distributions(teacher_prompts, completions).to(student_dist.device)
        if self.cfg.top_k is not None:
            student_dist, teacher_dist = top_k_restricted(student_dist, teacher_dist, self.cfg.top_k)
        kwargs = {"beta": self.cfg.beta} if self.cfg.divergence == "jsd" else {}
        per_token = scored.scatter(self.divergence(student_dist, teacher_dist, **kwargs))
        per_token = torch.nn.functional.pad(per_token, (0, mask.shape[1] - per_token.shape[1]))
        term = agg_loss(per_token, mask, loss_agg, **agg)
        return self.cfg.coef * term, {"distill/divergence": term.detach()}


class DistillationSteps:
    """The RL trainer's distillation steps (mixed into :class:`~tether.trainers.rl.RLTrainer`, which owns
    ``distillation``, ``records``, ``config`` and the log-prob passes)."""

    distillation: Distillation | None

    def distill_signal(self, batch: Any, behaviour: torch.Tensor | None = None) -> None:
        """After the frozen passes: each sample's teacher prompt, and the sampled-token advantage from the
        behaviour policy's log-probs (``behaviour``, when the frozen passes computed them; else recomputed)."""
        rollout = batch.rollout
        records = [self.records[batch.prompt_indices[i]] for i in rollout.prompt_index]
        batch.teacher_prompts = self.distillation.teacher_prompts(records, rollout.prompt_ids)
        student = behaviour if behaviour is not None else batch.old_logprobs
        if student is None and not self.distillation.whole:
            student = self.frozen_logprobs(rollout, reference=False)
        with self.frozen_pass():  # the teacher's scores
            batch.distill_advantages, figures = self.distillation.advantages(
                batch.teacher_prompts, rollout.completion_ids, student, batch.mask)
        batch.metrics.update(figures)

    def with_distillation(self, batch: Any, out: Any) -> Any:
        """The estimator's advantages plus the sampled-token distillation signal (discount 0), when on."""
        if batch.distill_advantages is not None:
            out.advantages = out.advantages + batch.distill_advantages
            out.metrics["distill_mean"] = float((batch.distill_advantages * batch.mask).sum()
                                                / batch.mask.sum().clamp(min=1))
        return out

    def distill_loss(self, batch: Any, rows: torch.Tensor, loss: torch.Tensor, metrics: dict[str, Any],
                     agg: dict[str, Any]) -> torch.Tensor:
        """``loss`` plus the whole-distribution divergence term on the rows' samples; figures into ``metrics``."""
        ids = rows.tolist()
        rollout = batch.rollout
        term, figures = self.distillation.loss(
            self.policy, [rollout.prompt_ids[i] for i in ids], [batch.teacher_prompts[i] for i in ids],
            [rollout.completion_ids[i] for i in ids], batch.mask[rows], self.config.loss_agg, agg)
        metrics.update(figures)
        return loss + term
