"""The stages of one continual-learning cycle, as plain functions (the Prefect flows only chain them).

    rollouts → curate → index → distill → evaluate → promote

Each stage takes a :class:`CycleContext` and returns a small JSON-able reference (counts, table versions,
run ids, model versions), never tensors. Stages are **idempotent on the cycle id**: a finished stage is
recorded in ``<workspace>/runs/<cycle_id>/cycle.json`` and returns its recorded result when run again;
writes are keyed upserts (trajectory ids are ``<cycle>/<stage>/<index>``), registration is keyed by the
cycle id, and distillation resumes from its last checkpoint — so a crash anywhere resumes from the last
completed stage / step, and re-running a finished cycle changes nothing. A stage in progress stamps the
record with its owner (pid, host, heartbeat; :mod:`lopd_core.liveness`), so that a cycle whose process was
killed is found by :func:`reap_cycle_records` and marked ``crashed``.

The promote stage compares the challenger with the champion *as it is at promotion time*: the champion
scored at evaluate time when @champion has not moved since, else the current champion evaluated again
(:func:`lopd_core.registry.run_gate`, with the registry's lock and compare-and-set).

Lineage (docs/method.md, "Across continual-learning cycles"): rollouts always use ``@champion``; the
teacher and the composer's encoder backbone are the configured base model of the whole lineage (tag
``base_model``); the student and composer continue from the champion pair; the composer is cold-started
once, when the champion's composer is still the base marker (cycle 1), and φ0 with its anchor cache
travels inside every later composer artifact.

What this module is not: the algorithms (``training``), the store (``memory``), the gate maths
(``registry.decide_promotion``), or any orchestration (``flows/``).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from pathlib import Path
from typing import Any

from lopd_core import liveness
from lopd_core.config import Config, check_cycle_id
from lopd_core.envs import get_suite
from lopd_core.evaluation import episode_metrics, other_suite
from lopd_core.memory.curation import curate_store
from lopd_core.memory.indexing import index_store
from lopd_core.memory.store import TABLES, ExperienceStore
from lopd_core.metrics import numeric
from lopd_core.models.loading import resolve_model_path
from lopd_core.recipe import bank_from_store, cold_start_composer, evaluate_policy, seed_episodes
from lopd_core.records.experience import Bank
from lopd_core.registry import (
    FORGETTING,
    LENGTH,
    MALFORMED,
    PROBE,
    SUCCESS,
    ModelRegistry,
    PairVersion,
    is_base_marker,
    run_gate,
    run_params,
)
from lopd_core.state_mirror import mirror_of, relocate
from lopd_core.training import build_policies, load_student_init, needs_composer, train
from lopd_core.workspace import Workspace

log = logging.getLogger(__name__)

STAGES = ("rollouts", "curate", "index", "distill", "evaluate", "promote")


class CycleState(enum.StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CRASHED = "crashed"
    """Its process died mid-stage (found by :func:`reap_cycle_records`); re-running the cycle id resumes it."""


@dataclass
class CycleRecord:
    cycle_id: str
    state: CycleState = CycleState.RUNNING
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Results of the completed stages, by stage name."""
    timings: dict[str, float] = field(default_factory=dict)
    """Compute seconds per stage (first successful run)."""
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    error: str = ""
    owner: dict[str, str] = field(default_factory=dict)
    """The process running (or that last ran) a stage: pid, host, boot, start, heartbeat, flow_run_id."""

    @classmethod
    def load(cls, path: Path, cycle_id: str) -> CycleRecord:
        if not path.exists():
            return cls(cycle_id=cycle_id)
        data = json.loads(path.read_text())
        data["state"] = CycleState(data["state"])
        return cls(**data)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**asdict(self), "state": self.state.value}, indent=2, default=str))
        os.replace(tmp, path)


def cycle_id_at(moment: datetime, *, run_id: str = "") -> str:
    """The cycle id of a run started (or scheduled) at ``moment``: ``20261205T1300Z`` (UTC, to the minute),
    followed by ``-`` and the first 8 characters of ``run_id`` when given (runs nobody scheduled)."""
    stamp = moment.astimezone(UTC).strftime("%Y%m%dT%H%MZ")
    return check_cycle_id(f"{stamp}-{run_id.replace('-', '')[:8]}" if run_id else stamp)


