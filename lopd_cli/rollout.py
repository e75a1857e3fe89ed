"""`lopd rollout`: play N episodes of a task suite with a model and an engine; report and optionally save them.

Every option overrides the matching config field (``--suite`` → ``rollout.suite``, ``--model`` →
``model.base``, ``--n`` → ``rollout.n_tasks``, ``--engine`` → ``rollout.engine``, ``--level`` →
``rollout.level``, ``--seed`` → ``rollout.seed``), so ``--profile``/``--set`` and the options compose. The
trajectories are the exact records the trainer consumes (:class:`lopd_core.records.trajectory.Trajectory`);
``--out DIR`` writes them as JSONL plus a summary JSON, under a new file name each run (nothing is
overwritten). Sampling uses the rollout config (temperature, top-p, top-k, max new tokens, seed); the summary
records the sampling parameters the episodes actually used (stop ids included).

It fails loudly: a suite whose declared needs the settings do not meet stops before the model loads (exit 2,
naming each setting), and a run whose every episode errored exits 1 with the reasons (after writing
``--out`` and the ``--json`` summary, so the records can be read).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from lopd_cli.common import JsonFlag, Overrides, Profile, emit_json, err, fail, load, out, workspace


def _config(profile, set_, **fields):
    from lopd_core.config import ConfigError

    cfg = load(profile, set_)
    extra = {k: v for k, v in fields.items() if v is not None}
    try:
        return cfg.with_overrides(extra) if extra else cfg
    except ConfigError as e:
        fail(str(e), code=2)


def _build_engine(cfg, model_path: Path, tokenizer):
    from lopd_core.models.loading import load_causal_lm
    from lopd_core.rollout.engines import make_engine

    name, m = cfg.rollout.engine, cfg.model
    if name == "hf":
        model = load_causal_lm(model_path, dtype=m.dtype, device=m.device)
        return make_engine("hf", model, tokenizer, batch_size=cfg.rollout.batch_size)
    if name == "vllm-server":
        from lopd_core.rollout.engines.server import ServerEngine, ServerError

        try:
            return ServerEngine(cfg.rollout.server_url, adapter_dir=cfg.rollout.server_adapter_dir,
                                batch_size=cfg.rollout.batch_size)
        except ServerError as e:
            fail(str(e))
    try:
        return make_engine("vllm", None, tokenizer, batch_size=cfg.rollout.batch_size, dtype=m.dtype, device=m.device,
                           model_path=model_path, max_model_len=cfg.rollout.max_trajectory_tokens + 16)
    except ImportError as e:
        fail(str(e))


def write_jsonl_atomic(path: Path, rows: list[str]) -> None:
    """Write lines to ``path`` through a temporary file and a rename (no half-written file on a crash)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.partial")
    with tmp.open("w") as f:
        for row in rows:
            f.write(row + "\n")
    tmp.replace(path)


