"""Resumable training state: one directory per step, one JSON manifest, atomic, the last N kept.

Layout (``<checkpoints>/<run>/step_000123/``, written after step 123 completed)::

    manifest.json       format, run, step, next data cursor, experience-table version, β, method,
                        budget counters, config (full dump) and its hash, creation time
    student/            the student artifact (peft adapter or full weights + lopd_student.json)
    composer/           the composer artifact (encoder adapter, χ, φ0, anchor cache, β), LOPD only
    trainer_state.pt    the algorithm's state_dict(): AdamW states, β, SDPO's EMA weights, Skill-SD's bandit
    rng.pt              Python, NumPy and torch (CPU and CUDA) RNG states

A step directory is first written as ``.step_000123.partial-<random>`` and renamed into place, so a crash
leaves either the previous complete checkpoint or the new one, never half of one; ``latest_checkpoint``
ignores partial directories. After a successful write only the newest ``keep`` step directories remain.

Resuming (see :func:`lopd_core.training.train`) loads the student and composer from the step directory
*before* the optimizers are built, then the optimizer states, then the RNG states, so the next step's
losses equal those of an uninterrupted run. ``trainer_state.pt`` and ``rng.pt`` are our own pickles
(``torch.load(weights_only=False)``): load checkpoints only from a directory you trust.

What it is not: the registry. Final artifacts for MLflow are written by :mod:`lopd_core.training`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lopd_core.config import Config
from lopd_core.models.composer import save_composer

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_PREFIX = "step_"


def step_dirname(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    """The last completed step; training resumes at ``step + 1``."""
    cursor: int
    """Index of the next task in the run's task order."""
    table_version: int | None
    beta: float | None
    method: str
    budget: dict[str, float] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    config_hash: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def student_dir(self) -> Path:
        return self.path / "student"

    @property
    def composer_dir(self) -> Path | None:
        path = self.path / "composer"
        return path if path.exists() else None


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def preserved_rng():
    """Run a block without moving the process's random streams (python, numpy, torch, CUDA).

    What an evaluation inside a training run needs: the run then samples exactly what it samples without
    the evaluation, and a resumed run what an uninterrupted one does."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def save_checkpoint(run_dir: Path, *, step: int, policies, algorithm, cfg: Config, cursor: int, composer=None,
                    table_version: int | None = None, budget: dict[str, float] | None = None,
                    extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write ``run_dir/step_<step>/`` atomically and prune to the newest ``keep``; returns the directory."""

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dirname(step)
    tmp = run_dir / f".{step_dirname(step)}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        policies.save_student(tmp / "student")
        if composer is not None:
            save_composer(policies, composer, tmp / "composer")
        torch.save(algorithm.state_dict(), tmp / "trainer_state.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        manifest = {"format": FORMAT_VERSION, "run": run_dir.name, "step": step, "cursor": cursor,
                    "table_version": table_version, "beta": composer.beta if composer is not None else None,
                    "method": cfg.distill.method, "budget": dict(budget or {}), "config": cfg.model_dump(mode="json"),
                    "config_hash": cfg.hash(), "extra": dict(extra or {}), "created": time.time()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if final.exists():  # the same step written again (a re-run): swap, then drop the old one
            trash = run_dir / f".{step_dirname(step)}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def read_checkpoint(path: Path) -> CheckpointInfo:
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {MANIFEST}); checkpoints live in "
                                "<checkpoints>/<run>/step_000123/")
    m = json.loads(manifest_path.read_text())
    if m.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {m.get('format')} is not the supported {FORMAT_VERSION}")
    return CheckpointInfo(path=path, step=int(m["step"]), cursor=int(m["cursor"]), table_version=m.get("table_version"),
                          beta=m.get("beta"), method=m["method"], budget=m.get("budget", {}), config=m.get("config", {}),
                          config_hash=m.get("config_hash", ""), extra=m.get("extra", {}))


def restore_trainer_state(info: CheckpointInfo, algorithm) -> None:
    """Load optimizer states etc. into an algorithm built on the checkpoint's weights, then the RNG states."""
    state = torch.load(info.path / "trainer_state.pt", map_location="cpu", weights_only=False)
    algorithm.load_state_dict(state)
    set_rng_state(torch.load(info.path / "rng.pt", weights_only=False))
