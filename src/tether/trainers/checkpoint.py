"""Checkpoints that survive a kill: write to a temporary name, then rename.

Layout of a stage directory::

    <stage>/checkpoints/step-000050/   model (save_pretrained, safetensors) + tokenizer
                                        + trainer_state.pt (optimizer, scheduler, RNG, step, extra)
                                        + manifest.json (size and sha256 of every other file)
    <stage>/config.json, model.safetensors, tokenizer.json, ...   the final model
    <stage>/stage.json                  written last: marks the stage finished

Only names ``step-<digits>`` are complete checkpoints: a write in progress is ``step-N.tmp``, a
checkpoint being replaced or pruned is renamed to ``step-N.old.tmp`` before it is deleted, and one
that failed verification on resume is set aside as ``step-N.corrupt``. The manifest is written
inside the ``.tmp`` directory before the rename, so a checkpoint is never visible without it, and
:func:`verify_checkpoint` detects a file that was later truncated, changed or deleted.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from tether.data.files import write_json_atomic
from tether.models.loading import no_progress_bars

STEP_PREFIX = "step-"
TMP_SUFFIX = ".tmp"
STATE_FILE = "trainer_state.pt"
DONE_FILE = "stage.json"
MANIFEST_FILE = "manifest.json"
CORRUPT_SUFFIX = ".corrupt"
# Fault injection for the kill-and-resume tests: sleep this many seconds in the middle of every
# checkpoint write (between the weights and the trainer state). Unset in normal use.
FAULT_DELAY_ENV = "TETHER_FAULT_SAVE_DELAY"
_STEP_NAME = re.compile(re.escape(STEP_PREFIX) + r"(\d+)")

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read back intact; the message names the directory and file."""


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
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):  # its attributes may proxy the model's
        return model.module
    return model.module if hasattr(model, "module") and not hasattr(model, "peft_config") else model


