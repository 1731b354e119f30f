"""What keeps a run directory honest: one process at a time (a lock file naming its holder; a stale one, whose
process is gone, is taken over), and a stage reused (skipped when finished, resumed when half done) only
under the configuration it was trained with (``STAGE/stage_config.json``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tether.config.base import ConfigError
from tether.config.common import StageConfig
from tether.data.files import write_json_atomic

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
STAGE_CONFIG_FILE = "stage_config.json"
# Settings that change how a run is watched or kept, never what it trains: a changed one is not a change.
UNTRAINED_KEYS = frozenset({"report_to", "train.progress", "train.log_every", "train.save_every",
                            "train.save_every_minutes", "train.keep_checkpoints"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``run_dir/.lock`` held while a run uses the directory: a second run on it fails at once, naming the
    holder; a lock left by a process that no longer runs (on this host) is taken over with a warning."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)[:300]}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = self._read()
                pid, host = other.get("pid"), other.get("host")
                if isinstance(pid, int) and host == holder["host"] and not _alive(pid):
                    log.warning("taking over the stale lock of %s: process %d (%s) is no longer running",
                                self.path.parent, pid, other.get("command", "?"))
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(f"run directory {self.path.parent} is in use by process {pid} on {host} since "
                                  f"{other.get('started', '?')} ({other.get('command', '?')}): wait for it to "
                                  f"finish, or use another --out (a lock left by a crash on another host: delete "
                                  f"{self.path})") from None
            with os.fdopen(fd, "w") as handle:
                json.dump(holder, handle)
            self.held = True
            return self
        raise ConfigError(f"could not take the lock {self.path}")

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def __exit__(self, *exc: Any) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def stage_settings(cfg: StageConfig, run_dir: Path) -> dict[str, Any]:
    """The stage's resolved configuration as flat ``key.path: value`` pairs, the run directory written as
    ``@run`` (a moved run stays the same run), without :data:`UNTRAINED_KEYS`."""
    root = str(run_dir)

    def relative(value: Any) -> Any:
        if isinstance(value, str) and (value == root or value.startswith(root + os.sep)):
            return "@run" + value[len(root):]
        if isinstance(value, list):
            return [relative(v) for v in value]
        if isinstance(value, dict):
            return {k: relative(v) for k, v in value.items()}
        return value

    flat = _flatten(cfg.model_dump(mode="json"))
    return {k: relative(v) for k, v in flat.items() if k not in UNTRAINED_KEYS}


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


UPSTREAM = "upstream."


def link_upstream(settings: dict[str, dict[str, Any]]) -> None:
    """Add to each stage's settings (in recipe order) an ``upstream.NAME`` digest of the settings of every
    earlier stage it reads (``@run/NAME...``), so a stage whose input stage changed is not reused: the digest
    covers the input's own inputs, so a change anywhere upstream reaches every stage after it."""
    earlier: set[str] = set()
    for name, flat in settings.items():
        reads = {s.split("/")[1] for s in _strings(list(flat.values())) if s.startswith("@run/")}
        for source in sorted(reads & earlier):
            flat[f"{UPSTREAM}{source}"] = settings_digest(settings[source])
        earlier.add(name)


def settings_digest(flat: dict[str, Any]) -> str:
    """A stage's settings as the short digest the stages reading it record (``upstream.NAME``)."""
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_stage_settings(stage_dir: Path, settings: dict[str, Any], config_class: type[StageConfig] | None = None,
                         accepted_inputs: Collection[str] = ()) -> None:
    """ConfigError, in one line naming the changed keys and the ways forward, when the stage was trained (or
    started) under other settings or its input stages were (``link_upstream``); nothing when it was not, or
    when it predates the record (a record without input digests is checked on its own keys only). With
    ``config_class``, a key the record lacks whose value is that field's declared default is no change: a
    field added to tether since, whose default keeps what configurations without it did. The same holds
    for an input stage named in ``accepted_inputs`` (checked already, and accepted): its digest is taken
    of the settings it recorded, so a field added since does not change the input of the stages after it."""
    path = stage_dir / STAGE_CONFIG_FILE
    if not path.exists():
        if (stage_dir / "stage.json").exists():
            log.warning("stage %r in %s predates recorded configurations: it is reused without checking that it was "
                        "trained under this one (delete it to train it again)", stage_dir.name, stage_dir.parent)
        return
    before = json.loads(path.read_text())
    if not any(k.startswith(UPSTREAM) for k in before):
        settings = {k: v for k, v in settings.items() if not k.startswith(UPSTREAM)}
    changed = sorted(k for k in set(before) | set(settings) if before.get(k, "<unset>") != settings.get(k, "<unset>")
                     and not _field_added_or_removed_while_off(k, before, settings)
                     and not (k not in before and _is_declared_default(config_class, k, settings[k]))
                     and not _input_as_trained(stage_dir, k, before, accepted_inputs))
    if not changed:
        return
    shown = ", ".join(f"its input stage {k[len(UPSTREAM):]!r} changed" if k.startswith(UPSTREAM)
                      else f"{k}: {before.get(k, '<unset>')!r} -> {settings.get(k, '<unset>')!r}" for k in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    raise ConfigError(f"stage {stage_dir.name!r} in {stage_dir.parent} was trained under another configuration "
                      f"({shown}{more}): run into a new --out, or delete {stage_dir} (and the stages after it) to "
                      "train it again")


def _input_as_trained(stage_dir: Path, key: str, before: dict[str, Any], accepted: Collection[str]) -> bool:
    """An input stage's digest (``upstream.NAME``) that still matches once taken of the settings that input
    recorded, the input being accepted as trained under today's settings."""
    source = key[len(UPSTREAM):] if key.startswith(UPSTREAM) else None
    record = stage_dir.parent / source / STAGE_CONFIG_FILE if source in accepted else None
    return (record is not None and key in before and record.exists()
            and settings_digest(json.loads(record.read_text())) == before[key])


def _field_added_or_removed_while_off(key: str, before: dict[str, Any], settings: dict[str, Any]) -> bool:
    """A key only one side has, whose value there is off (None, False, empty): a configuration field added to
    (or removed from) tether since the stage trained, left at its off default, which cannot have changed what
    the stage trained. A new field with any other default still counts as a change."""
    if (key in before) == (key in settings):
        return False
    value = before[key] if key in before else settings[key]
    return value is None or value is False or value in ([], {}, "")


def _is_declared_default(config_class: type[StageConfig] | None, key: str, value: Any) -> bool:
    """Whether ``value`` is the default the field at dotted ``key`` declares in ``config_class`` (nested
    configuration classes followed through optional and union annotations)."""
    import typing

    from pydantic import BaseModel

    model: Any = config_class
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = getattr(model, "model_fields", {}).get(part) if model is not None else None
        if field is None:
            return False
        if i == len(parts) - 1:
            default = field.get_default(call_default_factory=True)
            dumped = default.model_dump(mode="json") if isinstance(default, BaseModel) else default
            return json.dumps(dumped, sort_keys=True, default=str) == json.dumps(value, sort_keys=True, default=str)
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return False


def record_stage_settings(stage_dir: Path, settings: dict[str, Any]) -> None:
    """Write the settings a stage is about to train under (kept when it finishes)."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(stage_dir / STAGE_CONFIG_FILE, settings)
