"""The code sandbox: every piece of model-generated code runs here, never in the caller's process.

One call runs one Python program in a fresh process tree and returns a :class:`Verdict` (status ``ok`` /
``error`` / ``timeout`` / ``memory`` / ``killed`` / ``refused``, exit code, capped stdout/stderr, what the
program wrote to its result channel, seconds, and which protections were applied). :func:`run_batch` runs
many programs concurrently (threads waiting on subprocesses; one worker per CPU core by default), and
:class:`SandboxSession` keeps one program running to exchange lines with it (a verifier calling a candidate
function many times).

The program gets a **result channel**: file descriptor 3, a pipe read by the caller and kept apart from its
stdout (which the program's own prints fill). A verifier reads the candidate's outputs there and decides
pass/fail itself: exit status and printed text never decide.

Isolation modes (chosen once per process by a probe run, :func:`isolation_available`):

- ``root`` (lopd runs as root): namespaces created directly, the program runs as uid/gid 65534;
- ``userns`` (an ordinary user): the same namespaces under an unprivileged user namespace (as bubblewrap
  does); the program keeps the caller's uid with every capability dropped;
- ``none``: neither works (no user namespaces, e.g. a container that forbids them). Then the sandbox
  **refuses** to run model code (status ``refused``, nothing is run) unless the caller opted in with
  ``SandboxLimits(allow_uncontained=True)`` or ``LOPD_SANDBOX_ALLOW_UNCONTAINED=1``; opted in, the
  program runs in a host temporary directory with the rlimits, no-new-privileges, seccomp and (as root) the
  privilege drop only.

What it protects against, in the ``root`` and ``userns`` modes (each is checked and reported in
``Verdict.protections``; anything missing is in ``Verdict.uncontained``, and then the program is refused
before it runs unless the caller opted in):

- **runaway time**: a wall-clock deadline (the process tree is SIGKILLed) and ``RLIMIT_CPU``;
- **leftover processes**: the program runs under pid 1 of a private PID namespace; when that init ends, the
  kernel kills everything the program started (fork bombs, ``setsid`` daemons). The launcher and init die
  with their parent even when lopd is SIGKILLed (``PR_SET_PDEATHSIG``: it follows the spawning thread, and
  the thread that starts a sandbox waits for it to end), so nothing outlives lopd;
- **memory / processes / file size**: ``RLIMIT_AS`` (→ ``memory``), ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``;
- **the file system**: a private mount namespace whose root is a fresh read-only tree holding only the
  system directories (``/usr``, ``/etc``, ``/lib*``, ``/bin``, ``/sbin``) and the interpreter's prefix, read-only,
  with site-packages covered; the project, the workspace (``LOPD_HOME``), home directories, ``/run`` and the
  host's ``/tmp`` are not there at all (nor their unix sockets). The only writable places are the working
  directory ``/sandbox`` and private ``/tmp``, ``/var/tmp``, ``/dev/shm``, all on one ``tmpfs`` of
  ``workdir_mb`` MiB that disappears with the namespace (nothing is written on the host's disk);
- **network**: a private network namespace (only a down loopback; abstract unix sockets are per namespace);
- **privileges**: no capabilities (root: uid 65534; userns: capabilities dropped, bounding set cleared),
  ``PR_SET_NO_NEW_PRIVS``, and a seccomp filter (x86_64, aarch64) that refuses new namespaces — user
  namespaces included —, mounts, ``ptrace``, keyrings, ``bpf``, ``perf_event_open``, ``io_uring`` and module
  loading (userns mode also sets ``user.max_user_namespaces = 0`` inside);
- **secrets in the environment**: a scrubbed environment and a bare interpreter (``python -I -S``); the PID
  namespace hides host processes and their ``/proc/<pid>/environ``;
- **huge output**: stdout, stderr and the channel are capped; beyond ``hard_output_bytes`` the program is
  killed.

What it does NOT protect against:

- reading world-readable files in the system directories (``/etc`` is visible, read-only): keep no secrets
  in world-readable files under ``/etc`` or ``/usr`` on a machine that runs untrusted code;
- kernel exploits through the system calls that remain allowed, side channels, CPU starvation of other
  processes beyond the limits above; in ``root`` mode ``RLIMIT_NPROC`` counts every process of uid 65534,
  so concurrent sandboxes share it;
- anything in mode ``none`` beyond its rlimits: it exists only for machines that cannot do better and only
  when the caller opts in (the program can then read what the user can read, e.g. the project's files).

This is defence in depth for a research pipeline, not a container runtime: for hostile code use a VM or
gVisor/Firecracker around the whole worker.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "memory", "killed", "refused"]
Mode = Literal["root", "userns", "none"]

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
MEMORY_EXIT_CODE = 199  # keep in sync with _sandbox_launcher.MEMORY_EXIT_CODE
CHANNEL_FD = 3  # keep in sync with _sandbox_launcher.CHANNEL_FD
NOBODY = 65534
ALLOW_UNCONTAINED_ENV = "LOPD_SANDBOX_ALLOW_UNCONTAINED"

def allow_uncontained(enabled: bool) -> None:
    """Apply ``rollout.allow_uncontained_sandbox``: when on, opt this process and its children in through
    ``LOPD_SANDBOX_ALLOW_UNCONTAINED`` (sandboxes start from worker threads, engine processes and the verifiers'
    own subprocesses, which all inherit the environment). Off changes nothing: the variable set by hand still counts."""
    if enabled:
        os.environ[ALLOW_UNCONTAINED_ENV] = "1"


PROTECTIONS = (
    "pid_namespace", "network_namespace", "mount_namespace", "private_root", "private_tmp", "workdir_quota",
    "unprivileged_user", "no_new_privs", "seccomp", "no_user_namespaces", "dies_with_parent",
    "rlimit_cpu", "rlimit_as", "rlimit_nproc", "rlimit_fsize", "scrubbed_env", "output_cap",
)
_PARENT_SIDE = ("scrubbed_env", "output_cap")
"""Protections the parent applies itself (the launcher does not check them)."""


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (not the program's failure)."""


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock limit; the whole process tree is killed after it."""
    cpu_s: float | None = None
    """CPU-seconds limit (RLIMIT_CPU); None = int(timeout_s) + 2."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) in MiB."""
    max_processes: int = 32
    """Process-count limit (RLIMIT_NPROC) of the program's user."""
    max_file_mb: int = 16
    """Largest file the program may write (RLIMIT_FSIZE), MiB."""
    max_output_bytes: int = 16_384
    """Bytes of stdout and of stderr kept in the verdict (the rest is counted and dropped)."""
    hard_output_bytes: int = 8 * 1024 * 1024
    """Total output (stdout + stderr + channel) after which the program is killed (status 'killed')."""
    network: bool = False
    """Allow network access (False = a private network namespace)."""
    uid: int = NOBODY
    gid: int = NOBODY
    """The identity the program runs as when lopd runs as root."""
    require_isolation: bool = False
    """Raise SandboxError instead of returning a 'refused' verdict when the program would not be contained."""
    workdir_mb: int = 64
    """Size of the private tmpfs that holds the working directory, /tmp, /var/tmp and /dev/shm, MiB."""
    max_channel_bytes: int = 1024 * 1024
    """Bytes of the result channel kept (more is counted, dropped and flagged: ``channel_truncated``)."""
    allow_uncontained: bool = False
    """Run the program even when some protection is unavailable (also: LOPD_SANDBOX_ALLOW_UNCONTAINED=1)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"SandboxLimits.timeout_s must be > 0 (got {self.timeout_s})")
        if self.memory_mb < 32:
            raise ValueError(f"SandboxLimits.memory_mb must be >= 32 MiB for a Python interpreter (got {self.memory_mb})")
        if self.max_processes < 1:
            raise ValueError(f"SandboxLimits.max_processes must be >= 1 (got {self.max_processes})")
        if self.workdir_mb < 1:
            raise ValueError(f"SandboxLimits.workdir_mb must be >= 1 MiB (got {self.workdir_mb})")

    @property
    def cpu_seconds(self) -> int:
        return int(self.cpu_s) if self.cpu_s is not None else int(self.timeout_s) + 2

    @property
    def uncontained_allowed(self) -> bool:
        return self.allow_uncontained or os.environ.get(ALLOW_UNCONTAINED_ENV, "").lower() in ("1", "true", "yes")

    def required(self) -> list[str]:
        """Protections without which the program is refused (none when the caller opted in)."""
        if self.uncontained_allowed:
            return []
        return [p for p in PROTECTIONS if p not in _PARENT_SIDE and not (p == "network_namespace" and self.network)]


@dataclass
class Verdict:
    status: Status
    exit_code: int | None
    """Exit code of the program; None when it was ended by a signal (or never ran)."""
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
    channel: str = ""
    """What the program wrote to the result channel (file descriptor 3)."""
    channel_truncated: bool = False
    mode: str = ""
    """Isolation mode of the run: 'root', 'userns' or 'none' ('' when nothing ran)."""

    @property
    def uncontained(self) -> list[str]:
        """Protections that were not applied for this run."""
        # A run with network access has no network_namespace entry; any other absent entry is uncontained.
        network_allowed = bool(self.protections) and "network_namespace" not in self.protections
        return [p for p in PROTECTIONS if not self.protections.get(p, False)
                and not (p == "network_namespace" and network_allowed)]

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "uncontained": self.uncontained}


# --------------------------------------------------------------------------------------------------
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
    """The Python the sandbox runs: the base interpreter of this one (never a virtualenv's, whose
    site-packages hold lopd), or the system ``python3`` when, as root, the unprivileged user could not reach
    this one in mode ``none`` (e.g. it lives under root's 0700 home)."""
    own = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    stdlib = os.path.dirname(os.__file__)
    if os.geteuid() != 0 or (_world_traversable(own) and _world_traversable(stdlib)):
        return own
    for candidate in ("/usr/bin/python3", shutil.which("python3") or ""):
        if candidate and _world_traversable(candidate):
            try:
                probe = subprocess.run([candidate, "-I", "-S", "-c", "import os, json; print(os.path.dirname(json.__file__))"],
                                       capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if probe.returncode == 0 and _world_traversable(probe.stdout.strip()):
                return candidate
    return own


def _hidden_paths() -> list[str]:
    """Paths covered inside the sandbox if they lie in a directory it can see: lopd's own code and
    interpreter environment (site-packages with the reference solutions and benchmark data) and the workspace."""
    import site

    from lopd_core.workspace import lopd_home

    paths = {str(Path(__file__).resolve().parents[2]), str(lopd_home()), *site.getsitepackages()}
    if sys.prefix != sys.base_prefix:
        paths.add(sys.prefix)  # a virtualenv
    try:
        paths.add(site.getusersitepackages())
    except (AttributeError, OSError):
        pass
    return sorted(p for p in paths if p and p != "/")


def _scrubbed_env(mode: str, workdir: str) -> dict[str, str]:
    home, tmp = ("/sandbox", "/tmp") if mode != "none" else (workdir, workdir)
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": tmp,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


_WORKDIR_PREFIX = "lopd-sandbox-"
_run_ids = itertools.count()


@lru_cache(maxsize=1)
def _sweep_stale_workdirs() -> int:
    """Remove mode-``none`` working directories left by lopd processes that no longer exist (a SIGKILLed
    lopd cannot remove its own); the isolated modes write nothing on the host. Runs once per process."""
    removed = 0
    pattern = re.compile(rf"{_WORKDIR_PREFIX}(\d+)-")
    root = Path(tempfile.gettempdir())
    for entry in root.iterdir() if root.is_dir() else []:
        match = pattern.match(entry.name)
        if not match or int(match.group(1)) == os.getpid() or not entry.is_dir():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its lopd is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's live process
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    return removed


def _validate_files(files: dict[str, str], program: str) -> None:
    if program not in files:
        raise ValueError(f"sandbox program {program!r} is not among the files given ({sorted(files)})")
    for name in files:
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ValueError(f"sandbox file name {name!r} must be a relative path inside the working directory")


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
        self.data = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.data)
        if room > 0:
            self.data += data[:room]

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)


