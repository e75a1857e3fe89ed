"""Probes that tell, before any training, whether there is anything to learn and whether a teacher can teach it.

- :func:`pass_at_k`: per task family, how often the base model solves training tasks when sampled k
  times at a temperature (per-sample success, pass@1, pass@k, mean reward). A family with pass@k = 0 gives
  no successful episode to learn from: no experience for LOPD, no positive example for RFT or GRPO.
- :func:`text_teacher_as_agent`: the base model playing tasks with the text teacher's context in its prompt
  (the teacher's own success as an agent), next to its success without it;
- the teacher's δ on the base model's own episodes is :mod:`lopd_core.privilege`.

Both return plain dicts (the ``lopd probe-passk`` / ``lopd probe-teacher`` JSON). Not here: any training.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from lopd_core.config import Config
from lopd_core.envs.base import Suite, Task
from lopd_core.models.composer import experience_turns
from lopd_core.models.policy import PolicySet
from lopd_core.recipe import play_tasks
from lopd_core.records.experience import Bank, RetrievalQuery
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.context import ContextSuite


# --------------------------------------------------------------------------------------------------
# pass@k per family
def tasks_per_family(suite: Suite, *, split: str, level: int, per_family: int, seed: int,
                     max_draw: int = 4000) -> list[Task]:
    """The first ``per_family`` tasks of every family, drawn in the suite's order."""
    chosen: dict[str, list[Task]] = defaultdict(list)
    draw = max(per_family * 16, 64)
    while True:
        for task in suite.tasks(split, draw, level=level, seed=seed):
            if len(chosen[task.family]) < per_family and task not in chosen[task.family]:
                chosen[task.family].append(task)
        if all(len(v) >= per_family for v in chosen.values()) or draw >= max_draw:
            break
        draw *= 2
    return [t for family in sorted(chosen) for t in chosen[family]]


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` successes in ``n`` samples: 1 − C(n−c, k)/C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k(cfg: Config, policies: PolicySet, suite: Suite, *, per_family: int, k: int, temperature: float,
              split: str = "train", seed: int = 0, success_reward: float = 0.8,
              progress: bool = True) -> tuple[dict[str, Any], list[Trajectory]]:
    """``k`` sampled episodes of the base model on ``per_family`` tasks of every family; per-family summary."""
    tasks = tasks_per_family(suite, split=split, level=cfg.rollout.level, per_family=per_family, seed=seed)
    repeated = [t for t in tasks for _ in range(k)]
    episodes = play_tasks(cfg, policies, suite, repeated, weights="base", seed=seed, temperature=temperature,
                          label=f"base/T{temperature}", cycle_id="probe", progress=progress)
    by_family: dict[str, list[Trajectory]] = defaultdict(list)
    for episode in episodes:
        by_family[episode.family].append(episode)
    families = {}
    for family, rows in sorted(by_family.items()):
        per_task: dict[str, list[Trajectory]] = defaultdict(list)
        for row in rows:
            per_task[row.task_id].append(row)
        solved = [sum(r.reward >= success_reward for r in runs) for runs in per_task.values()]
        families[family] = {
            "tasks": len(per_task), "samples": len(rows),
            "success_rate": statistics.fmean(r.reward >= success_reward for r in rows),
            "mean_reward": statistics.fmean(r.reward for r in rows),
            "pass_at_1": statistics.fmean(pass_at_k_estimate(k, c, 1) for c in solved),
            f"pass_at_{k}": statistics.fmean(pass_at_k_estimate(k, c, k) for c in solved),
            "tasks_solved_at_least_once": sum(c > 0 for c in solved),
        }
    summary = {"suite": getattr(suite, "name", str(suite)), "split": split, "level": cfg.rollout.level, "k": k,
               "temperature": temperature, "tasks_per_family": per_family, "episodes": len(episodes),
               "success_rate": statistics.fmean(r.reward >= success_reward for r in episodes) if episodes else 0.0,
               "families": families,
               "learnable_families": sorted(f for f, v in families.items() if v[f"pass_at_{k}"] > 0)}
    return summary, episodes


# --------------------------------------------------------------------------------------------------
# The text teacher as an agent
def text_teacher_as_agent(cfg: Config, policies: PolicySet, suite: Suite, tasks: list[Task], bank: Bank, *,
                          temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Success of the base model playing each task with the text teacher's context (same family, never the
    task itself), next to its success without it; tasks without an experience of their family are skipped."""
    lopd = cfg.distill.lopd
    queries = [RetrievalQuery(instruction=t.instruction, task_id=t.task_id, exclude_same_task=True,
                              family=t.family if lopd.retrieval_family == "same" else "") for t in tasks]
    found = {t.task_id: bank.retriever.retrieve(q, lopd.n_retrieved) for t, q in zip(tasks, queries, strict=True)}
    played = [t for t in tasks if found[t.task_id]]
    if not played:
        return {"tasks": 0}
    tok = policies.tokenizer
    contexts = {t.task_id: [experience_turns(tok, e, max_tokens=lopd.experience_max_tokens) for e in found[t.task_id]]
                for t in played}
    placed = ContextSuite(suite, lambda task: contexts[task.task_id], placement=lopd.context_placement)
    with_context = play_tasks(cfg, policies, placed, played, weights="base", seed=seed, temperature=temperature,
                              label="teacher-as-agent")
    without = play_tasks(cfg, policies, suite, played, weights="base", seed=seed, temperature=temperature, label="base")
    rate = lambda rows: statistics.fmean(r.reward >= lopd.success_reward for r in rows)  # noqa: E731
    return {"tasks": len(played), "success_with_context": rate(with_context), "success_without": rate(without),
            "mean_reward_with_context": statistics.fmean(r.reward for r in with_context),
            "mean_reward_without": statistics.fmean(r.reward for r in without)}