def cycle_seed(cycle_id: str, base_seed: int = 0) -> int:
    """A per-cycle seed, so every cycle samples fresh tasks yet re-running one cycle id repeats it exactly."""
    return (int(hashlib.sha256(cycle_id.encode()).hexdigest()[:8], 16) + base_seed) % (2**31 - 1)


class MlflowMetricLogger:
    """The training driver's MetricLogger protocol, writing to the cycle's MLflow run."""

    def __init__(self, registry, run_id: str, *, step_offset: int = 0):
        self.registry, self.run_id, self.step_offset = registry, run_id, step_offset

    def log(self, metrics, *, step: int) -> None:
        self.registry.log_metrics(self.run_id, numeric(metrics), step=step + self.step_offset)


# --------------------------------------------------------------------------------------------------
class CycleContext:
    """Everything a stage needs, created lazily: workspace, store, registry, suite, the cycle record."""

    def __init__(self, cfg: Config, cycle_id: str, *, flow_run_id: str = ""):
        check_cycle_id(cycle_id)  # a ConfigError (a ValueError) naming the id and the rule
        self.cycle_id = cycle_id
        self.seed = cycle_seed(cycle_id, cfg.rollout.seed)
        self.cfg = cfg.with_overrides({"distill.seed": self.seed})
        self.flow_run_id = flow_run_id
        self.ws = Workspace.from_config(cfg.workspace).ensure()
        self.dir = self.ws.runs_dir / cycle_id
        self.record_path = self.dir / "cycle.json"
        self.mirror = mirror_of(self.ws)
        if self.mirror is not None:  # what another worker did on this cycle: its record and checkpoints
            self.mirror.pull(f"runs/{cycle_id}")
            self.mirror.pull(f"checkpoints/cycle-{cycle_id}")
        self.record = CycleRecord.load(self.record_path, cycle_id)
        self._record_lock = threading.Lock()

    @cached_property
    def store(self):
        return ExperienceStore.from_config(self.cfg)

    @cached_property
    def registry(self):
        return ModelRegistry.from_workspace(self.ws, self.cfg.registry)

    @cached_property
    def suite(self):
        return get_suite(self.cfg.rollout.suite)

    @cached_property
    def mlflow_run_id(self) -> str:
        return self.registry.cycle_run(self.cycle_id, params={"cycle_id": self.cycle_id, **run_params(self.cfg)},
                                       config=self.cfg.model_dump(mode="json"), flow_run_id=self.flow_run_id)

    def champion(self):
        return self.registry.bootstrap_base(self.cfg.model.base, config_hash=self.cfg.hash(),
                                            base_path=resolve_model_path(self.cfg.model.base, self.ws.models_dir))

    def _save(self) -> None:
        with self._record_lock:
            self.record.save(self.record_path)

    def push(self) -> None:
        """The cycle's folders to the shared state (``workspace.state_uri``), when there is one."""
        if self.mirror is not None:
            self.mirror.push(f"runs/{self.cycle_id}")
            self.mirror.push(f"checkpoints/cycle-{self.cycle_id}")

    def _beat(self) -> None:
        with self._record_lock:
            self.record.owner["heartbeat"] = f"{time.time():.0f}"
            self.record.save(self.record_path)

    def _fail_mlflow_run(self) -> None:
        """The cycle's MLflow run, if this process holds it open, must not stay RUNNING after a failure."""
        try:  # MLflow may be what failed
            run = self.registry.find_run("lopd.cycle_id", self.cycle_id)
            if run is not None and run.info.status == "RUNNING" and liveness.is_self(
                    {k.removeprefix("lopd.owner."): v for k, v in run.data.tags.items()}):
                self.registry.end_run(run.info.run_id, "FAILED", reason=self.record.error)
        except Exception as e:
            log.warning("cycle %s: could not mark its MLflow run FAILED: %s", self.cycle_id, e)

    def mark_failed(self, reason: str) -> bool:
        """A cycle whose run failed outside a stage (or crashed): its record and its MLflow run FAILED, unless
        it completed. Returns whether there was a started cycle to mark. (A stage that raises marks both
        itself; a killed process is found by the reaper.)"""
        if not self.record_path.exists() or self.record.state == CycleState.COMPLETED:
            return False
        with self._record_lock:
            if self.record.state != CycleState.FAILED or not self.record.error:
                self.record.state, self.record.error = CycleState.FAILED, reason
                self.record.save(self.record_path)
        self._fail_mlflow_run()
        return True

    def run_stage(self, name: str, fn) -> dict[str, Any]:
        """Run ``fn(self)`` once per cycle id; later calls return the recorded result.

        While it runs, the record names this process as its owner and a heartbeat refreshes it; a stage that
        raises marks the record and the cycle's MLflow run FAILED with the error.
        """
        if name in self.record.stages:
            log.info("cycle %s: stage %s already completed, reusing its result", self.cycle_id, name)
            return self.record.stages[name]
        self.record.owner = {**liveness.owner(), "flow_run_id": self.flow_run_id, "stage": name}
        self.record.state, self.record.error = CycleState.RUNNING, ""
        self._save()
        beat = f"cycle:{self.record_path}"
        liveness.HEARTBEAT.start(beat, self._beat, self.cfg.registry.heartbeat_seconds)
        started = time.perf_counter()
        try:
            result = fn(self)
        except BaseException as e:
            liveness.HEARTBEAT.stop(beat)
            with self._record_lock:  # a beat may still be saving the record
                self.record.state, self.record.error = CycleState.FAILED, f"{name}: {type(e).__name__}: {e}"
                self.record.save(self.record_path)
            self._fail_mlflow_run()
            self.push()
            raise
        liveness.HEARTBEAT.stop(beat)
        with self._record_lock:
            self.record.timings[name] = round(time.perf_counter() - started, 2)
            self.record.stages[name] = result
            self.record.state, self.record.error = CycleState.RUNNING, ""
            if "mlflow_run_id" in self.__dict__:
                self.record.owner["mlflow_run_id"] = self.mlflow_run_id
            if name == STAGES[-1]:
                self.record.state, self.record.finished_at = CycleState.COMPLETED, time.time()
            self.record.save(self.record_path)
        self.push()
        return result


