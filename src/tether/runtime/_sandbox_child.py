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

Not root (Linux with unprivileged user namespaces): the same, inside a new user namespace in which this
user's uid is root, ``unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)``. Mounts made
there are the user's to undo, so the program first loses every capability (bounding set emptied,
capabilities cleared, ``SECBIT_NOROOT`` locked so exec grants none, no new privileges): it keeps the user's
own file permissions and nothing more. The whole mount tree is made read-only (``mount_setattr`` with
``AT_RECURSIVE``; as root too, since 2026-12-08: a separately mounted ``/home`` or ``/var/tmp`` stayed
writable under a read-only ``/`` alone), the user's home directory is covered by an empty tmpfs (the
interpreter's prefix re-exposed if it lives there), and ``RLIMIT_NPROC`` counts the namespace's processes
only (Linux >= 5.14 counts per user namespace; the launcher and the namespace's pid 1 are two of them, so
the limit is ``processes + 2``).

Fallback (no namespaces: ``namespaces: false``, or a kernel that permits neither): the same limits and environment in a
fresh host temporary directory (made and removed by the parent), with a Python audit hook that refuses
sockets, process creation (a child would run without the hook), signals to other processes, writes and
file changes outside the directory (``mkfifo`` / ``mknod``, which raise no audit event, are replaced by
checked versions), and reads of other processes' ``/proc`` entries. An audit hook is a tripwire, not a
wall (PEP 578: code that reaches ``ctypes`` can go around it), which is why ``ctypes`` imports are
refused too and why the report names the mechanism that was active. As root, the fallback never runs
the program as root: it runs under the dedicated uid, with an interpreter every user can run (tether's
own, or when that is closed to others, e.g. a pyenv under ``/root``, the parent's ``shared_python``);
when there is none it refuses (status ``{"refused": reason}``) rather than run the program as root.

Under every mechanism, last before exec, a seccomp filter (:func:`_install_seccomp`) refuses the system calls
in :data:`DENIED_SYSCALLS` and new namespaces; where this machine has no table here, ``isolation["syscalls"]``
says ``unfiltered``.

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

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 0x1  # 442 on every architecture
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 28, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL, CAPABILITY_VERSION_3 = 4, 0x20080522
# NOROOT, NO_SETUID_FIXUP, KEEP_CAPS (locked off) and NO_CAP_AMBIENT_RAISE, each with its lock bit
SECURE_NO_PRIVILEGE = 0b11101111

# The seccomp filter: system calls a program of the standard library has no use for, which are the kernel's
# most exposed surface or would reach past the sandbox (debugging other processes, kernel modules, mounts,
# new namespaces, io_uring). Numbers (x86-64, aarch64) from the kernel's tables.
DENIED_SYSCALLS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "perf_event_open": (298, 241), "bpf": (321, 280), "userfaultfd": (323, 282), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "swapon": (167, 224), "swapoff": (168, 225),
    "reboot": (169, 142), "setns": (308, 268), "unshare": (272, 97), "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
}
CLONE, CLONE3 = (56, 220), (435, 435)  # clone: refused with a namespace flag; clone3 (flags in memory): ENOSYS,
CLONE_NAMESPACES = 0x7E020000           # so the C library falls back to clone
AUDIT_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38

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


def _inside(path, directory):
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _cover(libc, directory, prefix):
    """An empty read-only tmpfs over ``directory``; when the interpreter's ``prefix`` lies below it, the tmpfs
    holds only the path down to a read-only bind of the prefix."""
    keep = _inside(prefix, directory)
    stage = "/tmp/.tether-prefix"
    if keep:
        os.mkdir(stage)
        _mount(libc, prefix, stage, None, MS_BIND | MS_REC)
    _mount(libc, "tmpfs", directory, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    if keep:
        os.makedirs(prefix, mode=0o755)
        _mount(libc, stage, prefix, None, MS_BIND | MS_REC)
        _mount(libc, None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(prefix))
        libc.umount2(stage.encode(), MNT_DETACH)
        os.rmdir(stage)
    _mount(libc, None, directory, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _closed_ancestor(prefix):
    """The first directory above ``prefix`` that other users cannot search (a pyenv under a 0700 ``/root``), or None."""
    parts = prefix.strip("/").split("/")
    ancestors = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
    return next((a for a in ancestors if not os.stat(a).st_mode & stat.S_IXOTH), None)


def _locked_flags(path):
    """The mount flags a user namespace may not clear on a mount it inherited (a remount must repeat them)."""
    flags = os.statvfs(path).f_flag
    pairs = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
             (os.ST_NOATIME, 1024), (os.ST_NODIRATIME, 2048), (os.ST_RELATIME, 1 << 21))
    return sum(ms for st, ms in pairs if flags & st)


def _read_only_tree(libc):
    """Every mount read-only (``mount_setattr``, Linux >= 5.12), or ``/`` alone where that call is missing."""
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, 0, 0)  # attr_set, attr_clr, propagation, userns_fd
    if libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/", ctypes.c_uint(AT_RECURSIVE),
                    attr, ctypes.c_size_t(ctypes.sizeof(attr))) == 0:
        return
    _mount(libc, None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags("/"))


