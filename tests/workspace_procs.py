"""Test helpers for local processes: those running for one lopd workspace or one flow run (found by their
environment), a free port, and a server started and waited for."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from lopd_core.workspace import free_port

__all__ = ["free_port", "processes_with_env", "start_server", "workspace_processes"]


def processes_with_env(entry: str) -> list[int]:
    """Processes (other than this one) whose environment holds exactly ``entry`` (``NAME=value``)."""
    marker, pids = f"{entry}\0".encode(), []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc_dir / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ + b"\0" and int(proc_dir.name) != os.getpid():
            pids.append(int(proc_dir.name))
    return pids


def workspace_processes(home: Path) -> list[int]:
    """Processes (other than this one) whose environment has exactly LOPD_HOME=home."""
    return processes_with_env(f"LOPD_HOME={home}")


def start_server(cmd: list[str], ready: Callable[[], object], *, log: Path, timeout: float,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` (its own session, output to ``log``) and wait until ``ready()`` returns without raising;
    raises with the log's tail when it exits or does not come up in ``timeout`` seconds."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            ready()
            return proc
        except Exception:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not come up in {timeout:.0f} s: {log.read_text()[-3000:]}")
