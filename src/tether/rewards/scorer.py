"""Score completions with a trained reward model: outcome (one scalar) or process (steps aggregated).

``RewardModelScorer`` loads the model once and scores in packed batches without gradients. It
follows the reward-function protocol of the RL trainers, ``scorer(prompts, completions,
**columns) -> list[float]``, so it can be passed wherever a reward function goes:

>>> scorer = RewardModelScorer("runs/rm-arith/rm")               # doctest: +SKIP
>>> train_grpo(cfg, reward_functions=[scorer], out="runs/rl")    # doctest: +SKIP

or named in a config as ``{name: reward_model, kwargs: {path: ...}}`` (or the dotted path
``tether.rewards.scorer:reward_model``).

Texts are laid out exactly as the reward trainer laid them out: an outcome model reads the head
at the last token of ``bos + prompt + completion + eos`` (the chat template for message-list
prompts, or for string prompts with ``chat=True``); a process model cuts the completion into
steps at its step separator, reads ``sigmoid(head)`` after each step, and aggregates the step
scores with a ``STEP_AGGREGATIONS`` entry (``min`` by default; a completion with no step scores
0). Knows nothing about training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tether.core.reward import STEP_AGGREGATIONS
from tether.data import tokenize_sft
from tether.data.tokenize import split_steps, step_sequence
from tether.models.reward_model import load_reward_model, reward_info, score_positions
from tether.rewards.verifiers import REWARD_FUNCTIONS


class RewardModelScorer:
    """A reward model as a reward function: ``score(prompts, completions) -> list[float]``.

    Args:
        path_or_model: a saved reward model directory (or hub id), or a loaded
            ``*ForSequenceClassification`` model (then pass ``tokenizer``).
        batch_size: sequences per forward pass.
        process: score as a process reward model; None reads it from the model's config.
        aggregation: step-score aggregation for a process model (min, product, last, mean); None
            takes the one stored with the model (``min`` unless it was trained with another).
        step_separator: None reads it from the model's config.
        chat: wrap string prompts in a user message and the completion in an assistant message.
        max_length: longer texts keep their first ``max_length - 1`` tokens and the last one.
        row_tokens: tokens per packed row.
    """

    def __init__(self, path_or_model: str | Path | torch.nn.Module, tokenizer: Any = None, *, batch_size: int = 32,
                 process: bool | None = None, aggregation: str | None = None, step_separator: str | None = None,
                 chat: bool = False, device: str = "cpu", dtype: str = "float32", max_length: int | None = None,
                 row_tokens: int = 2048) -> None:
        if isinstance(path_or_model, str | Path):
            self.model, self.tokenizer = load_reward_model(str(path_or_model), device=device, dtype=dtype,
                                                           tokenizer=tokenizer)
        else:
            if tokenizer is None:
                raise ValueError("pass the tokenizer together with a loaded model")
            self.model, self.tokenizer = path_or_model, tokenizer
        self.model.eval()
        info = reward_info(self.model)
        self.process = info["process"] if process is None else process
        self.aggregation = aggregation or info["aggregation"]
        self.step_separator = step_separator or info["step_separator"]
        self.aggregate = STEP_AGGREGATIONS.get(self.aggregation)
        self.batch_size, self.chat, self.row_tokens = batch_size, chat, row_tokens
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any) -> list[float]:
        return self.score(prompts, completions)

    def _prompt(self, prompt: Any) -> Any:
        return [{"role": "user", "content": prompt}] if self.chat and isinstance(prompt, str) else prompt

    def _outcome_sequence(self, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
        prompt = self._prompt(prompt)
        if isinstance(prompt, list) and isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        example = tokenize_sft({"prompt": prompt, "completion": completion}, self.tokenizer,
                               max_length=10**9, overflow="truncate")
        ids = example.input_ids
        if self.max_length and len(ids) > self.max_length:
            ids = ids[: self.max_length - 1] + ids[-1:]
        return ids, [len(ids) - 1]

    def _process_sequence(self, prompt: Any, completion: str, finished: bool = True) -> tuple[list[int], list[int]]:
        steps = split_steps(completion, self.step_separator)
        ids, positions = step_sequence(self._prompt(prompt), steps, self.tokenizer, self.step_separator,
                                       finished=finished)
        if self.max_length and len(ids) > self.max_length:
            positions = [p for p in positions if p < self.max_length]
            ids = ids[: self.max_length]
        return ids, positions

    @torch.no_grad()
    def score(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[float]:
        """One reward per completion, in order."""
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts for {len(completions)} completions")
        out: list[float] = []
        for start in range(0, len(completions), self.batch_size):
            batch = list(zip(prompts[start:start + self.batch_size], completions[start:start + self.batch_size],
                             strict=True))
            out.extend(self._score_batch(batch))
        return out

    def _score_batch(self, batch: list[tuple[Any, Any]]) -> list[float]:
        if not self.process:
            sequences, positions = zip(*(self._outcome_sequence(p, c) for p, c in batch), strict=True)
            return score_positions(self.model, sequences, positions, row_tokens=self.row_tokens,
                                   pad_token_id=self.tokenizer.pad_token_id).cpu().tolist()
        steps = self._step_scores_batch([(p, c, True) for p, c in batch])
        width = max(max((len(s) for s in steps), default=0), 1)
        padded = torch.zeros(len(batch), width)
        mask = torch.arange(width)[None, :] < torch.tensor([len(s) for s in steps])[:, None]
        padded[mask] = torch.tensor([x for s in steps for x in s], dtype=padded.dtype)
        return self.aggregate(padded, mask).tolist()

    def _step_scores_batch(self, batch: list[tuple[Any, Any, bool]]) -> list[list[float]]:
        sequences, positions = zip(*(self._process_sequence(p, c, f) for p, c, f in batch), strict=True)
        # a process model may have nothing to read for an empty completion; keep one position so the
        # sequence still packs, and drop its score below
        read = [pos or [len(ids) - 1] for ids, pos in zip(sequences, positions, strict=True)]
        scores = score_positions(self.model, sequences, read, row_tokens=self.row_tokens,
                                 pad_token_id=self.tokenizer.pad_token_id).cpu()
        return [torch.sigmoid(s).tolist() if p else [] for s, p in zip(scores.split([len(r) for r in read]), positions,
                                                                         strict=True)]

    @torch.no_grad()
    def step_scores(self, prompts: Sequence[Any], completions: Sequence[str],
                    finished: Sequence[bool] | None = None) -> list[list[float]]:
        """A process model's score of every step (sigmoid of the head where the step ends), per completion.

        The steps are the completion cut at the separator the model was trained with (empty pieces
        dropped). The last step of a ``finished`` completion (all of them by default) is read at eos,
        as the model was trained; of an open one (a partial trace in step-level search) at the separator.
        """
        if not self.process:
            raise ValueError("step scores come from a process reward model; this one is an outcome model")
        finished = [True] * len(completions) if finished is None else list(finished)
        if not len(prompts) == len(completions) == len(finished):
            raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions and {len(finished)} "
                             "finished flags")
        batch = list(zip(prompts, completions, finished, strict=True))
        out: list[list[float]] = []
        for start in range(0, len(batch), self.batch_size):
            out.extend(self._step_scores_batch(batch[start:start + self.batch_size]))
        return out


_SCORERS: dict[tuple, RewardModelScorer] = {}


@REWARD_FUNCTIONS.register("reward_model")
def reward_model(prompts: Sequence[Any], completions: Sequence[Any], *, path: str, batch_size: int = 32,
                 process: bool | None = None, aggregation: str | None = None, chat: bool = False,
                 **columns: Any) -> list[float]:
    """Reward function for configs: ``{name: reward_model, kwargs: {path: ...}}``.

    The model at ``path`` is loaded on first use and kept for later calls.
    """
    key = (str(path), batch_size, process, aggregation, chat)
    if key not in _SCORERS:
        _SCORERS[key] = RewardModelScorer(path, batch_size=batch_size, process=process, aggregation=aggregation,
                                          chat=chat)
    return _SCORERS[key].score(prompts, completions)
