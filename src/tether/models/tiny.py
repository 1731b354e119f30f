"""The offline default: a Llama-architecture model built from a config and a character tokenizer.

Nothing is downloaded. ``build_tiny(size, seed)`` is deterministic: the same seed gives the
same weights, and ``save_tiny`` writes the Hugging Face layout (safetensors + tokenizer.json +
chat template) so ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
reload it with no network.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
EXTRA_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

SIZES: dict[str, dict[str, int]] = {
    # ~0.9M parameters: learns 2-3 digit arithmetic with a reasoning trace on a laptop CPU.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4),
    # ~26M parameters.
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8),
}


def character_vocab() -> list[str]:
    """Specials first (pad=0, bos=1, eos=2, unk=3), role and tag tokens, then printable ASCII."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    return [PAD, BOS, EOS, UNK, *ROLE_TOKENS, *EXTRA_TOKENS, *chars]


def build_tokenizer(max_length: int = 512) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built with the ``tokenizers`` library.

    A BPE model with no merges splits text into single characters; role and tag
    tokens are added tokens so ``<think>`` is one id.
    """
    vocab = {tok: i for i, tok in enumerate(character_vocab())}
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=False))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([PAD, BOS, EOS, UNK, *ROLE_TOKENS])
    backend.add_tokens(list(EXTRA_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=max_length,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(size: str = "tiny", vocab_size: int | None = None, max_position_embeddings: int = 512,
                **overrides: int) -> LlamaConfig:
    """The ``LlamaConfig`` of a built-in size; ``overrides`` (``num_hidden_layers=2``, ...) replace its
    dimensions, e.g. for a shallower distillation student."""
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; valid sizes: {', '.join(SIZES)}")
    dims = {**SIZES[size], **overrides}
    unknown = sorted(set(overrides) - set(LlamaConfig().to_dict()))
    if unknown:
        raise ValueError(f"unknown LlamaConfig field(s) {unknown} in the model's config_overrides")
    dims.setdefault("num_key_value_heads", dims["num_attention_heads"])
    return LlamaConfig(
        vocab_size=vocab_size or len(character_vocab()),
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **dims,
    )


def build_tiny(size: str = "tiny", seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None,
               **overrides: int) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build the tiny model and its tokenizer deterministically from ``seed`` (``overrides``: see
    :func:`tiny_config`); ``tokenizer`` replaces the character tokenizer (the vocabulary is its length)."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = tiny_config(size, vocab_size=len(tokenizer), **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model, tokenizer


def save_tiny(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Build and save the tiny model + tokenizer in the Hugging Face layout; returns the path."""
    path = Path(path)
    model, tokenizer = build_tiny(size, seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
