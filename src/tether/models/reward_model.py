"""Reward models: a causal-LM backbone with a scalar head, in the Hugging Face layout.

The model is ``AutoModelForSequenceClassification`` with ``num_labels=1`` (for Llama,
``LlamaForSequenceClassification``: the decoder plus a bias-free linear ``score`` head on the last
hidden state). Saved with ``save_pretrained`` it reloads with
``AutoModelForSequenceClassification.from_pretrained(path)``, and a plain forward returns the
score at the last non-pad token, as Hugging Face users expect.

tether reads scores itself, at chosen token positions of packed rows (``score_positions``): the
last token of each sequence for an outcome reward model, each step separator for a process
reward model. That is the same head on the same hidden states, without padding.

What kind of reward model it is (outcome or process, the step separator, the step-score
aggregation) is stored in its config under ``tether_reward``, so a scorer loading it needs no
other settings.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel
from transformers.utils import logging as hf_logging

from tether.data import PackedSequences, pack_sequences
from tether.models.loading import no_progress_bars

log = logging.getLogger(__name__)

REWARD_INFO_KEY = "tether_reward"
DEFAULT_INFO = {"process": False, "step_separator": "\n", "aggregation": "min"}


def build_tiny_reward_model(size: str = "tiny", seed: int = 0) -> tuple[PreTrainedModel, Any]:
    """The built-in tiny Llama (``tether/tiny``) with a scalar head, from ``seed``."""
    from tether.models.tiny import build_tokenizer, tiny_config

    tokenizer = build_tokenizer()
    config = tiny_config(size, vocab_size=len(tokenizer))
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    return model, tokenizer


def load_reward_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    lora: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    tokenizer: Any = None,
) -> tuple[PreTrainedModel, Any]:
    """A scalar-head reward model and its tokenizer.

    ``name_or_path``: a saved reward model, a causal-LM checkpoint (an SFT stage's output, a hub
    id) whose LM head is dropped and a new score head added (initialised from ``seed``), or
    ``tether/tiny`` / ``tether/small``. ``lora`` (``peft.LoraConfig`` fields) adds a LoRA adapter
    with the score head fully trained (peft's ``SEQ_CLS`` task).
    """
    from tether.models.loading import builtin_size, load_tokenizer, resolve_device, resolve_dtype

    size = builtin_size(name_or_path)
    if size:
        model, tok = build_tiny_reward_model(size, seed=seed)
        tokenizer = tokenizer or tok
        if dtype not in ("auto", "float32"):
            model = model.to(resolve_dtype(dtype))
    else:
        if not Path(name_or_path).exists() and name_or_path.startswith((".", "/")):
            raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        config.num_labels = 1
        kwargs: dict[str, Any] = {"config": config, "dtype": resolve_dtype(dtype),
                                  "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        from_lm = not any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
        verbosity = hf_logging.get_verbosity()
        if from_lm:  # the report would list the dropped LM head and the new score head: expected here
            hf_logging.set_verbosity_error()
        try:
            with torch.random.fork_rng(devices=[]):  # a new score head is initialised from `seed`
                torch.manual_seed(seed)
                with no_progress_bars():
                    model = AutoModelForSequenceClassification.from_pretrained(name_or_path, **kwargs)
        finally:
            hf_logging.set_verbosity(verbosity)
        if from_lm:
            log.info("%s: causal LM checkpoint; LM head dropped, scalar score head initialised (seed %d)",
                     name_or_path, seed)
        tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(resolve_device(device))
    if lora:
        from peft import LoraConfig, get_peft_model

        options = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", **lora}
        model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", **options))
    return model, tokenizer


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForSequenceClassification`` module inside DDP / peft wrappers."""
    if hasattr(model, "module") and not hasattr(model, "peft_config"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def reward_info(model: torch.nn.Module) -> dict[str, Any]:
    """``{"process", "step_separator", "aggregation"}`` stored in the model's config (defaults if absent)."""
    stored = getattr(_base(model).config, REWARD_INFO_KEY, None) or {}
    return {**DEFAULT_INFO, **stored}


def set_reward_info(model: torch.nn.Module, *, process: bool, step_separator: str, aggregation: str) -> None:
    """Record the reward model's kind in its config; ``save_pretrained`` writes it to config.json."""
    setattr(_base(model).config, REWARD_INFO_KEY,
            {"process": process, "step_separator": step_separator, "aggregation": aggregation})


def layout_sequences(sequences: Sequence[Sequence[int]], *, packing: bool, row_tokens: int, pad_token_id: int
                     ) -> tuple[PackedSequences, Tensor | None]:
    """Sequences as model rows: packed padding-free (no attention mask), or one per row, right-padded.

    Returns the rows (``rows[i]`` / ``starts[i]``: where sequence i begins) and the attention mask
    of the padded layout (None when packed).
    """
    if packing:
        return pack_sequences(sequences, row_tokens=row_tokens, pad_token_id=pad_token_id), None
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    positions = torch.arange(width).expand(len(sequences), width).clone()
    rows = PackedSequences(input_ids, positions, torch.arange(len(sequences)), torch.zeros(len(sequences), dtype=torch.long))
    return rows, mask


def token_scores(model: torch.nn.Module, input_ids: Tensor, position_ids: Tensor,
                 attention_mask: Tensor | None = None) -> Tensor:
    """The scalar head at every position: shape (R, L) from ``input_ids`` of shape (R, L).

    Rows may be packed (position ids restarting at 0 per sequence, no attention mask); the
    backbone is called with ``use_cache=False`` so transformers builds the block-diagonal mask.
    """
    base = _base(model)
    backbone = getattr(base, base.base_model_prefix)
    hidden = backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      use_cache=False).last_hidden_state
    return base.score(hidden).squeeze(-1).float()


def score_positions(model: torch.nn.Module, sequences: Sequence[Sequence[int]],
                    positions: Sequence[Sequence[int]], *, row_tokens: int, pad_token_id: int,
                    packing: bool = True) -> Tensor:
    """Head outputs at the given positions of each sequence, in one forward pass (packed by default).

    Args:
        sequences: N token-id lists.
        positions: for each sequence, the (0-based) positions to read, e.g. ``[len - 1]``.

    Returns:
        shape (P,), float32: the scores of sequence 0's positions, then sequence 1's, ...
    """
    if len(sequences) != len(positions):
        raise ValueError(f"{len(sequences)} sequences but {len(positions)} position lists")
    device = next(model.parameters()).device
    rows, mask = layout_sequences(sequences, packing=packing, row_tokens=row_tokens, pad_token_id=pad_token_id)
    scores = token_scores(model, rows.input_ids.to(device), rows.position_ids.to(device),
                          None if mask is None else mask.to(device))
    counts = torch.tensor([len(p) for p in positions])
    row = rows.rows.repeat_interleave(counts)
    cols = rows.starts.repeat_interleave(counts) + torch.tensor([q for p in positions for q in p], dtype=torch.long)
    return scores[row.to(scores.device), cols.to(scores.device)]
