"""The training recipe, written once: episodes → experience bank → composer cold start → train → evaluate.

Four callers put these pieces together; none of them re-implements one:

- the cycle (:mod:`lopd_core.cycle`): the ``@champion`` plays the rollouts stage, curation and indexing
  make the bank, :func:`bank_from_store` pins it for the distill stage, which cold-starts the composer in
  cycle 1 and trains; the evaluate stage scores challenger and champion;
- the comparison (:mod:`lopd_core.compare`): one bank (:func:`seed_episodes` + :func:`bank_in_store`) and
  one cold start per suite, then every method trains under :class:`HeldOutCurve`;
- ``lopd distill`` (:mod:`lopd_cli.train`): the workspace's store when it holds experiences, else an
  in-memory bank (:func:`memory_bank`) from seed episodes;
- ``benchmarks/gpu_compare.py``: an in-memory bank, the same cold start, runs and curve, and nothing of
  the orchestration or storage stack.

Each piece takes the typed config and returns a small record (:class:`~lopd_core.records.experience.Bank`,
:class:`~lopd_core.training.ColdStartResult`, :class:`~lopd_core.training.TrainResult`,
:class:`~lopd_core.evaluation.EvalResult`). Not here: the stages' bookkeeping (cycle records, MLflow runs,
result files), which stays with each caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from lopd_core.checkpoint import preserved_rng
from lopd_core.config import Config
from lopd_core.envs import Suite, suite_kind
from lopd_core.evaluation import EvalResult, evaluate
from lopd_core.memory.curation import curate_store
from lopd_core.memory.in_memory import InMemoryRetriever
from lopd_core.memory.indexing import index_store
from lopd_core.memory.sql import sql_in, sql_literal
from lopd_core.memory.store import ExperienceStore
from lopd_core.metrics import MetricLogger
from lopd_core.models.policy import PolicySet
from lopd_core.records.experience import Bank
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.agent import play
from lopd_core.rollout.engines import policy_engine
from lopd_core.training import ColdStartResult, cold_start, experiences_from_trajectories

Weights = Literal["student", "base"]
BANK_SEED_OFFSET = 7919
"""Seed episodes draw their tasks with ``rollout.seed + 7919``: disjoint from a training run's task order."""


# --------------------------------------------------------------------------------------------------
# Episodes
def play_tasks(cfg: Config, policies: PolicySet, suite: Suite, tasks: list, *, weights: Weights, seed: int | None,
               temperature: float | None = None, label: str = "base", cycle_id: str = "", step: int = -1,
               progress: bool = False) -> list[Trajectory]:
    """Episodes of ``tasks`` with the student's weights or the base weights, on ``rollout.engine``."""
    with policy_engine(cfg, policies, weights=weights, version=label) as engine:
        return play(cfg.rollout, engine, policies.tokenizer, suite, tasks, seed=seed, temperature=temperature,
                    policy_version=label, cycle_id=cycle_id, step=step, progress=progress)


def seed_episodes(cfg: Config, policies: PolicySet, suite: Suite, *, n: int, seed: int | None = None,
                  weights: Weights = "base", label: str = "base", id_prefix: str = "bank", cycle_id: str = "bank",
                  progress: bool = True) -> list[Trajectory]:
    """``n`` sampled episodes on training tasks (seed default: ``rollout.seed + 7919``), ids ``<prefix>/0000``…"""
    seed = cfg.rollout.seed + BANK_SEED_OFFSET if seed is None else seed
    tasks = suite.tasks("train", n, level=cfg.rollout.level, seed=seed)
    episodes = play_tasks(cfg, policies, suite, tasks, weights=weights, seed=seed, label=label, cycle_id=cycle_id,
                          progress=progress)
    return [replace(t, trajectory_id=f"{id_prefix}/{i:04d}", episode_id=f"{id_prefix}/{i:04d}")
            for i, t in enumerate(episodes)]


# --------------------------------------------------------------------------------------------------
# The experience bank
def bank_from_store(store: ExperienceStore, *, version: int | None = None, episodes: int = 0) -> Bank:
    """The store's experiences pinned at ``version`` (None: the latest now) and the curated y* behind them."""
    retriever = store.retriever(version=version)
    curated = store.read("curated", columns=["trajectory_id"])["trajectory_id"].tolist()
    successes = store.read_trajectories(where=sql_in("trajectory_id", curated)) if curated else []
    return Bank(retriever=retriever, successes=successes, version=retriever.version, episodes=episodes,
                source="lancedb", stored_successes=lambda suite, threshold: stored_successes(store, suite, threshold))


def stored_successes(store: ExperienceStore, suite: str, threshold: float) -> list[Trajectory]:
    """Every stored ``ok`` train-split episode of ``suite`` with ``reward >= threshold``, by trajectory id."""
    where = (f"split = 'train' AND status = 'ok' AND suite = {sql_literal(suite)} "
             f"AND reward >= {float(threshold)!r}")
    return sorted(store.read_trajectories(where=where), key=lambda t: t.trajectory_id)


def bank_in_store(store: ExperienceStore, cfg: Config, trajectories: list[Trajectory], *, stage: str,
                  cycle_id: str, max_bad_fraction: float | None = None) -> Bank:
    """Store the episodes, curate and index them (as the cycle's stages do), and pin the result."""
    store.write_trajectories(trajectories, stage=stage, cycle_id=cycle_id, max_bad_fraction=max_bad_fraction)
    curate_store(store, cfg)
    indexed = index_store(store, max_bad_fraction=max_bad_fraction)
    return bank_from_store(store, version=indexed.experiences_version, episodes=len(trajectories))


