"""Checkpoints that survive a kill: write to a temporary name, then rename.

Layout of a stage directory::

    <stage>/checkpoints/step-000050/   model (save_pretrained, safetensors) + tokenizer
                                        + trainer_state.pt (optimizer, scheduler, RNG, step, extra)
    <stage>/config.json, model.safetensors, tokenizer.json, ...   the final model
    <stage>/stage.json                  written last: marks the stage finished
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

STEP_PREFIX = "step-"
TMP_SUFFIX = ".tmp"
STATE_FILE = "trainer_state.pt"
DONE_FILE = "stage.json"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") and not hasattr(model, "peft_config") else model


def save_weights(model: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    model = unwrap(model)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load weights written by ``save_weights`` into ``model`` in place (plain or peft)."""
    model = unwrap(model)
    adapter = path / "adapter_model.safetensors"
    if adapter.exists() and hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no model weights in checkpoint {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")


def checkpoint_dir(stage_dir: Path) -> Path:
    return stage_dir / "checkpoints"


def list_checkpoints(stage_dir: Path) -> list[Path]:
    """Complete checkpoints (never the ``.tmp`` of an interrupted write), oldest first."""
    root = checkpoint_dir(stage_dir)
    if not root.exists():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and not p.name.endswith(TMP_SUFFIX)
            and (p / STATE_FILE).exists()]
    return sorted(done, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def save_checkpoint(stage_dir: Path, step: int, model: torch.nn.Module, tokenizer: Any,
                    trainer_state: dict[str, Any], *, keep: int = 2) -> Path:
    root = checkpoint_dir(stage_dir)
    final = root / f"{STEP_PREFIX}{step:06d}"
    tmp = root / (final.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_weights(model, tokenizer, tmp)
    torch.save(trainer_state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(stage_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)


def export_final(stage_dir: Path, model: torch.nn.Module, tokenizer: Any, *, merge_lora: bool = True) -> None:
    """Write the final model into ``stage_dir`` itself (Hugging Face layout), file by file atomically."""
    tmp = stage_dir / (".final" + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    model = unwrap(model)
    if merge_lora and hasattr(model, "merge_and_unload"):
        # merge into a copy so the live peft model stays usable
        import copy

        model = copy.deepcopy(model).merge_and_unload()
    save_weights(model, tokenizer, tmp)
    for file in tmp.iterdir():
        os.replace(file, stage_dir / file.name)
    tmp.rmdir()


def mark_done(stage_dir: Path, info: dict[str, Any]) -> None:
    tmp = stage_dir / (DONE_FILE + TMP_SUFFIX)
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, stage_dir / DONE_FILE)


def read_done(stage_dir: Path) -> dict[str, Any] | None:
    path = stage_dir / DONE_FILE
    return json.loads(path.read_text()) if path.exists() else None