# --------------------------------------------------------------------------------------------------
class _Run:
    """One launched sandbox: the subprocess, its pipes, and the loop that drains them against the deadline."""

    def __init__(self, files: dict[str, str], program: str, limits: SandboxLimits, mode: str,
                 argv: list[str] | None = None) -> None:
        _validate_files(files, program)
        self.limits, self.mode = limits, mode
        self.workdir = ""
        if mode == "none":
            _sweep_stale_workdirs()
            self.workdir = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}-")
        run_id = f"lopd-sandbox:{os.getpid()}:{next(_run_ids)}"
        status_r, status_w = os.pipe()
        chan_r, chan_w = os.pipe()
        cfg_fd = os.memfd_create("lopd-sandbox-config")
        cfg = {
            "mode": mode, "parent_pid": os.getpid(), "status_fd": status_w, "channel_fd": chan_w,
            "program": program, "argv": list(argv or []), "files": files, "workdir": self.workdir,
            "uid": limits.uid, "gid": limits.gid, "network": limits.network,
            "cpu_seconds": limits.cpu_seconds, "memory_mb": limits.memory_mb, "max_processes": limits.max_processes,
            "max_file_mb": limits.max_file_mb, "workdir_mb": limits.workdir_mb,
            "required": limits.required(), "hide": _hidden_paths(),
        }
        os.write(cfg_fd, json.dumps(cfg).encode())
        cmd = [sandbox_interpreter(), "-I", "-S", str(LAUNCHER), run_id, str(cfg_fd)]
        self.start = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_w, chan_w, cfg_fd), env=_scrubbed_env(mode, self.workdir),
                cwd=self.workdir or "/", start_new_session=True,
            )
        except OSError as exc:
            for fd in (status_r, status_w, chan_r, chan_w, cfg_fd):
                os.close(fd)
            self._remove_workdir()
            raise SandboxError(f"sandbox could not start {cmd[0]}: {exc}") from exc
        for fd in (status_w, chan_w, cfg_fd):
            os.close(fd)
        self.out, self.err = _Capped(limits.max_output_bytes), _Capped(limits.max_output_bytes)
        self.chan, self.status = _Capped(limits.max_channel_bytes), _Capped(1 << 20)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ, self.out)
        self.sel.register(self.proc.stderr, selectors.EVENT_READ, self.err)
        self.sel.register(status_r, selectors.EVENT_READ, self.status)
        self.sel.register(chan_r, selectors.EVENT_READ, self.chan)
        self.chan_fd, self.status_fd = chan_r, status_r
        self.open_streams = 4
        self.stdin_fd: int | None = self.proc.stdin.fileno()
        os.set_blocking(self.stdin_fd, False)
        self.pending = bytearray()
        self.stdin_closing = False
        self.deadline = self.start + limits.timeout_s
        self.timed_out = self.output_killed = self.abandoned = False

    # ---------------------------------------------------------------- stdin
    def send(self, data: bytes) -> None:
        if self.stdin_fd is None:
            return
        was_empty = not self.pending
        self.pending += data
        if was_empty:
            self.sel.register(self.stdin_fd, selectors.EVENT_WRITE, None)

    def close_stdin(self) -> None:
        self.stdin_closing = True
        if not self.pending:
            self._drop_stdin()

    def _drop_stdin(self) -> None:
        if self.stdin_fd is None:
            return
        if self.pending:
            self.sel.unregister(self.stdin_fd)
            self.pending.clear()
        self.proc.stdin.close()
        self.stdin_fd = None

    def _write_stdin(self) -> None:
        try:
            written = os.write(self.stdin_fd, self.pending[:65536])
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            self._drop_stdin()
            return
        del self.pending[:written]
        if not self.pending:
            self.sel.unregister(self.stdin_fd)
            if self.stdin_closing:
                self._drop_stdin()

    # ---------------------------------------------------------------- the loop
    @property
    def reading(self) -> bool:
        return self.open_streams > 0 and not self.abandoned

    def step(self, max_wait: float = 0.5) -> None:
        """One round: wait for data (at most ``max_wait`` s), read it, enforce the deadline and output caps."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            if not self.timed_out and not self.output_killed:
                self.timed_out = True
                self.kill()
                self.deadline = time.monotonic() + 2.0  # grace period to drain what is left in the pipes
            else:
                self.abandoned = True  # something outside the group still holds a pipe: stop reading
            return
        for key, mask in self.sel.select(timeout=max(0.0, min(remaining, max_wait))):
            if mask & selectors.EVENT_WRITE:
                self._write_stdin()
                continue
            data = os.read(key.fd, 65536)
            if not data:
                self.sel.unregister(key.fileobj)
                self.open_streams -= 1
                continue
            key.data.add(data)
        if self.out.total + self.err.total + self.chan.total > self.limits.hard_output_bytes and not self.output_killed:
            self.output_killed = True
            self.kill()
        if self.mode == "none" and self.proc.poll() is not None:
            # Without a PID namespace, children left in the group would keep the pipes open.
            self.kill()

    def kill(self) -> None:
        _kill_group(self.proc.pid)

    def finish(self) -> Verdict:
        """Close stdin, drain everything until the launcher is gone, and build the verdict."""
        try:
            self.close_stdin()
            while self.reading:
                self.step()
        finally:
            self._close()
        return self._verdict()

    def _close(self) -> None:
        if self.stdin_fd is not None:
            self.pending.clear()
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self.stdin_fd = None
        self.sel.close()
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()
        for fd in (self.chan_fd, self.status_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _verdict(self) -> Verdict:
        seconds = time.monotonic() - self.start
        launcher, child, result = {}, {}, {}
        for line in self.status.text().splitlines():
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            launcher.update(msg.get("launcher", {}))
            child.update(msg.get("child", {}))
            result.update(msg.get("result", {}))
        if launcher.get("error"):
            raise SandboxError(f"the sandbox ({self.mode} mode) could not be set up: {launcher['error']}")
        if not child and not self.timed_out and not self.output_killed:
            tail = self.err.text().strip().splitlines()[-1:] or [f"exit status {self.proc.returncode}"]
            raise SandboxError(f"the sandbox launcher failed before running the program: {tail[0][:300]}")
        applied = {**launcher, **child}
        protections = {name: bool(applied.get(name)) for name in PROTECTIONS if name not in _PARENT_SIDE}
        protections["no_user_namespaces"] = bool(launcher.get("userns_sysctl") or child.get("seccomp"))
        protections.update(scrubbed_env=True, output_cap=True)
        if self.limits.network:
            protections.pop("network_namespace")

        if result:
            exit_code, signum = result.get("exit_code"), result.get("signal")
        elif self.proc.returncode is not None and self.proc.returncode < 0:
            exit_code, signum = None, -self.proc.returncode
        else:  # the launcher itself was killed before reporting (timeout / output kill)
            exit_code, signum = None, signal.SIGKILL
        cpu_seconds = result.get("cpu_seconds")
        if child.get("refused"):
            status, reason = "refused", (f"refused to run the program: not contained on this machine "
                                         f"({', '.join(child['refused'])}); {_opt_in_hint()}")
            exit_code, signum = None, None
        else:
            status, reason = _classify(exit_code, signum, self.err, self.timed_out, self.output_killed, self.limits,
                                       cpu_seconds)
        return Verdict(
            status=status, exit_code=exit_code, stdout=self.out.text(), stderr=self.err.text(),
            seconds=round(seconds, 4), signal=_signal_name(signum) if signum else None, reason=reason,
            stdout_truncated=self.out.truncated, stderr_truncated=self.err.truncated, cpu_seconds=cpu_seconds,
            protections=protections, channel=self.chan.text(), channel_truncated=self.chan.truncated, mode=self.mode,
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


def _opt_in_hint() -> str:
    return (f"set {ALLOW_UNCONTAINED_ENV}=1 (or SandboxLimits(allow_uncontained=True)) to run model code "
            "without these protections, at your own risk")


# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Isolation:
    mode: Mode
    uncontained: tuple[str, ...]
    """Protections the probe run could not apply in this mode."""
    detail: str = ""
    """Why the better modes failed (one line each)."""


_probe_lock = threading.Lock()


@lru_cache(maxsize=1)
def _probe() -> Isolation:
    limits = SandboxLimits(timeout_s=30, memory_mb=256, allow_uncontained=True)
    failures = []
    for mode in (("root", "userns") if os.geteuid() == 0 else ("userns",)):
        try:
            run = _Run({"main.py": "pass\n"}, "main.py", limits, mode)
            verdict = run.finish()
        except SandboxError as exc:
            failures.append(f"{mode}: {exc}")
            continue
        essential = ("pid_namespace", "mount_namespace", "private_root", "dies_with_parent")
        if verdict.ok and all(verdict.protections.get(p) for p in essential):
            return Isolation(mode, tuple(verdict.uncontained), "; ".join(failures))
        failures.append(f"{mode}: {verdict.status} {verdict.reason} (missing {', '.join(verdict.uncontained)})")
    verdict = _Run({"main.py": "pass\n"}, "main.py", limits, "none").finish()
    return Isolation("none", tuple(verdict.uncontained), "; ".join(failures))


def isolation_available() -> Mode:
    """The isolation mode this machine gives (probed once per process): 'root', 'userns' or 'none'."""
    with _probe_lock:
        return _probe().mode


def isolation() -> Isolation:
    """The probed isolation mode, what it cannot apply and why better modes failed."""
    with _probe_lock:
        return _probe()


def refusal(limits: SandboxLimits | None = None) -> str | None:
    """Why the sandbox would refuse to run model code on this machine with ``limits`` (None: it would run)."""
    limits = limits or SandboxLimits()
    required = set(limits.required())
    if not required:
        return None
    iso = isolation()
    missing = [p for p in iso.uncontained if p in required]
    if not missing:
        return None
    why = f" ({iso.detail})" if iso.detail else ""
    return (f"refused to run model code: the sandbox cannot contain it on this machine ({iso.mode} mode; missing "
            f"{', '.join(missing)}){why}; {_opt_in_hint()}")


def _refused_verdict(reason: str) -> Verdict:
    return Verdict(status="refused", exit_code=None, stdout="", stderr="", seconds=0.0, reason=reason,
                   protections={p: False for p in PROTECTIONS})


def _start(files: dict[str, str], program: str, limits: SandboxLimits, argv: list[str] | None) -> _Run | Verdict:
    reason = refusal(limits)
    if reason:
        if limits.require_isolation:
            raise SandboxError(reason)
        return _refused_verdict(reason)
    return _Run(files, program, limits, isolation().mode, argv)


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
    _validate_files(files, program)
    run = _start(files, program, limits, argv)
    if isinstance(run, Verdict):
        return run
    if stdin:
        run.send(stdin.encode())
    return run.finish()


class SandboxSession:
    """One sandboxed program kept running to exchange lines with: :meth:`send` writes to its stdin,
    :meth:`receive_line` reads the next line of its result channel, :meth:`close` ends it and returns the
    verdict. Use it from one thread, the one that opened it (the sandbox dies with that thread's process).

    Raises :class:`SandboxError` when the sandbox refuses to run (see :func:`refusal`).
    """

    def __init__(self, files: dict[str, str], program: str = "main.py", *, limits: SandboxLimits | None = None,
                 argv: list[str] | None = None) -> None:
        self.limits = limits or SandboxLimits()
        _validate_files(files, program)
        run = _start(files, program, self.limits, argv)
        if isinstance(run, Verdict):
            raise SandboxError(run.reason)
        self._run = run
        self._offset = 0
        self.verdict: Verdict | None = None

    def send(self, text: str) -> None:
        self._run.send(text.encode())

    def receive_line(self, timeout: float) -> str | None:
        """The next complete line of the channel (without its newline), or None when the program closed the
        channel, ended, or did not write one within ``timeout`` seconds (or the sandbox's own deadline)."""
        until = time.monotonic() + timeout
        run = self._run
        while True:
            newline = run.chan.data.find(b"\n", self._offset)
            if newline >= 0:
                line = bytes(run.chan.data[self._offset:newline]).decode("utf-8", errors="replace")
                self._offset = newline + 1
                return line
            if not run.reading or run.chan.truncated or time.monotonic() >= until or run.timed_out:
                return None
            if run.chan_fd not in (k.fd for k in run.sel.get_map().values()):
                return None  # the channel is closed
            run.step(max_wait=max(0.0, until - time.monotonic()))

    def unread(self) -> str:
        """Channel data received but not yet returned by :meth:`receive_line`."""
        return bytes(self._run.chan.data[self._offset:]).decode("utf-8", errors="replace")

    def close(self) -> Verdict:
        if self.verdict is None:
            self.verdict = self._run.finish()
        return self.verdict

    def __enter__(self) -> SandboxSession:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.verdict is None:
            self._run.kill()
            self.close()


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
