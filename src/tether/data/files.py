"""Files written whole or not at all: written under a temporary sibling name, then renamed over the target.

A reader (or a resumed run) sees the old file or the new one, never half of one; a crash leaves at most
a ``*.tmp`` behind. Checkpoint directories have their own, fsync-ed protocol (``tether.trainers.checkpoint``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_atomic(path: str | Path, write: Callable[[Path], None], *, concurrent: bool = False) -> Path:
    """``write(tmp)`` then rename ``tmp`` to ``path`` (its folder created). ``concurrent``: the temporary name
    carries the process and thread, for writers that may race on one path (an endpoint's reply cache)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = f".{os.getpid()}.{threading.get_ident()}.tmp" if concurrent else ".tmp"
    tmp = path.with_name(path.name + suffix)
    write(tmp)
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | Path, text: str, *, concurrent: bool = False) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), concurrent=concurrent)


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(data, indent=indent))


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict]) -> Path:
    """One JSON object per line."""
    return write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of a jsonl file (blank lines skipped)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def torch_save_atomic(path: str | Path, obj: Any) -> Path:
    import torch

    return write_atomic(path, lambda tmp: torch.save(obj, tmp))
