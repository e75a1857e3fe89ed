"""The code sandbox: every piece of model-generated code runs here, never in the caller's process.

One call runs one Python program in a fresh process tree and returns a :class:`Verdict` (status ``ok`` /
``error`` / ``timeout`` / ``memory`` / ``killed``, exit code, capped stdout/stderr, seconds, and which
protections were applied). :func:`run_batch` runs many programs concurrently (threads waiting on
subprocesses; the default is one worker per CPU core).

What it protects against (each is applied when the machine allows it, and reported in
``Verdict.protections``; anything missing is listed in ``Verdict.uncontained``):

- **runaway time**: a wall-clock deadline (the whole process group is SIGKILLed) and ``RLIMIT_CPU``;
- **memory bombs**: ``RLIMIT_AS`` (address space), so allocation fails with ``MemoryError`` → ``memory``;
- **fork bombs / leftover processes**: ``RLIMIT_NPROC`` for the unprivileged user, a new process group,
  and — with ``unshare`` as root — a private PID namespace whose init is our launcher, so every process
  the program started dies with it (even ones that called ``setsid``);
- **network**: a private network namespace (``unshare --net``: only a down loopback device);
- **the file system**: the program runs as an unprivileged uid/gid (65534, "nobody"; root would ignore
  the process limit and every file permission) in a fresh temporary directory it owns, with private
  ``tmpfs`` mounts over ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (a private mount namespace), ``umask 077``,
  ``RLIMIT_FSIZE`` on every file it writes;
- **secrets in the environment**: the program gets a scrubbed environment (``PATH``, ``HOME`` = its
  directory, ``LANG``, ``PYTHONHASHSEED``, ``PYTHONDONTWRITEBYTECODE``) and a bare interpreter
  (``python -I -S``: no site-packages, no user site, no ``PYTHON*`` variables); with the PID namespace and
  a fresh ``/proc`` it cannot see host processes (nor read their ``/proc/<pid>/environ``);
- **huge output**: stdout and stderr are capped (``max_output_bytes`` kept, the rest drained up to
  ``hard_output_bytes``; beyond that the program is killed).

What it does NOT protect against:

- reading world-readable files of the host (the file system is not hidden, only write-protected by
  permissions): do not keep secrets in world-readable files on a machine that runs untrusted code;
- kernel exploits, side channels, CPU starvation of other processes beyond the limits above, and disk
  use by many files each under ``RLIMIT_FSIZE`` (the tmpfs mounts are size-capped; the working directory is
  on the host's temp file system and removed at the end);
- a program that deliberately tampers with the test harness running in the same interpreter (reward
  hacking by code that inspects its callers): verifiers only trust what the harness prints;
- ``RLIMIT_NPROC`` counts every process of uid 65534 on the machine, so concurrent sandboxes share it;
- without root (or without ``unshare``) there are no namespaces and no privilege drop: the verdict says so
  (``uncontained``) and the caller decides (``SandboxLimits.require_isolation``).

This is defence in depth for a research pipeline, not a container runtime: for hostile code use a VM or
gVisor/Firecracker around the whole worker.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "memory", "killed"]

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
MEMORY_EXIT_CODE = 199  # keep in sync with _sandbox_launcher.MEMORY_EXIT_CODE
NOBODY = 65534

PROTECTIONS = (
    "process_group", "pid_namespace", "network_namespace", "mount_namespace", "private_tmp",
    "unprivileged_user", "rlimit_cpu", "rlimit_as", "rlimit_nproc", "rlimit_fsize", "scrubbed_env",
    "fresh_workdir", "output_cap",
)


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (not the program's failure)."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed after it."""
    cpu_s: float | None = None
    """CPU-seconds limit (RLIMIT_CPU); None = ceil(timeout_s) + 1."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) in MiB."""
    max_processes: int = 32
    """Process-count limit (RLIMIT_NPROC) of the unprivileged user."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), MiB."""
    max_output_bytes: int = 16_384
    """Bytes of stdout and of stderr kept in the verdict (the rest is counted and dropped)."""
    hard_output_bytes: int = 8 * 1024 * 1024
    """Total output after which the program is killed (status 'killed')."""
    network: bool = False
    """Allow network access (False = a private network namespace)."""
    uid: int = NOBODY
    gid: int = NOBODY
    require_isolation: bool = False
    """Raise SandboxError instead of running when namespaces or the privilege drop are unavailable."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"SandboxLimits.timeout_s must be > 0 (got {self.timeout_s})")
        if self.memory_mb < 32:
            raise ValueError(f"SandboxLimits.memory_mb must be >= 32 MiB for a Python interpreter (got {self.memory_mb})")
        if self.max_processes < 1:
            raise ValueError(f"SandboxLimits.max_processes must be >= 1 (got {self.max_processes})")

    @property
    def cpu_seconds(self) -> int:
        return int(self.cpu_s) if self.cpu_s is not None else int(self.timeout_s) + 2


@dataclass
class Verdict:
    status: Status
    exit_code: int | None
    """Exit code of the program; None when it was ended by a signal."""
    stdout: str
    stderr: str
    seconds: float
    signal: str | None = None
    """Name of the signal that ended the program (SIGSEGV, SIGKILL, …), if any."""
    reason: str = ""
    """One line saying why the status is not 'ok'."""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    cpu_seconds: float | None = None
    protections: dict[str, bool] = field(default_factory=dict)

    @property
    def uncontained(self) -> list[str]:
        """Protections that were not applied for this run."""
        return [name for name in PROTECTIONS if not self.protections.get(name, False)]

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "uncontained": self.uncontained}


# --------------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def isolation_available() -> tuple[str, ...]:
    """The ``unshare`` flags that work on this machine (empty when namespaces are unavailable)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return ()
    for flags in (("--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"),
                  ("--net", "--pid", "--fork", "--kill-child"), ("--net",)):
        try:
            done = subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return (unshare, *flags)
    return ()


