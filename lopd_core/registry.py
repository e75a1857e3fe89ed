"""MLflow tracking and the model registry: one run per cycle, paired student/composer versions, the gate.

Conventions (MLflow 3: aliases, not stages; see docs/architecture.md):

- two registered models, ``lopd-student`` and ``lopd-composer`` (names from the ``registry`` config);
  each training cycle registers one version of each — a *pair* — from plain directories logged as run
  artifacts (``create_model_version(source=…)``; no MLflow model flavour, so nothing goes through
  torch.export). Both versions carry the same tags: ``paired_version``, ``cycle_id``,
  ``experience_table_version``, ``data_contract_version``, ``config_hash``, ``eval_run_id``,
  ``flow_run_id``, ``base_model``;
- ``@challenger`` points at the latest pair that finished training, ``@champion`` at the pair that passed
  the gate. Promotion records the previous champion in the tag ``promoted_from`` so that
  :meth:`ModelRegistry.rollback` can re-point ``@champion`` to it (repeatable);
- cycle 1 registers the configured base model as version 1 ``@champion`` (student = base reference,
  composer = "not yet trained", cold start pending), so every cycle rolls out with ``@champion``.

:func:`decide_promotion` is the gate itself, a pure function of two evaluation summaries and the config.
MLflow is imported inside the class, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lopd_core.config import RegistryConfig
from lopd_core.workspace import Workspace

CHAMPION = "champion"
CHALLENGER = "challenger"
BASE_MARKER = "lopd_base.json"
"""A registered directory holding this file stands for "the configured base model / no composer yet"."""


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


def decide_promotion(challenger: dict[str, float], champion: dict[str, float], cfg: RegistryConfig) -> GateDecision:
    """Promote only if the challenger wins on held-out success by ``gate_margin`` without forgetting or drift.

    ``challenger`` / ``champion`` are evaluation summaries with the keys ``eval/success_rate``,
    ``eval/mean_response_tokens``, ``eval/malformed_call_rate`` and, when the probe ran,
    ``eval/probe_success_rate`` and ``eval/forgetting_delta`` (student NLL − base NLL on general prompts,
    nats/token). ``cfg`` is the ``registry`` config section.
    """
    reasons, checks = [], {}
    gain = challenger["eval/success_rate"] - champion["eval/success_rate"]
    checks["success_gain"] = gain
    wins = gain >= cfg.gate_margin - 1e-9
    reasons.append(
        f"held-out success {challenger['eval/success_rate']:.3f} vs champion {champion['eval/success_rate']:.3f} "
        f"(gain {gain:+.3f}, needs ≥ {cfg.gate_margin:+.3f})"
    )
    ok_forgetting = True
    if "eval/probe_success_rate" in challenger and "eval/probe_success_rate" in champion:
        drop = champion["eval/probe_success_rate"] - challenger["eval/probe_success_rate"]
        checks["probe_drop"] = drop
        if drop > cfg.max_forgetting:
            ok_forgetting = False
            reasons.append(f"forgetting: probe success dropped by {drop:.3f} > {cfg.max_forgetting}")
    if "eval/forgetting_delta" in challenger:
        delta = challenger["eval/forgetting_delta"] - champion.get("eval/forgetting_delta", 0.0)
        checks["forgetting_delta_increase"] = delta
        if delta > cfg.max_forgetting:
            ok_forgetting = False
            reasons.append(f"forgetting: general-prompt NLL rose by {delta:.3f} nats/token > {cfg.max_forgetting}")
    base_len = max(champion.get("eval/mean_response_tokens", 0.0), 1.0)
    length_drift = abs(challenger.get("eval/mean_response_tokens", base_len) - base_len) / base_len
    checks["length_drift"] = length_drift
    ok_length = length_drift <= cfg.max_length_drift
    if not ok_length:
        reasons.append(f"length drift {length_drift:.2f} > {cfg.max_length_drift}")
    format_drift = challenger.get("eval/malformed_call_rate", 0.0) - champion.get("eval/malformed_call_rate", 0.0)
    checks["format_drift"] = format_drift
    ok_format = format_drift <= cfg.max_format_drift
    if not ok_format:
        reasons.append(f"format drift: malformed tool calls +{format_drift:.2f} > {cfg.max_format_drift}")
    if ok_forgetting and ok_length and ok_format:
        reasons.append("no forgetting or drift beyond tolerances")
    return GateDecision(promote=bool(wins and ok_forgetting and ok_length and ok_format), reasons=reasons, checks=checks)


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


class ModelRegistry:
    """The MLflow side of a workspace: the experiment, cycle runs, paired versions and aliases."""

    def __init__(self, tracking_uri: str, artifacts_uri: str, cfg: RegistryConfig):
        import mlflow
        from mlflow import MlflowClient

        self.cfg = cfg
        self.tracking_uri = tracking_uri
        self.artifacts_uri = artifacts_uri
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
        if "://" not in artifacts:
            artifacts = Path(artifacts).resolve().as_uri()
        return cls(ws.mlflow_tracking_uri, artifacts, cfg)

    # ---------------------------------------------------------------------------------------------
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

    def cycle_run(self, cycle_id: str, *, params: dict[str, Any] | None = None, config: dict | None = None) -> str:
        """The MLflow run of a cycle (created once; re-running a cycle id reuses it)."""
        run = self.find_run("lopd.cycle_id", cycle_id)
        if run is not None:
            return run.info.run_id
        run = self.client.create_run(self.experiment_id, run_name=f"cycle-{cycle_id}",
                                     tags={"lopd.cycle_id": cycle_id, "lopd.kind": "cycle"})
        run_id = run.info.run_id
        for k, v in (params or {}).items():
            self.client.log_param(run_id, k, str(v)[:500])
        if config is not None:
            self.client.log_dict(run_id, config, "config.json")
        return run_id

    def comparison_run(self, experiment: str, key: str, *, tags: dict[str, str] | None = None) -> str:
        """The MLflow run of one comparison run (``key`` = ``<method>-s<seed>``) in ``experiment``, created once."""
        experiment_id = self.experiment_for(experiment)
        run = self.find_run("lopd.compare_run", key, experiment_id)
        if run is not None:
            return run.info.run_id
        return self.client.create_run(experiment_id, run_name=key,
                                      tags={"lopd.compare_run": key, **(tags or {})}).info.run_id

    def metric_by_step(self, run_id: str, key: str) -> dict[int, float]:
        """A metric's history as ``{step: value}``; a step logged twice (a resumed step) keeps its last value."""
        history = sorted(self.client.get_metric_history(run_id, key), key=lambda m: m.timestamp)
        return {m.step: m.value for m in history}

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items() if v is not None]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def log_artifact_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def log_artifact_file(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    # --- versions --------------------------------------------------------------------------------
    def _versions_with_tag(self, model: str, key: str, value: str) -> list:
        return list(self.client.search_model_versions(f"name = '{model}' and tags.{key} = '{value}'"))

    def _latest_pair_number(self) -> int:
        versions = self.client.search_model_versions(f"name = '{self.cfg.student_model}'")
        return max((int(v.tags.get("paired_version", 0)) for v in versions), default=0)

    def register_pair(self, student_dir: Path, composer_dir: Path, *, run_id: str, cycle_id: str,
                      tags: dict[str, Any]) -> PairVersion:
        """Log both directories as artifacts of ``run_id`` and register them as one pair (idempotent on cycle_id)."""
        existing = self.pair_for_cycle(cycle_id)
        if existing is not None:
            return existing
        pair_number = self._latest_pair_number() + 1
        all_tags = {k: str(v) for k, v in tags.items()} | {"cycle_id": cycle_id, "paired_version": str(pair_number)}
        versions = {}
        for role, model, directory in (("student", self.cfg.student_model, student_dir),
                                       ("composer", self.cfg.composer_model, composer_dir)):
            artifact_path = f"{role}-pair{pair_number}"
            self.client.log_artifacts(run_id, str(directory), artifact_path)
            source = f"{self.client.get_run(run_id).info.artifact_uri}/{artifact_path}"
            mv = self.client.create_model_version(model, source=source, run_id=run_id, tags=all_tags)
            versions[role] = str(mv.version)
        for role, model in (("student", self.cfg.student_model), ("composer", self.cfg.composer_model)):
            other = versions["composer" if role == "student" else "student"]
            self.client.set_model_version_tag(model, versions[role], "paired_with", other)
        return PairVersion(versions["student"], versions["composer"], all_tags)

    def pair_for_cycle(self, cycle_id: str) -> PairVersion | None:
        s = self._versions_with_tag(self.cfg.student_model, "cycle_id", cycle_id)
        c = self._versions_with_tag(self.cfg.composer_model, "cycle_id", cycle_id)
        if not s or not c:
            return None
        return PairVersion(str(s[0].version), str(c[0].version), dict(s[0].tags))

    def bootstrap_base(self, base_model: str, *, config_hash: str) -> PairVersion:
        """Cycle 1: register the configured base as version 1 @champion (once)."""
        champion = self.champion()
        if champion is not None:
            return champion
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            (tmp_path / "student").mkdir()
            (tmp_path / "composer").mkdir()
            marker = {"kind": "base", "base_model": base_model}
            (tmp_path / "student" / BASE_MARKER).write_text(json.dumps(marker, indent=2))
            (tmp_path / "composer" / BASE_MARKER).write_text(json.dumps({**marker, "composer": "cold start pending"}))
            run_id = self.cycle_run("base", params={"base_model": base_model})
            pair = self.register_pair(tmp_path / "student", tmp_path / "composer", run_id=run_id, cycle_id="base",
                                      tags={"kind": "base", "base_model": base_model, "config_hash": config_hash})
            self.end_run(run_id)
        self._set_pair_alias(pair, CHAMPION)
        return pair

    # --- aliases ---------------------------------------------------------------------------------
    def _set_pair_alias(self, pair: PairVersion, alias: str) -> None:
        self.client.set_registered_model_alias(self.cfg.student_model, alias, pair.student)
        self.client.set_registered_model_alias(self.cfg.composer_model, alias, pair.composer)

    def _pair_by_alias(self, alias: str) -> PairVersion | None:
        from mlflow.exceptions import MlflowException

        try:
            s = self.client.get_model_version_by_alias(self.cfg.student_model, alias)
            c = self.client.get_model_version_by_alias(self.cfg.composer_model, alias)
        except MlflowException:
            return None
        return PairVersion(str(s.version), str(c.version), dict(s.tags))

    def champion(self) -> PairVersion | None:
        return self._pair_by_alias(CHAMPION)

    def challenger(self) -> PairVersion | None:
        return self._pair_by_alias(CHALLENGER)

    def set_challenger(self, pair: PairVersion) -> None:
        self._set_pair_alias(pair, CHALLENGER)

    def promote(self, pair: PairVersion, *, decision: GateDecision | None = None, flow_run_id: str = "") -> None:
        """Point @champion at ``pair``, remembering the previous champion for rollback."""
        previous = self.champion()
        if previous is not None and previous.student == pair.student:
            return
        for model, version in ((self.cfg.student_model, pair.student), (self.cfg.composer_model, pair.composer)):
            if previous is not None:
                prev = previous.student if model == self.cfg.student_model else previous.composer
                self.client.set_model_version_tag(model, version, "promoted_from", prev)
            if flow_run_id:
                self.client.set_model_version_tag(model, version, "promoting_flow_run_id", flow_run_id)
            if decision is not None:
                self.client.set_model_version_tag(model, version, "gate", decision.summary()[:4000])
        self._set_pair_alias(pair, CHAMPION)

    def tag_pair(self, pair: PairVersion, tags: dict[str, Any]) -> None:
        for model, version in ((self.cfg.student_model, pair.student), (self.cfg.composer_model, pair.composer)):
            for k, v in tags.items():
                self.client.set_model_version_tag(model, version, k, str(v))

    def rollback(self) -> tuple[PairVersion, PairVersion]:
        """Re-point @champion to the pair it was promoted from. Returns (old champion, new champion)."""
        current = self.champion()
        if current is None:
            raise RuntimeError("no @champion to roll back from; run a cycle first")
        s = self.client.get_model_version(self.cfg.student_model, current.student)
        c = self.client.get_model_version(self.cfg.composer_model, current.composer)
        if "promoted_from" not in s.tags or "promoted_from" not in c.tags:
            raise RuntimeError(f"@champion (student v{current.student}) was never promoted over another pair; "
                               "there is nothing to roll back to")
        previous = PairVersion(s.tags["promoted_from"], c.tags["promoted_from"])
        self.tag_pair(current, {"rolled_back": "true"})
        self._set_pair_alias(previous, CHAMPION)
        return current, self.champion()

    # --- artifacts -------------------------------------------------------------------------------
    def download(self, role: str, version: str, dst: Path | None = None) -> Path:
        """Local directory of a registered version (local file stores are used in place)."""
        model = self.cfg.student_model if role == "student" else self.cfg.composer_model
        source = self.client.get_model_version(model, version).source
        local = Path(self.mlflow.artifacts.download_artifacts(artifact_uri=source))
        if dst is not None:
            shutil.copytree(local, dst, dirs_exist_ok=True)
            return dst
        return local

    def version_tags(self, role: str, version: str) -> dict[str, str]:
        model = self.cfg.student_model if role == "student" else self.cfg.composer_model
        return dict(self.client.get_model_version(model, version).tags)

    def set_version_tag(self, role: str, version: str, key: str, value: Any) -> None:
        model = self.cfg.student_model if role == "student" else self.cfg.composer_model
        self.client.set_model_version_tag(model, version, key, str(value))

    def versions(self, role: str = "student") -> list[dict[str, Any]]:
        model = self.cfg.student_model if role == "student" else self.cfg.composer_model
        out = []
        for v in self.client.search_model_versions(f"name = '{model}'"):
            out.append({"version": str(v.version), "aliases": list(v.aliases), "tags": dict(v.tags),
                        "run_id": v.run_id, "source": v.source})
        return sorted(out, key=lambda r: int(r["version"]))


def is_base_marker(path: Path | None) -> bool:
    """Whether a registered (or downloaded) directory is the base marker rather than trained weights."""
    return path is not None and (Path(path) / BASE_MARKER).exists()
