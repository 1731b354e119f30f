"""Run untrusted Python in a separate, limited process: the sandbox behind the python tool and the code verifier.

``run_python(code, limits=SandboxLimits(...))`` starts ``_sandbox_child.py`` (a launcher, trusted
code), which isolates itself and then runs ``code`` as ``python -I -S main.py`` with:

=================  ==============================================================================
limit              how it is enforced (and reported in ``SandboxResult.limit``)
=================  ==============================================================================
CPU time           ``RLIMIT_CPU`` (SIGXCPU, SIGKILL one second later) -> ``"cpu"``
wall time          this process's clock; the whole process tree is killed -> ``"wall"``
memory             ``RLIMIT_AS`` (allocation fails, ``MemoryError``) -> ``"memory"``
file size          ``RLIMIT_FSIZE`` (``EFBIG``), and a size-capped tmpfs for the directory -> ``"file_size"``
processes          ``RLIMIT_NPROC`` under a dedicated uid (``EAGAIN`` on fork) -> ``"processes"``
output             stdout + stderr read with a bounded reader; killed at the cap -> ``"output"``
=================  ==============================================================================

and no network, no view of the host's files beyond a read-only root, and an empty environment.
Which isolation mechanism was active (Linux network / mount / pid namespaces: as root, or for any other
user inside a user namespace of their own, without capabilities and with their home directory hidden; or
the audit-hook fallback), and the seccomp filter under each, are reported in ``SandboxResult.isolation``; see
``_sandbox_child.py`` for each.

How "which limit was hit" is decided: signals and this process's own kills are certain; memory,
file-size and process limits are read from the error the interpreter printed (``MemoryError``,
``File too large``, ``Resource temporarily unavailable``), which a program could also print on
purpose. That can only mislabel its own result, never lift a limit.

Why a launcher script rather than ``preexec_fn``: tool calls run from worker threads, and
``preexec_fn`` is not safe in a threaded parent (the child may inherit a held lock).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from tether.config import StrictModel

LAUNCHER = Path(__file__).with_name("_sandbox_child.py")
LIMITS = ("cpu", "wall", "memory", "file_size", "processes", "output")
# Dedicated uids for sandboxed programs when running as root (the kernel skips RLIMIT_NPROC for root):
# one per concurrent sandbox of this process, so one program's fork bomb never exhausts another's quota.
_UID_SLOTS = 64
_UID_BASE = 1_500_000_000 + (os.getpid() % 65536) * _UID_SLOTS


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not the program failing)."""


class SandboxLimits(StrictModel):
    """Limits for one sandboxed run. Defaults suit short tool calls and unit-test verification."""

    cpu_s: float = Field(2.0, gt=0, description="CPU seconds (RLIMIT_CPU, rounded up to whole seconds)")
    wall_s: float = Field(5.0, gt=0, description="wall-clock seconds before the process tree is killed")
    memory_mb: int = Field(256, ge=32, description="address space (RLIMIT_AS)")
    file_size_kb: int = Field(1024, ge=1, description="largest file the program may write (RLIMIT_FSIZE)")
    disk_kb: int = Field(8192, ge=64, description="size of the private tmpfs holding its directory")
    processes: int = Field(1, ge=1, description="processes + threads of its uid (RLIMIT_NPROC); 1 = no children")
    output_bytes: int = Field(65536, ge=1, description="stdout + stderr bytes kept; more kills the program")
    namespaces: bool = Field(True, description="use Linux namespaces when permitted (else the audit-hook fallback)")
    python: str | None = Field(None, description="fallback mode as root: the interpreter for programs when this "
                                                 "one is closed to other users; None: the first python3 on "
                                                 "/usr/local/bin:/usr/bin:/bin that every user can run")


