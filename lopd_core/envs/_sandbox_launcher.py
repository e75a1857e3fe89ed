"""The first program of every sandbox run: it builds the isolation, applies the limits and runs the user's file.

This file is executed by a bare interpreter (``python -I -S``), so it uses the standard library only and must
not import ``lopd_core``. It is started by :mod:`lopd_core.envs.sandbox` with two arguments, a run id (so
that its processes can be told apart in ``ps``) and the number of an inherited ``memfd`` that holds a JSON
object: the settings and the files of the run. It reports back through an inherited pipe (``status_fd``):
one JSON line from the launcher with the isolation it built, one from the child with the limits and
privilege drop it applied, and after the program ended one line with its exit code / signal and CPU time.

Process tree in the isolated modes (``root``: started as root; ``userns``: started as an ordinary user,
isolated through an unprivileged user namespace, as bubblewrap does)::

    lopd (a worker thread) ── launcher ── init (pid 1 of a new PID namespace) ── program
                            PDEATHSIG      PDEATHSIG + life pipe

The launcher and init each ask the kernel for SIGKILL when their parent dies (``PR_SET_PDEATHSIG``; it
follows the thread that spawned the process, and the lopd thread that starts a sandbox waits for it, so it
only dies with the whole lopd process) and check that the parent had not died already. When init dies, the
kernel kills every process of its PID namespace (a fork bomb, a ``setsid`` daemon), and the namespace's
mounts, including the working directory, are freed: a run leaves no process and no file on the host.

Init builds the file system in a private mount namespace: a fresh root on ``tmpfs`` holding read-only bind
mounts of the system directories (``/usr``, ``/etc``, ``/lib*``, ``/bin``, ``/sbin``) and of the interpreter's
prefix, device nodes (null, zero, full, random, urandom), a fresh ``/proc``, and one size-limited ``tmpfs``
that provides the writable places: the working directory ``/sandbox`` and ``/tmp``, ``/var/tmp``,
``/dev/shm``. Site-packages and the paths the caller lists are covered by empty read-only mounts. It then
``pivot_root``s into it and detaches the host's tree, so the project, the workspace, home directories,
``/run`` (and its sockets) are not there at all. The root itself is remounted read-only.

The child drops every capability (root: to uid/gid 65534; userns: ``capset`` to nothing, it keeps the
caller's uid), clears the capability bounding set, sets ``PR_SET_NO_NEW_PRIVS`` and installs a seccomp filter
(x86_64 and aarch64) that refuses to create namespaces (``unshare``, ``clone`` with namespace flags,
``clone3``), to mount, to ``pivot_root``/``chroot``, keyrings, ``bpf``, ``perf_event_open``, ``ptrace``,
``io_uring``, kernel modules and kexec. In the ``userns`` mode init also sets
``user.max_user_namespaces = 0`` for the sandbox's user namespace.

Mode ``none`` (no namespaces; only when the caller opted in to running uncontained) runs the program in a
host directory with the limits, the privilege drop (as root), no-new-privileges and seccomp only.

It is not a security boundary on its own; see the module docstring of :mod:`lopd_core.envs.sandbox`.
"""

import json
import os
import resource
import select
import signal
import sys

MEMORY_EXIT_CODE = 199
"""Exit code the child uses when the user program died of MemoryError (the parent maps it to 'memory')."""
REFUSED_EXIT_CODE = 126
CHANNEL_FD = 3
WORKDIR = "/sandbox"

SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = (("work", WORKDIR, 0o700), ("tmp", "/tmp", 0o1777), ("vartmp", "/var/tmp", 0o1777),
           ("shm", "/dev/shm", 0o1777))

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 22, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4

