"""Two LOPD steps on a fixed global batch, run under ``torchrun`` (any number of processes); rank 0 saves the
metrics and the trained parameters. Used by test_distributed.py: 2 processes must give the 1-process step.

    torchrun --standalone --nproc_per_node 2 tests/ddp_lopd_step.py MODELS_DIR OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from test_lopd import build, smoke, toy_rollouts

from lopd_core import distributed
from lopd_core.algorithms.base import StepInputs
from lopd_core.algorithms.lopd import LOPD, composer_parameters
from lopd_core.models.loading import load_tokenizer, resolve_model_path


def main(models_dir: Path, out: str) -> None:
    torch.set_num_threads(1)
    distributed.init_from_env()
    tok = load_tokenizer(resolve_model_path("tiny", models_dir))
    rows, tasks, retrieved = toy_rollouts(tok)
    rows, tasks, retrieved = rows * 2, tasks * 2, retrieved * 2  # 4 rollouts: 2 successes, 2 failures
    cfg = smoke(**{"distill.micro_batch": 1, "distill.lopd.lr_composer": 1e-3, "distill.lr_student": 1e-3,
                   "distill.lopd.dual_lr": 0.5})
    policies, composer = build(cfg, models_dir)
    algo = LOPD(cfg.distill, policies, composer)
    metrics = [algo.step(StepInputs(step=s, trajectories=rows, tasks=tasks, retrieved=retrieved)) for s in range(2)]
    rank, size = distributed.world()
    if rank == 0:
        torch.save({"world": size, "metrics": metrics, "beta": algo.beta,
                    "student": [p.detach().clone() for p in policies.student_parameters()],
                    "composer": [p.detach().clone() for p in composer_parameters(policies, composer)]}, out)
    if distributed.active():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