def _policies(ctx: CycleContext, student_version: str | None):
    """The run's models with the given registered student version loaded (None/base: the base weights)."""

    policies = build_policies(ctx.cfg, models_dir=ctx.ws.models_dir)
    if student_version is not None:
        load_student_init(policies, ctx.registry.download("student", student_version))
    return policies


def _rekey(trajectories, cycle_id: str, step: int):
    """Deterministic ids ``<cycle>/distill/<step>/<index>``: the idempotency key of every stored training rollout."""
    out = []
    for i, t in enumerate(trajectories):
        key = f"{cycle_id}/distill/{step:04d}/{i:04d}"
        out.append(replace(t, trajectory_id=key, episode_id=key, cycle_id=cycle_id))
    return out


# --------------------------------------------------------------------------------------------------
# Stages
def stage_rollouts(ctx: CycleContext) -> dict[str, Any]:
    """Episodes on training tasks with the @champion student, into the trajectories table."""
    cfg = ctx.cfg
    champion = ctx.champion()
    policies = _policies(ctx, None if champion.is_base else champion.student)
    started = time.perf_counter()
    trajectories = seed_episodes(cfg, policies, ctx.suite, n=cfg.rollout.n_tasks, seed=ctx.seed, weights="student",
                                 label=f"student-v{champion.student}", id_prefix=f"{ctx.cycle_id}/rollouts",
                                 cycle_id=ctx.cycle_id)
    wall = time.perf_counter() - started
    write = ctx.store.write_trajectories(trajectories, stage="rollouts", cycle_id=ctx.cycle_id,
                                         max_bad_fraction=cfg.curation.max_bad_row_fraction)
    metrics = {k.replace("eval/", "rollout/"): v for k, v in episode_metrics(trajectories).items()}
    metrics["rollout/generated_tokens_per_s"] = sum(t.n_generated for t in trajectories) / max(wall, 1e-9)
    ctx.registry.log_metrics(ctx.mlflow_run_id, metrics)
    return {"n": len(trajectories), "champion_student": champion.student, "champion_composer": champion.composer,
            "trajectories_version": write.version, "quarantined": write.n_quarantined, **metrics}