# Syscall numbers per architecture: (audit arch, pivot_root, clone, clone3, refused syscalls). The refused
# ones: unshare, setns, mount, umount2, pivot_root, chroot, keyctl, add_key, request_key, bpf,
# perf_event_open, userfaultfd, kexec_load, kexec_file_load, init_module, finit_module, delete_module,
# io_uring_setup/enter/register, open_tree, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr,
# open_by_handle_at, ptrace, process_vm_readv, process_vm_writev.
_ARCH = {
    "x86_64": (0xC000003E, 155, 56, 435, (272, 308, 165, 166, 155, 161, 250, 248, 249, 321, 298, 323, 246, 320,
                                          175, 313, 176, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442, 304,
                                          101, 310, 311)),
    "aarch64": (0xC00000B7, 41, 220, 435, (97, 268, 40, 39, 41, 51, 219, 217, 218, 280, 241, 282, 104, 294, 105,
                                           273, 106, 425, 426, 427, 428, 429, 430, 431, 432, 433, 442, 265, 117,
                                           270, 271)),
}
_NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET

_libc = None


def libc():
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.unshare.argtypes = [ctypes.c_int]
        lib.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = lib
    return _libc


def _check(rc, what):
    if rc != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def prctl(option, arg2=0, arg3=0, arg4=0, arg5=0):
    return libc().prctl(option, arg2, arg3, arg4, arg5)


def _bytes(text):
    return text.encode() if isinstance(text, str) else text


def mount(source, target, fstype, flags, data=None):
    _check(libc().mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), f"mount {target}")


def emit(fd, obj):
    os.write(fd, (json.dumps(obj) + "\n").encode())


# -------------------------------------------------------------------------------------------- file system
def _unescape(field):
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts_under(path):
    with open("/proc/self/mountinfo") as f:
        points = [_unescape(line.split()[4]) for line in f]
    return [p for p in points if p == path or p.startswith(path.rstrip("/") + "/")]


