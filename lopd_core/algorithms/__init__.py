"""Training methods behind one interface (:class:`lopd_core.algorithms.base.Algorithm`).

``lopd`` (the method, :mod:`.lopd`), the baselines ``grpo``, ``opsd``, ``sdpo``, ``skill_sd``, the controls
``rft`` (fine-tuning on the agent's own successes, optionally hinted) and ``sft_oracle`` (on oracle
transcripts: the capacity control), and ``none`` (no update: the reference curve). :func:`make_algorithm` builds the one ``distill.method`` names; every
method reads its settings from the ``distill`` config section.
"""

from __future__ import annotations

from typing import Any

from lopd_core.algorithms.base import Algorithm, StepInputs, skipped_metrics, usable_rollouts
from lopd_core.algorithms.grpo import GRPO
from lopd_core.algorithms.lopd import LOPD
from lopd_core.algorithms.opsd import OPSD
from lopd_core.algorithms.rft import RFT, OracleSFT
from lopd_core.algorithms.sdpo import SDPO
from lopd_core.algorithms.skill_sd import SkillSD
from lopd_core.config import DistillConfig
from lopd_core.models.policy import PolicySet


class NoUpdate:
    """'none': rollouts are generated and scored (the reference curve) but nothing is trained."""

    name = "none"
    episodes_per_task = 1

    def __init__(self, cfg: DistillConfig, policies: PolicySet | None = None):
        self.cfg = cfg

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        usable = usable_rollouts(inputs.trajectories)
        return {**skipped_metrics("distill", total=len(inputs.trajectories),
                                  errored=len(inputs.trajectories) - len(usable)), "distill/updated": 0.0}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def make_algorithm(cfg: DistillConfig, policies: PolicySet, *, composer=None, engine=None, level: int = 1) -> Algorithm:
    """The method ``cfg.method`` (``cfg`` is the ``distill`` section) on these models."""
    if cfg.method == "lopd":
        return LOPD(cfg, policies, composer)
    if cfg.method == "grpo":
        return GRPO(cfg, policies)
    if cfg.method == "opsd":
        return OPSD(cfg, policies)
    if cfg.method == "sdpo":
        return SDPO(cfg, policies)
    if cfg.method == "skill_sd":
        return SkillSD(cfg, policies, engine=engine)
    if cfg.method == "rft":
        return RFT(cfg, policies, level=level, seed=cfg.seed)
    if cfg.method == "sft_oracle":
        return OracleSFT(cfg, policies)
    if cfg.method == "none":
        return NoUpdate(cfg, policies)
    raise ValueError(f"distill.method '{cfg.method}' is not one of lopd, grpo, opsd, sdpo, skill_sd, rft, sft_oracle, none")


__all__ = ["Algorithm", "NoUpdate", "StepInputs", "make_algorithm"]