def stage_curate(ctx: CycleContext) -> dict[str, Any]:
    """All stored trajectories → the curated table (cumulative bank; the report says what was kept and why)."""

    report = curate_store(ctx.store, ctx.cfg)
    (ctx.dir / "curation.md").write_text(report.to_markdown())
    ctx.registry.log_artifact_text(ctx.mlflow_run_id, report.to_markdown(), "curation.md")
    ctx.registry.log_metrics(ctx.mlflow_run_id, {"memory/curated": float(report.n_kept)})
    return {"curated_version": report.curated_version, "kept": report.n_kept, "input": report.n_input,
            "dropped": report.dropped, "changes": report.changes}


def stage_index(ctx: CycleContext) -> dict[str, Any]:
    """Embed the curated rows into ``experiences`` (new table version when anything changed)."""

    result = index_store(ctx.store, max_bad_fraction=ctx.cfg.curation.max_bad_row_fraction)
    n = ctx.store.count("experiences")
    ctx.registry.log_metrics(ctx.mlflow_run_id, {"memory/experiences": float(n),
                                                 "memory/experiences_version": float(result.experiences_version),
                                                 "memory/index_experiences_per_s": result.experiences_per_second})
    pinned = {result.experiences_version} | {int(v["tags"]["experience_table_version"])
                                            for v in ctx.registry.versions("student")
                                            if str(v["tags"].get("experience_table_version", "")).isdigit()}
    keep = timedelta(days=ctx.cfg.index.keep_versions_days)
    cleaned = {name: ctx.store.keep_versions(name, keep=keep, pinned=pinned if name == "experiences" else ())
               for name in TABLES}
    ctx.registry.log_metrics(ctx.mlflow_run_id, {"memory/versions_removed": float(sum(c["removed"] for c in cleaned.values()))})
    return {"experiences_version": result.experiences_version, "experiences": n, "versions": cleaned,
            "inserted": result.n_inserted, "updated": result.n_updated, "deleted": result.n_deleted,
            "near_duplicates": len(result.near_duplicates), "vector_index": result.vector_index}


def _cold_start_if_needed(ctx: CycleContext, composer_init: Path | None, bank: Bank) -> Path | None:
    """Cycle 1 (champion composer = base marker): cold-start the composer on the bank's own successes."""
    if not needs_composer(ctx.cfg) or not (composer_init is None or is_base_marker(composer_init)):
        return composer_init
    out_dir = ctx.dir / "cold_start"
    if (out_dir / "lopd_composer.json").exists():
        return out_dir
    result = cold_start_composer(ctx.cfg, bank, suite_name=ctx.cfg.rollout.suite, out_dir=out_dir,
                                 models_dir=ctx.ws.models_dir, logger=MlflowMetricLogger(ctx.registry, ctx.mlflow_run_id))
    ctx.registry.log_metrics(ctx.mlflow_run_id, {"cold_start/nll_first": result.nll_first,
                                                 "cold_start/nll_last": result.nll_last,
                                                 "cold_start/examples": float(result.examples)})
    return out_dir


def stage_distill(ctx: CycleContext) -> dict[str, Any]:
    """N training steps from the champion pair, retrieval pinned at this cycle's experiences version."""

    if "index" not in ctx.record.stages:
        raise ValueError(f"cycle {ctx.cycle_id}: the distill stage needs the index stage's experiences version; "
                         "run the index stage first (`python -m flows.stages index --cycle-id ...`)")
    version = int(ctx.record.stages["index"]["experiences_version"])
    champion = ctx.champion()
    student_init = ctx.registry.download("student", champion.student)
    composer_init = ctx.registry.download("composer", champion.composer)
    bank = bank_from_store(ctx.store, version=version, episodes=ctx.record.stages.get("rollouts", {}).get("n", 0))
    composer_init = _cold_start_if_needed(ctx, composer_init, bank)

    def store_step(step: int, metrics: dict[str, float], trajectories) -> None:
        ctx.store.write_trajectories(_rekey(trajectories, ctx.cycle_id, step), stage="distill",
                                     cycle_id=ctx.cycle_id, max_bad_fraction=ctx.cfg.curation.max_bad_row_fraction)

    result = train(ctx.cfg, suite=ctx.suite, bank=bank, run_dir=ctx.ws.checkpoints_dir / f"cycle-{ctx.cycle_id}",
                   student_init=student_init, composer_init=composer_init,
                   logger=MlflowMetricLogger(ctx.registry, ctx.mlflow_run_id), on_step=store_step,
                   models_dir=ctx.ws.models_dir, on_checkpoint=lambda path: ctx.push())
    composer_dir = result.composer_dir or composer_init
    history = [{k: v for k, v in m.items() if k.startswith(("distill/", "rollout/success", "budget/episodes"))}
               for m in result.history]
    (ctx.dir / "distill_history.json").write_text(json.dumps(history))
    return {"student_dir": str(result.student_dir), "composer_dir": str(composer_dir) if composer_dir else "",
            "steps": result.last_step + 1, "resumed": result.resumed, "experiences_version": version,
            "budget": result.budget,
            "last": {k: v for k, v in result.metrics.items() if k.startswith(("distill/", "rollout/"))}}


