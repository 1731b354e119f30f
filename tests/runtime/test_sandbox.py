"""The sandbox against adversarial programs: each is contained and reported, and the host is unaffected.

Limits are kept small (1 s of CPU, 128 MB, 4 processes) so the suite is quick and a fork bomb never
gets far on a shared machine. Every program runs under each isolation mechanism: Linux namespaces as
root (when this machine permits them: root with CAP_SYS_ADMIN), a user namespace as an ordinary user
(the launcher run as ``nobody`` with the system's python3, when the suite runs as root and the kernel
permits unprivileged user namespaces), and the audit-hook fallback.
"""

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import uuid
from pathlib import Path
from unittest import mock

import pytest

import tether.runtime.sandbox as sandbox
from tether.runtime.sandbox import _UID_BASE, _UID_SLOTS, SandboxLimits, isolation_report, run_python

SMALL = dict(cpu_s=1, wall_s=4, memory_mb=128, file_size_kb=64, output_bytes=10_000)
NAMESPACES = isolation_report().get("network") == "namespace"
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def _readable_by_others(path: Path) -> bool:
    return all(a.stat().st_mode & stat.S_IXOTH for a in path.parents) and bool(path.stat().st_mode & stat.S_IROTH)


def _user_namespaces_unavailable() -> str:
    """Why the suite cannot run the sandbox as an ordinary user here ("" when it can)."""
    python = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if os.geteuid() != 0 or not shutil.which("setpriv") or not python:
        return "needs root, setpriv and a system python3 to run the launcher as nobody"
    if not (sandbox.open_to_others(os.path.realpath(python)) and _readable_by_others(sandbox.LAUNCHER)):
        return "the system python3 or the launcher is closed to other users"
    probe = "import ctypes; raise SystemExit(ctypes.CDLL(None).unshare(0x10000000) != 0)"
    if subprocess.run([*SETPRIV, python, "-I", "-S", "-c", probe], capture_output=True).returncode != 0:
        return "this kernel does not permit unprivileged user namespaces"
    return ""


USER_NAMESPACES_UNAVAILABLE = _user_namespaces_unavailable()


@contextlib.contextmanager
def as_nobody(private: list[str] | None = None):
    """``run_python`` starts its launcher as ``nobody`` (and runs programs with the system's python3, which
    nobody can run); ``private`` replaces the home directory the launcher would hide."""
    python = os.path.realpath(shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"))
    with mock.patch.object(sandbox, "_interpreter", lambda: (python, str(Path(python).parent.parent))), \
            mock.patch.object(sandbox, "_launcher_argv", lambda py: [*SETPRIV, py, "-I", "-S", "-B",
                                                                     str(sandbox.LAUNCHER)]), \
            mock.patch.object(sandbox, "_private_directories", lambda: list(private or [])):
        yield


MODES = [pytest.param(True, id="namespaces",
                      marks=pytest.mark.skipif(not NAMESPACES, reason="namespaces not permitted here")),
         pytest.param("user", id="user-namespace",
                      marks=pytest.mark.skipif(bool(USER_NAMESPACES_UNAVAILABLE), reason=USER_NAMESPACES_UNAVAILABLE)),
         pytest.param(False, id="fallback")]


def run(code: str, namespaces: bool | str, **limits):
    """``code`` in the sandbox: ``namespaces`` True (as root), "user" (as nobody, in a user namespace) or False."""
    context = as_nobody() if namespaces == "user" else contextlib.nullcontext()
    with context:
        return run_python(code, limits=SandboxLimits(**{**SMALL, "namespaces": bool(namespaces), **limits}))


def _describe(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/stat").read_text()[:120] + " | "
                + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200])
    except OSError:
        return "gone"


