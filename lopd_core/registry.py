"""MLflow tracking and the model registry: one run per cycle, paired student/composer versions, the gate.

Conventions (MLflow 3: aliases, not stages; see docs/architecture.md):

- two registered models, ``lopd-student`` and ``lopd-composer`` (names from the ``registry`` config);
  each training cycle registers one version of each — a *pair*. The student is an MLflow model logged by
  the cycle's run (a LoggedModel): the pyfunc flavour with :mod:`lopd_core.serving` as its loader, the chat
  signature and an input example, so ``mlflow.pyfunc.load_model("models:/lopd-student@champion")`` and
  ``mlflow models serve`` answer chat completions (the layout is in that module; :meth:`ModelRegistry.download`
  returns the student folder inside it). The composer, which is never served, is its plain directory logged
  as run artifacts. Both versions carry the same tags: ``paired_version``, ``cycle_id``,
  ``experience_table_version``, ``data_contract_version``, ``config_hash``, ``eval_run_id``,
  ``flow_run_id``, ``base_model``; each names the other in ``paired_with`` (written once, never changed);
- **one champion record**: ``@champion`` (and ``@challenger``) on ``lopd-student`` is the record; the pair is
  that student version and the composer its ``paired_with`` tag names. One alias write moves the whole
  pair, so no reader can see a student and a composer of different pairs. The composer's alias is a
  mirror for MLflow's UI and ``models:/lopd-composer@champion`` URIs, set right after and repaired by every
  later write (:meth:`ModelRegistry.alias_mismatches` says when it lags; ``lopd status`` shows it);
- every move of ``@champion`` (promote, rollback, bootstrap) and every pair registration holds the registry
  lock, a file lock next to the sqlite store or in the workspace (one machine, all processes); a promotion
  moves the alias only if ``@champion`` is still the pair the gate compared against (compare-and-set);
- promotion records the previous champion in ``promoted_from`` so that :meth:`ModelRegistry.rollback` can
  re-point ``@champion`` to it (repeatable); a rolled-back pair carries ``rolled_back=true`` and is promoted
  again only with ``force`` (``lopd promote --force``), recorded in its ``forced`` tag;
- cycle 1 registers the configured base model as version 1 ``@champion`` (student = the base marker naming
  the base folder, served as the base model itself; composer = "not yet trained", cold start pending), so
  every cycle rolls out with ``@champion``;
- runs are stamped with their owner (``lopd.owner.*`` tags and a ``lopd.heartbeat``, see
  :mod:`lopd_core.liveness`); :meth:`ModelRegistry.reap_runs` marks the ones whose process died KILLED.

:func:`decide_promotion` is the gate itself, a pure function of two evaluation summaries and the config; it
fails closed (a missing or non-finite metric refuses, naming it). :func:`run_gate` is the whole promotion:
the gate against the *current* champion's metrics, then the compare-and-set move, retried when the
champion moved in between. MLflow is imported inside the class, so importing this module costs nothing.
Across machines (an MLflow server) the lock does not reach; the compare-and-set then narrows the window
between the check and the move but cannot close it, since MLflow has no transactions.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lopd_core import liveness
from lopd_core.config import RegistryConfig
from lopd_core.workspace import Workspace, has_scheme

CHAMPION = "champion"
CHALLENGER = "challenger"
BASE_MARKER = "lopd_base.json"
"""A registered directory holding this file stands for "the configured base model / no composer yet"."""

SERVING_LOADER = "lopd_core.serving"
"""The loader module of a registered student's pyfunc flavour (MLflow imports it when the model is loaded)."""
STUDENT_DATA = "student"
"""The folder name of the student artifact inside a registered student's MLflow model (``data/student``)."""
SERVING_PACKAGES = ("mlflow", "torch", "transformers", "peft")
"""Written with their installed versions into a student model's requirements (lopd itself must be installed
where the model is served: its loader is lopd_core.serving)."""
SERVING_MODEL_CONFIG = {"base_model_path": "", "device": "cpu", "dtype": "float32", "max_tokens": 256}
"""A student model's defaults, each overridable at load time (``mlflow.pyfunc.load_model(uri, model_config=…)``):
the base folder ('' = the one the artifact names), where and in which dtype it runs, ``max_tokens`` when a
request gives none."""
CHAT_INPUT_EXAMPLE = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                      "temperature": 0.0, "max_tokens": 32}

