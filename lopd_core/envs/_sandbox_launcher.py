"""The first program inside the sandbox: it applies the limits, drops privileges and runs the user's file.

This file is executed by a bare interpreter (``python -I -S``), so it uses the standard library only and
must not import ``lopd_core``. It is started as root (inside the namespaces ``unshare`` created, when
available) with one argument, a JSON object of settings written by :mod:`lopd_core.envs.sandbox`, and an
inherited pipe on file descriptor ``status_fd`` through which it reports back to the parent:

1. one JSON line with the protections that were actually applied;
2. after the user program ended, one JSON line with its exit code / signal and CPU seconds.

The launcher forks: the child applies rlimits, drops to the unprivileged uid/gid, closes the status pipe
and runs the user file with :mod:`runpy`; the parent waits. When the launcher is pid 1 of a fresh PID
namespace, its exit makes the kernel kill every process the user program left behind (a fork bomb, a
daemonised child) — and because the user program is *not* pid 1, it receives signals normally.

It is not a security boundary on its own; see the module docstring of :mod:`lopd_core.envs.sandbox`.
"""

import json
import os
import resource
import sys

MEMORY_EXIT_CODE = 199
"""Exit code the child uses when the user program died of MemoryError (the parent maps it to 'memory')."""


def _mount_private_tmp(report, workdir, workdir_fd):
    """Fresh tmpfs on the world-writable directories (only inside a private mount namespace).

    The working directory usually lives under /tmp: it is bind-mounted back at the same path afterwards.
    """
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    ms_nosuid, ms_nodev = 2, 4
    done = []
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        if not os.path.isdir(target):
            continue
        rc = libc.mount(b"tmpfs", target.encode(), b"tmpfs", ms_nosuid | ms_nodev, b"size=64m,mode=1777")
        if rc == 0:
            done.append(target)
    hidden = [t for t in done if workdir == t or workdir.startswith(t.rstrip("/") + "/")]
    if hidden:
        ms_bind = 4096
        os.makedirs(workdir, exist_ok=True)
        if libc.mount(f"/proc/self/fd/{workdir_fd}".encode(), workdir.encode(), None, ms_bind, None) != 0:
            raise OSError(ctypes.get_errno(), "bind-mounting the working directory back failed")
    report["private_tmp"] = bool(done) and "/tmp" in done


def _set_limits(cfg, report):
    def setlim(name, kind, value):
        try:
            resource.setrlimit(kind, (value, value))
            report[name] = True
        except (ValueError, OSError):
            report[name] = False

    cpu = int(cfg["cpu_seconds"])
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        report["rlimit_cpu"] = True
    except (ValueError, OSError):
        report["rlimit_cpu"] = False
    setlim("rlimit_as", resource.RLIMIT_AS, int(cfg["memory_mb"]) * 1024 * 1024)
    setlim("rlimit_nproc", resource.RLIMIT_NPROC, int(cfg["max_processes"]))
    setlim("rlimit_fsize", resource.RLIMIT_FSIZE, int(cfg["max_file_mb"]) * 1024 * 1024)
    setlim("rlimit_nofile", resource.RLIMIT_NOFILE, 256)
    setlim("rlimit_core", resource.RLIMIT_CORE, 0)


def _drop_privileges(cfg, report):
    uid, gid = int(cfg["uid"]), int(cfg["gid"])
    if os.geteuid() != 0:
        # Already unprivileged (not started as root): nothing to drop, but nothing to gain either.
        report["unprivileged_user"] = True
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    report["unprivileged_user"] = os.getuid() == uid and os.geteuid() == uid and os.getegid() == gid


def _run_child(cfg, workdir_fd, status_fd):
    report = {}
    _set_limits(cfg, report)
    try:
        _drop_privileges(cfg, report)
    except OSError as exc:  # the parent's verdict will say the user was not dropped
        report["unprivileged_user"] = False
        report["drop_error"] = str(exc)
    os.fchdir(workdir_fd)
    os.close(workdir_fd)
    os.umask(0o077)
    # The child reports its own protections (they are only known after setrlimit/setuid), then closes the pipe
    # so the user program cannot write to it.
    os.write(status_fd, (json.dumps({"child": report}) + "\n").encode())
    os.close(status_fd)
    if cfg["require_drop"] and not report.get("unprivileged_user"):
        os.write(2, b"sandbox: could not drop privileges; refusing to run the program as root\n")
        os._exit(126)

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


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = int(cfg["status_fd"])
    report = {"pid_namespace": os.getpid() == 1}
    # Open the working directory first: it may live under /tmp, which the private tmpfs is about to hide.
    workdir_fd = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    if cfg.get("private_tmp") and report["pid_namespace"]:
        try:
            _mount_private_tmp(report, os.path.realpath(cfg["workdir"]), workdir_fd)
        except OSError:
            report["private_tmp"] = False
    else:
        report["private_tmp"] = False
    os.write(status_fd, (json.dumps({"launcher": report}) + "\n").encode())

    pid = os.fork()
    if pid == 0:
        try:
            _run_child(cfg, workdir_fd, status_fd)
        except BaseException as exc:  # noqa: BLE001 - report the launcher's own failure, then exit
            os.write(2, f"sandbox launcher: {type(exc).__name__}: {exc}\n".encode())
        os._exit(127)
    os.close(workdir_fd)
    # As pid 1 we also inherit orphans: reap everything until our child is reported.
    while True:
        try:
            got, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            status, usage = 0, None
            break
        if got == pid:
            break
    result = {"cpu_seconds": (usage.ru_utime + usage.ru_stime) if usage else None}
    if os.WIFSIGNALED(status):
        result.update(exit_code=None, signal=os.WTERMSIG(status))
    else:
        result.update(exit_code=os.WEXITSTATUS(status), signal=None)
    os.write(status_fd, (json.dumps({"result": result}) + "\n").encode())
    os.close(status_fd)
    os._exit(0)


if __name__ == "__main__":
    main()
