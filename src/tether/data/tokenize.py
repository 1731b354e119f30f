"""Tokenisation with loss masks: which tokens a model is trained on.

Labels follow the Hugging Face convention: aligned with ``input_ids`` (the trainer shifts),
``-100`` on tokens not trained on. ``labels[0]`` is always ``-100`` since nothing predicts
the first token. Masks are built from spans, never by comparing token ids with the pad id,
so a tokenizer whose pad equals its eos still learns the eos.

- raw ``prompt_completion``: ``bos + prompt + completion + eos``; loss on completion + eos.
  Prompt and completion are tokenised separately and concatenated, so the prompt tokens are
  exactly what ``tokenize_prompt`` feeds a generator.
- conversational records (``chat``, or ``prompt_completion`` with message lists): the chat
  template; loss on the assistant turns (of the completion only, for prompt_completion)
  including the end-of-turn tokens the template writes after them. Each assistant span is
  found by rendering the conversation up to that turn (with the generation prompt) and up to
  its end, and checking that both token prefixes agree with the full conversation's tokens;
  a template that rewrites earlier turns (e.g. strips old reasoning) fails loudly.
  If the conversation ends with a trained assistant turn that the template closes without
  the eos token (its own end-of-turn marker, or nothing), eos is appended there and learned.
- truncation cuts on the right (``overflow="truncate"``); an example with no loss token left
  is dropped. ``overflow="drop"`` drops every over-long example.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tether.data.schemas import DataError

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


@dataclass
class TokenizedExample:
    """One training sequence. ``labels`` = ``input_ids`` with -100 where no loss is taken."""

    input_ids: list[int]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Targets after the HF shift (the first label never is one)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


# ---------------------------------------------------------------- tokenizer helpers


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids, no special tokens added (each piece of a prompt, turn or observation alone)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _bos(tokenizer: Any) -> list[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _eos(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; tether appends and trains on eos")
    return tokenizer.eos_token_id


def _render(tokenizer: Any, messages: list[dict], *, generation_prompt: bool, tools: Any = None) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("conversational records need a tokenizer with a chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja2's TemplateError, or whatever the template's own code raised
        raise ValueError(f"the tokenizer's chat template cannot render these messages "
                         f"({type(err).__name__}: {err})") from err
    return encode_text(tokenizer, text)


def _is_prefix(prefix: list[int], full: list[int]) -> bool:
    return len(prefix) <= len(full) and full[: len(prefix)] == prefix


# ---------------------------------------------------------------- sft


def _chat_example(messages: list[dict], trainable: Sequence[int], tokenizer: Any, tools: Any) -> TokenizedExample:
    """Tokens of the whole conversation; labels on the assistant messages at ``trainable``."""
    full = _render(tokenizer, messages, generation_prompt=False, tools=tools)
    labels = [IGNORE_INDEX] * len(full)
    eos = _eos(tokenizer)
    start = end = 0
    for i in trainable:
        if i == 0:
            raise ValueError("the conversation starts with an assistant message; there is no prefix "
                             "to locate its start in the chat template (prepend a system or user message)")
        start_ids = _render(tokenizer, messages[:i], generation_prompt=True, tools=tools)
        end_ids = _render(tokenizer, messages[: i + 1], generation_prompt=False, tools=tools)
        if not (_is_prefix(start_ids, end_ids) and _is_prefix(end_ids, full)):
            raise ValueError(f"the chat template is not prefix-stable at message {i}: rendering the "
                             "conversation up to that turn does not give a prefix of the full rendering, "
                             "so the assistant tokens cannot be located")
        start, end = len(start_ids), len(end_ids)
        labels[start:end] = full[start:end]
    if trainable and trainable[-1] == len(messages) - 1 and eos not in full[start:end]:
        # The template closes turns with its own marker (or nothing): teach the model to stop.
        full, labels = [*full[:end], eos, *full[end:]], [*labels[:end], eos, *labels[end:]]
    labels[0] = IGNORE_INDEX
    return TokenizedExample(full, labels)


def _sft_example(record: dict, tokenizer: Any) -> TokenizedExample:
    if "segments" in record:  # each piece tokenised on its own, as the agent loop appends them
        ids = _bos(tokenizer)
        labels = [IGNORE_INDEX] * len(ids)
        for piece in record["segments"]:
            piece_ids = encode_text(tokenizer, piece["text"])
            ids, labels = ids + piece_ids, labels + (piece_ids if piece["loss"] else [IGNORE_INDEX] * len(piece_ids))
        if record.get("eos", True):
            ids, labels = [*ids, _eos(tokenizer)], [*labels, _eos(tokenizer)]
        return TokenizedExample(ids, labels)
    if "messages" in record:
        messages = record["messages"]
        trainable = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return _chat_example(messages, trainable, tokenizer, record.get("tools"))
    if "prompt" not in record or "completion" not in record:
        raise ValueError(f"an sft record needs 'messages' or 'prompt' + 'completion'; got fields {sorted(record)}")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list):
        messages = [*prompt, *completion]
        trainable = [i for i, m in enumerate(messages) if i >= len(prompt) and m["role"] == "assistant"]
        return _chat_example(messages, trainable, tokenizer, record.get("tools"))
    prompt_ids = _bos(tokenizer) + encode_text(tokenizer, prompt)
    # a ``partial`` completion (one step of a longer answer, as Step-DPO's) does not end the answer: no eos
    completion_ids = [*encode_text(tokenizer, completion), *([] if record.get("partial") else [_eos(tokenizer)])]
    labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    labels[0] = IGNORE_INDEX
    return TokenizedExample(prompt_ids + completion_ids, labels)


def _fit(example: TokenizedExample, max_length: int, overflow: str) -> tuple[TokenizedExample | None, str]:
    """Apply the overflow policy; the status is "ok", "truncated" or "dropped"."""
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
    status = "ok"
    if len(example) > max_length:
        if overflow == "drop":
            return None, "dropped"
        example = TokenizedExample(example.input_ids[:max_length], example.labels[:max_length])
        status = "truncated"
    if example.num_loss_tokens == 0:
        return None, "dropped"
    return example, status


def tokenize_sft(record: dict, tokenizer: Any, *, max_length: int,
                 overflow: Literal["truncate", "drop"] = "truncate") -> TokenizedExample | None:
    """Tokenise a ``prompt_completion``, ``chat`` or ``segments`` record with its loss mask; None when dropped."""
    example, _ = _fit(_sft_example(record, tokenizer), max_length, overflow)
    return example


# ---------------------------------------------------------------- text and prompts


def tokenize_text(record: dict, tokenizer: Any, *, max_length: int) -> list[TokenizedExample]:
    """Pre-training text: ``bos + text + eos``, loss on everything but bos.

    A long text is split into chunks of at most ``max_length`` tokens that overlap by one
    token: the last token of a chunk is the (unscored) first token of the next, so every
    token but bos is a target exactly once, as in the unsplit sequence.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    ids = _bos(tokenizer) + encode_text(tokenizer, record["text"]) + [_eos(tokenizer)]
    chunks = []
    for start in range(0, max(len(ids) - 1, 1), max_length - 1):
        piece = ids[start : start + max_length]
        if len(piece) >= 2:
            chunks.append(TokenizedExample(piece, [IGNORE_INDEX, *piece[1:]]))
    return chunks