def _world_traversable(path: str) -> bool:
    """Every ancestor directory of ``path`` can be entered by any user (o+x)."""
    current = Path(path).resolve()
    for parent in [current, *current.parents]:
        try:
            mode = parent.stat().st_mode
        except OSError:
            return False
        if parent != current and not mode & 0o001:
            return False
    return True


@lru_cache(maxsize=1)
def sandbox_interpreter() -> str:
    """The Python the sandbox runs: this one when the unprivileged user can reach it and its standard
    library, else the system ``python3`` (e.g. when this interpreter lives under root's 0700 home)."""
    stdlib = os.path.dirname(os.__file__)
    if os.geteuid() != 0 or (_world_traversable(sys.executable) and _world_traversable(stdlib)):
        return sys.executable
    for candidate in (getattr(sys, "_base_executable", ""), "/usr/bin/python3", shutil.which("python3") or ""):
        if candidate and _world_traversable(candidate):
            try:
                probe = subprocess.run([candidate, "-I", "-S", "-c", "import os, json; print(os.path.dirname(json.__file__))"],
                                       capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if probe.returncode == 0 and _world_traversable(probe.stdout.strip()):
                return candidate
    return sys.executable


def _scrubbed_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def _prepare_workdir(files: dict[str, str], limits: SandboxLimits) -> str:
    workdir = tempfile.mkdtemp(prefix="lopd-sandbox-")
    for name, content in files.items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts:
            shutil.rmtree(workdir, ignore_errors=True)
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the working directory")
        path = Path(workdir, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    if os.geteuid() == 0:
        for root, dirs, names in os.walk(workdir):
            for entry in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, n) for n in names)]:
                os.chown(entry, limits.uid, limits.gid)
    os.chmod(workdir, 0o700)
    return workdir


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Capped:
    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.chunks: list[bytes] = []
        self.kept = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - self.kept
        if room > 0:
            self.chunks.append(data[:room])
            self.kept += min(room, len(data))

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")

    @property
    def truncated(self) -> bool:
        return self.total > self.kept


# --------------------------------------------------------------------------------------------------
def run_python(code: str, *, limits: SandboxLimits | None = None, files: dict[str, str] | None = None,
               stdin: str = "", argv: list[str] | None = None) -> Verdict:
    """Run ``code`` as ``main.py`` in a fresh sandbox; ``files`` are extra files put beside it."""
    return run_files({**(files or {}), "main.py": code}, "main.py", limits=limits, stdin=stdin, argv=argv)


