"""Whether the process behind a run still lives: the owner stamp, the dead-owner test, the heartbeat thread.

A run (an MLflow run, a cycle record, a Prefect flow run, the training slot) is stamped with its owner:
pid, host name, boot id, the process's start time (so a recycled pid is not mistaken for the owner) and a
heartbeat time that a daemon thread refreshes while the process lives. :func:`dead_reason` says when an
owner is certainly gone: on this host, its pid is not running (or now belongs to another process, or the
machine rebooted); on another host, its heartbeat is older than the given limit. A host name is taken to
be one pid namespace.

What this module is not: the reaper (``registry.ModelRegistry.reap_runs``, ``cycle.reap_cycle_records``,
``operations.reap``, ``flows.common.reap_crashed`` act on what it finds). Standard library only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)


@cache
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc is not available)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name in parentheses may contain spaces


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def owner() -> dict[str, str]:
    """This process's stamp, with a fresh heartbeat."""
    return {"pid": str(os.getpid()), "host": socket.gethostname(), "boot": boot_id(),
            "start": process_start(os.getpid()), "heartbeat": f"{time.time():.0f}"}


def is_self(stamp: Mapping[str, str]) -> bool:
    return stamp.get("pid") == str(os.getpid()) and stamp.get("host") == socket.gethostname()


def dead_reason(stamp: Mapping[str, str], *, stale_after: float, now: float | None = None) -> str:
    """Why the owner of ``stamp`` is certainly gone; '' while it may be alive (or the stamp is incomplete)."""
    pid, host = stamp.get("pid", ""), stamp.get("host", "")
    if not pid.isdigit() or not host:
        return ""
    if host == socket.gethostname():
        if stamp.get("boot") and boot_id() and stamp["boot"] != boot_id():
            return f"host {host} rebooted after process {pid} started the run"
        if not pid_alive(int(pid)):
            return f"process {pid} on {host} is gone"
        start = process_start(int(pid))
        if stamp.get("start") and start and start != stamp["start"]:
            return f"process {pid} on {host} is gone (the pid now belongs to another process)"
        return ""
    try:
        beat = float(stamp.get("heartbeat", ""))
    except ValueError:
        return ""
    age = (time.time() if now is None else now) - beat
    if age > stale_after:
        return f"no heartbeat from process {pid} on {host} for {age:.0f} s (limit {stale_after:.0f} s)"
    return ""


# --------------------------------------------------------------------------------------------------
class _Heartbeat:
    """One daemon thread per process calling every registered beat each ``interval`` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beats: dict[str, Callable[[], None]] = {}
        self._interval = 60.0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, key: str, beat: Callable[[], None], interval: float) -> None:
        with self._lock:
            self._beats[key] = beat
            self._interval = min(self._interval, interval) if self._thread else interval
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lopd-heartbeat", daemon=True)
                self._thread.start()

    def stop(self, key: str) -> None:
        with self._lock:
            self._beats.pop(key, None)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            with self._lock:
                beats = list(self._beats.items())
            for key, beat in beats:
                try:
                    beat()
                except Exception as e:  # a missed beat only makes the run look older to another host
                    log.debug("heartbeat %s failed: %s", key, e)


HEARTBEAT = _Heartbeat()