def memory_bank(trajectories: list[Trajectory], cfg: Config, *, kind: str) -> Bank:
    """An in-memory bank of the successful train-split episodes (no LanceDB, no curation beyond the threshold)."""
    experiences = experiences_from_trajectories(trajectories, cfg, kind=kind)
    kept = {e.experience_id for e in experiences}
    return Bank(retriever=InMemoryRetriever(experiences), successes=[t for t in trajectories if t.trajectory_id in kept],
                version=None, episodes=len(trajectories), source="in-memory")


# --------------------------------------------------------------------------------------------------
# Cold start
def cold_start_y_star(cfg: Config, bank: Bank, *, suite_name: str, threshold: float | None = None) -> list[Trajectory]:
    """The cold start's y*: every stored success of the suite (``cold_start.y_star: successes``, the default,
    on a LanceDB bank) or only the curated ones behind the experiences (``curated``, or an in-memory bank).

    Curation keeps a few diverse successes per task and family for retrieval; the composer learns from
    more y* than that (each still retrieves only curated experiences, never itself or its own task)."""
    if threshold is None:
        threshold = cfg.curation.success_threshold(suite_kind(suite_name))
    if cfg.distill.lopd.cold_start.y_star == "successes" and bank.stored_successes is not None:
        return bank.stored_successes(suite_name, threshold)
    return list(bank.successes)


def cold_start_composer(cfg: Config, bank: Bank, *, suite_name: str, out_dir: Path, policies: PolicySet | None = None,
                        models_dir: Path | None = None, logger: MetricLogger | None = None,
                        progress: bool = True) -> ColdStartResult:
    """Cold-start the composer on :func:`cold_start_y_star` (the suite kind's success threshold) into ``out_dir``."""
    threshold = cfg.curation.success_threshold(suite_kind(suite_name))
    y_star = cold_start_y_star(cfg, bank, suite_name=suite_name, threshold=threshold)
    if not y_star:
        raise ValueError(f"the composer cold start needs successful training episodes and the bank has none "
                         f"({bank.episodes} seed episodes on {suite_name}); raise rollout.n_tasks or lower "
                         "rollout.level so the base model solves some tasks")
    return cold_start(cfg, retriever=bank.retriever, out_dir=Path(out_dir), trajectories=y_star,
                      policies=policies, models_dir=models_dir, logger=logger, progress=progress,
                      success_threshold=threshold)


# --------------------------------------------------------------------------------------------------
# Evaluation
def evaluate_policy(cfg: Config, policies: PolicySet, suite_name: str, *, label: str, weights: Weights = "student",
                    with_probe: bool = False, reference_cache: Path | None = None, cycle_id: str = "",
                    progress: bool = False) -> EvalResult:
    """Held-out evaluation of the student (or the base weights); the forgetting probe when ``with_probe``."""
    scope = policies.teacher if weights == "base" else policies.student
    return evaluate(scope, policies.tokenizer, cfg=cfg, suite_name=suite_name, policy_version=label,
                    base=policies.teacher if with_probe else None, reference_cache=reference_cache,
                    with_probe=with_probe, cycle_id=cycle_id, progress=progress)


def curve_point(metrics: dict[str, float]) -> dict[str, float]:
    """The held-out numbers a learning curve keeps from an evaluation summary."""
    return {"success_rate": metrics["eval/success_rate"], "mean_reward": metrics["eval/mean_reward"],
            "response_tokens": metrics["eval/mean_response_tokens"]}


class HeldOutCurve:
    """A training ``on_step`` hook: held-out evaluation every ``every`` steps, at ``extra_steps`` and at the end.

    The evaluation runs inside :func:`~lopd_core.checkpoint.preserved_rng`, so a run with a curve samples
    exactly what the same run without one samples (and a resumed run what an uninterrupted one does).
    ``done_steps`` are skipped (points a resumed run already measured); ``on_point(point, metrics)``
    receives each new point. ``score(step, last)`` (``last``: the run's final point) replaces the default
    evaluation (``evaluate_policy`` on ``evaluate.n_tasks`` held-out tasks) and returns the point's extra
    fields and its ``eval/*`` metrics.
    """

    def __init__(self, cfg: Config, policies: PolicySet, suite_name: str, *, every: int, label: str,
                 done_steps: set[int] | None = None, extra_steps: set[int] | None = None,
                 on_point: Callable[[dict[str, Any], dict[str, float]], None] | None = None,
                 score: Callable[[int], tuple[dict[str, Any], dict[str, float]]] | None = None):
        self.cfg, self.policies, self.suite_name = cfg, policies, suite_name
        self.every, self.label, self.done_steps = max(every, 1), label, set(done_steps or ())
        self.extra_steps = set(extra_steps or ())
        self.on_point, self.score = on_point, score
        self.points: list[dict[str, Any]] = []

    def __call__(self, step: int, metrics: dict[str, float], trajectories: list[Trajectory]) -> None:
        n = step + 1
        # the run's last step: the configured last, or one after which the episode budget is spent
        last = n == self.cfg.distill.steps or bool(metrics.get("budget/last_step"))
        due = n % self.every == 0 or last or n in self.extra_steps
        if not due or n in self.done_steps:
            return
        with preserved_rng():
            if self.score is not None:
                fields, evaluated = self.score(n, last)
            else:
                evaluated = evaluate_policy(self.cfg, self.policies, self.suite_name,
                                            label=f"{self.label}/step{step}").metrics
                fields = curve_point(evaluated)
        point = {"step": n, "episodes": int(metrics["budget/episodes"]), **fields,
                 "kl_topk": metrics.get("distill/kl_topk"), "privilege_delta": metrics.get("distill/privilege_delta"),
                 "beta": metrics.get("distill/beta"), "train_success": metrics.get("rollout/success_rate")}
        self.points.append(point)
        self.done_steps.add(n)
        if self.on_point is not None:
            self.on_point(point, evaluated)