def run_file(path: str | Path, *, limits: SandboxLimits | None = None, stdin: str = "") -> Verdict:
    """Run a Python file from the host (copied into the sandbox's fresh directory)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sandbox: no such file {path}; pass the path of a Python file to run")
    return run_python(path.read_text(encoding="utf-8", errors="replace"), limits=limits, stdin=stdin)


def run_files(files: dict[str, str], program: str, *, limits: SandboxLimits | None = None, stdin: str = "",
              argv: list[str] | None = None) -> Verdict:
    """Run ``program`` (one of ``files``) in a fresh sandbox directory holding ``files``."""
    limits = limits or SandboxLimits()
    if program not in files:
        raise ValueError(f"sandbox program {program!r} is not among the files given ({sorted(files)})")
    isolation = isolation_available()
    is_root = os.geteuid() == 0
    if limits.require_isolation and (not isolation or not is_root):
        raise SandboxError("sandbox isolation is unavailable on this machine (needs root and `unshare`); "
                           "set SandboxLimits.require_isolation=False to run with rlimits only")
    workdir = _prepare_workdir(files, limits)
    status_r, status_w = os.pipe()
    cfg = {
        "workdir": workdir, "program": program, "argv": list(argv or []), "status_fd": status_w,
        "uid": limits.uid, "gid": limits.gid, "require_drop": is_root,
        "cpu_seconds": limits.cpu_seconds, "memory_mb": limits.memory_mb,
        "max_processes": limits.max_processes, "max_file_mb": limits.max_file_mb,
        "private_tmp": "--mount" in isolation,
    }
    cmd = [sandbox_interpreter(), "-I", "-S", str(LAUNCHER), json.dumps(cfg)]
    if isolation:
        flags = [f for f in isolation if f != "--net" or not limits.network]
        if len(flags) > 1:
            cmd = [*flags, *cmd]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(status_w,), env=_scrubbed_env(workdir), cwd=workdir, start_new_session=True,
        )
    except OSError as exc:
        os.close(status_r)
        os.close(status_w)
        shutil.rmtree(workdir, ignore_errors=True)
        raise SandboxError(f"sandbox could not start {cmd[0]}: {exc}") from exc
    os.close(status_w)
    try:
        return _supervise(proc, status_r, stdin, limits, start, isolation)
    finally:
        _kill_group(proc.pid)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(proc: subprocess.Popen, status_r: int, stdin: str, limits: SandboxLimits, start: float,
               isolation: tuple[str, ...]) -> Verdict:
    out, err, status_buf = _Capped(limits.max_output_bytes), _Capped(limits.max_output_bytes), bytearray()
    try:
        if stdin:
            proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    sel.register(status_r, selectors.EVENT_READ, None)
    deadline = start + limits.timeout_s
    timed_out = output_killed = False
    open_streams = 3
    while open_streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0 and not timed_out:
            timed_out = True
            _kill_group(proc.pid)
            deadline = time.monotonic() + 2.0  # grace period to drain what is left in the pipes
            continue
        if remaining <= 0:
            break  # something outside the group still holds a pipe: stop reading
        for key, _ in sel.select(timeout=min(remaining, 0.5)):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data is None:
                status_buf.extend(data)
            else:
                key.data.add(data)
        if out.total + err.total > limits.hard_output_bytes and not output_killed:
            output_killed = True
            _kill_group(proc.pid)
        if proc.poll() is not None and not isolation:
            # Without a PID namespace, children left in the group would keep the pipes open.
            _kill_group(proc.pid)
    sel.close()
    os.close(status_r)
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
    seconds = time.monotonic() - start

    launcher, child, result = {}, {}, {}
    for line in bytes(status_buf).decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        launcher.update(msg.get("launcher", {}))
        child.update(msg.get("child", {}))
        result.update(msg.get("result", {}))
    protections = {
        "process_group": True,
        "pid_namespace": bool(launcher.get("pid_namespace")),
        "network_namespace": "--net" in isolation and not limits.network,
        "mount_namespace": "--mount" in isolation,
        "private_tmp": bool(launcher.get("private_tmp")),
        "unprivileged_user": bool(child.get("unprivileged_user")),
        "rlimit_cpu": bool(child.get("rlimit_cpu")),
        "rlimit_as": bool(child.get("rlimit_as")),
        "rlimit_nproc": bool(child.get("rlimit_nproc")),
        "rlimit_fsize": bool(child.get("rlimit_fsize")),
        "scrubbed_env": True,
        "fresh_workdir": True,
        "output_cap": True,
    }
    if limits.network:
        protections.pop("network_namespace")

    if result:
        exit_code, signum = result.get("exit_code"), result.get("signal")
    elif proc.returncode is not None and proc.returncode < 0:
        exit_code, signum = None, -proc.returncode
    else:  # the launcher itself was killed before reporting (timeout / output kill)
        exit_code, signum = None, signal.SIGKILL
    cpu_seconds = result.get("cpu_seconds")
    status, reason = _classify(exit_code, signum, err, timed_out, output_killed, limits, cpu_seconds)
    if not child and not timed_out and not output_killed:
        tail = err.text().strip().splitlines()[-1:] or [""]
        raise SandboxError(f"the sandbox launcher failed before running the program: {tail[0][:300]}")
    return Verdict(
        status=status, exit_code=exit_code, stdout=out.text(), stderr=err.text(), seconds=round(seconds, 4),
        signal=_signal_name(signum) if signum else None, reason=reason, stdout_truncated=out.truncated,
        stderr_truncated=err.truncated, cpu_seconds=cpu_seconds, protections=protections,
    )


def _classify(exit_code, signum, err: _Capped, timed_out: bool, output_killed: bool, limits: SandboxLimits,
              cpu_seconds) -> tuple[Status, str]:
    if timed_out:
        return "timeout", f"wall-clock limit of {limits.timeout_s:g} s exceeded; the process tree was killed"
    if output_killed:
        return "killed", f"output exceeded {limits.hard_output_bytes} bytes; the process tree was killed"
    if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_seconds and cpu_seconds >= limits.cpu_seconds):
        return "timeout", f"CPU limit of {limits.cpu_seconds} s exceeded"
    tail = err.text()[-2000:]
    if exit_code == MEMORY_EXIT_CODE or (exit_code not in (0, None) and "MemoryError" in tail):
        return "memory", f"memory limit of {limits.memory_mb} MiB exceeded (MemoryError)"
    if signum is not None:
        if signum == signal.SIGXFSZ:
            return "killed", f"wrote a file larger than {limits.max_file_mb} MiB (SIGXFSZ)"
        return "killed", f"terminated by {_signal_name(signum)}"
    if exit_code == 0:
        return "ok", ""
    last = next((line for line in reversed(tail.strip().splitlines()) if line.strip()), "")
    return "error", f"exit code {exit_code}" + (f": {last.strip()[:200]}" if last else "")


@dataclass
class SandboxJob:
    """One program for :func:`run_batch`: the files of its directory, which one to run, its stdin."""

    files: dict[str, str]
    program: str = "main.py"
    stdin: str = ""


def run_batch(programs: list[str | dict[str, str] | SandboxJob], *, limits: SandboxLimits | None = None,
              workers: int | None = None) -> list[Verdict]:
    """Run many programs concurrently; an item is source code (run as main.py), a files dict (main.py is
    run) or a :class:`SandboxJob`.

    Verdicts come back in input order. ``workers`` defaults to the number of CPU cores (each sandbox is one
    interpreter; more workers than cores only adds contention).
    """
    limits = limits or SandboxLimits()
    workers = max(1, workers or os.cpu_count() or 1)

    def one(item):
        if isinstance(item, str):
            return run_python(item, limits=limits)
        if isinstance(item, SandboxJob):
            return run_files(item.files, item.program, limits=limits, stdin=item.stdin)
        return run_files(item, "main.py", limits=limits)

    if workers == 1 or len(programs) <= 1:
        return [one(p) for p in programs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, programs))