def tokenize_prompt(prompt: str | list[dict], tokenizer: Any, *, tools: Any = None) -> list[int]:
    """Prompt ids for generation: ``bos + prompt`` for text, the chat template with the
    generation prompt for a list of messages."""
    if isinstance(prompt, list):
        return _render(tokenizer, prompt, generation_prompt=True, tools=tools)
    return _bos(tokenizer) + encode_text(tokenizer, prompt)


def tokenize_prompts(prompts: Sequence[str | list[dict]], tokenizer: Any, *, chat: bool = False) -> list[list[int]]:
    """Prompt ids for a batch; with ``chat``, a plain-string prompt becomes one user message
    (message lists always go through the chat template as they are)."""
    return [tokenize_prompt([{"role": "user", "content": p}] if chat and isinstance(p, str) else p, tokenizer)
            for p in prompts]


# ---------------------------------------------------------------- datasets


def tokenize_dataset(records: Sequence[dict], tokenizer: Any, *, kind: Literal["sft", "text"],
                     max_length: int, overflow: Literal["truncate", "drop"] = "truncate",
                     ) -> tuple[list[TokenizedExample], dict[str, int]]:
    """Tokenise every record; returns the examples and counts.

    Stats: ``records`` in, ``examples`` out, ``truncated``, ``dropped`` (over-long with
    ``overflow="drop"``, or no loss token left), ``split`` (texts cut into several chunks),
    ``tokens`` and ``loss_tokens`` over the kept examples.
    """
    if kind not in ("sft", "text"):
        raise ValueError(f"kind must be 'sft' or 'text', got {kind!r}")
    stats = dict(records=len(records), examples=0, truncated=0, dropped=0, split=0, tokens=0, loss_tokens=0)
    examples: list[TokenizedExample] = []
    for number, record in enumerate(records, start=1):
        try:
            if kind == "text":
                chunks = tokenize_text(record, tokenizer, max_length=max_length)
                stats["split"] += len(chunks) > 1
                stats["dropped"] += not chunks
            else:
                example, status = _fit(_sft_example(record, tokenizer), max_length, overflow)
                stats[status] = stats.get(status, 0) + 1
                chunks = [example] if example is not None else []
        except Exception as err:  # a template or tokenizer that does not fit this record
            raise DataError(f"record {number}: cannot tokenise it ({err})", row=number) from err
        examples.extend(chunks)
    stats.pop("ok", None)
    stats["examples"] = len(examples)
    stats["tokens"] = sum(len(e) for e in examples)
    stats["loss_tokens"] = sum(e.num_loss_tokens for e in examples)
    # over-long records are always reported (a warning), not only with -v
    report = log.warning if stats["truncated"] or stats["dropped"] else log.info
    report("tokenised %d %s records -> %d examples (%d truncated, %d dropped, %d split) at max_length %d",
             stats["records"], kind, stats["examples"], stats["truncated"], stats["dropped"], stats["split"],
             max_length)
    return examples, stats


