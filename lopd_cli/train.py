"""`lopd distill` (and `--cold-start`): train the student (and the composer) for N steps.

Retrieval comes from the LanceDB experience store when it holds experiences (pinned at its current
version, recorded in the checkpoints); otherwise from an in-memory bank seeded here from base-model
rollouts on ``rollout.n_tasks`` training tasks (those episodes count as pre-training budget). The JSON
output says which (``retriever``). ``--cold-start`` first trains the composer on the bank's successes
(:func:`lopd_core.recipe.cold_start_composer`) and then runs the joint training with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lopd_cli.common import (
    JsonFlag,
    Overrides,
    Profile,
    emit_json,
    engine_line,
    err,
    fail,
    load,
    out,
    workspace,
)


def _config(profile, set_, *, suite, steps, method):
    from lopd_core.config import ConfigError

    cfg = load(profile, set_)
    extra = {k: v for k, v in {"rollout.suite": suite, "distill.steps": steps, "distill.method": method}.items()
             if v is not None}
    try:
        return cfg.with_overrides(extra) if extra else cfg
    except ConfigError as e:
        fail(str(e), code=2)


def _bank(cfg, policies, suite):
    """The workspace's LanceDB experiences when it holds some (pinned now), else an in-memory bank seeded here."""
    from lopd_core.envs import suite_kind
    from lopd_core.recipe import bank_from_store, memory_bank, seed_episodes

    try:
        from lopd_core.memory.store import ExperienceStore

        store = ExperienceStore.from_config(cfg)
        if store.has_table("experiences") and store.count("experiences") > 0:
            return bank_from_store(store)
    except ImportError as e:
        err.print(f"LanceDB store unavailable ({e}); using an in-memory experience bank", highlight=False)
    err.print(f"seeding an in-memory experience bank from {cfg.rollout.n_tasks} base-model episodes…", highlight=False)
    episodes = seed_episodes(cfg, policies, suite, n=cfg.rollout.n_tasks)
    return memory_bank(episodes, cfg, kind=suite_kind(cfg.rollout.suite))


def _mlflow_run(cfg, ws, run: str):
    """(registry, run id) of this training run in the MLflow experiment ``lopd-distill`` (created once per run
    name, reopened on resume); None where MLflow is not installed (a torch-only machine)."""
    try:
        from lopd_core.registry import ModelRegistry, run_params

        registry = ModelRegistry.from_workspace(ws, cfg.registry)
    except ImportError as e:
        err.print(f"MLflow unavailable ({e}); metrics go to metrics.jsonl only", highlight=False)
        return None
    return registry, registry.training_run(DISTILL_EXPERIMENT, run, params=run_params(cfg),
                                           config=cfg.model_dump(mode="json"))


DISTILL_EXPERIMENT = "lopd-distill"


def distill(
    profile: Profile = "demo",
    set_: Overrides = None,
    suite: Annotated[str | None, typer.Option(help="Task suite (overrides rollout.suite).")] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (overrides distill.steps).")] = None,
    method: Annotated[str | None, typer.Option(help="lopd, grpo, opsd, sdpo, skill_sd or none.")] = None,
    cold_start: Annotated[bool, typer.Option("--cold-start", help="Cold-start the composer first (LOPD).")] = False,
    run: Annotated[str, typer.Option(help="Run name: checkpoints go to <checkpoints>/<run>/.")] = "",
    student_init: Annotated[Path | None, typer.Option(help="Student directory to continue from.")] = None,
    composer_init: Annotated[Path | None, typer.Option(help="Composer directory (with φ0) to continue from.")] = None,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Resume from the run's latest checkpoint.")] = True,
    as_json: JsonFlag = False,
):
    """Run N training steps (LOPD or a baseline); --cold-start trains the composer first.

    Under torchrun (`torchrun --nproc_per_node N --no-python lopd distill ...`) LOPD runs data-parallel over N
    processes: each plays its share of every step's tasks and computes its share of the step; process 0 alone
    cold-starts, logs (metrics.jsonl, MLflow), checkpoints and prints."""
    from lopd_core import distributed
    from lopd_core.cycle import MlflowMetricLogger
    from lopd_core.envs import get_suite
    from lopd_core.metrics import JsonlLogger, MultiLogger
    from lopd_core.models.loading import ModelNotFoundError
    from lopd_core.recipe import cold_start_composer
    from lopd_core.training import build_policies, needs_composer, train

    cfg = _config(profile, set_, suite=suite, steps=steps, method=method)
    distributed.init_from_env()
    lead = distributed.world()[0] == 0
    ws = workspace(cfg)
    run = run or f"{cfg.distill.method}-{cfg.name}"
    run_dir = ws.checkpoints_dir / run
    try:
        suite_obj = get_suite(cfg.rollout.suite)
        policies = build_policies(cfg, models_dir=ws.models_dir)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))

    err.print(engine_line(cfg), highlight=False)
    bank = _bank(cfg, policies, suite_obj)
    err.print(f"experience bank: {bank.source}" + (f", table version {bank.version}" if bank.version is not None else
                                                     f", {len(bank.successes)} successes of {bank.episodes} episodes"),
              highlight=False)

    cold = None
    if cold_start and not needs_composer(cfg):
        err.print(f"--cold-start ignored: method '{cfg.distill.method}' (context '{cfg.distill.lopd.context}') "
                  "has no composer", highlight=False)
    if cold_start and needs_composer(cfg):
        if lead:
            try:
                cold = cold_start_composer(cfg, bank, suite_name=cfg.rollout.suite, policies=policies,
                                           out_dir=run_dir / "cold_start" / "composer",
                                           logger=JsonlLogger(run_dir / "cold_start" / "metrics.jsonl"))
            except ValueError as e:
                fail(f"cold start: {e}")
        distributed.barrier()  # the other processes load what process 0 wrote
        composer_init = cold.composer_dir if cold else run_dir / "cold_start" / "composer"
    tracked = _mlflow_run(cfg, ws, run) if lead else None
    logger = MultiLogger(JsonlLogger(run_dir / "metrics.jsonl"),
                         MlflowMetricLogger(*tracked) if tracked is not None else None)
    try:
        result = train(cfg, suite=suite_obj, bank=bank, run_dir=run_dir, student_init=student_init,
                       composer_init=composer_init, logger=logger, resume=resume,
                       policies=policies, pretraining_episodes=0 if bank.source == "lancedb" else bank.episodes)
    except BaseException as e:
        if tracked is not None:
            tracked[0].end_run(tracked[1], "FAILED", reason=f"{type(e).__name__}: {e}")
        if isinstance(e, ValueError | FileNotFoundError):
            fail(str(e))
        raise
    if tracked is not None:
        tracked[0].end_run(tracked[1])
    distributed.barrier()
    if not lead:
        return
    summary = {"run": run, "method": cfg.distill.method, "profile": cfg.name, "suite": cfg.rollout.suite,
               "retriever": bank.source, "experience_bank_version": bank.version,
               "experience_bank_successes": len(bank.successes),
               "cold_start": cold.to_dict() if cold else None, "metrics_path": str(run_dir / "metrics.jsonl"),
               "mlflow_run_id": tracked[1] if tracked is not None else None,
               **result.to_dict()}
    if as_json:
        emit_json(summary)
    else:
        m = result.metrics
        out.print(f"{cfg.distill.method}: steps {result.first_step}–{result.last_step} in {run_dir}  "
                  f"success {m.get('rollout/success_rate', float('nan')):.3f}  budget {result.budget.get('episodes', 0):.0f} "
                  f"episodes  student → {result.student_dir}", highlight=False)