def _isolate_filesystem(libc, job):
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _read_only_tree(libc)
    _mount(libc, "tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['disk_kb']}k,mode=1777")
    if os.path.isdir("/dev/shm"):
        _mount(libc, "tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=755")
    if job["uid"] is not None:  # root (a user namespace has none): the program's uid must reach the interpreter
        closed = _closed_ancestor(job["prefix"])
        if closed is not None:
            _cover(libc, closed, job["prefix"])
    for directory in job.get("private", []):  # a user namespace: the program is this user; hide their files
        if os.path.isdir(directory) and directory not in ("/", "/tmp"):
            _cover(libc, directory, job["prefix"])


def _enter_user_namespace(libc):
    """Not root: a new user namespace (this uid as its root), with new mount, network and pid namespaces."""
    uid, gid = os.getuid(), os.getgid()
    if not _try_unshare(libc, CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID):
        return False
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as err:  # in new namespaces without a uid: nothing safe to fall back to in this process
        os.write(2, f"sandbox: the user namespace could not map uid {uid}: {err}\n".encode())
        os._exit(125)
    return True


def _drop_capabilities(libc):
    """Give up every capability of the user namespace's root, for good: the program could otherwise undo the
    namespace's mounts. Exec grants none afterwards (``SECBIT_NOROOT`` locked, empty bounding set)."""
    def prctl(*args):
        if libc.prctl(*(ctypes.c_ulong(a) for a in args), *(ctypes.c_ulong(0),) * (5 - len(args))) != 0:
            raise OSError(ctypes.get_errno(), f"prctl{args}: {os.strerror(ctypes.get_errno())}")
    prctl(PR_SET_SECUREBITS, SECURE_NO_PRIVILEGE)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    cap = 0
    while libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), 0, 0, 0) == 0:
        cap += 1
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise OSError(ctypes.get_errno(), f"capset: {os.strerror(ctypes.get_errno())}")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def _set_limits(job, isolation):
    cpu = max(1, int(job["cpu_s"] + 0.999))
    memory = job["memory_mb"] * 2**20
    limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
              (resource.RLIMIT_FSIZE, (job["file_size_kb"] * 1024,) * 2), (resource.RLIMIT_CORE, (0, 0)),
              (resource.RLIMIT_NOFILE, (64, 64))]
    if isolation["user"].startswith("user namespace"):  # the launcher and pid 1 share the program's count
        limits.append((resource.RLIMIT_NPROC, (job["processes"] + 2,) * 2))
    elif job["uid"] is not None or os.geteuid() != 0:  # the kernel never applies RLIMIT_NPROC to real root
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
    _set_limits(job, isolation)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif isolation["user"].startswith("user namespace"):
        _drop_capabilities(_libc())
    if isolation["syscalls"].startswith("seccomp"):
        _install_seccomp(_libc())  # a failure ends the child here: the program never runs unfiltered
    argv = [job["python"], "-I", "-S", "-B"]
    if isolation["network"] == "namespace":
        argv.append("main.py")
    else:  # a child process would run without the audit hook: the hook refuses process creation outright
        argv += ["-c", AUDIT_PRELUDE]
    os.execve(job["python"], argv, {})


def _seccomp_arch():
    """(table column, audit arch) of this machine for the filter, or None where it has no table here."""
    return AUDIT_ARCHES.get(os.uname().machine)


