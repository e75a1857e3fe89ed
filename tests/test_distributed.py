"""Multi-process distillation (lopd_core.distributed): two processes under torchrun (gloo, CPU), each running
half of a step's micro-batches, give the one-process step on the same global batch — the same losses, Δ, β and
trained parameters. Real processes, a real process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def run(nproc: int, models_dir: Path, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(HERE / "ddp_lopd_step.py"), str(models_dir), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_two_processes_give_the_one_process_lopd_step(models_dir, tmp_path, tiny_model_path):
    one = run(1, models_dir, tmp_path / "one.pt")
    two = run(2, models_dir, tmp_path / "two.pt")
    assert (one["world"], two["world"]) == (1, 2)
    for step, (a, b) in enumerate(zip(one["metrics"], two["metrics"], strict=True)):
        assert a["distill/micro_batches"] == b["distill/micro_batches"] == 4
        for key in ("distill/kl_topk", "distill/composer_kl", "distill/margin_delta", "distill/privilege_delta",
                    "distill/anchor", "distill/student_grad_norm", "distill/composer_grad_norm",
                    "distill/supervised_tokens", "distill/beta", "distill/privilege_first_token"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
    assert one["metrics"][0]["distill/student_grad_norm"] > 0 and one["beta"] == pytest.approx(two["beta"], abs=1e-6)
    for name in ("student", "composer"):
        moved = 0
        for p1, p2 in zip(one[name], two[name], strict=True):
            # two Adam steps at lr 1e-3 move an element by ~1e-3 whatever its gradient's size, so the order of
            # float sums shows up to ~1e-5 on elements whose gradient is ~0 (as in test_lopd's micro-batch test)
            torch.testing.assert_close(p2, p1, rtol=1e-3, atol=1e-5)
            moved += int(p1.abs().sum() > 0)
        assert moved, name


@pytest.mark.slow  # ~30 s: the fast suite keeps the step-equivalence test
def test_lopd_distill_runs_data_parallel_under_torchrun(tmp_path, models_dir, tiny_model_path):
    """`torchrun --nproc_per_node 2 --no-python lopd distill`: process 0 cold-starts, the two processes share
    each step's rollouts, process 0 alone writes the log, checkpoints and the summary."""
    lopd = Path(sys.executable).with_name("lopd")
    env = {**os.environ, "LOPD_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
           str(lopd), "distill", "--profile", "smoke", "--method", "lopd", "--steps", "2", "--cold-start", "--json",
           "--set", f"workspace.models_dir={models_dir}", "--set", "distill.micro_batch=1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summaries = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # one process speaks
    import json

    summary = json.loads(summaries[0])
    assert summary["method"] == "lopd" and summary["last_step"] == 1
    rows = [json.loads(line) for line in open(summary["metrics_path"])]
    assert [r["step"] for r in rows] == [0, 1]  # logged once per step
    # the step's batch is both processes' rollouts: the smoke profile's tasks_per_step, in micro-batches of 1
    assert all(r["distill/rollouts"] == 2 and r["distill/micro_batches"] >= 1 for r in rows)
    assert (tmp_path / "checkpoints" / "lopd-smoke" / "step_000001" / "manifest.json").exists()
    assert (tmp_path / "checkpoints" / "lopd-smoke" / "final" / "student").is_dir()