def _evaluate_student(ctx: CycleContext, policies, role: str, label: str, *, use_base_weights: bool) -> dict:
    from data_contracts.convert import evaluation_frame

    result = evaluate_policy(ctx.cfg, policies, ctx.cfg.rollout.suite, label=label,
                             weights="base" if use_base_weights else "student", with_probe=True,
                             reference_cache=ctx.ws.runs_dir / "probe_references" / f"{Path(str(policies.base_path)).name}.json",
                             cycle_id=ctx.cycle_id)
    eval_run_id = f"{ctx.cycle_id}/{role}"
    frames = [evaluation_frame(result.trajectories, eval_run_id=eval_run_id, role=role, cycle_id=ctx.cycle_id)]
    if result.probe_trajectories:
        frames.append(evaluation_frame(result.probe_trajectories, eval_run_id=eval_run_id, role=role,
                                       probe="forgetting", cycle_id=ctx.cycle_id))
    import pandas as pd

    ctx.store.write_evaluations(pd.concat(frames, ignore_index=True), cycle_id=ctx.cycle_id)
    return result.metrics


def stage_evaluate(ctx: CycleContext) -> dict[str, Any]:
    """Challenger (this cycle's student) vs champion on the held-out set, with the probe and drift metrics."""

    distill = ctx.record.stages["distill"]
    champion = ctx.champion()
    policies = _policies(ctx, None)
    load_student_init(policies, relocate(distill["student_dir"], ctx.ws))
    challenger = _evaluate_student(ctx, policies, "challenger", f"{ctx.cycle_id}/challenger", use_base_weights=False)
    if champion.is_base:
        champion_metrics = _evaluate_student(ctx, policies, "champion", f"student-v{champion.student}",
                                             use_base_weights=True)
    else:
        load_student_init(policies, ctx.registry.download("student", champion.student))
        champion_metrics = _evaluate_student(ctx, policies, "champion", f"student-v{champion.student}",
                                             use_base_weights=False)
    ctx.registry.log_metrics(ctx.mlflow_run_id, challenger)
    ctx.registry.log_metrics(ctx.mlflow_run_id, {k.replace("eval/", "eval_champion/"): v
                                                 for k, v in champion_metrics.items()})
    return {"challenger": challenger, "champion": champion_metrics, "champion_student": champion.student,
            "champion_composer": champion.composer}


def gate_metrics(cfg: Config) -> tuple[str, ...]:
    """The metrics the gate requires on both sides: the evaluation always measures success, length and
    malformed calls; the probe suite and the general-prompt NLL only when the ``evaluate`` config runs them."""
    required = [SUCCESS, LENGTH, MALFORMED]
    probe = cfg.evaluate.probe_suite if cfg.evaluate.probe_suite != "auto" else other_suite(cfg.rollout.suite)
    if probe and cfg.evaluate.probe_n_tasks:
        required.append(PROBE)
    if cfg.evaluate.probe_prompts:
        required.append(FORGETTING)
    return tuple(required)