def _locked_flags(path):
    """The flags a remount must keep (a user namespace may not clear them on mounts it did not create)."""
    have = os.statvfs(path).f_flag
    flags = 0
    for st, ms in ((os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
                   (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                   (os.ST_RELATIME, MS_RELATIME)):
        if have & st:
            flags |= ms
    return flags


def _bind_readonly(source, target):
    mount(source, target, None, MS_BIND | MS_REC)
    for point in _mounts_under(target):
        mount(None, point, None, _locked_flags(point) | MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _covered(path, roots):
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _interpreter_dirs():
    """Directories the running interpreter needs after the pivot (its prefix, outside the system dirs)."""
    real = [os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable))]
    system = [os.path.realpath(d) for d in SYSTEM_DIRS if os.path.exists(d)]
    out = []
    for path in real:
        if os.path.isdir(path) and not _covered(path, system + out) and path != "/":
            out.append(path)
    return out


def _site_dirs():
    import site

    dirs = list(site.getsitepackages())
    try:
        dirs.append(site.getusersitepackages())
    except (AttributeError, OSError):
        pass
    return dirs


def _write_files(workdir, files, uid, gid):
    for name, content in files.items():
        rel = os.path.normpath(name)
        if os.path.isabs(rel) or rel.startswith(".."):
            raise ValueError(f"sandbox file name {name!r} is not inside the working directory")
        path = os.path.join(workdir, rel)
        parent = os.path.dirname(path)
        if parent != workdir:
            os.makedirs(parent, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(content.encode("utf-8"))
        if uid is not None:
            os.chown(path, uid, gid)
            while parent != workdir:
                os.chown(parent, uid, gid)
                parent = os.path.dirname(parent)


def _build_root(cfg, report):
    """Private mount namespace → a fresh read-only root with a size-limited writable scratch; pivot into it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount may propagate to the host
    root = next(d for d in ("/tmp", "/mnt", "/media", "/opt", "/srv", "/home") if os.path.isdir(d) and not os.path.islink(d))
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    report["mount_namespace"] = True

    # One tmpfs for everything writable, so a single size limit covers the working directory and /tmp.
    scratch = root + "/.scratch"
    os.mkdir(scratch)
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['workdir_mb'])}m,mode=0755")
    owner = (cfg["uid"], cfg["gid"]) if cfg["mode"] == "root" else (None, None)
    for sub, _, mode in SCRATCH:
        os.mkdir(f"{scratch}/{sub}")
        os.chmod(f"{scratch}/{sub}", mode)
        if sub == "work" and owner[0] is not None:
            os.chown(f"{scratch}/{sub}", *owner)
    _write_files(f"{scratch}/work", cfg["files"], *owner)

    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), root + path)
        elif os.path.isdir(path):
            os.makedirs(root + path)
            _bind_readonly(path, root + path)
    for path in _interpreter_dirs():
        os.makedirs(root + path, exist_ok=True)
        _bind_readonly(path, root + path)

    os.makedirs(root + "/dev", exist_ok=True)
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{root}/dev/{name}", "w").close()
            mount("/dev/" + name, f"{root}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    for sub, target, _ in SCRATCH:
        os.makedirs(root + target, exist_ok=True)
        mount(f"{scratch}/{sub}", root + target, None, MS_BIND)
    _check(libc().umount2(scratch.encode(), MNT_DETACH), "detaching the scratch mount")
    os.rmdir(scratch)
    report["private_tmp"] = report["workdir_quota"] = True

    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    # Site-packages (where lopd itself or its data may be installed) and the caller's paths: empty, read-only.
    needed = [os.path.realpath(d) for d in (*SYSTEM_DIRS, *_interpreter_dirs(), os.path.dirname(os.__file__))]
    for path in [*cfg.get("hide", []), *_site_dirs()]:
        path = os.path.realpath(path)
        target = root + path
        if os.path.islink(target) or not os.path.exists(target) or any(_covered(n, [path]) for n in needed):
            continue  # absent, or a directory the interpreter itself needs (never hide /usr as 'a prefix')
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
        else:
            mount("/dev/null", target, None, MS_BIND)

    if cfg["mode"] == "userns":
        # Per user namespace: no namespace created in the sandbox's own user namespace may nest another one.
        try:
            with open(root + "/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("0")
            report["userns_sysctl"] = True
        except OSError:
            report["userns_sysctl"] = False

    if os.uname().machine not in _ARCH:
        raise OSError(38, f"pivot_root: no syscall number known for {os.uname().machine}")
    os.chdir(root)
    _check(libc().syscall(_ARCH[os.uname().machine][1], b".", b"."), "pivot_root")
    _check(libc().umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    report["private_root"] = True
    try:
        _check(libc().sethostname(b"sandbox", 7), "sethostname")
    except OSError:
        pass


# ---------------------------------------------------------------------------------------- the child
def _set_limits(cfg, report):
    def setlim(name, kind, soft, hard=None):
        try:
            resource.setrlimit(kind, (soft, soft if hard is None else hard))
            report[name] = True
        except (ValueError, OSError):
            report[name] = False

    cpu = int(cfg["cpu_seconds"])
    setlim("rlimit_cpu", resource.RLIMIT_CPU, cpu, cpu + 1)
    setlim("rlimit_as", resource.RLIMIT_AS, int(cfg["memory_mb"]) * 1024 * 1024)
    setlim("rlimit_nproc", resource.RLIMIT_NPROC, int(cfg["max_processes"]))
    setlim("rlimit_fsize", resource.RLIMIT_FSIZE, int(cfg["max_file_mb"]) * 1024 * 1024)
    setlim("rlimit_nofile", resource.RLIMIT_NOFILE, 256)
    setlim("rlimit_core", resource.RLIMIT_CORE, 0)


def _drop_bounding_set():
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)


def _clear_capabilities():
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()
    _check(libc().capset(ctypes.byref(header), data), "capset")


def _drop_privileges(cfg):
    mode = cfg["mode"]
    if mode == "userns" or (mode == "none" and os.geteuid() != 0):
        if mode == "userns":
            _drop_bounding_set()
            _clear_capabilities()
        return
    uid, gid = int(cfg["uid"]), int(cfg["gid"])
    _drop_bounding_set()
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _seccomp_program():
    arch, _, clone, clone3, refused = _ARCH[os.uname().machine]
    ld_abs, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld_abs, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld_abs, 0, 0, 0)]
    if arch == 0xC000003E:  # x32 syscalls (nr | 0x40000000) would bypass the numbers below
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, kill)]
    for nr in refused:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    # clone3 passes its flags in memory a filter cannot read: ENOSYS makes glibc fall back to clone.
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, enosys)]
    prog += [(jeq, 0, 3, clone), (ld_abs, 0, 0, 16), (jset, 0, 1, _NAMESPACE_FLAGS), (ret, 0, 0, eperm)]
    prog += [(ret, 0, 0, allow)]
    return prog


def _install_seccomp():
    import ctypes

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    if os.uname().machine not in _ARCH:
        return False
    insns = _seccomp_program()
    table = (Filter * len(insns))(*[Filter(*i) for i in insns])
    program = Program(len(insns), table)
    _check(prctl(PR_SET_SECCOMP, 2, ctypes.addressof(program)), "seccomp")
    return True


def _status_fields():
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except OSError:
        pass
    return fields


def _run_child(cfg, status_fd, workdir, launcher):
    report = {}
    _set_limits(cfg, report)
    # The program gets stdin/stdout/stderr and the result channel on fd 3; nothing else stays open.
    import fcntl

    status_fd = fcntl.fcntl(status_fd, fcntl.F_DUPFD_CLOEXEC, 64)
    os.dup2(int(cfg["channel_fd"]), CHANNEL_FD)
    os.closerange(CHANNEL_FD + 1, status_fd)
    os.closerange(status_fd + 1, 4096)
    errors = []
    try:
        _drop_privileges(cfg)
    except OSError as exc:
        errors.append(f"privilege drop: {exc}")
    report["no_new_privs"] = prctl(PR_SET_NO_NEW_PRIVS, 1) == 0
    try:
        report["seccomp"] = _install_seccomp()
    except OSError as exc:
        errors.append(str(exc))
        report["seccomp"] = False
    status = _status_fields()
    caps_gone = all(status.get(k, "1").strip("0") == "" for k in ("CapEff", "CapPrm", "CapAmb"))
    if cfg["mode"] == "userns":
        report["unprivileged_user"] = int(cfg["host_uid"]) != 0 and caps_gone
    else:
        report["unprivileged_user"] = os.getuid() != 0 and os.geteuid() != 0 and caps_gone
    report["no_new_privs"] = report["no_new_privs"] and status.get("NoNewPrivs", "1") == "1"
    report["seccomp"] = report["seccomp"] and status.get("Seccomp", "2") == "2"
    if errors:
        report["errors"] = errors
    os.chdir(workdir)
    os.umask(0o077)
    applied = {**launcher, **report}
    applied["no_user_namespaces"] = bool(launcher.get("userns_sysctl") or report["seccomp"])
    missing = [name for name in cfg["required"] if not applied.get(name)]
    if missing:
        report["refused"] = missing
    # The child reports its own protections (only known after setrlimit/setuid), then closes the pipe so the
    # user program cannot write to it.
    emit(status_fd, {"child": report})
    os.close(status_fd)
    if missing:
        os.write(2, f"sandbox: refusing to run the program: not contained ({', '.join(missing)})\n".encode())
        os._exit(REFUSED_EXIT_CODE)

    import runpy
    import traceback

    program = cfg["program"]
    sys.argv = [program, *cfg.get("argv", [])]
    sys.path.insert(0, os.getcwd())
    code = 0
    try:
        runpy.run_path(program, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except MemoryError:
        traceback.print_exc()
        code = MEMORY_EXIT_CODE
    except BaseException:  # noqa: BLE001 - the user's program may raise anything; report it like python would
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed/broken stream must not change the verdict
            pass
    os._exit(code)


def _reap(child):
    """Wait for ``child``, reaping every other process handed to us on the way (we may be pid 1)."""
    while True:
        try:
            got, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return {"cpu_seconds": None, "exit_code": None, "signal": int(signal.SIGKILL)}
        if got == child:
            break
    result = {"cpu_seconds": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        result.update(exit_code=None, signal=os.WTERMSIG(status))
    else:
        result.update(exit_code=os.WEXITSTATUS(status), signal=None)
    return result


def _fork_program(cfg, status_fd, workdir, launcher):
    pid = os.fork()
    if pid == 0:
        try:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
            _run_child(cfg, status_fd, workdir, launcher)
        except BaseException as exc:  # noqa: BLE001 - report the launcher's own failure, then exit
            os.write(2, f"sandbox launcher: {type(exc).__name__}: {exc}\n".encode())
        os._exit(127)
    os.close(int(cfg["channel_fd"]))
    emit(status_fd, {"result": _reap(pid)})
    os.close(status_fd)
    os._exit(0)


def _init(cfg, status_fd, life_r, launcher_tied):
    """Pid 1 of the new PID namespace: build the file system, start the program, reap, report."""
    report = {"pid_namespace": os.getpid() == 1, "network_namespace": not cfg["network"]}
    tied = prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) == 0
    if select.select([life_r], [], [], 0)[0]:
        os._exit(124)  # the launcher died before we asked to die with it
    os.close(life_r)
    prctl(PR_SET_DUMPABLE, 0)
    report["dies_with_parent"] = bool(launcher_tied and tied and report["pid_namespace"])
    try:
        _build_root(cfg, report)
    except (OSError, StopIteration, ValueError) as exc:
        emit(status_fd, {"launcher": {**report, "error": f"building the sandbox's file system failed: {exc}"}})
        os._exit(125)
    emit(status_fd, {"launcher": report})
    _fork_program(cfg, status_fd, WORKDIR, report)


def _unisolated(cfg, status_fd):
    report = {}
    uid, gid = (cfg["uid"], cfg["gid"]) if os.geteuid() == 0 else (None, None)
    _write_files(cfg["workdir"], cfg["files"], uid, gid)
    if uid is not None:
        os.chown(cfg["workdir"], uid, gid)
    emit(status_fd, {"launcher": report})
    _fork_program(cfg, status_fd, cfg["workdir"], report)


def _map_ids(uid, gid):
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def main():
    cfg_fd = int(sys.argv[2])
    os.lseek(cfg_fd, 0, os.SEEK_SET)
    with os.fdopen(cfg_fd, "rb") as f:
        cfg = json.loads(f.read())
    status_fd = int(cfg["status_fd"])
    tied = prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL)) == 0
    if os.getppid() != int(cfg["parent_pid"]):
        os._exit(124)  # lopd died before we asked to die with it
    if cfg["mode"] == "none":
        prctl(PR_SET_DUMPABLE, 0)  # the program (same uid) may not ptrace us or read our fds
        _unisolated(cfg, status_fd)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (0 if cfg["network"] else CLONE_NEWNET)
    uid, gid = os.getuid(), os.getgid()
    cfg["host_uid"] = uid
    try:
        if cfg["mode"] == "userns":
            _check(libc().unshare(flags | CLONE_NEWUSER), "unshare")
            _map_ids(uid, gid)
        else:
            _check(libc().unshare(flags), "unshare")
    except OSError as exc:
        emit(status_fd, {"launcher": {"error": f"creating the namespaces failed: {exc}"}})
        os._exit(125)
    prctl(PR_SET_DUMPABLE, 0)  # after the id maps: it makes /proc/self root-owned
    life_r, life_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(life_w)
        try:
            _init(cfg, status_fd, life_r, tied)
        except BaseException as exc:  # noqa: BLE001 - report the launcher's own failure, then exit
            os.write(2, f"sandbox launcher: {type(exc).__name__}: {exc}\n".encode())
        os._exit(127)
    os.close(life_r)
    os.close(status_fd)
    os.close(int(cfg["channel_fd"]))
    os.waitpid(pid, 0)
    os._exit(0)


if __name__ == "__main__":
    main()