@dataclass
class SandboxResult:
    """What a sandboxed run did. ``exit_code`` is None when a signal ended it (``signal`` says which);
    ``limit`` names the limit it hit (one of ``LIMITS``) or is None."""

    stdout: str
    stderr: str
    exit_code: int | None
    signal: int | None
    limit: str | None
    duration_s: float
    isolation: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    @property
    def error(self) -> str:
        """The last line of stderr (the exception a failed program raised), or ""."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""


class _UidPool:
    def __init__(self, base: int, slots: int) -> None:
        self.free = list(range(base, base + slots))
        self.ready = threading.Condition()

    @contextlib.contextmanager
    def take(self):
        with self.ready:
            self.ready.wait_for(lambda: bool(self.free))
            uid = self.free.pop()
        try:
            yield uid
        finally:
            with self.ready:
                self.free.append(uid)
                self.ready.notify()


_UIDS = _UidPool(_UID_BASE, _UID_SLOTS)


def _interpreter() -> tuple[str, str]:
    """The real interpreter binary (a venv's ``python`` resolves to its base) and its prefix."""
    python = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if not python.startswith(prefix + os.sep):
        prefix = str(Path(python).parent.parent)
    return python, prefix


def open_to_others(path: str) -> bool:
    """Whether a user other than the owner can reach ``path``: every ancestor searchable, the file itself
    readable and executable by others."""
    parts = Path(path).parts
    try:
        ancestors_open = all(os.stat(Path(*parts[: i + 1])).st_mode & stat.S_IXOTH for i in range(1, len(parts) - 1))
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return ancestors_open and mode & stat.S_IXOTH and mode & stat.S_IROTH


def shared_interpreter(python: str | None = None) -> str | None:
    """An interpreter every user can run, for programs the fallback sandbox runs under an unprivileged
    uid when tether's own interpreter is closed to others (a pyenv under ``/root``): ``python`` if given,
    else the first ``python3`` on a fixed system path. None if there is none."""
    candidates = [python] if python else [shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")]
    for candidate in candidates:
        if candidate and open_to_others(os.path.realpath(candidate)):
            return os.path.realpath(candidate)
    return None


def _launcher_argv(python: str) -> list[str]:
    """The launcher's command line (the tests run it as another user)."""
    return [python, "-I", "-S", "-B", str(LAUNCHER)]


def _private_directories() -> list[str]:
    """What a program in a user namespace must not see of its user's files: their home directory (it runs
    with their permissions). Root's programs run under a dedicated uid instead, which cannot read it."""
    if os.geteuid() == 0:
        return []
    with contextlib.suppress(KeyError, ImportError):
        import pwd

        return [os.path.realpath(pwd.getpwuid(os.getuid()).pw_dir)]
    return []


def _read_bounded(proc: subprocess.Popen, status_fd: int, deadline: float, cap: int
                  ) -> tuple[bytes, bytes, list[dict], str | None]:
    """Read stdout, stderr and the status pipe until all close, the deadline passes or the output cap is hit."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), status_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    limit, total = None, 0
    try:
        while selector.get_map() and limit is None:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                limit = "wall"
                break
            for key, _ in selector.select(timeout):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                if key.fd != status_fd:
                    keep = max(0, cap - total)
                    total += len(chunk)
                    chunk = chunk[:keep]
                    if total > cap:
                        limit = "output"
                streams[key.fd] += chunk
    finally:
        selector.close()
    status = [json.loads(line) for line in streams[status_fd].decode().splitlines() if line.strip()]
    return bytes(streams[proc.stdout.fileno()]), bytes(streams[proc.stderr.fileno()]), status, limit


def _kill_tree(proc: subprocess.Popen, status: list[dict]) -> None:
    """End whatever is left of a run. Namespaces: SIGKILL the namespace's pid 1 (the kernel then kills
    every process in it). Fallback: SIGKILL the program alone (its parent, the launcher's fork, reaps it,
    reports and exits, so no dead program lingers under the sandbox uid to count against the next run's
    process limit), unless it has already been reported finished. Then the launcher's process group, if
    the launcher has not exited within a few seconds. Called before the launcher is reaped, so no id
    here can have been reused."""
    ns_init = next((s["pid"] for s in status if "pid" in s), None)
    program = next((s["program"] for s in status if "program" in s), None)
    finished = any("isolation" in s for s in status)
    if proc.poll() is None:
        target = program if program is not None else ns_init
        if target is not None and not finished:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(target, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _classify(signal_number: int | None, stderr: str, own_limit: str | None) -> str | None:
    if own_limit is not None:
        return own_limit
    if signal_number in (signal.SIGXCPU, signal.SIGKILL):
        return "cpu"  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard one
    if signal_number == signal.SIGXFSZ or "File too large" in stderr or "No space left on device" in stderr:
        return "file_size"
    if "MemoryError" in stderr or (signal_number == signal.SIGSEGV and "memory" in stderr.lower()):
        return "memory"
    if any(s in stderr for s in ("Resource temporarily unavailable", "can't start new thread",
                                 "process creation is disabled")):
        return "processes"
    return None


def run_python(code: str, *, limits: SandboxLimits | dict | None = None, stdin: str = "") -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox; see the module docstring.

    ``stdin`` is the program's standard input. Never raises for anything the program does; raises
    :class:`SandboxError` only if the sandbox could not be set up.
    """
    limits = limits if isinstance(limits, SandboxLimits) else SandboxLimits.model_validate(limits or {})
    python, prefix = _interpreter()
    with _UIDS.take() as uid, tempfile.TemporaryDirectory(prefix="tether-sandbox-") as workdir:
        status_r, status_w = os.pipe()
        job = {**limits.model_dump(), "code": code, "stdin": stdin, "status_fd": status_w, "uid": uid,
               "python": python, "prefix": prefix, "workdir": workdir, "private": _private_directories(),
               "shared_python": None if open_to_others(python) else (shared_interpreter(limits.python) or "")}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(_launcher_argv(python), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
                                    env={}, cwd="/", start_new_session=True)
        finally:
            os.close(status_w)
        try:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(json.dumps(job).encode())
                proc.stdin.close()
            out, err, status, own_limit = _read_bounded(proc, status_r, start + limits.wall_s,
                                                        limits.output_bytes)
            _kill_tree(proc, status)
            proc.wait()
        finally:
            os.close(status_r)
            for stream in (proc.stdout, proc.stderr):
                stream.close()
    final = next((s for s in status if "isolation" in s), {})
    stderr = err.decode(errors="replace")
    refusal = next((s["refused"] for s in status if "refused" in s), None)
    if refusal:
        raise SandboxError(refusal)
    started = any("pid" in s for s in status)
    if own_limit is None and not started and (proc.returncode != 0 or not final):
        raise SandboxError(f"the sandbox launcher failed (exit {proc.returncode}): {stderr.strip()[-2000:]}")
    if own_limit is None and not final:  # the program started, then its launcher died: a failed run, not ours
        stderr += f"\nsandbox: the launcher ended before the program reported (exit {proc.returncode})"
        final = {"exit": None, "signal": -proc.returncode if proc.returncode < 0 else None}
    return SandboxResult(
        stdout=out.decode(errors="replace"), stderr=stderr, exit_code=final.get("exit"),
        signal=final.get("signal"), limit=_classify(final.get("signal"), stderr, own_limit),
        duration_s=time.monotonic() - start, isolation=final.get("isolation", {}))


TEST_HARNESS = r'''
import sys as _sys
_nonce, _tests = _sys.stdin.readline().strip(), __import__("json").loads(_sys.stdin.readline())
_namespace = {"__name__": "solution"}
_passed = 0
try:
    exec(compile(%(code)r, "solution.py", "exec"), _namespace)
except BaseException as _error:
    print(f"solution failed: {type(_error).__name__}: {_error}", file=_sys.stderr)
else:
    for _test in _tests:
        try:
            exec(compile(_test, "test.py", "exec"), dict(_namespace))
            _passed += 1
        except BaseException as _error:
            print(f"test failed: {_test!r}: {type(_error).__name__}: {_error}", file=_sys.stderr)
print("\n" + _nonce, _passed, len(_tests), flush=True)
'''


def run_tests(code: str, tests: list[str], *, limits: SandboxLimits | dict | None = None
              ) -> tuple[int, SandboxResult]:
    """Run ``code`` then ``tests`` in one sandboxed process; returns (tests passed, the sandbox result).

    A test is an ``assert`` statement, or any code that raises on failure. The candidate runs first,
    inside a harness that then runs each test and prints a summary line tagged with a random nonce
    passed on stdin, so a program cannot simply print a pass count. The tests are hidden from the
    prompt, not from the process: a program that inspects the harness's frames could find the nonce,
    so the nonce stops reward hacking by printing, not by introspection.
    """
    nonce = secrets.token_hex(16)
    result = run_python(TEST_HARNESS % {"code": code}, limits=limits, stdin=f"{nonce}\n{json.dumps(tests)}\n")
    for line in reversed(result.stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == nonce and parts[2] == str(len(tests)) and result.limit is None:
            return int(parts[1]), result
    return 0, result


def isolation_report(limits: SandboxLimits | dict | None = None) -> dict[str, str]:
    """Which mechanisms the sandbox uses on this machine (runs a trivial program once)."""
    return run_python("pass", limits=limits).isolation
