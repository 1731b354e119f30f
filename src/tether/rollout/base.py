"""The generation protocol every rollout engine implements: token ids in, token ids out.

An engine takes prompts as lists of token ids and a :class:`SamplingParams`, and returns a
:class:`Rollout` holding, per sample, the sampled token ids, the log-prob of each sampled token
and why the sample ended. Engines never re-tokenise decoded text, so what the trainer scores is
exactly what was sampled.

What ``completion_logprobs`` means (the one definition every engine follows):

* sampling (``temperature > 0`` and not ``greedy``): ``log_softmax(logits / temperature)`` at the
  sampled token. This is the distribution a trainer recomputes from a forward pass over
  prompt + completion (as TRL and verl do), so old and new log-probs are comparable. The
  top-k / top-p truncation used to *draw* the token is **not** reflected: under a truncated
  distribution the kept tokens would have slightly higher probability than reported.
* greedy (``greedy=True`` or ``temperature == 0``): ``log_softmax(logits)`` at the argmax token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from tether.config.sampling import SamplingParams

FINISH_REASONS = ("stop", "length")


@dataclass
class Rollout:
    """The result of one ``generate`` call: ``N = len(prompts) * n`` samples.

    The ``n`` samples of one prompt are contiguous: sample ``i`` came from prompt
    ``prompt_index[i] == i // n``. Every field is a list of length ``N``.

    * ``prompt_ids``: the prompt of each sample, as given (no padding).
    * ``completion_ids``: exactly the sampled token ids, EOS included when the sample stopped on it.
    * ``completion_logprobs``: one float per completion token; see the module docstring.
    * ``finish_reasons``: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_new_tokens`` hit).
    * ``prompt_index``: which input prompt each sample came from.
    * ``texts``: decoded completions, special tokens skipped, cut after the stop string if one matched.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completion_logprobs: list[list[float]]
    finish_reasons: list[str]
    prompt_index: list[int]
    texts: list[str]

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        for name in ("completion_ids", "completion_logprobs", "finish_reasons", "prompt_index", "texts"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Rollout.{name} has {len(getattr(self, name))} entries, expected {n}")

    def __len__(self) -> int:
        return len(self.completion_ids)

    def select(self, indices: Iterable[int]) -> Rollout:
        """The samples at ``indices``; prompt indices renumbered from 0 in order of appearance."""
        indices = list(indices)
        renumber: dict[int, int] = {}
        for i in indices:
            renumber.setdefault(self.prompt_index[i], len(renumber))
        return Rollout(
            prompt_ids=[self.prompt_ids[i] for i in indices],
            completion_ids=[self.completion_ids[i] for i in indices],
            completion_logprobs=[self.completion_logprobs[i] for i in indices],
            finish_reasons=[self.finish_reasons[i] for i in indices],
            prompt_index=[renumber[self.prompt_index[i]] for i in indices],
            texts=[self.texts[i] for i in indices],
        )

    @staticmethod
    def concat(rollouts: Sequence[Rollout]) -> Rollout:
        """One rollout of all samples in order; prompt indices offset so they stay distinct."""
        fields: dict[str, list] = {
            name: []
            for name in (
                "prompt_ids",
                "completion_ids",
                "completion_logprobs",
                "finish_reasons",
                "prompt_index",
                "texts",
            )
        }
        offset = 0
        for rollout in rollouts:
            for name in fields:
                if name == "prompt_index":
                    fields[name].extend(offset + i for i in rollout.prompt_index)
                else:
                    fields[name].extend(getattr(rollout, name))
            offset += max(rollout.prompt_index, default=-1) + 1
        return Rollout(**fields)

    def to_padded(self, pad_id: int, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Stack the samples into padded tensors.

        Returns a dict with
        ``completion_ids`` (N, T) int64 right-padded with ``pad_id``,
        ``completion_mask`` (N, T) int64, 1 on sampled tokens,
        ``logprobs`` (N, T) float32, 0 on padding,
        ``prompt_ids`` (N, P) int64 *left*-padded with ``pad_id`` and
        ``prompt_mask`` (N, P) int64, so ``cat([prompt_ids, completion_ids], 1)`` is the full sequence.
        ``T`` is the longest completion (at least 1), ``P`` the longest prompt.
        """
        n = len(self)
        t = max([len(c) for c in self.completion_ids] + [1])
        p = max([len(q) for q in self.prompt_ids] + [1])
        ids = torch.full((n, t), pad_id, dtype=torch.long)
        mask = torch.zeros((n, t), dtype=torch.long)
        logprobs = torch.zeros((n, t), dtype=torch.float32)
        prompt_ids = torch.full((n, p), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p), dtype=torch.long)
        for i, (comp, lps, prompt) in enumerate(
            zip(self.completion_ids, self.completion_logprobs, self.prompt_ids, strict=True)
        ):
            if comp:
                ids[i, : len(comp)] = torch.tensor(comp, dtype=torch.long)
                mask[i, : len(comp)] = 1
                logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
            if prompt:
                prompt_ids[i, p - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
                prompt_mask[i, p - len(prompt) :] = 1
        out = {
            "completion_ids": ids,
            "completion_mask": mask,
            "logprobs": logprobs,
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
        }
        if device is not None:
            out = {k: v.to(device) for k, v in out.items()}
        return out


@runtime_checkable
class GenerationEngine(Protocol):
    """Anything that turns token-id prompts into a :class:`Rollout`."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout: ...


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return ``(tokens (B,), logprobs (B,))``.

    ``logits`` has shape (B, V), float32. Greedy rows take the argmax and report
    ``log_softmax(logits)`` of it. Otherwise the token is drawn from ``softmax(logits / T)``
    restricted to the top-k, then to the smallest set of tokens whose mass reaches top-p
    (the most likely token always survives), and the reported log-prob is
    ``log_softmax(logits / T)`` of the drawn token, without the truncation.
    """
    if params.is_greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    scaled = logits if params.temperature == 1.0 else logits / params.temperature  # x / 1 is x, bitwise
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = None
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        filtered = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        base = scaled if filtered is None else filtered
        sorted_logits, order = torch.sort(base, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= params.top_p, float("-inf"))
        filtered = torch.full_like(base, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logp.exp() if filtered is None else torch.softmax(filtered, dim=-1)
    tokens = exponential_race(probs, generator)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` (B, V): ``argmax(p / q)`` with ``q ~ Exp(1)`` per entry, the race of
    exponential clocks (the Gumbel-max trick, exponentiated) that ``torch.multinomial(probs, 1)`` itself runs.

    The same draws from the same generator state, bitwise (tested), without ``multinomial``'s validity
    checks, which cost two synchronisations and about ten dispatches per decode step; one check remains: a
    row with a NaN or an infinity (a diverged model) raises as ``multinomial`` would."""
    if not math.isfinite(probs.sum().item()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    clocks = torch.empty_like(probs).exponential_(1, generator=generator)
    return torch.div(probs, clocks, out=clocks).argmax(-1)
