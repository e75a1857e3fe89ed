"""Test helper: the processes running for one lopd workspace (found by LOPD_HOME in their environment)."""

from __future__ import annotations

import os
from pathlib import Path


def workspace_processes(home: Path) -> list[int]:
    """Processes (other than this one) whose environment has exactly LOPD_HOME=home."""
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc_dir / "environ").read_bytes()
        except OSError:
            continue
        if f"LOPD_HOME={home}\0".encode() in environ + b"\0" and int(proc_dir.name) != os.getpid():
            pids.append(int(proc_dir.name))
    return pids
