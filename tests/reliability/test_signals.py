"""Graceful stop through the real command line: SIGTERM / SIGINT sent to a running `tether sft` process
finish the step, write a checkpoint, exit 128+signal with the exact command that resumes, and that command
finishes the run with the weights of an uninterrupted one."""

import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tether.cli import resume_command
from tether.trainers.checkpoint import FAULT_DELAY_ENV, list_checkpoints, verify_checkpoint

CONFIG = """\
model: {name_or_path: tether/tiny}
data: {task: {name: arithmetic, options: {digits: 2}, n: 24}, pack_length: 128}
train: {max_steps: 6, batch_size: 8, save_every: 1, log_every: 1, threads: 1, progress: false}
optim: {lr: 3.0e-3, schedule: constant}
report_to: []
"""


def cli(argv: list[str], log: Path, *, delay: float | None = None) -> int:
    """Fork a child that runs ``tether ARGV`` with its output in ``log``; returns the pid."""
    import tether.stages  # noqa: F401  (imported before the fork, so the child starts at once)

    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if delay:
            os.environ[FAULT_DELAY_ENV] = str(delay)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        sys.argv = ["tether", *argv]
        from tether.cli import main

        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def wait(pid: int, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("the child did not finish")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_cli_checkpoints_and_prints_the_resume_command(tmp_path, signum):
    config = tmp_path / "sft.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    pid = cli(["sft", "--config", str(config), "--out", str(out)], tmp_path / "stopped.log", delay=0.2)
    checkpoints = out / "sft" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (checkpoints / "step-000002").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signum)
    code = wait(pid)
    output = (tmp_path / "stopped.log").read_text()
    assert code == 128 + signum, output
    assert "interrupted:" in output and signal.Signals(signum).name in output
    saved = list_checkpoints(out / "sft")
    assert saved and all(verify_checkpoint(p) for p in saved)
    assert not any(p.name.endswith(".tmp") for p in checkpoints.iterdir())
    step = int(saved[-1].name.split("-")[1])
    assert 2 <= step < 6 and f"after step {step} of 6" in output  # the checkpoint holds the last finished step
    line = next(li for li in output.splitlines() if li.startswith("resume with: "))
    command = shlex.split(line.removeprefix("resume with: "))
    assert command == ["tether", "sft", "--config", str(config), "--out", str(out), "--resume"]
    if signum == signal.SIGINT:
        return
    # the printed command finishes the run, and lands on the uninterrupted run's weights
    assert wait(cli(command[1:], tmp_path / "resumed.log")) == 0, (tmp_path / "resumed.log").read_text()
    reference = tmp_path / "reference"
    assert wait(cli(["sft", "--config", str(config), "--out", str(reference)], tmp_path / "ref.log")) == 0
    got, want = load_file(out / "sft" / "model.safetensors"), load_file(reference / "sft" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_resume_command_adds_out_and_resume():
    run = Path("runs") / "sft-20260101-000000"
    assert resume_command(["sft", "--config", "a b.yaml"], run) == \
        f"tether sft --config 'a b.yaml' --out {run} --resume"
    assert resume_command(["run", "--no-resume", "--out=x", "sft.train.max_steps=3"], Path("x")) == \
        "tether run --out=x sft.train.max_steps=3 --resume"


TIMED = """\
model: {name_or_path: tether/tiny}
data: {task: {name: arithmetic, options: {digits: 2}, n: 24}, pack_length: 128}
train: {max_steps: 8, batch_size: 8, save_every_minutes: 0.002, log_every: 1, threads: 1, progress: false}
optim: {lr: 3.0e-3, schedule: constant}
eval: {n: 400, max_new_tokens: 24}
report_to: []
"""


def reference_weights(config: Path, tmp_path: Path) -> dict:
    reference = tmp_path / "reference"
    assert wait(cli(["sft", "--config", str(config), "--out", str(reference)], tmp_path / "ref.log")) == 0
    return load_file(reference / "sft" / "model.safetensors")


def test_time_based_checkpoints_survive_a_sigkill_and_a_stop_in_the_final_evaluation_keeps_the_model(tmp_path):
    """No ``save_every``: the time-based checkpoints (``save_every_minutes``, on by default) are there when a
    SIGKILL lands mid-training; the end-of-training checkpoint is there when Ctrl-C lands in the final
    evaluation, so the resumed stage does not train again; both resumed runs end on the uninterrupted weights."""
    config = tmp_path / "sft.yaml"
    config.write_text(TIMED)
    want = reference_weights(config, tmp_path)
    out = tmp_path / "killed"
    pid = cli(["sft", "--config", str(config), "--out", str(out)], tmp_path / "killed.log", delay=0.1)
    deadline = time.monotonic() + 120
    while not list_checkpoints(out / "sft") and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    wait(pid)
    assert list_checkpoints(out / "sft"), "no time-based checkpoint before the kill"
    assert wait(cli(["sft", "--config", str(config), "--out", str(out), "--resume"], tmp_path / "r1.log")) == 0
    got = load_file(out / "sft" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)

    stopped = tmp_path / "stopped"
    pid = cli(["sft", "--config", str(config), "--out", str(stopped)], tmp_path / "stopped.log")
    final = stopped / "sft" / "checkpoints" / "step-000008"
    deadline = time.monotonic() + 120
    while not final.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the final evaluation (400 problems) is running
    os.kill(pid, signal.SIGINT)
    assert wait(pid) != 0
    assert not (stopped / "sft" / "stage.json").exists() and verify_checkpoint(final)
    assert wait(cli(["sft", "--config", str(config), "--out", str(stopped), "--resume"], tmp_path / "r2.log")) == 0
    rows = (stopped / "metrics.jsonl").read_text().splitlines()
    trained = [r for r in rows if '"loss"' in r]
    assert len(trained) == 8  # steps 1-8 once: the resumed stage went straight to its evaluation
    got = load_file(stopped / "sft" / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
