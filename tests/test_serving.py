"""The deployable student on a real MLflow sqlite store and the tiny model: a registered version is an MLflow
model that names its base folder, answers chat requests, and is served over HTTP by `mlflow models serve`
(slow). The trained pair promoted with `lopd promote --force` and `lopd export` are covered in
tests/test_cycle.py, on the pair a real cycle trained."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lopd_core.config import load_config
from lopd_core.registry import ModelRegistry
from lopd_core.serving import ChatStudent, chat_request
from lopd_core.workspace import free_port

REQUEST = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0.0,
           "max_tokens": 6}


def _registry(home: Path) -> ModelRegistry:
    return ModelRegistry(f"sqlite:///{home / 'mlflow.db'}", (home / "art").as_uri(), load_config("smoke").registry)


def _champion_student(home: Path, base: Path) -> str:
    """A LoRA student on ``base`` registered as a pair and promoted; its student version."""
    from lopd_core.training import build_policies, save_student

    cfg = load_config("smoke", {"model.base": str(base)})
    policies = build_policies(cfg, models_dir=home / "models")
    registry = _registry(home)
    registry.bootstrap_base(str(base), config_hash="h", base_path=base)
    composer = home / "composer"
    composer.mkdir(parents=True)
    (composer / "weights.txt").write_text("not served")
    pair = registry.register_pair(save_student(policies, home / "student"), composer,
                                  run_id=registry.cycle_run("c1"), cycle_id="c1", tags={})
    registry.promote(pair)
    return pair.student


def test_a_version_whose_base_moved_loads_with_the_base_given_in_the_model_config(tmp_path, tiny_model_path):
    import mlflow

    base = tmp_path / "base-copy"
    shutil.copytree(tiny_model_path, base)
    home = tmp_path / "ws"
    version = _champion_student(home, base)
    uri = f"models:/lopd-student/{version}"
    assert mlflow.pyfunc.load_model(uri).predict(REQUEST)["choices"][0]["finish_reason"] in ("stop", "length")

    shutil.rmtree(base)  # the workspace moved to a machine where the base lives elsewhere
    with pytest.raises(FileNotFoundError, match=r"model_config=\{'base_model_path'"):
        mlflow.pyfunc.load_model(uri)
    moved = mlflow.pyfunc.load_model(uri, model_config={"base_model_path": str(tiny_model_path)})
    assert moved.predict(REQUEST)["object"] == "chat.completion"


def test_chat_requests_are_checked_and_answered_as_openai_chat_completions(tiny_model, tiny_tokenizer):
    import pandas as pd

    student = ChatStudent(tiny_model, tiny_tokenizer, name="tiny")
    reply = student.predict({**REQUEST, "n": 2, "temperature": 0.7, "seed": 3})
    assert [c["index"] for c in reply["choices"]] == [0, 1] and reply["model"] == "tiny"
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]
    # what MLflow's schema enforcement may hand over instead of a dict: a one-row DataFrame of arrays
    assert chat_request(pd.DataFrame([REQUEST]))["messages"] == REQUEST["messages"]
    # a stop string cuts the answer and makes it a stop
    greedy = student.predict({**REQUEST, "max_tokens": 12})["choices"][0]["message"]["content"]
    if len(greedy) > 2:
        cut = student.predict({**REQUEST, "max_tokens": 12, "stop": [greedy[1:3]]})["choices"][0]
        assert cut["message"]["content"] == greedy.split(greedy[1:3], 1)[0] and cut["finish_reason"] == "stop"
    with pytest.raises(ValueError, match="'messages'"):
        chat_request({"messages": []})
    with pytest.raises(ValueError, match="one chat request per call"):
        chat_request(pd.DataFrame([REQUEST, REQUEST]))


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_chat_request(tmp_path, tiny_model_path):
    home = tmp_path / "ws"
    _champion_student(home, tiny_model_path)
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # mlflow starts `uvicorn` from PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/lopd-student@champion",
                               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(REQUEST).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["role"] == "assistant"
        assert 1 <= reply["usage"]["completion_tokens"] <= REQUEST["max_tokens"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the uvicorn worker it started
        server.wait(timeout=30)
