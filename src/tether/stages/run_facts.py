"""``DIR/run.json``: what a report needs to say about how a run was made, none of it a training input.

Each invocation of ``run_recipe`` on the directory appends ``{"command", "started", "ended", "status",
"versions", "commit"}`` (``status``: running, finished, interrupted or failed), and every stage's
wall-clock seconds are summed over invocations in ``stage_seconds``. Nothing here feeds back into
training, so ``metrics.jsonl`` and the weights stay functions of the configuration and seed.
"""

from __future__ import annotations

import platform
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from importlib import metadata
from pathlib import Path

from tether.data.files import write_json_atomic
from tether.report.read import RUN_FACTS, read_run_facts

PACKAGES = ("tether", "torch", "transformers", "tokenizers", "datasets", "peft")


def versions() -> dict[str, str]:
    """Python and the installed versions of the packages a run's numbers depend on."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        with suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def source_commit() -> str | None:
    """The git commit of tether's own source when it runs from a checkout (a ``+`` when it has local
    changes), else None."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+" if dirty else "")


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


@contextmanager
def recorded_invocation(run_dir: Path, *, enabled: bool = True):
    """Append this invocation to ``run.json`` and close it with its status; yields ``add_seconds(stage, s)``."""
    if not enabled:
        yield lambda stage, seconds: None
        return
    facts = read_run_facts(run_dir)
    invocations = facts.setdefault("invocations", [])
    invocations.append({"command": " ".join(["tether" if i == 0 else a for i, a in enumerate(sys.argv)]),
                        "started": _now(), "ended": None, "status": "running", "versions": versions(),
                        "commit": source_commit()})
    write_json_atomic(run_dir / RUN_FACTS, facts)

    def add_seconds(stage: str, seconds: float) -> None:
        totals = facts.setdefault("stage_seconds", {})
        totals[stage] = round(totals.get(stage, 0.0) + seconds, 1)
        write_json_atomic(run_dir / RUN_FACTS, facts)

    status = "failed"
    try:
        yield add_seconds
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        invocations[-1].update(ended=_now(), status=status)
        write_json_atomic(run_dir / RUN_FACTS, facts)
