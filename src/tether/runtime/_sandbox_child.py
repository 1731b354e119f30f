"""The sandbox launcher: trusted code that runs in the child process and then starts the untrusted program.

Run by :mod:`tether.runtime.sandbox` as ``python -I -S _sandbox_child.py`` with a JSON job on stdin
(``code``, ``stdin``, the limits, ``status_fd``, ``uid``, ``namespaces``). Standard library only, and
never imported by tether itself: it is a program, not a module.

Full isolation (root with CAP_SYS_ADMIN, Linux):

1. ``unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)``: a private mount table, a network namespace
   holding only a downed loopback (no route anywhere), and a fresh pid namespace;
2. mounts, private to this child: a fresh size-capped tmpfs on ``/tmp`` (the program's directory is
   ``/tmp/sandbox``; the host's ``/tmp`` is hidden), empty tmpfs on ``/dev/shm``, the interpreter's
   prefix re-exposed if an ancestor directory is closed to others (pyenv under ``/root``), then
   ``/`` remounted read-only;
3. fork: the child is pid 1 of the new pid namespace; it mounts its own ``/proc`` (host processes are
   invisible) and forks the program, so when pid 1 exits or is killed the kernel kills every process
   left in the namespace, however it daemonised;
4. the program: resource limits (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``,
   ``RLIMIT_NOFILE``, no core files), a dedicated unprivileged uid (so ``RLIMIT_NPROC`` counts only
   its processes: the kernel does not apply it to root), an empty environment, ``python -I -S``.

Fallback (no namespaces: not root, or ``namespaces: false``): the same limits and environment in a
fresh host temporary directory (made and removed by the parent), with a Python audit hook that refuses
sockets, process creation (a child would run without the hook), signals to other processes, writes and
file changes outside the directory (``mkfifo`` / ``mknod``, which raise no audit event, are replaced by
checked versions), and reads of other processes' ``/proc`` entries. An audit hook is a tripwire, not a
wall (PEP 578: code that reaches ``ctypes`` can go around it), which is why ``ctypes`` imports are
refused too and why the report names the mechanism that was active. As root, the fallback never runs
the program as root: it runs under the dedicated uid, with an interpreter every user can run (tether's
own, or when that is closed to others, e.g. a pyenv under ``/root``, the parent's ``shared_python``);
when there is none it refuses (status ``{"refused": reason}``) rather than run the program as root.

Status goes to ``status_fd`` as JSON lines: ``{"pid": host pid of the namespace's pid 1}`` (in the
fallback, of the fork that waits for the program) first, in the fallback ``{"program": its pid}``, then
``{"exit": code, "signal": n, "isolation": {...}}``.
"""

import ctypes
import json
import os
import resource
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2

AUDIT_PRELUDE = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_spawn = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
          "pty.spawn"}
def _inside(path):
    try:
        path = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return path == _root or path.startswith(_root + os.sep)
_pid = str(os.getpid())
def _hook(event, args, _spawn=_spawn):
    if event.startswith("socket."):
        raise PermissionError("sandbox: network access is disabled")
    if event in _spawn:
        raise PermissionError("sandbox: process creation is disabled")
    if event in ("os.kill", "os.killpg") and args[0] not in (0, os.getpid()):
        raise PermissionError("sandbox: signalling other processes is disabled")
    if event == "import" and args[0] in ("ctypes", "_ctypes"):
        raise PermissionError("sandbox: ctypes is disabled")
    if event == "open" and isinstance(args[0], (str, bytes)):
        parts = os.path.realpath(os.fsdecode(args[0])).split(os.sep)
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != _pid:
            raise PermissionError("sandbox: other processes' /proc entries are off limits")
        mode, flags = args[1], args[2]
        writing = ((mode is not None and any(c in str(mode) for c in "wax+"))
                   or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)))
        if writing and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing outside the sandbox directory ({args[0]!r})")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.utime",
                 "os.symlink", "os.link", "shutil.rmtree", "os.truncate") and (
            not isinstance(args[0], (str, bytes)) or not _inside(args[0])):
        raise PermissionError(f"sandbox: changing files outside the sandbox directory ({args[0]!r})")
def _confined(real):
    def confined(path, *args, dir_fd=None, **kwargs):
        if dir_fd is not None or not _inside(path):
            raise PermissionError(f"sandbox: making special files outside the sandbox directory ({path!r})")
        return real(path, *args, **kwargs)
    return confined
import posix
for _name in ("mkfifo", "mknod"):  # no audit event exists for these: replaced before the program runs
    setattr(posix, _name, _confined(getattr(posix, _name)))
    setattr(os, _name, getattr(posix, _name))
