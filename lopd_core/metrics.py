"""Where training metrics go: a one-method logger protocol and three small implementations.

Metric names are namespaced and stable (``distill/kl_topk``, ``distill/privilege_delta``, ``distill/beta``,
``rollout/success_rate``, ``memory/hit_rate``, ``budget/episodes`` …); the training driver logs one dict per
step. :class:`JsonlLogger` appends one JSON object per line (``{"step": …, "time": …, <metrics>}``) and is
what ``lopd distill`` writes; :class:`InMemoryLogger` is for tests and for flows that forward the dict to
MLflow themselves; :class:`MultiLogger` fans out.

What it is not: an MLflow client (the flows own that; lopd_core stays importable without MLflow).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MetricLogger(Protocol):
    def log(self, metrics: Mapping[str, Any], *, step: int) -> None: ...


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries (bools as 0/1); everything else is dropped."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class InMemoryLogger:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, Any]]] = []

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        self.records.append((step, dict(metrics)))

    def history(self, name: str) -> list[float]:
        return [m[name] for _, m in self.records if name in m]


class JsonlLogger:
    """Appends ``{"step", "time", …metrics}`` lines to ``path`` (created with its parent directory)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        row = {"step": step, "time": time.time(), **numeric(metrics)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


class MultiLogger:
    def __init__(self, *loggers: MetricLogger | None) -> None:
        self.loggers = [lg for lg in loggers if lg is not None]

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        for logger in self.loggers:
            logger.log(metrics, step=step)


class Timer:
    """Wall-clock seconds per named phase (``with timer('teacher'): …``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - self.start

        return _Phase()

    def total(self) -> float:
        return sum(self.seconds.values())