def sandbox_processes(*uids: int) -> list[int]:
    """Pids of live processes owned by one of this test process's sandbox uids (or by ``uids``). A zombie
    (state Z: dead, waiting for whoever inherited it to read its exit status) is not live: a killed fallback
    program whose launcher was killed with it is inherited by the machine's pid 1, which may reap it late."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                uid = entry.stat().st_uid
                if (_UID_BASE <= uid < _UID_BASE + _UID_SLOTS or uid in uids) and \
                        (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return pids


@pytest.mark.parametrize("namespaces", MODES)
def test_a_well_behaved_program_runs(namespaces):
    result = run("import sys\nprint(sum(range(10)), sys.stdin.read())", namespaces, wall_s=10)
    assert result.ok and result.stdout == "45 \n" and result.stderr == ""
    with as_nobody() if namespaces == "user" else contextlib.nullcontext():
        result = run_python("print(input()[::-1])", limits={"namespaces": bool(namespaces)}, stdin="abc\n")
    assert result.stdout == "cba\n"
    failed = run("raise ValueError('boom')", namespaces)
    assert failed.exit_code == 1 and failed.limit is None and failed.error == "ValueError: boom"


@pytest.mark.parametrize("namespaces", MODES)
def test_fork_bomb_is_contained(namespaces):
    result = run("import os\nwhile True:\n    os.fork()\n", namespaces, processes=4)
    assert result.limit == "processes" and not result.ok
    assert sandbox_processes(*([NOBODY] if namespaces == "user" else [])) == []  # nothing survives the run


@pytest.mark.parametrize("namespaces", MODES)
def test_infinite_loop_hits_the_cpu_limit_and_sleeping_the_wall_limit(namespaces):
    assert run("while True: pass", namespaces, wall_s=30).limit == "cpu"  # 1 s of CPU, however busy the host
    result = run("import time\ntime.sleep(60)", namespaces, wall_s=1)
    assert result.limit == "wall" and result.duration_s < 5


@pytest.mark.parametrize("namespaces", MODES)
def test_allocating_10_gb_hits_the_memory_limit(namespaces):
    result = run("x = bytearray(10 * 2**30)\nprint('allocated')", namespaces)
    assert result.limit == "memory" and "allocated" not in result.stdout


@pytest.fixture
def separate_mount():
    """A world-writable tmpfs mounted on its own (as a separate /home or /var/tmp would be), or None where
    this process cannot mount one."""
    where = Path(f"/var/tmp/tether-mount-{uuid.uuid4().hex}")
    where.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(where)], capture_output=True).returncode == 0
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("namespaces", MODES)
def test_writing_outside_its_directory_fails(namespaces, tmp_path, separate_mount):
    """Nothing outside its directory is writable: the host's /tmp (hidden), /var/tmp, the working directory,
    and a world-writable file system mounted on its own (every mount is read-only, not / alone)."""
    targets = [tmp_path / "escape.txt", Path(f"/var/tmp/tether-escape-{uuid.uuid4().hex}"),
               Path.cwd() / f"tether-escape-{uuid.uuid4().hex}"]
    if separate_mount is not None:
        targets.append(separate_mount / "escape.txt")
    code = "import sys\nfor path in sys.argv[1:] or %r:\n" % [str(t) for t in targets] + (
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as err:\n        print('refused', type(err).__name__)\n"
        "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    try:
        result = run(code, namespaces)
        assert result.ok and "wrote" not in result.stdout and result.stdout.count("refused") == len(targets)
        assert result.stdout.endswith("ok\n")  # its own directory is writable
        assert not any(t.exists() for t in targets)
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@pytest.mark.parametrize("namespaces", MODES)
def test_big_files_hit_the_file_size_limit(namespaces):
    result = run("open('big', 'wb').write(b'x' * 2**20)", namespaces)
    assert result.limit == "file_size"


@pytest.mark.parametrize("namespaces", MODES)
def test_the_parent_environment_is_unreadable(namespaces, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("TETHER_TEST_SECRET", secret)
    code = (f"import os\nprint(dict(os.environ))\ntry:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
            "except OSError as err:\n    print('refused', type(err).__name__)")
    result = run(code, namespaces)
    assert secret not in result.stdout + result.stderr and "refused" in result.stdout


@pytest.mark.parametrize("namespaces", MODES)
def test_network_connections_fail(namespaces):
    """A server listening on the host's loopback is unreachable from the sandbox."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
                     namespaces)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting in the backlog
            server.accept()
    finally:
        server.close()
    assert "connected" not in result.stdout and result.exit_code != 0
    assert ("Network is unreachable" if namespaces else "network access is disabled") in result.error