sys.addaudithook(_hook)
del _hook
import runpy
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
'''


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _expose_prefix(libc, prefix):
    """Make ``prefix`` reachable for an unprivileged uid when an ancestor is closed to others
    (e.g. a pyenv interpreter under a 0700 ``/root``): a tmpfs over that ancestor, holding only
    the path down to a read-only bind of the prefix."""
    parts = prefix.strip("/").split("/")
    ancestors = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
    closed = next((a for a in ancestors if not os.stat(a).st_mode & stat.S_IXOTH), None)
    if closed is None:
        return
    stage = "/tmp/.tether-prefix"
    os.mkdir(stage)
    _mount(libc, prefix, stage, None, MS_BIND | MS_REC)
    _mount(libc, "tmpfs", closed, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    os.makedirs(prefix, mode=0o755)
    _mount(libc, stage, prefix, None, MS_BIND | MS_REC)
    _mount(libc, None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    libc.umount2(stage.encode(), MNT_DETACH)
    os.rmdir(stage)


def _isolate_filesystem(libc, job):
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['disk_kb']}k,mode=1777")
    if os.path.isdir("/dev/shm"):
        _mount(libc, "tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
    _expose_prefix(libc, job["prefix"])
    _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _set_limits(job):
    cpu = max(1, int(job["cpu_s"] + 0.999))
    memory = job["memory_mb"] * 2**20
    limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
              (resource.RLIMIT_FSIZE, (job["file_size_kb"] * 1024,) * 2), (resource.RLIMIT_CORE, (0, 0)),
              (resource.RLIMIT_NOFILE, (64, 64))]
    if job["uid"] is not None or os.geteuid() != 0:  # the kernel never applies RLIMIT_NPROC to root
        limits.append((resource.RLIMIT_NPROC, (job["processes"], job["processes"])))
    for kind, value in limits:
        resource.setrlimit(kind, value)


def _program(job, workdir, isolation):
    """In the forked child: write the program, drop privileges, set limits, exec the interpreter."""
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(job["code"])
    with open(os.path.join(workdir, ".stdin"), "w") as f:
        f.write(job["stdin"])
    fd = os.open(os.path.join(workdir, ".stdin"), os.O_RDONLY)
    os.unlink(os.path.join(workdir, ".stdin"))
    os.dup2(fd, 0)
    os.close(fd)
    uid = job["uid"]
    if uid is not None:
        for root, dirs, files in os.walk(workdir):
            for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                os.chown(name, uid, uid)
    os.chdir(workdir)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _set_limits(job)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    argv = [job["python"], "-I", "-S", "-B"]
    if isolation["network"] == "namespace":
        argv.append("main.py")
    else:  # a child process would run without the audit hook: the hook refuses process creation outright
        argv += ["-c", AUDIT_PRELUDE]
    os.execve(job["python"], argv, {})


def _wait_status(pid):
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"exit": None, "signal": os.WTERMSIG(status)}
    return {"exit": os.WEXITSTATUS(status), "signal": None}


def _init(job, isolation, report):
    """pid 1 of the new pid namespace: its own /proc, then the program as its only child."""
    libc = _libc()
    try:
        _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        isolation["processes"] += " (host /proc visible)"
    workdir = "/tmp/sandbox"
    os.mkdir(workdir, 0o700)
    pid = os.fork()
    if pid == 0:
        _child(job, workdir, isolation)
    report({**_wait_status(pid), "isolation": isolation})
    os._exit(0)


def _child(job, workdir, isolation):
    try:
        _program(job, workdir, isolation)
    except BaseException as err:
        os.write(2, f"sandbox: could not start the program: {type(err).__name__}: {err}\n".encode())
    os._exit(126)


def _try_unshare(libc, flag):
    return libc.unshare(ctypes.c_int(flag)) == 0


def main():
    job = json.loads(sys.stdin.buffer.read())
    status = os.fdopen(job["status_fd"], "w", buffering=1)

    def report(obj):
        status.write(json.dumps(obj) + "\n")

    isolation = {"network": "audit-hook", "filesystem": "audit-hook", "processes": "rlimit", "user": "unchanged"}
    namespaces = False
    if job["namespaces"] and sys.platform.startswith("linux") and os.geteuid() == 0:
        libc = _libc()
        namespaces = _try_unshare(libc, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
        if namespaces:
            try:
                _isolate_filesystem(libc, job)
            except OSError as err:
                os.write(2, f"sandbox: filesystem isolation failed: {err}\n".encode())
                os._exit(125)
    if namespaces:
        isolation.update(network="namespace", filesystem="namespace (read-only root, private tmpfs /tmp)",
                         processes="pid namespace + RLIMIT_NPROC")
    else:
        isolation["processes"] = "audit-hook (no process creation)"
    if os.geteuid() == 0 and not namespaces and job["shared_python"] is not None:
        if not job["shared_python"]:
            report({"refused": "the fallback sandbox never runs a program as root, and no Python here can be "
                               f"run by an unprivileged user ({job['python']} is closed to other users): set "
                               "the sandbox's `python` to an interpreter every user can run, install python3 "
                               "under /usr/bin, or run where Linux namespaces are permitted"})
            os._exit(3)
        job["python"] = job["shared_python"]  # its own stdlib: the program needs nothing of tether's
    if os.geteuid() == 0:
        isolation["user"] = f"uid {job['uid']}"
    else:
        job["uid"] = None
    pid = os.fork()
    if pid == 0:
        if namespaces:
            _init(job, isolation, report)
        child = os.fork()  # the fallback: the host directory made (and removed) by the parent
        if child == 0:
            _child(job, job["workdir"], isolation)
        report({"program": child})  # the parent kills the program alone; this process then reaps it
        report({**_wait_status(child), "isolation": isolation})
        os._exit(0)
    report({"pid": pid})
    os.waitpid(pid, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
