"""Kill-and-resume harness: SFT, DPO and GRPO runs killed with SIGKILL at random moments, then resumed
until they finish; the final weights must equal an uninterrupted run's, bit for bit.

CI mode is ``tests/reliability/test_kill_resume.py`` (2 kills per family). Full mode, from the
repository root::

    python -m tests.reliability.harness --kills 20                # 20 kills per family, all three
    python -m tests.reliability.harness --kills 50 --families sft --seed 3

Every run is a child process forked from this one: the modules are imported once (an import costs
seconds on a small machine, a fork milliseconds), each kill is a real SIGKILL of a real process,
and a child's state reaches the next child only through the run directory on disk. Half of the
kills wait for a checkpoint write to be in progress (a ``step-N.tmp`` directory exists; the write
is slowed by ``TETHER_FAULT_SAVE_DELAY``) and strike inside it; the rest land at a uniform random
time over the length of an uninterrupted run, so they also hit start-up, the reference pass, the
final export and the stage marker.

Checked after every kill: each checkpoint visible as complete verifies against its manifest (no
half-written checkpoint ever looks complete), and a ``stage.json`` never exists without the final
model. Checked at the end: the exported model equals the uninterrupted run's exactly, and
``metrics.jsonl`` holds every step once with the uninterrupted run's losses.

Exactness holds on CPU with a fixed thread count (1 here): every trainer draws its batches and its
sampling seeds as functions of the step and restores the RNG state, so a resumed run repeats the
same float operations in the same order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FAULT_DELAY = 0.15  # seconds each checkpoint write is held open mid-way, to be killed in
EXIT_OK, EXIT_ERROR = 0, 3


def digit_fraction(prompts, completions, **columns):
    """A dense verifiable reward (so GRPO's updates are not zero on the random tiny model)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _train(threads: int = 1) -> dict:
    return {"max_steps": 5, "batch_size": 8, "log_every": 1, "save_every": 1, "keep_checkpoints": 2,
            "progress": False, "seed": 0, "threads": threads}


def sft_stage() -> dict:
    return {"name": "sft", "type": "sft", "model": {"name_or_path": "tether/tiny"},
            "data": {"task": {"name": "arithmetic", "options": {"digits": 2}, "n": 64}, "pack_length": 128},
            "train": _train(), "optim": {"lr": 3e-3, "schedule": "cosine"}, "report_to": []}


def dpo_stage() -> dict:
    return {"name": "dpo", "type": "dpo", "loss": "sigmoid", "model": {"name_or_path": "tether/tiny"},
            "data": {"task": {"name": "arithmetic", "options": {"digits": 2}, "n": 16, "eval_n": 4,
                              "kind": "style"}, "pack_length": 256},
            "train": _train(), "optim": {"lr": 2e-3, "schedule": "constant"}, "report_to": []}


def grpo_stage() -> dict:
    return {"name": "grpo", "type": "grpo", "algorithm": "grpo", "model": {"name_or_path": "tether/tiny"},
            "data": {"task": {"name": "arithmetic", "n": 32}},
            "rollout": {"group_size": 4, "max_new_tokens": 8},
            "train": {**_train(), "batch_size": 4}, "optim": {"lr": 1e-2, "schedule": "constant"},
            "report_to": []}


def async_grpo_stage() -> dict:
    """GRPO with a rollout producer process one policy version behind (async RL)."""
    return {**grpo_stage(), "name": "async_grpo", "async": {"max_staleness": 1},
            "rollout_correction": {"mode": "tis"}}


def async_agent_stage() -> dict:
    """Multi-turn tool-use RL whose episodes (turns, calculator calls) run in the producer process, one
    policy version behind."""
    return {"name": "async_agent", "type": "agent", "algorithm": "grpo", "model": {"name_or_path": "tether/tiny"},
            "environment": {"task": {"name": "multiplication", "options": {"digits": 2}, "n": 32},
                            "tools": ["calculator"], "system_prompt": False, "max_observation_chars": 24},
            "agent": {"max_turns": 2, "max_tokens": 48, "max_tokens_per_turn": 8},
            "rollout": {"group_size": 4}, "row_tokens": 256, "kl": {"coef": 0.05},
            "train": {**_train(), "batch_size": 2}, "optim": {"lr": 1e-2, "schedule": "constant"},
            "report_to": [], "async": {"max_staleness": 1}, "rollout_correction": {"mode": "tis"}}


def generated_digits(prompts, completions, trajectory, **columns):
    """A dense reward on the agent's own turns (the random tiny model never solves a task)."""
    texts = ["".join(turn.text for turn in t.turns) for t in trajectory]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


FAMILIES: dict[str, Callable[[], dict]] = {"sft": sft_stage, "dpo": dpo_stage, "grpo": grpo_stage,
                                           "async_grpo": async_grpo_stage, "async_agent": async_agent_stage}


def run_family(family: str, run_dir: Path) -> None:
    """One attempt at the whole run, resuming from whatever the run directory holds (the child's body)."""
    stage = FAMILIES[family]()
    if family in ("grpo", "async_grpo"):  # a Python reward function: the public API, as a notebook would call it
        from tether.stages import train_grpo

        if (run_dir / family / "stage.json").exists():
            return
        train_grpo(stage, out=run_dir, reward_functions=[digit_fraction], resume=True)
    elif family == "async_agent":
        from tether.stages import train_agent

        if (run_dir / family / "stage.json").exists():
            return
        train_agent(stage, out=run_dir, reward_functions=[generated_digits], resume=True)
    else:  # a recipe through the pipeline, as `tether run` does (a finished stage is skipped)
        from tether.stages.pipeline import run_recipe

        run_recipe({"name": family, "stages": [stage]}, run_dir, resume=True, report=False)


def spawn(family: str, run_dir: Path, *, delay: float | None) -> int:
    """Fork a child that runs ``run_family``; returns its pid. Output goes to ``run_dir/../NAME.log``."""
    log_path = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    pid = os.fork()
    if pid:
        return pid
    code = EXIT_ERROR
    try:  # the child: behave like a fresh process
        import torch

        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if delay:
            os.environ["TETHER_FAULT_SAVE_DELAY"] = str(delay)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        random.seed(0)
        run_family(family, run_dir)
        code = EXIT_OK
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def wait(pid: int, timeout: float = 600.0, until: Callable[[], bool] | None = None) -> int | None:
    """The child's exit code, or None if it is still running after ``timeout`` seconds (or once
    ``until()`` is true)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline or (until is not None and until()):
            return None
        time.sleep(0.002)


def writing(checkpoints: Path) -> bool:
    """A checkpoint write is in progress (its ``.tmp`` directory exists)."""
    try:
        return any(p.name.endswith(".tmp") for p in checkpoints.iterdir())
    except FileNotFoundError:
        return False


def final_weights(stage_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(stage_dir / "model.safetensors")


def logged_losses(run_dir: Path, stage: str) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by a kill, read mid-run
            rows.append(json.loads(line))
    return [(r["step"], r["loss"]) for r in rows if r.get("stage") == stage and "loss" in r]


def check_no_half_written(stage_dir: Path) -> None:
    """Every checkpoint that looks complete verifies; a finished stage has its model."""
    from tether.trainers.checkpoint import list_checkpoints, verify_checkpoint

    for path in list_checkpoints(stage_dir):
        assert verify_checkpoint(path), f"{path} has no manifest"
    if (stage_dir / "stage.json").exists():
        assert (stage_dir / "model.safetensors").exists() and (stage_dir / "config.json").exists()


@dataclass
class FamilyReport:
    family: str
    kills: int = 0
    kills_during_write: int = 0
    kills_before_training: int = 0
    children: int = 0
    runs: int = 0
    exact: bool = False
    reference_s: float = 0.0
    total_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.family}: {self.kills} SIGKILLs ({self.kills_during_write} during a checkpoint write, "
                f"{self.kills_before_training} before the first step) over {self.runs} runs in {self.children} "
                f"processes; final weights {'identical' if self.exact else 'DIFFERENT'} to the uninterrupted "
                "run; reference "
                f"{self.reference_s:.1f}s, harness {self.total_s:.1f}s")


def run_reference(family: str, root: Path) -> tuple[Path, float]:
    ref_dir = root / f"{family}-reference"
    start = time.monotonic()
    code = wait(spawn(family, ref_dir, delay=None))
    assert code == EXIT_OK, f"uninterrupted {family} run failed (exit {code}); see {ref_dir.with_suffix('.log')}"
    return ref_dir, time.monotonic() - start


def kill_once(family: str, run_dir: Path, span: float, rng: random.Random, report: FamilyReport) -> bool:
    """Start (resume) the run and SIGKILL it at a random moment; True if it finished first."""
    checkpoints = run_dir / family / "checkpoints"
    pid = spawn(family, run_dir, delay=FAULT_DELAY)
    report.children += 1
    if rng.random() < 0.5:  # strike inside a checkpoint write: wait for a .tmp directory, then a random moment
        code = wait(pid, timeout=4 * span, until=lambda: writing(checkpoints))
        if code is None:
            time.sleep(rng.uniform(0, FAULT_DELAY))
    else:
        code = wait(pid, timeout=rng.uniform(0, span))
    if code is None:  # still running: kill it (a zombie ignores the signal and reports its exit)
        in_write = writing(checkpoints)
        first_step = not logged_losses(run_dir, family)
        os.kill(pid, signal.SIGKILL)
        code = wait(pid)
    if code == EXIT_OK:
        return True
    assert code == -signal.SIGKILL, f"{family} child exited with {code}; see {run_dir.with_suffix('.log')}"
    report.kills += 1
    report.kills_during_write += in_write
    report.kills_before_training += first_step
    check_no_half_written(run_dir / family)
    return False


def compare(family: str, run_dir: Path, ref_dir: Path) -> None:
    """The killed-and-resumed run ends exactly where the uninterrupted one does, with the same metrics."""
    import torch

    check_no_half_written(run_dir / family)
    ref, got = final_weights(ref_dir / family), final_weights(run_dir / family)
    assert ref.keys() == got.keys()
    differ = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not differ, f"{family}: resumed weights differ from the uninterrupted run: " + ", ".join(
        f"{k} max |diff| {float((ref[k] - got[k]).abs().max()):.3g}" for k in differ)
    assert logged_losses(run_dir, family) == logged_losses(ref_dir, family), \
        f"{family}: metrics.jsonl of the killed run differs from the uninterrupted run's"


def kill_and_resume(family: str, root: Path, kills: int, rng: random.Random) -> FamilyReport:
    """``kills`` SIGKILLs of ``family`` runs, each resumed until it finishes and compared with an
    uninterrupted run; a run that finishes before the kills are spent is followed by a fresh one."""
    import tether.stages  # noqa: F401  (imported once here; every forked child inherits it)

    report = FamilyReport(family)
    start = time.monotonic()
    ref_dir, report.reference_s = run_reference(family, root)
    # A killed child runs longer than the reference (each save is held FAULT_DELAY seconds).
    span = report.reference_s + FAULT_DELAY * FAMILIES[family]()["train"]["max_steps"]
    while report.kills < kills:
        run_dir = root / f"{family}-killed-{report.runs}"
        finished = False
        while not finished and report.kills < kills:
            finished = kill_once(family, run_dir, span, rng, report)
        if not finished:  # the last resume, with no kill: it must finish
            code = wait(spawn(family, run_dir, delay=FAULT_DELAY))
            report.children += 1
            assert code == EXIT_OK, f"final {family} resume failed (exit {code}); see {run_dir.with_suffix('.log')}"
        compare(family, run_dir, ref_dir)
        report.runs += 1
    report.exact = True
    report.total_s = time.monotonic() - start
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per family (default 20)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tether-kill-") as tmp:
        root = args.dir or Path(tmp)
        reports = []
        for family in args.families:
            report = kill_and_resume(family, root, args.kills, random.Random(f"{args.seed}:{family}"))
            print(report.line(), flush=True)
            reports.append(report)
    total = sum(r.kills for r in reports)
    print(f"all passed: {total} kills, {sum(r.kills_during_write for r in reports)} during checkpoint writes; "
          "every resumed run equals its uninterrupted run exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