def _score_champion(ctx: CycleContext, champion: PairVersion) -> dict[str, float]:
    """Evaluate the current champion the way the evaluate stage did (same tasks, same probe)."""
    source = ctx.registry.download("student", champion.student)
    base = is_base_marker(source)
    policies = _policies(ctx, None if base else champion.student)
    return _evaluate_student(ctx, policies, "champion", f"student-v{champion.student}", use_base_weights=base)


def stage_promote(ctx: CycleContext) -> dict[str, Any]:
    """Register the pair (@challenger), run the gate against the current champion, move @champion when it
    passes (compare-and-set under the registry lock); write the report."""
    from data_contracts import SCHEMA_VERSION

    distill, evaluation = ctx.record.stages["distill"], ctx.record.stages["evaluate"]
    ctx.champion()  # a fresh registry (its record lost) bootstraps before anything compares with it
    composer_dir = relocate(distill["composer_dir"], ctx.ws) if distill["composer_dir"] else \
        ctx.registry.download("composer", evaluation["champion_composer"])
    pair = ctx.registry.register_pair(
        relocate(distill["student_dir"], ctx.ws), composer_dir, run_id=ctx.mlflow_run_id, cycle_id=ctx.cycle_id,
        tags={"experience_table_version": distill["experiences_version"], "data_contract_version": SCHEMA_VERSION,
              "config_hash": ctx.cfg.hash(), "eval_run_id": ctx.mlflow_run_id, "flow_run_id": ctx.flow_run_id,
              "base_model": ctx.cfg.model.base, "method": ctx.cfg.distill.method,
              "eval_summary": json.dumps({k: round(v, 4) for k, v in evaluation["challenger"].items()})})
    ctx.registry.set_challenger(pair)
    rescored: dict[str, dict[str, float]] = {}

    def champion_metrics(champion: PairVersion) -> dict[str, float]:
        if champion.student == str(evaluation["champion_student"]):
            return evaluation["champion"]
        log.info("cycle %s: @champion moved from student v%s to v%s since the evaluate stage; evaluating it again",
                 ctx.cycle_id, evaluation["champion_student"], champion.student)
        rescored[champion.student] = _score_champion(ctx, champion)
        return rescored[champion.student]

    outcome = run_gate(ctx.registry, pair, evaluation["challenger"], champion_metrics,
                       required=gate_metrics(ctx.cfg), flow_run_id=ctx.flow_run_id)
    decision = outcome.decision
    ctx.registry.tag_pair(pair, {"gate": decision.summary()[:4000]})
    champion_after = outcome.champion_after or ctx.registry.champion()
    compared = outcome.champion_before
    ctx.registry.log_metrics(ctx.mlflow_run_id, {"gate/promoted": float(outcome.promoted),
                                                 **{f"gate/{k}": float(v) for k, v in decision.checks.items()}})
    result = {"student_version": pair.student, "composer_version": pair.composer,
              "promoted": champion_after is not None and champion_after.student == pair.student,
              "decision": decision.summary(),
              "champion_before": compared.student if compared is not None else None,
              "champion_evaluated": str(evaluation["champion_student"]),
              "champion_rescored": rescored, "gate_attempts": outcome.attempts,
              "champion_after": champion_after.student if champion_after is not None else None,
              "mlflow_run_id": ctx.mlflow_run_id}
    report = cycle_report(ctx, result)
    (ctx.dir / "report.md").write_text(report)
    ctx.registry.log_artifact_text(ctx.mlflow_run_id, report, "report.md")
    curve = learning_curve(ctx, result)
    if curve is not None:
        ctx.registry.log_artifact_file(ctx.mlflow_run_id, curve)
    ctx.registry.end_run(ctx.mlflow_run_id)
    return result


STAGE_FUNCTIONS = {"rollouts": stage_rollouts, "curate": stage_curate, "index": stage_index,
                   "distill": stage_distill, "evaluate": stage_evaluate, "promote": stage_promote}


def run_stage(cfg: Config, cycle_id: str, stage: str, *, flow_run_id: str = "") -> dict[str, Any]:
    """Run one stage of a cycle (what every flow task calls)."""
    ctx = CycleContext(cfg, cycle_id, flow_run_id=flow_run_id)
    return ctx.run_stage(stage, STAGE_FUNCTIONS[stage])