@pytest.mark.parametrize("namespaces", MODES)
def test_spawning_a_shell_is_refused_by_default(namespaces, monkeypatch):
    monkeypatch.setenv("TETHER_TEST_SECRET", "hunter2")
    code = "import subprocess\nprint(subprocess.run(['/bin/sh', '-c', 'echo $TETHER_TEST_SECRET; id -u'], " \
           "capture_output=True, text=True).stdout)"
    result = run(code, namespaces)
    assert result.limit == "processes" and "hunter2" not in result.stdout


@pytest.mark.skipif(not NAMESPACES, reason="namespaces not permitted here")
def test_a_permitted_shell_runs_unprivileged_and_isolated(monkeypatch):
    monkeypatch.setenv("TETHER_TEST_SECRET", "hunter2")
    code = "import subprocess\nprint(subprocess.run(['/bin/sh', '-c', 'echo [$TETHER_TEST_SECRET]; id -u; ls /proc'], " \
           "capture_output=True, text=True).stdout)"
    result = run(code, True, processes=4)
    lines = result.stdout.split()
    assert result.ok and lines[0] == "[]" and _UID_BASE <= int(lines[1]) < _UID_BASE + _UID_SLOTS
    assert str(os.getpid()) not in lines[2:]  # its own pid namespace: the host's processes are invisible
    left = sandbox_processes()
    assert left == [], [(pid, _describe(pid)) for pid in left]


