"""Checkpoint directories: atomic, the newest N kept, manifest fields, RNG and trainer state restored."""

from __future__ import annotations

import random

import pytest
import torch

from lopd_core.algorithms.grpo import GRPO
from lopd_core.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint,
    restore_trainer_state,
    save_checkpoint,
)
from lopd_core.config import load_config
from lopd_core.models.policy import STUDENT, build_policy_set


@pytest.fixture
def setup(models_dir):
    cfg = load_config("smoke").with_overrides({"distill.method": "grpo"})
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    return cfg, policies, GRPO(cfg.distill, policies)


def test_keep_last_n_and_ignore_partial_directories(tmp_path, setup):
    cfg, policies, algo = setup
    for step in range(4):
        save_checkpoint(tmp_path, step=step, policies=policies, algorithm=algo, cfg=cfg, cursor=2 * (step + 1),
                        table_version=3, budget={"episodes": 2.0 * (step + 1)}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    (tmp_path / ".step_000009.partial-dead").mkdir()  # a crash mid-write leaves only this behind
    (tmp_path / "step_000010").mkdir()  # a directory without a manifest is not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step_000003"
    info = read_checkpoint(latest_checkpoint(tmp_path))
    assert (info.step, info.cursor, info.table_version, info.method, info.budget) == (3, 8, 3, "grpo", {"episodes": 8.0})
    assert info.config["distill"]["method"] == "grpo" and info.config_hash == cfg.hash()
    assert not any(p.name.startswith(".step_000003") for p in tmp_path.iterdir())
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        read_checkpoint(tmp_path / "step_000010")


def test_rewriting_a_step_replaces_it_whole(tmp_path, setup):
    cfg, policies, algo = setup
    save_checkpoint(tmp_path, step=0, policies=policies, algorithm=algo, cfg=cfg, cursor=1)
    save_checkpoint(tmp_path, step=0, policies=policies, algorithm=algo, cfg=cfg, cursor=5)
    assert read_checkpoint(tmp_path / "step_000000").cursor == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000"]


def test_student_optimizer_and_rng_come_back(tmp_path, setup, models_dir):
    cfg, policies, algo = setup
    with torch.no_grad():
        for p in policies.adapter_parameters(STUDENT):
            p.add_(0.01)
        for p in policies.student_parameters():  # a fake gradient so AdamW has moments to save
            p.grad = torch.ones_like(p)
    algo.optimizer.step()
    algo.optimizer.zero_grad()
    torch.manual_seed(123)
    random.seed(9)
    path = save_checkpoint(tmp_path, step=0, policies=policies, algorithm=algo, cfg=cfg, cursor=2)
    expected_draw, expected_py = torch.rand(3), random.random()

    other = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    info = read_checkpoint(path)
    other.load_student(info.student_dir)
    fresh = GRPO(cfg.distill, other)
    restore_trainer_state(info, fresh)
    for a, b in zip(policies.student_parameters(), other.student_parameters(), strict=True):
        assert torch.equal(a, b)
    saved, loaded = algo.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)
    assert torch.equal(torch.rand(3), expected_draw) and random.random() == expected_py