def open_cycle(cfg: Config, cycle_id: str) -> str:
    """Create the record of ``cycle_id`` if it does not exist yet; returns its identity (the record's start
    time), which changes only when the record is made anew — what an orchestrator's cache of the stages is
    keyed on, so a deleted cycle is never answered from a cache."""
    ctx = CycleContext(cfg, cycle_id)
    if not ctx.record_path.exists():
        ctx._save()
    return f"{ctx.record.started_at:.6f}"


def recorded_stages(cfg: Config, cycle_id: str) -> list[str]:
    """The stages of ``cycle_id`` that completed (their results are recorded and will be returned as they are)."""
    return list(CycleContext(cfg, cycle_id).record.stages)


def mark_cycle_failed(cfg: Config, cycle_id: str, *, reason: str) -> bool:
    """:meth:`CycleContext.mark_failed` of ``cycle_id`` (what the flow's failure and crash hooks call)."""
    return CycleContext(cfg, cycle_id).mark_failed(reason)


def reap_cycle_records(ws: Workspace, *, stale_after: float) -> list[dict[str, str]]:
    """Mark ``crashed`` the cycle records left ``running`` by a process that is gone; returns them."""
    out = []
    for path in sorted(ws.runs_dir.glob("*/cycle.json")):
        try:
            record = CycleRecord.load(path, path.parent.name)
        except (ValueError, TypeError, KeyError) as e:
            log.warning("unreadable cycle record %s: %s", path, e)
            continue
        if record.state != CycleState.RUNNING or not record.owner:
            continue
        reason = liveness.dead_reason(record.owner, stale_after=stale_after)
        if not reason:
            continue
        stage = record.owner.get("stage", "")
        record.state = CycleState.CRASHED
        record.error = (f"crashed{f' in {stage}' if stage else ''}: {reason} (re-run with --cycle-id "
                        f"{record.cycle_id} to resume)")
        record.save(path)
        out.append({"cycle_id": record.cycle_id, "reason": reason, "stage": stage,
                    "flow_run_id": record.owner.get("flow_run_id", "")})
    return out


# --------------------------------------------------------------------------------------------------
# Reporting
def cycle_summary(cfg: Config, cycle_id: str) -> dict[str, Any]:
    """The cycle's recorded results in one small dict (the `lopd cycle --json` payload)."""
    ctx = CycleContext(cfg, cycle_id)
    st = ctx.record.stages
    ev = st.get("evaluate", {})
    return {
        "cycle_id": cycle_id, "state": ctx.record.state.value, "profile": cfg.name, "suite": cfg.rollout.suite,
        "method": cfg.distill.method,
        "success_before": ev.get("champion", {}).get("eval/success_rate"),
        "success_after": ev.get("challenger", {}).get("eval/success_rate"),
        "seed_rollout_success": st.get("rollouts", {}).get("rollout/success_rate"),
        "experiences": st.get("index", {}).get("experiences"),
        "experiences_version": st.get("index", {}).get("experiences_version"),
        "distill_steps": st.get("distill", {}).get("steps"),
        "student_version": st.get("promote", {}).get("student_version"),
        "composer_version": st.get("promote", {}).get("composer_version"),
        "promoted": st.get("promote", {}).get("promoted"),
        "decision": st.get("promote", {}).get("decision"),
        "champion": st.get("promote", {}).get("champion_after"),
        "timings_s": ctx.record.timings,
        "report": str(ctx.dir / "report.md"),
        "mlflow_tracking_uri": ctx.ws.mlflow_tracking_uri,
        "prefect_home": str(ctx.ws.prefect_home),
    }


