"""The workspace: one directory (``LOPD_HOME``, default ``./.lopd``) that holds everything a run writes.

Layout of the embedded default (every location can be re-pointed by URI in the ``workspace`` config
section, e.g. LanceDB on ``s3://…`` or MLflow on ``postgresql://…``):

    models/        prepared base models (``SmolLM2-135M-Instruct/``) and the tiny test model
    lance/         LanceDB: trajectories, experiences, evaluation results, quarantine
    mlflow.db      MLflow tracking + model registry (sqlite)
    mlartifacts/   MLflow artifacts (model versions are plain directories registered by source)
    prefect/       PREFECT_HOME for ephemeral flow runs
    checkpoints/   ``<run>/step_000123/`` training checkpoints
    runs/          per-cycle scratch (rollout JSONL, reports)

This module knows only paths; it does not import any of the storage libraries.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lopd_core.config import WorkspaceConfig

DEFAULT_HOME = ".lopd"


def lopd_home() -> Path:
    return Path(os.environ.get("LOPD_HOME", DEFAULT_HOME)).expanduser().resolve()


def portable(text: str, home: Path | str) -> str:
    """``text`` with the workspace directory written as ``$LOPD_HOME`` (also inside JSON strings), so that
    committed reports and results name no machine's directories."""
    for form in {str(home), json.dumps(str(home))[1:-1]}:
        text = text.replace(form, "$LOPD_HOME")
    return text


def _local_path(uri: str) -> Path | None:
    """The filesystem path of a ``file://`` URI or a plain path; None for remote URIs (s3://, http://,
    mlflow-artifacts:/…)."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if has_scheme(uri):
        return None
    return Path(uri)


def has_scheme(uri: str) -> bool:
    """Whether ``uri`` starts with a URI scheme (``s3://``, ``mlflow-artifacts:/``), not a plain path."""
    import re

    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", uri) is not None


@dataclass(frozen=True)
class Workspace:
    """Resolved locations. Remote URIs are kept as strings; local ones become absolute paths."""

    home: Path
    models_dir: Path
    lance_uri: str
    mlflow_tracking_uri: str
    mlflow_artifacts_uri: str
    prefect_home: Path
    checkpoints_dir: Path
    runs_dir: Path
    s3_endpoint_url: str = ""
    state_uri: str = ""

    @classmethod
    def from_config(cls, cfg: WorkspaceConfig | None) -> Workspace:
        """Build from a :class:`lopd_core.config.WorkspaceConfig` (empty fields, or no config, take the defaults
        under home). Plain attribute reads: this module stays importable with the standard library alone (the
        sandbox imports it from a bare interpreter)."""

        def field(name: str) -> str:
            return getattr(cfg, name, "") or ""

        home = Path(field("home")).expanduser().resolve() if field("home") else lopd_home()

        def under(value: str, default: str) -> str:
            return value or str(home / default)

        tracking = field("mlflow_tracking_uri") or f"sqlite:///{home / 'mlflow.db'}"
        return cls(
            home=home,
            models_dir=Path(under(field("models_dir"), "models")).expanduser().resolve(),
            lance_uri=under(field("lance_uri"), "lance"),
            mlflow_tracking_uri=tracking,
            mlflow_artifacts_uri=under(field("mlflow_artifacts_uri"), "mlartifacts"),
            prefect_home=Path(under(field("prefect_home"), "prefect")).expanduser().resolve(),
            checkpoints_dir=Path(under(field("checkpoints_dir"), "checkpoints")).expanduser().resolve(),
            runs_dir=home / "runs",
            s3_endpoint_url=field("s3_endpoint_url"),
            state_uri=field("state_uri"),
        )

    @classmethod
    def default(cls) -> Workspace:
        return cls.from_config(None)

    def ensure(self) -> Workspace:
        """Create the local directories (remote URIs are left alone)."""
        for p in (self.home, self.models_dir, self.prefect_home, self.checkpoints_dir, self.runs_dir):
            p.mkdir(parents=True, exist_ok=True)
        for uri in (self.lance_uri, self.mlflow_artifacts_uri):
            local = _local_path(uri)
            if local is not None:
                local.mkdir(parents=True, exist_ok=True)
        return self

    def storage_options(self, for_uri: str = "") -> dict[str, str]:
        """Options for an s3:// location (``lance_uri`` unless ``for_uri``): the endpoint of an S3-compatible
        store (plain http allowed when the endpoint says so) and the AWS_* credentials and region of the
        environment."""
        import os

        if not (for_uri or self.lance_uri).startswith("s3://"):
            return {}
        env = {"aws_access_key_id": "AWS_ACCESS_KEY_ID", "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
               "aws_session_token": "AWS_SESSION_TOKEN"}
        out = {key: os.environ[name] for key, name in env.items() if os.environ.get(name)}
        out["region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        if self.s3_endpoint_url:
            out["endpoint"] = self.s3_endpoint_url
            if self.s3_endpoint_url.startswith("http://"):
                out["allow_http"] = "true"
        return out

    def prefect_env(self) -> dict[str, str]:
        """Environment for Prefect's ephemeral (server-less) mode rooted in this workspace."""
        return {
            "PREFECT_HOME": str(self.prefect_home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (local servers: the UI, MLflow, PostgreSQL, S3, tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
