"""Shared fixtures. Every fast test runs on the tiny random Llama (SmolLM2 tokenizer), built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect waits 20 s for its ephemeral server; on 2 cores shared with a training run it took longer, and a
# flow test failed on the timeout, not on the code.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """A models directory shared by the whole session (the tiny model is created in it once)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_path(models_dir) -> Path:
    from lopd_core.models.loading import resolve_model_path

    return resolve_model_path("tiny", models_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from lopd_core.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture
def tiny_model(tiny_model_path):
    from lopd_core.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_path, device="cpu")


@pytest.fixture
def smoke_config(tmp_path, models_dir):
    """The smoke profile rooted in a fresh workspace, sharing the session's models directory."""
    from lopd_core.config import load_config

    return load_config(
        "smoke", {"workspace.home": str(tmp_path / "ws"), "workspace.models_dir": str(models_dir)}
    )


@pytest.fixture
def prepared_default_dir() -> Path:
    """The real SmolLM2-135M-Instruct folder (slow tests only): prepared in $LOPD_HOME once, then reused."""
    from lopd_core.models.default import prepare_default
    from lopd_core.workspace import Workspace

    ws = Workspace.default().ensure()
    return Path(prepare_default(ws.models_dir, log=lambda m: None).path)


def pytest_sessionfinish(session, exitstatus):
    """Stop Prefect's ephemeral API server while pytest's output capture is still open. Left to Prefect's own
    atexit hook, its "Stopping temporary server" log line hits a closed stream (a logging traceback after the
    summary) or a server already gone ("Error logging to API")."""
    import logging
    import sys

    # Only cosmetics: these are Prefect internals, so a Prefect release that moves them skips the clean-up
    # (and brings the noise back) instead of failing the session.
    server = sys.modules.get("prefect.server.api.server")
    instances = getattr(getattr(server, "SubprocessASGIServer", None), "_instances", None)
    if not instances:
        return
    worker = getattr(sys.modules.get("prefect.logging.handlers"), "APILogWorker", None)
    if worker is not None:
        worker.drain_all(timeout=5)
    logger = getattr(server, "subprocess_server_logger", logging.getLogger("prefect"))
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        for instance in list(instances.values()):
            instance.stop()
    finally:
        logger.setLevel(level)
