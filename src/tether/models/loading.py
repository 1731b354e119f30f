"""Load any causal LM (local path, hub id, or the built-in offline tiny models), with LoRA through peft."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from tether.models.tiny import SIZES, build_tiny

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "tether/"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class ModelLoadError(ValueError):
    """A model or tokenizer that cannot be loaded (not a model directory, damaged files, a tokenizer that
    does not fit the model); the message names the path and the reason."""


def check_model_source(name_or_path: str) -> None:
    """Fail early, with a clear message, on a path that cannot hold a model: missing (and not a hub id
    such as ``org/name``), a file, or a directory without ``config.json``."""
    path = Path(name_or_path)
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {name_or_path!r} is a file; give a directory in the Hugging Face "
                                 "layout (config.json, weights, tokenizer files) or a hub id")
        if not (path / "config.json").exists():
            hint = (" (a tether stage that has not finished? its checkpoints are in checkpoints/)"
                    if (path / "checkpoints").is_dir() else "")
            raise ModelLoadError(f"model path {name_or_path!r} has no config.json: not a Hugging Face model "
                                 f"directory{hint}")
    elif not _HUB_ID.fullmatch(name_or_path):
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist (and is not a hub id like 'org/name')")
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
    """``auto``: CUDA when available. Under torchrun a bare ``cuda`` is this rank's GPU (``LOCAL_RANK``)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None and "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return resolved


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
    check_model_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception as err:  # OSError, ValueError, JSON and tokenizers errors, depending on what is wrong
        raise ModelLoadError(f"cannot load a tokenizer from {name_or_path!r}: {type(err).__name__}: {err}") from err
    if isinstance(tokenizer, bool) or not callable(tokenizer):
        raise ModelLoadError(f"{name_or_path!r} holds no usable tokenizer (got {type(tokenizer).__name__})")
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
    config_overrides: dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``name_or_path`` is a local directory, a hub id, or a built-in offline model
    (``tether/tiny`` ~1M parameters, ``tether/small`` ~26M) built from ``seed``, whose
    dimensions ``config_overrides`` may change (``{"num_hidden_layers": 2}``).
    ``lora`` (keys of ``peft.LoraConfig``) wraps the model in a LoRA adapter.
    """
    size = builtin_size(name_or_path)
    if config_overrides and not size:
        raise ValueError(f"config_overrides apply to the built-in models only, not to {name_or_path!r}")
    if size:
        model, tok = build_tiny(size, seed=seed, **(config_overrides or {}))
        tokenizer = tokenizer or tok
        if dtype not in ("auto", "float32"):
            model = model.to(resolve_dtype(dtype))
    else:
        check_model_source(name_or_path)
        kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        try:
            with no_progress_bars():
                model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        except Exception as err:  # OSError, ValueError, safetensors and JSON errors, depending on what is wrong
            raise ModelLoadError(f"cannot load a causal LM from {name_or_path!r}: {type(err).__name__}: "
                                 f"{err}") from err
        tokenizer = tokenizer or load_tokenizer(name_or_path, trust_remote_code=trust_remote_code)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            # a documented recovery: a tokenizer that added tokens (e.g. our pad) gets rows for them
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
        check_tokenizer_fits(model, tokenizer)
        return model, tokenizer
    loader = loader or load_model
    extra = {"config_overrides": cfg.config_overrides} if getattr(cfg, "config_overrides", None) else {}
    return loader(str(model or cfg.name_or_path), dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
                  lora=cfg.lora.model_dump() if cfg.lora else None, trust_remote_code=cfg.trust_remote_code,
                  attn_implementation=cfg.attn_implementation, **extra)


def check_tokenizer_fits(model: Any, tokenizer: Any) -> None:
    """A tokenizer whose ids run past the model's embedding table would fail at the first forward pass
    with an index error; say so before training."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        return
    if len(tokenizer) > rows:
        raise ModelLoadError(f"the tokenizer has {len(tokenizer)} tokens but the model's embedding table has "
                             f"{rows} rows: pass the model's own tokenizer, or call "
                             "model.resize_token_embeddings(len(tokenizer)) first")


def apply_lora(model: PreTrainedModel, lora: dict[str, Any]) -> PreTrainedModel:
    """Wrap ``model`` in a peft LoRA adapter; ``lora`` holds ``peft.LoraConfig`` fields."""
    from peft import LoraConfig, get_peft_model

    options = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", **lora}
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **options))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    log.info("LoRA adapter: %d trainable parameters", trainable)
    return peft_model


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off while saving or loading weights: a bar holds tqdm's lock, which is
    shared with forked processes (a ``multiprocessing`` lock); a process killed mid-save or mid-load (SIGKILL,
    out of memory) would keep it held and every related process would wait on it forever at its next one."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | Path,
               *, merge_lora: bool = False) -> None:
    """``save_pretrained`` (safetensors) of the model and tokenizer; LoRA adapters merged if asked."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if merge_lora and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    with no_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode with no trainable parameter: a reference policy."""
    import copy

    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout rate in ``model`` to 0: each ``nn.Dropout``'s ``p`` and each attention module's
    ``attention_dropout`` (which transformers' attention functions read in training mode). Returns how many
    were above 0. The training forward then computes what an eval-mode pass of the same weights computes."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p, changed = 0.0, changed + 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


def own_trainable_weights(model: torch.nn.Module) -> int:
    """Copy every trainable CPU parameter that is a whole storage into fresh memory of its own; returns
    how many were copied. ``from_pretrained`` leaves CPU weights in a copy-on-write mapping of the
    safetensors file, so the first optimiser step writes each 4 KiB page through a page fault: 0.39 s
    for the 26M-parameter built-in model, against 0.025 s for this copy. Values, the ``Parameter``
    objects (and so tied weights and optimiser references) are unchanged; a parameter that is a view of
    a larger storage is left alone, since copying it would untie it from the rest of that storage."""
    copied = 0
    with torch.no_grad():
        for p in model.parameters():
            if (not p.requires_grad or p.device.type != "cpu" or type(p.data) is not torch.Tensor
                    or p.storage_offset() != 0
                    or p.untyped_storage().nbytes() != p.numel() * p.element_size() or not p.is_contiguous()):
                continue
            p.data = p.data.clone()
            copied += 1
    return copied