def cycle_report(ctx: CycleContext, promote: dict[str, Any]) -> str:
    st = ctx.record.stages
    ev = st["evaluate"]
    rows = sorted(set(ev["challenger"]) | set(ev["champion"]))
    lines = [f"# lopd cycle `{ctx.cycle_id}`", "",
             f"profile `{ctx.cfg.name}` · suite `{ctx.cfg.rollout.suite}` · method `{ctx.cfg.distill.method}` · "
             f"base `{ctx.cfg.model.base}`", "",
             f"**Decision:** {promote['decision']}", "",
             f"Pair registered: student v{promote['student_version']} / composer v{promote['composer_version']} "
             f"(@challenger); @champion is student v{promote['champion_after']}.", "",
             *([f"@champion moved after the evaluate stage (student v{promote['champion_evaluated']}); the gate "
                f"compared with student v{promote['champion_before']}"
                + (", evaluated again" if promote.get("champion_rescored") else "") + ".", ""]
               if promote.get("champion_before") not in (None, promote.get("champion_evaluated")) else []),
             "| metric | champion | challenger |", "|---|---|---|"]
    for k in rows:
        a, b = ev["champion"].get(k), ev["challenger"].get(k)
        lines.append(f"| {k} | {'' if a is None else f'{a:.4g}'} | {'' if b is None else f'{b:.4g}'} |")
    ro, ix, di = st.get("rollouts", {}), st.get("index", {}), st.get("distill", {})
    lines += ["", "## Stages", "",
              f"- rollouts: {ro.get('n')} episodes with student v{ro.get('champion_student')}, success "
              f"{ro.get('rollout/success_rate', 0):.3f}, {ro.get('quarantined', 0)} quarantined",
              f"- curated: {st.get('curate', {}).get('kept')} kept",
              f"- experiences: {ix.get('experiences')} rows at table version {ix.get('experiences_version')}",
              f"- distill: {di.get('steps')} steps (resumed: {di.get('resumed')}), last metrics "
              + ", ".join(f"{k}={v:.4g}" for k, v in sorted(di.get("last", {}).items())
                          if k in ("distill/kl_topk", "distill/privilege_delta", "distill/beta", "rollout/success_rate")),
              "", "## Compute seconds per stage", "",
              *(f"- {k}: {v:.1f}" for k, v in ctx.record.timings.items())]
    return "\n".join(lines) + "\n"


def cycle_history(ws: Workspace) -> list[dict[str, Any]]:
    """Held-out success of the champion and the challenger of every evaluated cycle of the workspace, in the
    order the cycles started, with the promotion decision (None while a cycle has not reached promote)."""
    rows = []
    for path in ws.runs_dir.glob("*/cycle.json"):
        try:
            record = CycleRecord.load(path, path.parent.name)
        except (ValueError, TypeError, KeyError):
            continue
        evaluation, promote = record.stages.get("evaluate"), record.stages.get("promote", {})
        if not evaluation:
            continue
        rows.append({"cycle_id": record.cycle_id, "started_at": record.started_at,
                     "champion_student": str(evaluation["champion_student"]),
                     "champion_success": evaluation["champion"].get(SUCCESS),
                     "challenger_success": evaluation["challenger"].get(SUCCESS),
                     "student_version": promote.get("student_version"), "promoted": promote.get("promoted")})
    return sorted(rows, key=lambda r: r["started_at"])


def learning_curve(ctx: CycleContext, promote: dict[str, Any] | None = None) -> Path | None:
    """PNG of held-out success across the workspace's cycles: the champion each cycle was compared with (line)
    and each cycle's challenger (dots), a promoted challenger starred and labelled with its version.
    ``promote``: this cycle's promote result, when it is not recorded yet (the promote stage draws it)."""
    history = cycle_history(ctx.ws)
    for row in history:
        if promote is not None and row["cycle_id"] == ctx.cycle_id:
            row.update(student_version=promote["student_version"], promoted=promote["promoted"])
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(history)))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(history) + 2.5), 3.2))
    ax.plot(x, [h["champion_success"] for h in history], marker="s", color="tab:blue", label="@champion")
    ax.scatter(x, [h["challenger_success"] for h in history], color="tab:orange", zorder=3, label="challenger")
    promoted = [i for i, h in enumerate(history) if h["promoted"]]
    if promoted:
        ax.scatter([x[i] for i in promoted], [history[i]["challenger_success"] for i in promoted], marker="*", s=220,
                   color="tab:green", zorder=4, label="promoted")
        for i in promoted:
            ax.annotate(f"v{history[i]['student_version']}", (x[i], history[i]["challenger_success"]),
                        textcoords="offset points", xytext=(6, 6), fontsize=8)
    ax.set_xticks(x, [h["cycle_id"] for h in history], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("held-out success")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"held-out success across cycles (up to {ctx.cycle_id})", fontsize=9)
    fig.tight_layout()
    path = ctx.dir / "learning_curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