def save_weights(model: torch.nn.Module, tokenizer: Any, path: Path,
                 state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``save_pretrained`` (+ tokenizer); ``state_dict``: the weights to write, when the model's own
    parameters are shards (FSDP2: gathered by ``parallel.full_state_dict``)."""
    model = unwrap(model)
    with no_progress_bars():
        model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
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
        try:
            state.update(load_file(file))
        except Exception as err:  # safetensors raises its own error types on a damaged file
            raise CheckpointError(f"checkpoint {path}: cannot read {file.name}: {err}") from err
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
    done = [p for p in root.iterdir() if _STEP_NAME.fullmatch(p.name) and (p / STATE_FILE).exists()]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(STEP_PREFIX):])


def newest_at(stage_dir: Path, step: int) -> Path | None:
    """The newest complete checkpoint if it was written at ``step``, else None."""
    checkpoints = list_checkpoints(stage_dir)
    return checkpoints[-1] if checkpoints and checkpoint_step(checkpoints[-1]) == step else None


# ---- integrity -------------------------------------------------------------------------------------
def _file_digest(path: Path, *, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        if sync:  # on disk before the rename publishes the checkpoint (power loss, not just a kill)
            os.fsync(f.fileno())
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # not every file system can sync a directory
        pass
    finally:
        os.close(fd)


def _checkpoint_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _side_by_side(function: Callable[[Any], Any], items: list[Any]) -> Iterator[Any]:
    """``function`` over ``items`` in a few threads (hashlib and fsync release the GIL), the results in
    the order of ``items``; work not yet started is cancelled when the caller stops early."""
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(items), os.cpu_count() or 1, 4)))
    try:
        yield from pool.map(function, items)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def write_manifest(directory: Path) -> None:
    """``manifest.json``: size and sha256 of every file under ``directory``, each synced to disk first.
    The files are hashed side by side."""
    paths = _checkpoint_files(directory)
    digests = list(_side_by_side(lambda p: _file_digest(p, sync=True), paths))
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": digest}
             for p, digest in zip(paths, digests, strict=True)}
    with open(directory / MANIFEST_FILE, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def verify_checkpoint(directory: Path) -> bool:
    """Check every file against ``manifest.json``; raises :class:`CheckpointError` naming the first
    missing, truncated or changed file. Returns False (with a warning) for a checkpoint without a
    manifest, which was written by an older version and cannot be checked."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.exists():
        log.warning("checkpoint %s has no %s (an older format); loading it unverified", directory, MANIFEST_FILE)
        return False
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {directory}: {MANIFEST_FILE} is unreadable ({err})") from None

    def problem(item: tuple[str, dict]) -> str | None:
        name, entry = item
        path = directory / name
        if not path.is_file():
            return f"file {name!r} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"file {name!r} is {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
        if _file_digest(path) != entry["sha256"]:
            return f"file {name!r} does not match its sha256 in {MANIFEST_FILE} (corrupted)"
        return None

    # checked side by side; the first problem in the manifest's order is the one reported
    for found in _side_by_side(problem, list(files.items())):
        if found is not None:
            raise CheckpointError(f"checkpoint {directory}: {found}")
    return True


def set_aside(checkpoint: Path) -> Path:
    """Rename a checkpoint that failed verification to ``step-N.corrupt`` (kept for inspection,
    never loaded, never deleted by tether)."""
    target = checkpoint.with_name(checkpoint.name + CORRUPT_SUFFIX)
    n = 1
    while target.exists():
        target = checkpoint.with_name(f"{checkpoint.name}{CORRUPT_SUFFIX}{n}")
        n += 1
    os.replace(checkpoint, target)
    return target


def _discard(path: Path) -> None:
    """Delete a directory without ever leaving it half-deleted under a complete checkpoint's name."""
    doomed = path.with_name(path.name + ".old" + TMP_SUFFIX)
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fault_delay() -> None:
    delay = os.environ.get(FAULT_DELAY_ENV)
    if delay:
        time.sleep(float(delay))


# ---- save and load ---------------------------------------------------------------------------------
def save_without_zip_checksums(obj: Any, path: Path) -> None:
    """``torch.save`` without the CRC-32 of each zip record: the manifest's sha256 already covers the file,
    and the CRC was a fifth of a checkpoint of the 26M-parameter model. ``torch.load`` reads it as usual."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, path)
    finally:
        torch.serialization.set_crc32_options(before)


def save_checkpoint(stage_dir: Path, step: int, model: torch.nn.Module, tokenizer: Any,
                    trainer_state: dict[str, Any], *, keep: int = 2,
                    write_model: Callable[[Path], None] | None = None) -> Path:
    """Write ``step-N`` atomically (a ``.tmp`` directory with its manifest, then a rename) and prune
    to the ``keep`` newest. A failed write (disk full, read-only) removes its ``.tmp`` and raises
    :class:`CheckpointError`; earlier checkpoints are untouched."""
    root = checkpoint_dir(stage_dir)
    final = root / f"{STEP_PREFIX}{step:06d}"
    tmp = root / (final.name + TMP_SUFFIX)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*" + TMP_SUFFIX):  # left by a killed write or prune
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir()
        if write_model is None:
            save_weights(model, tokenizer, tmp)
        else:  # another layout of the model, e.g. FSDP2's DCP shards (parallel.save_sharded_checkpoint)
            write_model(tmp)
        _fault_delay()
        save_without_zip_checksums(trainer_state, tmp / STATE_FILE)
        write_manifest(tmp)
    except Exception as err:  # ENOSPC and friends surface as OSError, RuntimeError or a safetensors error
        shutil.rmtree(tmp, ignore_errors=True)
        previous = list_checkpoints(stage_dir)
        kept = f"the last checkpoint, {previous[-1]}, is intact" if previous else "no earlier checkpoint exists"
        full = disk_full_reason(err, root, need_bytes=_tree_bytes(previous[-1]) if previous else 0)
        cause = f"{type(err).__name__}: {err}"
        cause = f"{full}: {cause}; free space, then resume with --resume" if full else cause
        raise CheckpointError(f"could not write checkpoint {final} ({cause}); {kept}") from err
    if final.exists():
        _discard(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(stage_dir)[:-keep]:
        _discard(old)
    return final


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL_BYTES = 64 * 2**20


def disk_full_reason(err: BaseException, path: Path, *, need_bytes: int = 0) -> str | None:
    """``"the disk is full (N MB free on PATH)"`` when ``err`` is, or was caused by, a full disk: ENOSPC /
    EDQUOT anywhere in its chain, or an error without an errno (torch's zip writer reports ``unexpected
    pos``, safetensors its own text) while the file system has less free than ``need_bytes`` or 64 MB.
    None otherwise."""
    chain, seen = err, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno in DISK_FULL_ERRNOS:
            break
        chain = chain.__cause__ or chain.__context__
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        free = None
    if chain is None and ((isinstance(err, OSError) and err.errno is not None)
                          or free is None or free >= max(need_bytes, NEARLY_FULL_BYTES)):
        return None
    where = f" ({free / 2**20:.0f} MB free on {path})" if free is not None else ""
    return f"the disk is full{where}"


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as err:  # a damaged zip / pickle raises from deep inside torch
        raise CheckpointError(f"checkpoint {checkpoint}: cannot read {STATE_FILE}: {err}") from err


def check_output_dir(path: Path, *, need_bytes: int = 0) -> None:
    """Fail before training if ``path`` cannot be created and written, or its file system has less
    than ``need_bytes`` free (about one checkpoint); raises :class:`CheckpointError` saying which."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}{TMP_SUFFIX}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise CheckpointError(f"output directory {str(path)!r} is not writable ({err.strerror or err}); "
                              "choose another with --out") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise CheckpointError(f"output directory {str(path)!r} has {free / 2**20:.1f} MiB free, less than one "
                              f"checkpoint needs (about {need_bytes / 2**20:.1f} MiB)")


def export_final(stage_dir: Path, model: torch.nn.Module, tokenizer: Any, *, merge_lora: bool = True,
                 state_dict: dict[str, torch.Tensor] | None = None, checkpoint: Path | None = None) -> None:
    """Write the final model into ``stage_dir`` itself (Hugging Face layout), file by file atomically.

    ``checkpoint``: a checkpoint of this model holding exactly these weights (the trainer's last, written at
    the final step). Its model files are hard-linked instead of serialised again, which saves the time and
    the disk space of a second copy; a merged LoRA model, gathered FSDP2 weights (``state_dict``) or a file
    system without hard links fall back to writing."""
    tmp = stage_dir / (".final" + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    model = unwrap(model)
    merge = merge_lora and hasattr(model, "merge_and_unload")
    linkable = checkpoint is not None and state_dict is None and not merge
    if not (linkable and _link_model_files(checkpoint, tmp)):
        if merge:
            # merge into a copy so the live peft model stays usable
            import copy

            model = copy.deepcopy(model).merge_and_unload()
        save_weights(model, tokenizer, tmp, state_dict)
    for file in tmp.iterdir():
        target = stage_dir / file.name
        if target.exists() and os.path.samefile(file, target):  # exported from this checkpoint before (a
            file.unlink()  # resumed, finished stage): renaming one link of a file onto another does nothing
        elif file.is_dir() and target.is_dir():  # a folder (PPO's value/) exported before: a rename cannot
            old = stage_dir / (".old-" + file.name + TMP_SUFFIX)  # replace a non-empty folder, so set it aside
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
            os.replace(file, target)
            shutil.rmtree(old)
        else:
            os.replace(file, target)
    tmp.rmdir()


def _link_model_files(checkpoint: Path, target: Path) -> bool:
    """Hard-link the model and tokenizer files of ``checkpoint`` (every file its manifest lists but the
    trainer state) into a new directory ``target``; False, leaving no ``target``, when that cannot be done
    (no manifest, a nested file, a file system without hard links)."""
    try:
        names = list(json.loads((checkpoint / MANIFEST_FILE).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    names = [n for n in names if n != STATE_FILE]
    if not names or any("/" in n for n in names):
        return False
    try:
        target.mkdir()
        for name in names:
            os.link(checkpoint / name, target / name)
    except OSError as err:
        log.info("could not hard-link %s into the export (%s); writing the weights again", checkpoint, err)
        shutil.rmtree(target, ignore_errors=True)
        return False
    return True


def mark_done(stage_dir: Path, info: dict[str, Any]) -> None:
    """Write ``stage.json``: the stage finished (written last, whole or not at all)."""
    write_json_atomic(stage_dir / DONE_FILE, info)


def read_done(stage_dir: Path) -> dict[str, Any] | None:
    path = stage_dir / DONE_FILE
    return json.loads(path.read_text()) if path.exists() else None