def split_steps(completion: str, separator: str) -> list[str]:
    """A generated completion cut into steps at ``separator``; empty or blank pieces are dropped."""
    return [s for s in completion.split(separator) if s.strip()]


def step_end_tokens(token_texts: Sequence[str], separator: str) -> list[int]:
    """The index of the token each step of a completion ends at, from each token's decoded text.

    The steps are those of :func:`split_steps` (the text cut at ``separator``, blank pieces dropped), so
    the k-th index belongs to the k-th score a process reward model gives the completion. A step ends at
    the token holding the last character of the separator after it; the last step, with no separator
    after it, at the completion's last token (its eos included). Exact when the tokens' texts join into
    the completion's text (character and byte-level tokenizers; a token that decodes to a partial
    character is counted where its text lands).
    """
    text = "".join(token_texts)
    owner = [i for i, piece in enumerate(token_texts) for _ in piece]
    ends, position = [], 0
    for piece in text.split(separator):
        end = position + len(piece)
        if piece.strip():
            ends.append(owner[end + len(separator) - 1] if end < len(text) else len(token_texts) - 1)
        position = end + len(separator)
    return ends


def step_sequence(prompt: Any, steps: Sequence[str], tokenizer: Any, separator: str, *,
                  finished: bool = True) -> tuple[list[int], list[int]]:
    """Ids of ``prompt + step_1 + sep + ... + step_n + end`` and the position each step's score is read at.

    The prompt is tokenised as for generation (``bos + prompt``, or the chat template with the
    assistant header); each step and separator separately, so the layout is the same for every
    record and for the scorer. Every step but the last is followed by the separator; the last one by
    eos when the trace is ``finished`` (the completion stopped there, so its last step is judged as
    the end of the solution: a trace that stops without an answer can be told from one that goes
    on), else by the separator (an open trace, as in step-level search). A tokenizer without an eos
    token ends every trace with the separator.
    """
    ids = tokenize_prompt(prompt, tokenizer)
    sep = list(tokenizer(separator, add_special_tokens=False)["input_ids"])
    if not sep:
        raise ValueError(f"the step separator {separator!r} tokenises to nothing")
    eos = getattr(tokenizer, "eos_token_id", None)
    end = [eos] if finished and eos is not None else sep
    positions = []
    for index, step in enumerate(steps):
        ids.extend(tokenizer(step, add_special_tokens=False)["input_ids"])
        ids.extend(end if index == len(steps) - 1 else sep)
        positions.append(len(ids) - 1)
    return ids, positions
