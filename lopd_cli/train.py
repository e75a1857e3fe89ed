"""`lopd distill` (and `--cold-start`): train the student (and the composer) for N steps.

Retrieval comes from the LanceDB experience store when it holds experiences (pinned at its current
version, recorded in the checkpoints); otherwise from an in-memory bank seeded here from base-model
rollouts on ``rollout.n_tasks`` training tasks (those episodes count as pre-training budget). The JSON
output says which (``retriever``). ``--cold-start`` first trains the composer on the successful
trajectories (the store's, or the seed rollouts') and then runs the joint training with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lopd_cli.common import JsonFlag, Overrides, Profile, emit_json, err, fail, load, out, workspace


def _config(profile, set_, *, suite, steps, method):
    from lopd_core.config import ConfigError

    cfg = load(profile, set_)
    extra = {k: v for k, v in {"rollout.suite": suite, "distill.steps": steps, "distill.method": method}.items()
             if v is not None}
    try:
        return cfg.with_overrides(extra) if extra else cfg
    except ConfigError as e:
        fail(str(e), code=2)


def _store_retriever(cfg):
    """(retriever, trajectories for the cold start) from LanceDB, or None when it has no experiences."""
    try:
        from lopd_core.memory.store import ExperienceStore

        store = ExperienceStore.from_config(cfg)
        if not store.has_table("experiences") or store.count("experiences") == 0:
            return None
        retriever = store.retriever()
        trajectories = store.read_trajectories() if store.has_table("trajectories") else []
        return retriever, [t for t in trajectories if t.split == "train"]
    except ImportError as e:
        err.print(f"LanceDB store unavailable ({e}); using an in-memory experience bank", highlight=False)
        return None


def _seed_bank(cfg, policies, suite):
    """Base-model rollouts on training tasks → an in-memory bank of the successful ones."""
    from lopd_core.memory.in_memory import InMemoryRetriever
    from lopd_core.rollout.agent import run_episodes
    from lopd_core.rollout.engines.base import SamplingParams
    from lopd_core.training import _make_engine, experiences_from_trajectories

    r = cfg.rollout
    tasks = suite.tasks("train", r.n_tasks, level=r.level, seed=r.seed + 7919)  # disjoint from the training order
    engine = _make_engine(cfg, policies)
    sampling = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              seed=r.seed)
    err.print(f"seeding an in-memory experience bank from {len(tasks)} base-model episodes…", highlight=False)
    trajectories = run_episodes(engine, policies.tokenizer, suite, tasks, max_turns=r.max_turns,
                                max_trajectory_tokens=r.max_trajectory_tokens, sampling=sampling,
                                observation_max_chars=r.observation_max_chars, policy_version="base", progress=True)
    experiences = experiences_from_trajectories(trajectories, cfg, kind=suite.kind)
    return InMemoryRetriever(experiences), trajectories, len(experiences)


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
    """Run N training steps (LOPD or a baseline); --cold-start trains the composer first."""
    from lopd_core.envs import get_suite
    from lopd_core.metrics import JsonlLogger
    from lopd_core.models.loading import ModelNotFoundError
    from lopd_core.training import build_policies, needs_composer, train
    from lopd_core.training import cold_start as run_cold_start

    cfg = _config(profile, set_, suite=suite, steps=steps, method=method)
    ws = workspace(cfg)
    run = run or f"{cfg.distill.method}-{cfg.name}"
    run_dir = ws.checkpoints_dir / run
    try:
        suite_obj = get_suite(cfg.rollout.suite)
        policies = build_policies(cfg, models_dir=ws.models_dir)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))

    found = _store_retriever(cfg)
    pretraining = 0
    if found is not None:
        retriever, cold_trajectories = found
        retriever_kind, table_version, bank_size = "lancedb", int(retriever.version), None
    else:
        retriever, cold_trajectories, bank_size = _seed_bank(cfg, policies, suite_obj)
        retriever_kind, table_version, pretraining = "in-memory (seeded from base-model rollouts)", None, len(cold_trajectories)
    err.print(f"retriever: {retriever_kind}" + (f", table version {table_version}" if table_version is not None else
                                                 f", {bank_size} experiences"), highlight=False)

    cold = None
    if cold_start and not needs_composer(cfg):
        err.print(f"--cold-start ignored: method '{cfg.distill.method}' (context '{cfg.distill.lopd.context}') "
                  "has no composer", highlight=False)
    if cold_start and needs_composer(cfg):
        threshold = cfg.curation.success_threshold(suite_obj.kind)
        try:
            cold = run_cold_start(cfg, retriever=retriever, out_dir=run_dir / "cold_start" / "composer",
                                  trajectories=cold_trajectories, policies=policies, success_threshold=threshold,
                                  logger=JsonlLogger(run_dir / "cold_start" / "metrics.jsonl"))
        except ValueError as e:
            fail(f"cold start: {e}")
        composer_init = cold.composer_dir
    try:
        result = train(cfg, suite=suite_obj, retriever=retriever, run_dir=run_dir, student_init=student_init,
                       composer_init=composer_init, logger=JsonlLogger(run_dir / "metrics.jsonl"), resume=resume,
                       policies=policies, table_version=table_version, pretraining_episodes=pretraining)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    summary = {"run": run, "method": cfg.distill.method, "profile": cfg.name, "suite": cfg.rollout.suite,
               "retriever": retriever_kind, "experience_bank_size": bank_size,
               "cold_start": cold.to_dict() if cold else None, "metrics_path": str(run_dir / "metrics.jsonl"),
               **result.to_dict()}
    if as_json:
        emit_json(summary)
    else:
        m = result.metrics
        out.print(f"{cfg.distill.method}: steps {result.first_step}–{result.last_step} in {run_dir}  "
                  f"success {m.get('rollout/success_rate', float('nan')):.3f}  budget {result.budget.get('episodes', 0):.0f} "
                  f"episodes  student → {result.student_dir}", highlight=False)
