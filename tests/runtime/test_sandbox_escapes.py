"""The escapes observed against the audit-hook fallback, each now refused, and programs that attack the
sandbox itself: none makes ``run_python`` or a reward raise.

Observed before: as root, the fallback ran programs as root; a program spawned a shell that wrote a
file on the host, killed a host process, made fifos in the host's /tmp and /dev/shm, and one that killed
its launcher made ``run_python`` raise (stopping a GRPO run).
"""

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tether.runtime import sandbox
from tether.runtime.sandbox import _UID_BASE, _UID_SLOTS, SandboxError, SandboxLimits, run_python

FALLBACK = SandboxLimits(cpu_s=1, wall_s=10, memory_mb=128, file_size_kb=64, output_bytes=10_000,
                         namespaces=False)
ROOT = os.geteuid() == 0


def run(code: str, **limits):
    return run_python(code, limits=FALLBACK.model_copy(update=limits))


def test_the_fallback_never_runs_a_program_as_root():
    result = run("import os\nprint(os.getuid(), os.geteuid())")
    uid, euid = map(int, result.stdout.split())
    if ROOT:
        assert _UID_BASE <= uid < _UID_BASE + _UID_SLOTS and euid == uid
        assert result.isolation["user"] == f"uid {uid}"
    else:
        assert uid == os.getuid()
    assert uid != 0 and euid != 0


@pytest.mark.skipif(not ROOT, reason="the refusal concerns root: an unprivileged caller's programs are never root")
def test_the_fallback_refuses_as_root_when_no_interpreter_is_open_to_other_users(monkeypatch):
    monkeypatch.setattr(sandbox, "open_to_others", lambda path: False)
    monkeypatch.setattr(sandbox, "shared_interpreter", lambda python=None: None)
    with pytest.raises(SandboxError, match="never runs a program as root"):
        run("print('ran')")


def test_a_shell_cannot_be_spawned_even_when_processes_are_allowed():
    target = Path(f"/tmp/tether-escape-{uuid.uuid4().hex}")
    code = (f"import os, subprocess\nfor spawn in (lambda: subprocess.run(['/bin/sh', '-c', 'echo x > {target}']),"
            f" lambda: os.system('echo x > {target}'), lambda: os.posix_spawn('/bin/sh', ['sh'], {{}})):\n"
            "    try:\n        spawn()\n        print('spawned')\n"
            "    except PermissionError as err:\n        print('refused')\n")
    result = run(code, processes=8)
    assert result.stdout.split() == ["refused"] * 3 and not target.exists()


def test_host_processes_cannot_be_signalled():
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = (f"import os, signal\nfor kill in (lambda: os.kill({victim.pid}, signal.SIGKILL),"
                f" lambda: os.killpg({victim.pid}, signal.SIGKILL), lambda: os.kill(os.getppid(), signal.SIGKILL),"
                " lambda: os.kill(-1, signal.SIGKILL)):\n"
                "    try:\n        kill()\n        print('killed')\n"
                "    except (PermissionError, ProcessLookupError):\n        print('refused')\n")
        result = run(code)
        time.sleep(0.2)
        assert result.stdout.split() == ["refused"] * 4 and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.parametrize("directory", ["/tmp", "/dev/shm"])
def test_no_fifo_or_file_appears_in_the_hosts_shared_directories(directory):
    if not os.path.isdir(directory):
        pytest.skip(f"{directory} does not exist here")
    names = [Path(directory) / f"tether-escape-{uuid.uuid4().hex}" for _ in range(3)]
    code = (f"import os, stat\nfor make in (lambda: os.mkfifo({str(names[0])!r}),"
            f" lambda: os.mknod({str(names[1])!r}, stat.S_IFIFO | 0o666),"
            f" lambda: os.close(os.open({str(names[2])!r}, os.O_CREAT))):\n"
            "    try:\n        make()\n        print('made')\n"
            "    except PermissionError:\n        print('refused')\n"
            "os.mkfifo('inside')\nprint(stat.S_ISFIFO(os.stat('inside').st_mode))")
    try:
        result = run(code)
        assert result.stdout.split() == ["refused"] * 3 + ["True"]  # its own directory still works
        assert not any(name.exists() for name in names)
    finally:
        for name in names:
            name.unlink(missing_ok=True)


def launcher_processes() -> list[int]:
    """Pids of this process's sandbox launchers and their forks (the program itself excluded)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "_sandbox_child.py" in (entry / "cmdline").read_text():
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(fields[1]), int(fields[3]))  # parent, session
        except (OSError, ValueError, IndexError):
            pass
    ours = {pid for pid, (parent, _) in stats.items() if parent == os.getpid()}
    return [pid for pid, (_, session) in stats.items() if session in ours]


def test_a_launcher_killed_mid_run_gives_a_failed_result_not_an_exception():
    results = []
    thread = threading.Thread(target=lambda: results.append(run("import time\ntime.sleep(4)", wall_s=20)))
    thread.start()
    deadline = time.monotonic() + 10
    while len(launcher_processes()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # past the launcher's first status line: the program has started
    for pid in launcher_processes():
        os.kill(pid, 9)
    thread.join(30)
    assert len(results) == 1 and not results[0].ok
    assert "launcher ended" in results[0].stderr


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "fallback"])
def test_a_program_attacking_its_parent_is_scored_zero_not_raised(namespaces):
    from tether.rewards.code import code_tests_reward

    program = "```python\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef f(x): return x\n```"
    rewards = code_tests_reward(["p"], [program], tests=[["assert f(1) == 1"]],
                                limits={"namespaces": namespaces, "wall_s": 10})
    assert rewards == [0.0]