SUCCESS = "eval/success_rate"
LENGTH = "eval/mean_response_tokens"
MALFORMED = "eval/malformed_call_rate"
PROBE = "eval/probe_success_rate"
FORGETTING = "eval/forgetting_delta"
GATE_METRICS = (SUCCESS, LENGTH, MALFORMED, PROBE, FORGETTING)
"""What the gate reads. All are required unless the caller says the evaluation does not produce one
(``cycle.gate_metrics``: the probe is configured off)."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------------
# The gate (pure)
@dataclass
class GateDecision:
    promote: bool
    reasons: list[str]
    checks: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        verdict = "PROMOTE" if self.promote else "KEEP CHAMPION"
        return f"{verdict}: " + "; ".join(self.reasons)


def _unusable(challenger: dict[str, float], champion: dict[str, float], required: Iterable[str]) -> list[str]:
    """Why the two summaries cannot be compared: a required metric missing, a metric not a finite number,
    or a gate metric measured on one side only."""
    problems = []
    required = set(required)
    for key in GATE_METRICS:
        sides = {"challenger": challenger.get(key), "champion": champion.get(key)}
        for side, value in sides.items():
            if value is None:
                if key in required:
                    problems.append(f"{key} is missing for the {side}")
                elif sides["challenger" if side == "champion" else "champion"] is not None:
                    problems.append(f"{key} was measured for the {'champion' if side == 'challenger' else 'challenger'}"
                                    f" only")
            elif not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                problems.append(f"{key} is {value!r} for the {side}")
    return list(dict.fromkeys(problems))


def decide_promotion(challenger: dict[str, float], champion: dict[str, float], cfg: RegistryConfig, *,
                     required: Iterable[str] = GATE_METRICS) -> GateDecision:
    """Promote only if the challenger wins on held-out success by ``gate_margin`` without forgetting or drift.

    ``challenger`` / ``champion`` are evaluation summaries with the keys ``eval/success_rate``,
    ``eval/mean_response_tokens``, ``eval/malformed_call_rate``, ``eval/probe_success_rate`` and
    ``eval/forgetting_delta`` (student NLL − base NLL on general prompts, nats/token). ``cfg`` is the
    ``registry`` config section. Fails closed: a metric of ``required`` missing on either side, any gate
    metric that is not a finite number, or one measured on one side only keeps the champion, and the
    reason names the metric.
    """
    problems = _unusable(challenger, champion, required)
    if problems:
        return GateDecision(promote=False, reasons=["cannot compare: " + ", ".join(problems)],
                            checks={"unusable_metrics": len(problems)})
    if not (math.isfinite(cfg.gate_margin) and cfg.gate_margin >= 0):  # the config refuses these; belt and braces
        return GateDecision(promote=False, reasons=[f"registry.gate_margin {cfg.gate_margin!r} must be ≥ 0"])
    reasons, checks = [], {}
    gain = challenger[SUCCESS] - champion[SUCCESS]
    checks["success_gain"] = gain
    wins = gain >= cfg.gate_margin - 1e-9
    reasons.append(
        f"held-out success {challenger[SUCCESS]:.3f} vs champion {champion[SUCCESS]:.3f} "
        f"(gain {gain:+.3f}, needs ≥ {cfg.gate_margin:+.3f})"
    )
    ok_forgetting = True
    if PROBE in challenger and PROBE in champion:
        drop = champion[PROBE] - challenger[PROBE]
        checks["probe_drop"] = drop
        if drop > cfg.max_forgetting:
            ok_forgetting = False
            reasons.append(f"forgetting: probe success dropped by {drop:.3f} > {cfg.max_forgetting}")
    if FORGETTING in challenger and FORGETTING in champion:
        delta = challenger[FORGETTING] - champion[FORGETTING]
        checks["forgetting_delta_increase"] = delta
        if delta > cfg.max_forgetting:
            ok_forgetting = False
            reasons.append(f"forgetting: general-prompt NLL rose by {delta:.3f} nats/token > {cfg.max_forgetting}")
    base_len = max(champion[LENGTH], 1.0)
    length_drift = abs(challenger[LENGTH] - base_len) / base_len
    checks["length_drift"] = length_drift
    ok_length = length_drift <= cfg.max_length_drift
    if not ok_length:
        reasons.append(f"length drift {length_drift:.2f} > {cfg.max_length_drift}")
    format_drift = challenger[MALFORMED] - champion[MALFORMED]
    checks["format_drift"] = format_drift
    ok_format = format_drift <= cfg.max_format_drift
    if not ok_format:
        reasons.append(f"format drift: malformed tool calls +{format_drift:.2f} > {cfg.max_format_drift}")
    if ok_forgetting and ok_length and ok_format:
        reasons.append("no forgetting or drift beyond tolerances")
    return GateDecision(promote=bool(wins and ok_forgetting and ok_length and ok_format), reasons=reasons, checks=checks)


class PromotionRefused(RuntimeError):
    """The registry did not move @champion; the message says why and what would."""


class ChampionMoved(PromotionRefused):
    """@champion is no longer the pair a decision was made against (compare-and-set failed)."""

    def __init__(self, expected: str, current: str):
        super().__init__(f"@champion moved from student v{expected} to v{current} since the decision")
        self.expected, self.current = expected, current


def run_params(cfg) -> dict[str, Any]:
    """The params every training run logs (cycle, comparison run, `lopd distill`), so that MLflow's compare
    view can group and filter runs by them. ``cfg`` is a :class:`lopd_core.config.Config`."""
    d = cfg.distill
    return {"profile": cfg.name, "suite": cfg.rollout.suite, "method": d.method, "base_model": cfg.model.base,
            "student": cfg.model.student, "steps": d.steps, "tasks_per_step": d.tasks_per_step,
            "group_size": d.group_size, "lr_student": d.lr_student, "seed": d.seed, "engine": cfg.rollout.engine,
            "config_hash": cfg.hash()}


# --------------------------------------------------------------------------------------------------
@dataclass
class PairVersion:
    student: str
    composer: str
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def is_base(self) -> bool:
        return self.tags.get("kind") == "base"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PROCESS_LOCKS: dict[str, threading.RLock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()
_HELD = threading.local()
OWNER_PREFIX = "lopd.owner."
HEARTBEAT_TAG = "lopd.heartbeat"


class ModelRegistry:
    """The MLflow side of a workspace: the experiment, cycle runs, paired versions and aliases.

    ``lock_path``: the registry lock file (default: ``<sqlite store>.lock``; :meth:`from_workspace` uses the
    workspace for other stores). Without one, only the threads of this process are serialised.
    """

    def __init__(self, tracking_uri: str, artifacts_uri: str, cfg: RegistryConfig, *, lock_path: Path | None = None):
        import mlflow
        from mlflow import MlflowClient

        self.cfg = cfg
        self.tracking_uri = tracking_uri
        self.artifacts_uri = artifacts_uri
        if lock_path is None and tracking_uri.startswith("sqlite:///"):
            lock_path = Path(tracking_uri.removeprefix("sqlite:///") + ".lock")
        self.lock_path = lock_path
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(tracking_uri)
        self.mlflow = mlflow
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.experiment_id = self._ensure_experiment(cfg.experiment)
        for name in (cfg.student_model, cfg.composer_model):
            self._ensure_registered_model(name)

    @classmethod
    def from_workspace(cls, ws: Workspace, cfg: RegistryConfig) -> ModelRegistry:
        artifacts = ws.mlflow_artifacts_uri
        if not has_scheme(artifacts):
            artifacts = Path(artifacts).resolve().as_uri()
        lock = None if ws.mlflow_tracking_uri.startswith("sqlite:///") else ws.home / "registry.lock"
        if ws.s3_endpoint_url and artifacts.startswith("s3://"):  # MLflow's S3 artifact store reads it from here
            os.environ.setdefault("MLFLOW_S3_ENDPOINT_URL", ws.s3_endpoint_url)
        return cls(ws.mlflow_tracking_uri, artifacts, cfg, lock_path=lock)

    # ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self):
        """Hold the registry lock (re-entrant in a thread): one writer of pairs and aliases at a time."""
        key = str(self.lock_path)
        with _PROCESS_LOCKS_GUARD:
            rlock = _PROCESS_LOCKS.setdefault(key, threading.RLock())
        timeout = self.cfg.lock_timeout_seconds
        if not rlock.acquire(timeout=timeout):
            raise TimeoutError(f"another thread of this process held the registry lock for more than {timeout:g} s")
        held = _HELD.__dict__
        try:
            if held.get(key) or self.lock_path is None:
                held[key] = held.get(key, 0) + 1
                try:
                    yield
                finally:
                    held[key] -= 1
                return
            self.lock_path.parent.mkdir(parents=True, exist_ok=True)
            with self.lock_path.open("a+") as f:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(
                                f"another lopd process has held the registry lock {self.lock_path} for more than "
                                f"{timeout:g} s (a promote, rollback or pair registration; the OS releases it "
                                "when that process ends; registry.lock_timeout_seconds sets the wait)") from None
                        time.sleep(0.02)
                held[key] = 1
                try:
                    yield
                finally:
                    held[key] = 0
                    fcntl.flock(f, fcntl.LOCK_UN)
        finally:
            rlock.release()

    def _ensure_experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=f"{self.artifacts_uri.rstrip('/')}/{name}")
        except Exception:  # created concurrently
            return self.client.get_experiment_by_name(name).experiment_id

    def _ensure_registered_model(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            try:
                self.client.create_registered_model(name, description=f"lopd {name.removeprefix('lopd-')} versions")
            except MlflowException:
                pass

    def experiment_for(self, name: str) -> str:
        return self._ensure_experiment(name)

    # --- runs ------------------------------------------------------------------------------------
    def find_run(self, key: str, value: str, experiment_id: str | None = None):
        runs = self.client.search_runs(
            [experiment_id or self.experiment_id], filter_string=f"tags.{key} = '{value}'", max_results=1
        )
        return runs[0] if runs else None

    def _claim(self, run, flow_run_id: str = "") -> str:
        """Stamp ``run`` (created or resumed by this process) with its owner, (re)open it and keep its heartbeat."""
        from mlflow.entities import RunTag

        run_id = run.info.run_id
        tags = run.data.tags
        mine = liveness.is_self({k.removeprefix(OWNER_PREFIX): v for k, v in tags.items() if k.startswith(OWNER_PREFIX)})
        if run.info.status == "FINISHED" or (run.info.status == "RUNNING" and mine):
            return run_id
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        stamp = liveness.owner()
        batch = [RunTag(OWNER_PREFIX + k, v) for k, v in stamp.items() if k != "heartbeat"]
        batch.append(RunTag(HEARTBEAT_TAG, stamp["heartbeat"]))
        if flow_run_id:
            batch.append(RunTag(OWNER_PREFIX + "flow_run_id", flow_run_id))
        self.client.log_batch(run_id, tags=batch)
        client = self.client
        liveness.HEARTBEAT.start(f"mlflow:{run_id}", lambda: client.set_tag(run_id, HEARTBEAT_TAG, f"{time.time():.0f}"),
                                 self.cfg.heartbeat_seconds)
        return run_id

    def keyed_run(self, experiment_id: str, tag: str, key: str, *, run_name: str = "", params: dict[str, Any] | None = None,
                  tags: dict[str, str] | None = None, config: dict | None = None, flow_run_id: str = "") -> str:
        """The run tagged ``tag = key`` in ``experiment_id``: created once (with its params, tags and the config
        as ``config.json``), found, reopened and re-claimed by every later call with the same key."""
        run = self.find_run(tag, key, experiment_id)
        if run is not None:
            return self._claim(run, flow_run_id)
        run = self.client.create_run(experiment_id, run_name=run_name or key, tags={tag: key, **(tags or {})})
        run_id = self._claim(self.client.get_run(run.info.run_id), flow_run_id)
        if params:
            from mlflow.entities import Param

            self.client.log_batch(run_id, params=[Param(k, str(v)[:500]) for k, v in params.items()])
        if config is not None:
            self.client.log_dict(run_id, config, "config.json")
        return run_id

    def cycle_run(self, cycle_id: str, *, params: dict[str, Any] | None = None, config: dict | None = None,
                  flow_run_id: str = "") -> str:
        """The MLflow run of a cycle (created once; re-running a cycle id reuses and reopens it)."""
        return self.keyed_run(self.experiment_id, "lopd.cycle_id", cycle_id, run_name=f"cycle-{cycle_id}",
                              params=params, tags={"lopd.kind": "cycle"}, config=config, flow_run_id=flow_run_id)

    def comparison_run(self, experiment: str, key: str, *, params: dict[str, Any] | None = None,
                       tags: dict[str, str] | None = None, config: dict | None = None, flow_run_id: str = "") -> str:
        """The MLflow run of one comparison run (``key``: the run folder's, ``<method>-s<seed>/<id>``) in
        ``experiment``, created once."""
        return self.keyed_run(self.experiment_for(experiment), "lopd.compare_run", key, params=params,
                              tags={"lopd.kind": "compare", **(tags or {})}, config=config, flow_run_id=flow_run_id)

    def training_run(self, experiment: str, key: str, *, params: dict[str, Any] | None = None,
                     config: dict | None = None) -> str:
        """The MLflow run of a `lopd distill` run (``key`` = its run name) in ``experiment``, created once."""
        return self.keyed_run(self.experiment_for(experiment), "lopd.distill_run", key, params=params,
                              tags={"lopd.kind": "distill"}, config=config)

    def metric_by_step(self, run_id: str, key: str) -> dict[int, float]:
        """A metric's history as ``{step: value}``; a step logged twice (a resumed step) keeps its last value."""
        history = sorted(self.client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
        return {m.step: m.value for m in history}

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items() if v is not None]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def log_artifact_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_artifact_file(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def end_run(self, run_id: str, status: str = "FINISHED", *, reason: str = "") -> None:
        liveness.HEARTBEAT.stop(f"mlflow:{run_id}")
        if reason:
            self.client.set_tag(run_id, "lopd.failed" if status == "FAILED" else "lopd.ended", reason[:4000])
        self.client.set_terminated(run_id, status)

    def reap_runs(self, *, dry_run: bool = False) -> list[dict[str, str]]:
        """Mark KILLED the runs left RUNNING by a process that is gone (tag ``lopd.crashed`` says why).

        Runs without an owner stamp (older versions of lopd) are left alone: nothing says whether they live.
        """
        experiments = [e.experiment_id for e in self.client.search_experiments()]
        if not experiments:
            return []
        out = []
        for run in self.client.search_runs(experiments, "attributes.status = 'RUNNING'", max_results=5000):
            tags = run.data.tags
            stamp = {k.removeprefix(OWNER_PREFIX): v for k, v in tags.items() if k.startswith(OWNER_PREFIX)}
            stamp["heartbeat"] = tags.get(HEARTBEAT_TAG, "")
            reason = liveness.dead_reason(stamp, stale_after=self.cfg.stale_after_seconds)
            if not reason:
                continue
            run_id = run.info.run_id
            if not dry_run:
                self.client.set_tag(run_id, "lopd.crashed", f"{_now()}: {reason}; marked by the reaper")
                self.client.set_terminated(run_id, "KILLED")
            out.append({"run_id": run_id, "run_name": run.info.run_name or "", "reason": reason,
                        "flow_run_id": stamp.get("flow_run_id", ""), "cycle_id": tags.get("lopd.cycle_id", "")})
        return out

    # --- versions --------------------------------------------------------------------------------
    def _model(self, role: str) -> str:
        return self.cfg.student_model if role == "student" else self.cfg.composer_model

    def _versions_with_tag(self, model: str, key: str, value: str) -> list:
        return sorted(self.client.search_model_versions(f"name = '{model}' and tags.{key} = '{value}'"),
                      key=lambda v: int(v.version))

    def _latest_pair_number(self) -> int:
        versions = self.client.search_model_versions(f"name = '{self.cfg.student_model}'")
        return max((int(v.tags.get("paired_version", 0)) for v in versions), default=0)

    def register_pair(self, student_dir: Path, composer_dir: Path, *, run_id: str, cycle_id: str,
                      tags: dict[str, Any]) -> PairVersion:
        """Log both directories as artifacts of ``run_id`` and register them as one pair (idempotent on cycle_id).

        A registration interrupted between the two versions (the student exists, the composer does not) is
        completed, not started again: no orphan version, and the two models' version numbers stay in step.
        """
        with self.locked():
            found = {role: self._versions_with_tag(self._model(role), "cycle_id", cycle_id)
                     for role in ("student", "composer")}
            existing = {role: (versions[0] if versions else None) for role, versions in found.items()}
            s, c = existing["student"], existing["composer"]
            if s is not None and c is not None and s.tags.get("paired_with") == str(c.version) \
                    and c.tags.get("paired_with") == str(s.version):
                return PairVersion(str(s.version), str(c.version), dict(s.tags))
            half = s or c
            pair_number = int(half.tags["paired_version"]) if half is not None else self._latest_pair_number() + 1
            all_tags = {k: str(v) for k, v in tags.items()} | {"cycle_id": cycle_id, "paired_version": str(pair_number)}
            if half is not None:
                all_tags = dict(half.tags) | {k: v for k, v in all_tags.items() if k not in half.tags}
                all_tags.pop("paired_with", None)
            versions = {}
            for role, directory in (("student", student_dir), ("composer", composer_dir)):
                if existing[role] is not None:
                    versions[role] = str(existing[role].version)
                    continue
                artifact_path = f"{role}-pair{pair_number}"
                model_id = None
                if role == "student":
                    model_id = self._log_student_model(run_id, Path(directory), artifact_path)
                    source = f"models:/{model_id}"
                else:
                    self.client.log_artifacts(run_id, str(directory), artifact_path)
                    source = f"{self.client.get_run(run_id).info.artifact_uri}/{artifact_path}"
                mv = self.client.create_model_version(self._model(role), source=source, run_id=run_id, tags=all_tags,
                                                      model_id=model_id)
                versions[role] = str(mv.version)
            for role in ("student", "composer"):
                other = versions["composer" if role == "student" else "student"]
                self.client.set_model_version_tag(self._model(role), versions[role], "paired_with", other)
            return PairVersion(versions["student"], versions["composer"], all_tags | {"paired_with": versions["composer"]})

    def _log_student_model(self, run_id: str, student_dir: Path, name: str) -> str:
        """Log ``student_dir`` as an MLflow model of ``run_id`` (the layout: :mod:`lopd_core.serving`): the pyfunc
        flavour with lopd's loader, the chat signature and an input example. Returns its model id.

        What ``mlflow.pyfunc.log_model`` does, less the check that loads the model and answers the input
        example (a second copy of the model in the promoting process; the tests load it instead)."""
        from importlib.metadata import version

        from mlflow.entities import LoggedModelOutput
        from mlflow.models import Model
        from mlflow.models.signature import ModelSignature
        from mlflow.types.llm import CHAT_MODEL_INPUT_SCHEMA, CHAT_MODEL_OUTPUT_SCHEMA

        run = self.client.get_run(run_id)
        logged = self.client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                                 model_type="lopd-student")
        self.client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / STUDENT_DATA
            shutil.copytree(student_dir, data)
            local = Path(tmp) / "model"
            self.mlflow.pyfunc.save_model(
                local, loader_module=SERVING_LOADER, data_path=str(data),
                mlflow_model=Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                                   model_id=logged.model_id, metadata={"task": "llm/v1/chat"}),
                signature=ModelSignature(CHAT_MODEL_INPUT_SCHEMA, CHAT_MODEL_OUTPUT_SCHEMA),
                input_example=CHAT_INPUT_EXAMPLE, pip_requirements=[f"{p}=={version(p)}" for p in SERVING_PACKAGES],
                model_config=dict(SERVING_MODEL_CONFIG))
            self.client.log_model_artifacts(logged.model_id, str(local))
        self.client.finalize_logged_model(logged.model_id, "READY")
        return logged.model_id

    def pair_for_cycle(self, cycle_id: str) -> PairVersion | None:
        """The complete pair registered for ``cycle_id`` (None while none, or only half of one, exists)."""
        s = self._versions_with_tag(self.cfg.student_model, "cycle_id", cycle_id)
        c = self._versions_with_tag(self.cfg.composer_model, "cycle_id", cycle_id)
        if not s or not c or s[0].tags.get("paired_with") != str(c[0].version):
            return None
        return PairVersion(str(s[0].version), str(c[0].version), dict(s[0].tags))

    def bootstrap_base(self, base_model: str, *, config_hash: str, base_path: Path) -> PairVersion:
        """Cycle 1: register the configured base as version 1 @champion (once). ``base_path``: its folder
        (the served version 1 loads the base model from it)."""
        champion = self.champion()
        if champion is not None:
            return champion
        with self.locked():
            champion = self.champion()
            if champion is not None:
                return champion
            with tempfile.TemporaryDirectory() as tmp:
                tmp_path = Path(tmp)
                (tmp_path / "student").mkdir()
                (tmp_path / "composer").mkdir()
                marker = {"kind": "base", "base_model": base_model, "base_model_path": str(Path(base_path).resolve())}
                (tmp_path / "student" / BASE_MARKER).write_text(json.dumps(marker, indent=2))
                (tmp_path / "composer" / BASE_MARKER).write_text(json.dumps({**marker, "composer": "cold start pending"}))
                run_id = self.cycle_run("base", params={"base_model": base_model})
                pair = self.register_pair(tmp_path / "student", tmp_path / "composer", run_id=run_id, cycle_id="base",
                                          tags={"kind": "base", "base_model": base_model, "config_hash": config_hash})
                self.end_run(run_id)
            self._set_pair_alias(pair, CHAMPION)
            return pair

    # --- aliases: the champion record --------------------------------------------------------------
    def _set_pair_alias(self, pair: PairVersion, alias: str) -> None:
        """The record first (the student's alias, one write), then the composer's mirror. Hold the lock."""
        self.client.set_registered_model_alias(self.cfg.student_model, alias, pair.student)
        self.client.set_registered_model_alias(self.cfg.composer_model, alias, pair.composer)

    def _alias_version(self, role: str, alias: str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(self._model(role), alias)
        except MlflowException:
            return None

    def _pair_by_alias(self, alias: str) -> PairVersion | None:
        s = self._alias_version("student", alias)
        if s is None:
            return None
        composer = s.tags.get("paired_with")
        if not composer:  # registered before pairs named each other: only the mirror knows
            c = self._alias_version("composer", alias)
            composer = str(c.version) if c is not None else ""
        return PairVersion(str(s.version), composer, dict(s.tags))

    def champion(self) -> PairVersion | None:
        """The champion pair, read from its one record (never a student and a composer of different pairs)."""
        return self._pair_by_alias(CHAMPION)

    def challenger(self) -> PairVersion | None:
        return self._pair_by_alias(CHALLENGER)

    def set_challenger(self, pair: PairVersion) -> None:
        with self.locked():
            self._set_pair_alias(pair, CHALLENGER)

    def alias_mismatches(self) -> list[str]:
        """Where the composer's alias (the mirror) disagrees with the pair record, or the record is not a pair."""
        problems = []
        for alias in (CHAMPION, CHALLENGER):
            s, c = self._alias_version("student", alias), self._alias_version("composer", alias)
            if s is None:
                if c is not None:
                    problems.append(f"@{alias} is on {self.cfg.composer_model} v{c.version} but not on "
                                    f"{self.cfg.student_model}")
                continue
            paired = s.tags.get("paired_with")
            if not paired:
                problems.append(f"@{alias}: student v{s.version} names no paired composer (registered half or by "
                                "an older lopd)")
            elif c is None or str(c.version) != paired:
                problems.append(f"@{alias}: student v{s.version} is paired with composer v{paired} but the composer's "
                                f"@{alias} is {'unset' if c is None else f'v{c.version}'} (the next promote, rollback "
                                "or cycle start repairs it)")
        return problems

    def repair_aliases(self) -> list[str]:
        """Point each composer alias at the composer its student record names; returns what was repaired."""
        repaired = []
        with self.locked():
            for alias in (CHAMPION, CHALLENGER):
                s, c = self._alias_version("student", alias), self._alias_version("composer", alias)
                paired = s.tags.get("paired_with") if s is not None else None
                if paired and (c is None or str(c.version) != paired):
                    self.client.set_registered_model_alias(self.cfg.composer_model, alias, paired)
                    repaired.append(f"@{alias}: composer v{c.version if c is not None else '-'} -> v{paired}")
        return repaired

    def promote(self, pair: PairVersion, *, decision: GateDecision | None = None, flow_run_id: str = "",
                expected_champion: str | None = None, force: bool = False) -> PairVersion | None:
        """Point @champion at ``pair``, remembering the previous champion for rollback; returns the previous one.

        Under the registry lock: ``expected_champion`` (a student version) makes it a compare-and-set —
        :class:`ChampionMoved` when @champion is another pair by now; a rolled-back pair is refused
        (:class:`PromotionRefused`) unless ``force``, which is recorded on the pair.
        """
        with self.locked():
            previous = self.champion()
            current = previous.student if previous is not None else ""
            if expected_champion is not None and current != expected_champion:
                raise ChampionMoved(expected_champion, current or "-")
            if previous is not None and previous.student == pair.student:
                self._set_pair_alias(previous, CHAMPION)  # repairs a lagging mirror
                return previous
            s_tags = self.version_tags("student", pair.student)
            if s_tags.get("paired_with") != pair.composer:
                raise ValueError(f"student v{pair.student} and composer v{pair.composer} are not a registered pair "
                                 f"(the student is paired with composer v{s_tags.get('paired_with', '-')})")
            tags: dict[str, str] = {"promoted_at": _now()}
            if s_tags.get("rolled_back") == "true":
                if not force:
                    raise PromotionRefused(
                        f"student v{pair.student} was rolled back ({s_tags.get('rolled_back_at', 'earlier')}); "
                        "it is promoted again only on purpose: `lopd promote --force`")
                tags |= {"rolled_back": "false",
                         "forced": f"{_now()}: promoted again with --force after its rollback of "
                                   f"{s_tags.get('rolled_back_at', '?')}" + (f" (flow run {flow_run_id})" if flow_run_id else "")}
            if flow_run_id:
                tags["promoting_flow_run_id"] = flow_run_id
            if decision is not None:
                tags["gate"] = decision.summary()[:4000]
            for role, version in (("student", pair.student), ("composer", pair.composer)):
                role_tags = dict(tags)
                if previous is not None:
                    role_tags["promoted_from"] = previous.student if role == "student" else previous.composer
                for k, v in role_tags.items():
                    self.set_version_tag(role, version, k, v)
            self._set_pair_alias(pair, CHAMPION)
            return previous

    def tag_pair(self, pair: PairVersion, tags: dict[str, Any]) -> None:
        for role, version in (("student", pair.student), ("composer", pair.composer)):
            for k, v in tags.items():
                self.set_version_tag(role, version, k, v)

    def rollback(self, *, flow_run_id: str = "") -> tuple[PairVersion, PairVersion]:
        """Re-point @champion to the pair it was promoted from. Returns (old champion, new champion).

        The old champion is tagged ``rolled_back=true``: the gate does not promote it again without ``force``.
        """
        with self.locked():
            current = self.champion()
            if current is None:
                raise RuntimeError("no @champion to roll back from; run a cycle first")
            s = self.client.get_model_version(self.cfg.student_model, current.student)
            if "promoted_from" not in s.tags:
                raise RuntimeError(f"@champion (student v{current.student}) was never promoted over another pair; "
                                   "there is nothing to roll back to")
            previous_student = s.tags["promoted_from"]
            composer = self.version_tags("student", previous_student).get("paired_with")
            if not composer:  # pairs registered before they named each other
                composer = self.version_tags("composer", current.composer).get("promoted_from", "")
            previous = PairVersion(previous_student, composer)
            self.tag_pair(current, {"rolled_back": "true", "rolled_back_at": _now(),
                                    "rolled_back_to": previous.student,
                                    **({"rolled_back_by": flow_run_id} if flow_run_id else {})})
            self._set_pair_alias(previous, CHAMPION)
            return current, self.champion()

    # --- artifacts -------------------------------------------------------------------------------
    def download(self, role: str, version: str, dst: Path | None = None) -> Path:
        """Local directory of a registered version as training wrote it (a student's MLflow model: its
        ``data/student`` folder); local file stores are used in place."""
        source = self.client.get_model_version(self._model(role), version).source
        local = Path(self.mlflow.artifacts.download_artifacts(artifact_uri=source))
        if (local / "MLmodel").exists() and (local / "data" / STUDENT_DATA).is_dir():
            local = local / "data" / STUDENT_DATA
        if dst is not None:
            shutil.copytree(local, dst, dirs_exist_ok=True)
            return dst
        return local

    def version_tags(self, role: str, version: str) -> dict[str, str]:
        return dict(self.client.get_model_version(self._model(role), version).tags)

    def set_version_tag(self, role: str, version: str, key: str, value: Any) -> None:
        self.client.set_model_version_tag(self._model(role), version, key, str(value))

    def versions(self, role: str = "student") -> list[dict[str, Any]]:
        out = []
        for v in self.client.search_model_versions(f"name = '{self._model(role)}'"):
            out.append({"version": str(v.version), "aliases": list(v.aliases), "tags": dict(v.tags),
                        "run_id": v.run_id, "source": v.source})
        return sorted(out, key=lambda r: int(r["version"]))


# --------------------------------------------------------------------------------------------------
@dataclass
class GateOutcome:
    """What :func:`run_gate` did: the decision, the champion it was made against (and that champion's
    metrics), the champion afterwards, and whether @champion moved to the challenger."""

    decision: GateDecision
    promoted: bool
    champion_before: PairVersion | None
    champion_after: PairVersion | None
    champion_metrics: dict[str, float] = field(default_factory=dict)
    attempts: int = 1


def run_gate(registry: ModelRegistry, pair: PairVersion, challenger_metrics: dict[str, float],
             champion_metrics: Callable[[PairVersion], dict[str, float]], *, required: Iterable[str] = GATE_METRICS,
             flow_run_id: str = "", force: bool = False, attempts: int = 3) -> GateOutcome:
    """The whole promotion of ``pair``: the gate against the *current* champion, then a compare-and-set move.

    ``champion_metrics(champion)`` returns the evaluation summary of the champion as it is now (recorded
    when it is the pair that was evaluated, else evaluated again); it may be slow and runs outside the
    lock. If @champion moves before the move, the decision is made again against the new champion, up to
    ``attempts`` times. A rolled-back ``pair`` is refused unless ``force``.
    """
    required = tuple(required)
    champion = None
    for attempt in range(1, attempts + 1):
        champion = registry.champion()
        if champion is None:
            return GateOutcome(GateDecision(False, ["there is no @champion to compare with"]), False, None, None,
                               attempts=attempt)
        if champion.student == pair.student:
            return GateOutcome(GateDecision(False, [f"student v{pair.student} is already @champion"]), False,
                               champion, champion, attempts=attempt)
        tags = registry.version_tags("student", pair.student)
        rolled_back = tags.get("rolled_back") == "true"
        if rolled_back and not force:
            decision = GateDecision(False, [f"student v{pair.student} was rolled back "
                                            f"({tags.get('rolled_back_at', 'earlier')}); it is promoted again only "
                                            "on purpose, with `lopd promote --force`"], {"rolled_back": 1.0})
            return GateOutcome(decision, False, champion, champion, attempts=attempt)
        scored = champion_metrics(champion)
        decision = decide_promotion(challenger_metrics, scored, registry.cfg, required=required)
        if rolled_back:
            decision.reasons.insert(0, f"--force: promoting student v{pair.student} again after its rollback of "
                                       f"{tags.get('rolled_back_at', '?')}")
        if not decision.promote:
            return GateOutcome(decision, False, champion, champion, scored, attempt)
        try:
            registry.promote(pair, decision=decision, flow_run_id=flow_run_id, expected_champion=champion.student,
                             force=force)
        except ChampionMoved:
            continue
        except PromotionRefused as e:  # rolled back between the check and the move
            return GateOutcome(GateDecision(False, [str(e)]), False, champion, registry.champion(), scored, attempt)
        return GateOutcome(decision, True, champion, registry.champion(), scored, attempt)
    decision = GateDecision(False, [f"@champion moved {attempts} times while the gate was deciding; nothing was "
                                    "promoted (run `lopd promote` again)"])
    return GateOutcome(decision, False, champion, registry.champion(), attempts=attempts)


def is_base_marker(path: Path | None) -> bool:
    """Whether a registered (or downloaded) directory is the base marker rather than trained weights."""
    return path is not None and (Path(path) / BASE_MARKER).exists()
