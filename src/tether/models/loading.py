"""Load any causal LM (local path, hub id, or the built-in offline tiny models), with LoRA through peft."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tether.models.tiny import SIZES, build_tiny

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "tether/"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def builtin_size(name_or_path: str) -> str | None:
    """``"tether/tiny"`` -> ``"tiny"`` when it names a built-in offline model and no such local path exists."""
    if name_or_path.startswith(BUILTIN_PREFIX) and not Path(name_or_path).exists():
        size = name_or_path[len(BUILTIN_PREFIX):]
        if size not in SIZES:
            raise ValueError(f"unknown built-in model {name_or_path!r}; built-ins: "
                             + ", ".join(BUILTIN_PREFIX + s for s in SIZES))
        return size
    return None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype | str:
    if dtype == "auto":
        return "auto"
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: auto, {', '.join(DTYPES)}") from None


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    if builtin_size(name_or_path):
        from tether.models.tiny import build_tokenizer

        return build_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Reusing EOS as pad would mask the EOS we train on; add a distinct pad token instead.
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return tokenizer


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seed: int = 0,
    lora: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``name_or_path`` is a local directory, a hub id, or a built-in offline model
    (``tether/tiny`` ~1M parameters, ``tether/small`` ~26M) built from ``seed``.
    ``lora`` (keys of ``peft.LoraConfig``) wraps the model in a LoRA adapter.
    """
    size = builtin_size(name_or_path)
    if size:
        model, tok = build_tiny(size, seed=seed)
        tokenizer = tokenizer or tok
        if dtype not in ("auto", "float32"):
            model = model.to(resolve_dtype(dtype))
    else:
        if not Path(name_or_path).exists() and name_or_path.startswith((".", "/")):
            raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
        kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model = model.to(resolve_device(device))
    if lora:
        model = apply_lora(model, lora)
    return model, tokenizer


def resolve_model(model: Any, tokenizer: Any, cfg: Any, *, loader: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a trainer: a loaded pair as given, or loaded by ``loader``
    (default :func:`load_model`) from a path / the ``ModelConfig``'s ``name_or_path`` with its options."""
    if model is not None and not isinstance(model, str | Path):
        if tokenizer is None:
            raise ValueError("pass the tokenizer together with a loaded model")
        return model, tokenizer
    loader = loader or load_model
    return loader(str(model or cfg.name_or_path), dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
                  lora=cfg.lora.model_dump() if cfg.lora else None, trust_remote_code=cfg.trust_remote_code,
                  attn_implementation=cfg.attn_implementation)


def apply_lora(model: PreTrainedModel, lora: dict[str, Any]) -> PreTrainedModel:
    """Wrap ``model`` in a peft LoRA adapter; ``lora`` holds ``peft.LoraConfig`` fields."""
    from peft import LoraConfig, get_peft_model

    options = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", **lora}
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **options))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    log.info("LoRA adapter: %d trainable parameters", trainable)
    return peft_model


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | Path,
               *, merge_lora: bool = False) -> None:
    """``save_pretrained`` (safetensors) of the model and tokenizer; LoRA adapters merged if asked."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if merge_lora and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