def _save(out_dir: Path, stem: str, trajectories, summary: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.jsonl"
    counter = 1
    while path.exists() or path.with_suffix(".summary.json").exists():
        counter += 1
        path = out_dir / f"{stem}-{counter}.jsonl"
    write_jsonl_atomic(path, [t.to_json() for t in trajectories])
    path.with_suffix(".summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


def rollout(
    suite: Annotated[str | None, typer.Option(help="Task suite or plug-in YAML path (overrides rollout.suite).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name or local folder (overrides model.base).")] = None,
    n: Annotated[int | None, typer.Option("--n", help="Episodes to play (overrides rollout.n_tasks).")] = None,
    engine: Annotated[str | None, typer.Option(help="hf or vllm (overrides rollout.engine).")] = None,
    split: Annotated[str, typer.Option(help="train, validation or test tasks.")] = "train",
    level: Annotated[int | None, typer.Option(help="Difficulty level (overrides rollout.level).")] = None,
    seed: Annotated[int | None, typer.Option(help="Task and sampling seed (overrides rollout.seed).")] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Write the trajectories as JSONL into this directory.")] = None,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Generate episodes on a task suite and print success rate, mean reward and generated tokens/s."""
    from lopd_core.envs import get_suite
    from lopd_core.envs.base import SPLITS, SuiteNeedsError, check_needs
    from lopd_core.models.loading import ModelNotFoundError, load_tokenizer, resolve_model_path
    from lopd_core.rollout.agent import (
        EpisodesFailed,
        episode_problems,
        play,
        sampling_params,
        summarize_trajectories,
    )

    if split not in SPLITS:
        fail(f"--split must be one of {', '.join(SPLITS)} (got {split!r})", code=2)
    cfg = _config(profile, set_, **{"rollout.suite": suite, "model.base": model, "rollout.n_tasks": n,
                                    "rollout.engine": engine, "rollout.level": level, "rollout.seed": seed})
    ws = workspace(cfg)
    r = cfg.rollout
    try:
        suite_obj = get_suite(r.suite)
        tasks = suite_obj.tasks(split, r.n_tasks, level=r.level, seed=r.seed)
        check_needs(suite_obj, r, levels={t.level for t in tasks})
    except SuiteNeedsError as e:
        fail(str(e), code=2)
    except (ValueError, FileNotFoundError) as e:
        fail(f"suite {r.suite!r}: {e}")
    if not tasks:
        fail(f"suite {r.suite!r} produced no {split} tasks at level {r.level}")
    try:
        model_path = resolve_model_path(cfg.model.base, ws.models_dir)
        tokenizer = load_tokenizer(model_path)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))
    err.print(f"{len(tasks)} {split} episodes of {suite_obj.name} (level {r.level}) with {cfg.model.base} "
              f"on the {r.engine} engine", highlight=False)
    engine_obj = _build_engine(cfg, model_path, tokenizer)

    start = time.perf_counter()
    failed = None
    try:
        trajectories = play(r, engine_obj, tokenizer, suite_obj, tasks, seed=r.seed, progress=True)
    except EpisodesFailed as e:
        trajectories, failed = e.trajectories, e
    metrics = summarize_trajectories(trajectories, wall_s=time.perf_counter() - start)
    # The sampling parameters the episodes recorded (what the engine was given), not a recomputation.
    used = trajectories[0].sampling if trajectories else sampling_params(r, tokenizer, seed=r.seed).to_dict()
    summary = {"suite": suite_obj.name, "split": split, "level": r.level, "engine": r.engine,
               "model": cfg.model.base, "seed": r.seed, "sampling": used, **metrics}
    if failed is not None:
        summary["failed"] = str(failed)
    problems = episode_problems(trajectories)
    summary["problems"] = problems
    if out_dir is not None:
        stem = f"rollout-{suite_obj.name}-{split}-l{r.level}-{r.engine}-{time.strftime('%Y%m%d-%H%M%S')}"
        summary["out"] = str(_save(out_dir, stem, trajectories, summary))
    for problem in problems:
        err.print(f"[yellow]problem:[/yellow] {escape(problem)}", highlight=False)

    if as_json:
        emit_json(summary)
    if failed is not None:
        fail(str(failed))
    if as_json:
        return
    out.print(f"suite {summary['suite']} ({split}, level {r.level}), {len(trajectories)} episodes, engine {r.engine}",
              highlight=False)
    out.print(f"  success rate          {metrics['rollout/success_rate']:.3f}", highlight=False)
    out.print(f"  mean reward           {metrics['rollout/mean_reward']:.3f}", highlight=False)
    out.print(f"  generated tokens/s    {metrics['rollout/generated_tokens_per_s']:.1f} "
              f"({metrics['rollout/generated_tokens']} tokens in {metrics['rollout/generate_s']:.1f} s of generation, "
              f"{metrics['rollout/wall_s']:.1f} s wall)", highlight=False)
    out.print(f"  status ok/truncated/error  {metrics['rollout/status_ok']}/{metrics['rollout/status_truncated']}/"
              f"{metrics['rollout/status_error']}", highlight=False)
    if "out" in summary:
        out.print(f"  trajectories          {summary['out']}", highlight=False)


def rescore(
    episodes: Annotated[list[Path], typer.Argument(help="JSONL episode files (`lopd rollout --out`, `lopd probe-passk --out`).")],
    out_file: Annotated[Path, typer.Option("--out", help="Write every episode here, rescored where replayed (a new file).")],
    suite: Annotated[str | None, typer.Option(help="The suite (a plug-in suite's YAML path); default: the episodes' own.")] = None,
    as_json: JsonFlag = False,
):
    """Score stored episodes again under the suite's current checker, by replaying the agent's turns (no model)."""
    from lopd_core.compare import read_episodes
    from lopd_core.envs import get_suite
    from lopd_core.envs.plugin import PluginError
    from lopd_core.rescore import rescore_episodes

    if out_file.resolve() in {p.resolve() for p in episodes}:
        fail(f"--out {out_file} is one of the inputs: write the rescored episodes to a new file", code=2)
    try:
        rows = read_episodes(episodes)
    except (FileNotFoundError, json.JSONDecodeError, TypeError) as e:
        fail(f"cannot read the episodes: {e}", code=2)
    names = sorted({r.suite for r in rows})
    if suite is None and len(names) != 1:
        fail(f"the episodes come from {len(names)} suites ({', '.join(names) or 'none'}); rescore one at a time "
             "or name it with --suite", code=2)
    try:
        suite_obj = get_suite(suite or names[0])
    except (ValueError, PluginError) as e:
        fail(str(e), code=2)
    result = rescore_episodes(suite_obj, rows, progress=not as_json)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(e.to_json() + "\n" for e in result.episodes))
    summary = {"suite": suite_obj.name, "out": str(out_file), **result.summary(rows),
               "changes": result.changed, "kept_episodes": result.kept}
    if as_json:
        emit_json(summary)
        return
    flips = summary["success_flips"]
    out.print(f"{summary['replayed']}/{summary['episodes']} episodes replayed under {suite_obj.name}'s current "
              f"checker: {summary['changed']} changed score ({flips['lost']} successes lost, {flips['gained']} "
              f"gained); {summary['kept']} kept their old score → {out_file}", highlight=False)
    for reason, n in summary["kept_reasons"].items():
        out.print(f"  kept, {reason}: {n}", highlight=False)
    for family, row in summary["families"].items():
        before, after = row["before"], row["after"]
        mark = " " if before == after else "*"
        out.print(f"{mark} {family:26s} successes {before['successes']:4d} → {after['successes']:<4d} reward "
                  f"{before['mean_reward']:.3f} → {after['mean_reward']:.3f}", highlight=False)
    for k in result.kept[:5]:
        err.print(f"  kept {k['task_id']}: {escape(k['reason'])}", highlight=False)