@pytest.mark.skipif(bool(USER_NAMESPACES_UNAVAILABLE), reason=USER_NAMESPACES_UNAVAILABLE)
def test_an_ordinary_users_program_has_no_capabilities_and_no_view_of_their_files():
    """As an ordinary user the program is its user namespace's root without a single capability: it cannot
    remount the read-only tree, make another user namespace, or see the user's home directory (here a
    0700 folder of nobody's with a secret nobody can read outside the sandbox); children it may have
    (processes=4) count against its limit only, and see only the sandbox's processes."""
    home = Path(f"/var/tmp/tether-home-{uuid.uuid4().hex}")
    home.mkdir(mode=0o700)
    (home / "secret").write_text("hunter2")
    for path in (home, home / "secret"):
        os.chown(path, NOBODY, NOBODY)
    code = """import ctypes, os, subprocess
caps = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')]
libc = ctypes.CDLL(None, use_errno=True)
print('remount', libc.mount(None, b'/', None, 32 | 4096, None), 'unshare', libc.unshare(0x10000000))
try:
    print('read', open(SECRET).read())
except OSError as err:
    print('hidden', type(err).__name__)
print('caps', caps[0], 'shell', *subprocess.run(['/bin/sh', '-c', 'id -u; ls /proc'], capture_output=True,
      text=True).stdout.split())""".replace("SECRET", repr(str(home / "secret")))
    try:
        with as_nobody(private=[str(home)]):
            result = run_python(code, limits=SandboxLimits(**{**SMALL, "processes": 4}))
        outside = subprocess.run([*SETPRIV, "cat", str(home / "secret")], capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(home)
    assert outside == "hunter2"  # nobody can read it on the host
    assert result.ok, result.stderr
    assert result.isolation["user"].startswith(f"user namespace (uid {NOBODY} as its root, no capabilities)")
    words = result.stdout.split()
    assert words[:4] == ["remount", "-1", "unshare", "-1"] and words[4:6] == ["hidden", "FileNotFoundError"]
    assert words[6:8] == ["caps", "0000000000000000"] and words[8:10] == ["shell", "0"]
    pids = [int(w) for w in words[10:] if w.isdigit()]
    assert 1 in pids and max(pids) < 10 and str(os.getpid()) not in words  # its own pid namespace
    assert sandbox_processes(NOBODY) == []


@pytest.mark.skipif(bool(USER_NAMESPACES_UNAVAILABLE), reason=USER_NAMESPACES_UNAVAILABLE)
def test_an_interpreter_inside_the_hidden_home_is_re_exposed():
    """A pyenv-style interpreter under the user's home: the home is covered, the interpreter's prefix alone is
    bound back read-only, so the program runs and still sees nothing else of the home. (The prefix here is the
    system's /usr bound under a folder of nobody's.)"""
    home = Path(f"/var/tmp/tether-home-{uuid.uuid4().hex}")
    prefix = home / "pyenv"
    prefix.mkdir(parents=True)
    (home / "secret").write_text("hunter2")
    for path in (home, prefix, home / "secret"):
        os.chown(path, NOBODY, NOBODY)
    home.chmod(0o700)
    # read-only, and never removed while mounted: a tree removal would otherwise reach the system's /usr
    if subprocess.run(["mount", "--bind", "/usr", str(prefix)], capture_output=True).returncode != 0:
        shutil.rmtree(home)
        pytest.skip("cannot bind-mount here")
    subprocess.run(["mount", "-o", "remount,bind,ro", str(prefix)], check=True, capture_output=True)
    python = str(prefix / "bin" / Path(os.path.realpath("/usr/bin/python3")).name)
    code = f"import sys\nprint(sys.executable)\ntry:\n    open({str(home / 'secret')!r})\nexcept OSError as err:\n" \
           "    print(type(err).__name__)\n"
    try:
        with as_nobody(private=[str(home)]), mock.patch.object(sandbox, "_interpreter", lambda: (python, str(prefix))):
            result = run_python(code, limits=SMALL)
    finally:
        subprocess.run(["umount", "-l", str(prefix)], capture_output=True)
        if os.path.ismount(prefix):
            raise RuntimeError(f"{prefix} is still mounted: remove {home} by hand after unmounting it")
        shutil.rmtree(home)
    assert result.ok, result.stderr
    assert result.stdout.split() == [python, "FileNotFoundError"]


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="no system call table here")
@pytest.mark.parametrize("namespaces", [m for m in MODES if m.values[0] is not False])
def test_the_kernels_exposed_calls_are_refused_and_ordinary_processes_still_start(namespaces):
    """The seccomp filter: a new user namespace (unshare, or clone with CLONE_NEWUSER), ptrace, bpf, io_uring and
    a new mount API call fail with EPERM (without the filter, an unprivileged uid here may make a user namespace
    and be root inside it); fork, a thread and a shell (processes=8) still run. The fallback blocks ctypes, so
    it is covered by the report alone."""
    x86 = os.uname().machine == "x86_64"
    calls = {"unshare": (272 if x86 else 97, 0x10000000), "clone_newuser": (56 if x86 else 220, 0x10000000 | 17),
             "ptrace": (101 if x86 else 117, 0), "bpf": (321 if x86 else 280, 0), "io_uring_setup": (425, 1),
             "fsopen": (430, 0)}
    code = f"""import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for name, (number, arg) in {calls!r}.items():
    result = libc.syscall(ctypes.c_long(number), ctypes.c_ulong(arg), 0, 0, 0, 0)
    print(name, result, ctypes.get_errno())
pid = os.fork()
if pid == 0:
    os._exit(7)
print('fork', os.waitpid(pid, 0)[1] >> 8)
thread = threading.Thread(target=print, args=('thread',))
thread.start()
thread.join()
print('shell', subprocess.run(['/bin/sh', '-c', 'echo ok'], capture_output=True, text=True).stdout.strip())"""
    result = run(code, namespaces, processes=8, wall_s=10)
    assert result.ok, result.stderr
    assert result.isolation["syscalls"].startswith("seccomp")
    lines = result.stdout.splitlines()
    assert lines[: len(calls)] == [f"{name} -1 1" for name in calls]  # EPERM
    assert lines[len(calls):] == ["fork 7", "thread", "shell ok"]
    assert run("pass", False).isolation["syscalls"].startswith("seccomp")


@pytest.mark.parametrize("namespaces", MODES)
def test_printing_1_gb_hits_the_output_limit(namespaces):
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 1_000_000)", namespaces)
    assert result.limit == "output" and len(result.stdout) <= SMALL["output_bytes"]
    assert run("print('x' * 2**30)", namespaces).limit in ("memory", "output")


def test_isolation_is_reported():
    report = isolation_report()
    assert set(report) == {"network", "filesystem", "processes", "user", "syscalls"}
    fallback = isolation_report({"namespaces": False})
    assert fallback["network"] == "audit-hook" and fallback["filesystem"] == "audit-hook"


def test_concurrent_runs_do_not_interfere():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})", limits=SMALL), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]
