"""Paired comparisons of two models on the same tasks, with intervals that respect how tasks are made.

Tasks of a procedural suite are not independent: tasks of one family and one phrasing template are near
duplicates of each other. :func:`paired_cluster_bootstrap` therefore resamples *clusters* (family,
phrasing) of tasks, not tasks: the interval of the mean paired difference (method − base, per task, the
method's seeds averaged per task first) is a percentile interval over resampled clusters. The minimum
detectable effect is the difference a two-sided 5 % test would detect with 80 % power at that spread:
(1.96 + 0.84) × the bootstrap standard error.

Pure functions over plain rows (``{"task_id", "cluster", <metric>}``); no models, no files.
"""

from __future__ import annotations

import random
import statistics
from collections import defaultdict

Z_POWER = 1.96 + 0.84
"""Two-sided α = 0.05 and 80 % power: the MDE is this many standard errors."""


def per_task_means(rows: list[dict], metric: str) -> dict[str, float]:
    """The metric per task id, averaged over repeated rows (seeds of one method)."""
    values: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get(metric) is not None:
            values[row["task_id"]].append(float(row[metric]))
    return {task: statistics.fmean(v) for task, v in values.items()}


def paired_cluster_bootstrap(method_rows: list[dict], base_rows: list[dict], *, metric: str = "reward",
                             samples: int = 4000, seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """Mean paired difference (method − base) over the tasks both were scored on, its cluster-bootstrap
    interval, the bootstrap standard error and the minimum detectable effect."""
    method, base = per_task_means(method_rows, metric), per_task_means(base_rows, metric)
    cluster_of = {row["task_id"]: str(row.get("cluster") or row["task_id"]) for row in [*method_rows, *base_rows]}
    shared = sorted(set(method) & set(base))
    if not shared:
        raise ValueError(f"no task was scored for both models on {metric!r}")
    clusters: dict[str, list[float]] = defaultdict(list)
    for task in shared:
        clusters[cluster_of[task]].append(method[task] - base[task])
    names = sorted(clusters)
    rng = random.Random(seed)
    means = []
    for _ in range(samples):
        picked = [clusters[names[rng.randrange(len(names))]] for _ in names]
        flat = [d for group in picked for d in group]
        means.append(statistics.fmean(flat))
    means.sort()
    diffs = [d for task in shared for d in [method[task] - base[task]]]
    se = statistics.pstdev(means)
    return {"mean_diff": statistics.fmean(diffs), "ci95_low": means[int((1 - level) / 2 * (samples - 1))],
            "ci95_high": means[int((1 + level) / 2 * (samples - 1))], "se": se, "mde": Z_POWER * se,
            "tasks": len(shared), "clusters": len(names), "method_mean": statistics.fmean(method[t] for t in shared),
            "base_mean": statistics.fmean(base[t] for t in shared)}


def per_family(rows: list[dict], metric: str) -> dict[str, float]:
    """The metric's mean per family (rows carry ``family``)."""
    values: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get(metric) is not None:
            values[row["family"]].append(float(row[metric]))
    return {family: statistics.fmean(v) for family, v in sorted(values.items())}