def _install_seccomp(libc):
    """Refuse :data:`DENIED_SYSCALLS` (EPERM), ``clone`` with a namespace flag (EPERM) and ``clone3`` (ENOSYS), kill
    a call through another architecture's entry (32-bit ``int 0x80``, x32), allow the rest. Needs no privilege
    (no new privileges is set first). A BPF program: load, compare, return."""
    column, arch = _seccomp_arch()

    def insn(code, jt, jf, k):
        return (code, jt, jf, k & 0xFFFFFFFF)

    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [insn(load, 0, 0, 4), insn(jeq, 1, 0, arch), insn(ret, 0, 0, SECCOMP_RET_KILL_PROCESS),
               insn(load, 0, 0, 0)]
    if column == 0:  # x32 system calls on x86-64 carry bit 30
        program += [insn(jge, 0, 1, 0x40000000), insn(ret, 0, 0, SECCOMP_RET_KILL_PROCESS)]
    for numbers in DENIED_SYSCALLS.values():
        program += [insn(jeq, 0, 1, numbers[column]), insn(ret, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    program += [insn(jeq, 0, 1, CLONE3[column]), insn(ret, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),
                insn(jeq, 0, 3, CLONE[column]), insn(load, 0, 0, 16), insn(jset, 0, 1, CLONE_NAMESPACES),
                insn(ret, 0, 0, SECCOMP_RET_ERRNO | EPERM), insn(ret, 0, 0, SECCOMP_RET_ALLOW)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*i) for i in program])
    fprog = Program(len(program), filters)  # kept alive across the call that reads it
    for args in ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0)):
        if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
            raise OSError(ctypes.get_errno(), f"seccomp: {os.strerror(ctypes.get_errno())}")


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
    except OSError:  # e.g. a container that masks parts of its /proc: then no /proc rather than the host's
        _mount(libc, "tmpfs", "/proc", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, "size=4k")
        isolation["processes"] += " (no /proc: a private one could not be mounted)"
    if isolation["user"].startswith("user namespace"):  # no nested user namespace (its root would regain
        try:                                             # capabilities there)
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
        except OSError:
            isolation["user"] += ", nested user namespaces permitted"
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

    isolation = {"network": "audit-hook", "filesystem": "audit-hook", "processes": "rlimit", "user": "unchanged",
                 "syscalls": (f"seccomp ({len(DENIED_SYSCALLS)} system calls refused, no new namespaces)"
                              if sys.platform.startswith("linux") and _seccomp_arch() else "unfiltered")}
    namespaces = user_namespace = False
    if job["namespaces"] and sys.platform.startswith("linux"):
        libc = _libc()
        if os.geteuid() == 0:
            namespaces = _try_unshare(libc, CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
        else:
            real_uid = os.getuid()
            namespaces = user_namespace = _enter_user_namespace(libc)
            if user_namespace:
                job["uid"] = None
                isolation["user"] = f"user namespace (uid {real_uid} as its root, no capabilities)"
        if namespaces:
            try:
                _isolate_filesystem(libc, job)
            except OSError as err:
                os.write(2, f"sandbox: filesystem isolation failed: {err}\n".encode())
                os._exit(125)
    if namespaces:
        isolation.update(network="namespace", filesystem="namespace (read-only mounts, private tmpfs /tmp"
                         + (", home hidden)" if user_namespace else ")"), processes="pid namespace + RLIMIT_NPROC")
    else:
        isolation["processes"] = "audit-hook (no process creation)"
    if os.geteuid() == 0 and not namespaces and job["shared_python"] is not None:  # (never in a user ns)
        if not job["shared_python"]:
            report({"refused": "the fallback sandbox never runs a program as root, and no Python here can be "
                               f"run by an unprivileged user ({job['python']} is closed to other users): set "
                               "the sandbox's `python` to an interpreter every user can run, install python3 "
                               "under /usr/bin, or run where Linux namespaces are permitted"})
            os._exit(3)
        job["python"] = job["shared_python"]  # its own stdlib: the program needs nothing of tether's
    if os.geteuid() != 0:  # an ordinary user: no uid to switch to (in a user namespace, uid 0 is this user)
        job["uid"] = None
    elif not user_namespace:
        isolation["user"] = f"uid {job['uid']}"
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
