"""`lopd compare`: LOPD against the baselines (and its ablations) under one rollout budget, in one harness.

Protocol (docs/method.md, "Rollout budget accounting"):

- every run starts from the same base model and gets the same training budget: ``distill.tasks_per_step``
  episodes per step for ``budget // tasks_per_step`` steps (R tasks x 1 for LOPD/OPSD, R/G x G for the
  group methods); every generated episode counts;
- every run is scored on the same held-out tasks (test split, greedy) before training and every
  ``evaluate.every_steps`` steps; the x axis is training episodes consumed;
- the experience bank is built ONCE per suite from base-model rollouts on training tasks (curated and
  indexed in LanceDB exactly as a cycle does) and pinned; its episodes are pre-training budget, reported
  separately (curves with and without them); the composer cold start also runs once per suite and
  latent shape (K), on that bank;
- seeds vary the training task order, sampling and the student's LoRA initialisation (bank and cold start
  are shared, so seeds measure training noise, not bank noise).

Runs are executed one after another; each has its own MLflow run in the experiment ``compare-<suite>`` and
its own training run directory (checkpoint every step), so an interrupted comparison resumes where it
stopped: finished runs are skipped, an unfinished one resumes from its last checkpoint, evaluation points
already measured are kept. The report (Markdown + PNG) is written by :mod:`lopd_core.compare_report`.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lopd_core.checkpoint import latest_checkpoint
from lopd_core.config import Config, DistillConfig
from lopd_core.cycle import MlflowMetricLogger
from lopd_core.envs import get_suite, suite_kind
from lopd_core.envs.base import task_fingerprint, tasks_by_id
from lopd_core.evaluation import EVAL_SEED, score_tasks, summarize_rows, validation_tasks
from lopd_core.inputs import render_model_inputs
from lopd_core.memory.store import ExperienceStore
from lopd_core.models.loading import load_tokenizer, resolve_model_path
from lopd_core.recipe import (
    HeldOutCurve,
    bank_from_store,
    bank_in_store,
    cold_start_composer,
    curve_point,
    seed_episodes,
)
from lopd_core.records.experience import Bank
from lopd_core.records.trajectory import Trajectory
from lopd_core.registry import ModelRegistry, run_params
from lopd_core.training import build_policies, needs_composer, task_order, train
from lopd_core.workspace import Workspace

METHODS: dict[str, dict[str, Any]] = {
    "lopd": {"distill.method": "lopd"},
    "grpo": {"distill.method": "grpo"},
    "opsd": {"distill.method": "opsd"},
    "sdpo": {"distill.method": "sdpo"},
    "skill_sd": {"distill.method": "skill_sd"},
    "rft": {"distill.method": "rft"},
    "rft_hinted": {"distill.method": "rft", "distill.rft.hint": True},
    "sft_oracle": {"distill.method": "sft_oracle"},
    "none": {"distill.method": "none"},
}
"""A comparison's method names and the config they stand for (controls included)."""
BASELINES = tuple(METHODS)
SIGNALS = ("rollout/success_rate", "distill/updated", "distill/student_grad_norm", "distill/kl_topk",
           "distill/privilege_delta", "distill/margin_delta", "distill/privilege_success",
           "distill/privilege_first_token", "distill/privilege_opener", "distill/beta", "rollout/generated_tokens")
"""Per-step metrics summarised into every run's result for the report's "training signals" table."""
ABLATIONS: dict[str, dict[str, Any]] = {
    "lopd_frozen": {"distill.lopd.frozen_composer": True},
    "lopd_m0": {"distill.lopd.margin": 0.0},
    "lopd_text": {"distill.lopd.context": "text"},
    "lopd_k8": {"distill.lopd.n_latents": 8},
    "lopd_k32": {"distill.lopd.n_latents": 32},
    "lopd_j1": {"distill.lopd.n_retrieved": 1},
    "lopd_j3": {"distill.lopd.n_retrieved": 3},
    "lopd_signed": {"distill.lopd.margin_form": "signed"},
    "lopd_user_framing": {"distill.lopd.context_placement": "user_framing"},
    "lopd_system": {"distill.lopd.context_placement": "system"},
    "lopd_chat_turn": {"distill.lopd.context_placement": "chat_turn"},
    "lopd_any_family": {"distill.lopd.retrieval_family": "any"},
    "lopd_oracle_fallback": {"distill.lopd.oracle_fallback": True},
    "lopd_opener": {"distill.lopd.cold_start.opener_weight": 10.0},
}


def run_dir(root: Path, key: str) -> Path:
    """A comparison run's folder under its root (``runs/<method>-s<seed>``)."""
    return Path(root) / "runs" / key


def final_dir(root: Path, key: str) -> Path:
    """Where a finished run's ``student`` (and, for LOPD, ``composer``) lie: what training writes as final."""
    return run_dir(root, key) / "train" / "final"


@dataclass
class RunSpec:
    name: str
    """Method or ablation name (``lopd``, ``grpo``, …, ``lopd_m0``)."""
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}-s{self.seed}"

    @property
    def method(self) -> str:
        """The training method the run uses (``distill.method``)."""
        return self.overrides.get("distill.method", self.name)


def lr_key(method: str) -> str:
    """The config field of a training method's student learning rate (its own, else the shared one)."""
    section = DistillConfig.model_fields.get(method)
    if section is not None and "lr_student" in getattr(section.annotation, "model_fields", {}):
        return f"distill.{method}.lr_student"
    return "distill.lr_student"


def run_specs(methods: list[str], seeds: int, *, ablations: list[str] | None = None, ablation_seeds: int = 1,
              seeds_by_method: dict[str, int] | None = None, lr_grid: list[float] | None = None) -> list[RunSpec]:
    """The runs in execution order: seed 0 of every method, then seed 1, …, then the ablations (seed-major
    too), then the learning-rate grid (``<method>@lr<value>`` for every method that trains; seed-major, one
    seed each unless named in ``seeds_by_method``).

    ``seeds_by_method`` overrides the seed count of a method (default ``seeds``), of an ablation (default
    ``ablation_seeds``) or of a grid point (default 1, e.g. ``lopd@lr3e-4``) of this plan; a name that is none
    of these is an error, not silently ignored.
    Seed-major, so that a comparison cut short after a few hours already holds every method once."""
    for m in methods:
        if m not in BASELINES:
            raise ValueError(f"unknown method '{m}'; choose from {', '.join(BASELINES)}")
    for a in ablations or []:
        if a not in ABLATIONS:
            raise ValueError(f"unknown ablation '{a}'; choose from {', '.join(ABLATIONS)}")
    grid = []  # (name, overrides) per rate and method, rate-major
    for lr in lr_grid or []:
        if not lr > 0:
            raise ValueError(f"learning rate {lr} in the grid is not positive")
        mantissa, exponent = f"{lr:e}".split("e")
        rate = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"  # 3e-4, 1.5e-5
        grid += [(f"{m}@lr{rate}", {**METHODS[m], lr_key(METHODS[m]["distill.method"]): lr})
                 for m in methods if m != "none"]
    per_run = seeds_by_method or {}
    stray = sorted(set(per_run) - set(methods) - set(ablations or []) - {name for name, _ in grid})
    if stray:
        raise ValueError(f"seeds-for names {', '.join(stray)}, which this comparison does not run "
                         f"(methods: {', '.join(methods) or 'none'}; ablations: {', '.join(ablations or []) or 'none'}"
                         f"; grid points: {', '.join(name for name, _ in grid) or 'none'})")
    return (_seed_major([(m, dict(METHODS[m])) for m in methods], per_run, seeds)
            + _seed_major([(a, {"distill.method": "lopd", **ABLATIONS[a]}) for a in ablations or []], per_run,
                          ablation_seeds)
            + _seed_major(grid, per_run, 1))


def _seed_major(runs: list[tuple[str, dict[str, Any]]], per_run: dict[str, int], default: int) -> list[RunSpec]:
    """Seed 0 of every run, then seed 1, …; a run's seed count from ``per_run``, else ``default``."""
    counts = {name: per_run.get(name, default) for name, _ in runs}
    return [RunSpec(name, s, dict(overrides))
            for s in range(max(counts.values(), default=0)) for name, overrides in runs if s < counts[name]]


# --------------------------------------------------------------------------------------------------
class Comparison:
    """One comparison on one suite: shared bank + cold starts, then the runs; everything under ``root``.

    Evaluation (``evaluate`` section): the first ``n_tasks`` held-out tasks every ``every_steps`` steps (the
    curve); at the start, the middle and the end, ``full_tasks`` held-out tasks and as many validation tasks
    (training phrasings and templates, the validation seed, no request a training task of the comparison
    has), each with the log-probability of the correct tool name and, on the first ``sampled_tasks``, the
    success of ``samples_per_task`` sampled episodes. Every task's scores are kept (``eval/*.jsonl``) for
    the paired, cluster-bootstrap intervals of the report.
    """

    def __init__(self, cfg: Config, *, suite: str, budget: int, root: Path, eval_every: int | None = None,
                 eval_tasks: int | None = None, seed_episodes: int | None = None,
                 bank_episodes: list[Path] | None = None, log=print):
        self.log = log
        self.suite_name = suite
        steps = max(budget // cfg.distill.tasks_per_step, 1)
        over = {"rollout.suite": suite, "distill.steps": steps, "distill.checkpoint_every": 1,
                "distill.keep_checkpoints": 1}
        if eval_tasks:
            over["evaluate.n_tasks"] = eval_tasks
        if seed_episodes:
            over["rollout.n_tasks"] = seed_episodes
        self.cfg = cfg.with_overrides(over)
        self.budget = steps * cfg.distill.tasks_per_step
        self.eval_every = eval_every or self.cfg.evaluate.every_steps
        self.full_steps = {max(steps // 2, 1), steps}
        """Steps after which the full evaluation runs (the middle and the end; the start is the base's)."""
        self.bank_episodes = [Path(p) for p in bank_episodes or []]
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

        self.ws = Workspace.from_config(self.cfg.workspace).ensure()
        self._store = None
        self._registry = None
        self._tasks: dict[str, list] | None = None

    # --- shared assets -------------------------------------------------------------------------------
    @property
    def store(self):
        if self._store is None:
            self._store = ExperienceStore.from_config(self.cfg, uri=str(self.root / "lance"))
        return self._store

    @property
    def registry(self):
        if self._registry is None:
            self._registry = ModelRegistry.from_workspace(self.ws, self.cfg.registry)
        return self._registry

    def _state(self) -> dict[str, Any]:
        path = self.root / "shared.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def _save_state(self, state: dict[str, Any]) -> None:
        (self.root / "shared.json").write_text(json.dumps(state, indent=2))

    def bank_info(self) -> dict[str, Any]:
        """The experience bank, built once: seed episodes of the base model (or ``bank_episodes`` files, e.g.
        the pass@k probe's) stored, curated and indexed; its coverage per family recorded."""
        state = self._state()
        if "bank" in state:
            return state["bank"]
        cfg = self.cfg
        started = time.perf_counter()
        if self.bank_episodes:
            episodes = [replace(t, trajectory_id=f"bank/{i:04d}", episode_id=f"bank/{i:04d}", cycle_id="bank")
                        for i, t in enumerate(read_episodes(self.bank_episodes))]
            self.log(f"[bank] {len(episodes)} base-model episodes from {', '.join(str(p) for p in self.bank_episodes)}")
        else:
            policies = build_policies(cfg, models_dir=self.ws.models_dir)
            self.log(f"[bank] {cfg.rollout.n_tasks} base-model episodes on {self.suite_name} training tasks")
            episodes = seed_episodes(cfg, policies, _suite(self.suite_name), n=cfg.rollout.n_tasks)
        bank = bank_in_store(self.store, cfg, episodes, stage="bank", cycle_id="bank")
        threshold = cfg.curation.success_threshold(suite_kind(self.suite_name))
        families = sorted({t.family for t in episodes})
        info = {"episodes": len(episodes), "successes": sum(t.reward >= threshold for t in episodes),
                "experiences": self.store.count("experiences"), "version": bank.version,
                "curated": len(bank.successes), "seconds": round(time.perf_counter() - started, 1),
                "generated_tokens": sum(t.n_generated for t in episodes),
                "coverage": {f: {"episodes": sum(t.family == f for t in episodes),
                                 "successes": sum(t.family == f and t.reward >= threshold for t in episodes),
                                 "experiences": sum(t.family == f for t in bank.successes)} for f in families}}
        self.log(f"[bank] {info['successes']}/{info['episodes']} successes → {info['experiences']} experiences; "
                 f"families with experiences: {sum(v['experiences'] > 0 for v in info['coverage'].values())}/{len(families)}")
        state["bank"] = info
        self._save_state(state)
        return info

    def bank(self) -> Bank:
        """The shared bank, pinned at the version it was built with."""
        info = self.bank_info()
        return bank_from_store(self.store, version=int(info["version"]), episodes=int(info["episodes"]))

    def write_inputs(self) -> Path:
        """``inputs.md``: what the student, the teachers and the encoder read, for one task of each domain."""
        path = self.root / "inputs.md"
        if not path.exists():
            tokenizer = load_tokenizer(resolve_model_path(self.cfg.model.base, self.ws.models_dir))
            path.write_text(render_model_inputs(self.cfg, tokenizer, _suite(self.suite_name), self.bank()))
        return path

    def cold_start(self, cfg: Config) -> Path:
        """The cold-started composer for these composer and cold-start settings (:func:`cold_start_key`),
        trained once on the bank."""
        lopd = cfg.distill.lopd
        key = cold_start_key(cfg)
        out = self.root / "cold_start" / key
        if (out / "lopd_composer.json").exists():
            return out
        bank = self.bank()
        started = time.perf_counter()
        self.log(f"[cold start] {key}: up to {lopd.cold_start.steps} steps, y* {lopd.cold_start.y_star} "
                 f"({len(bank.successes)} curated)")
        result = cold_start_composer(cfg, bank, suite_name=self.suite_name, out_dir=out, models_dir=self.ws.models_dir)
        self.log(f"[cold start] {key}: {result.steps} steps on {result.examples} y* with an experience to retrieve "
                 f"(skipped: {result.skipped}), validation NLL {result.val_nll_best:.3f} with latents, "
                 f"{result.val_nll_without_latents:.3f} without; δ at the opener's positions "
                 f"{', '.join(f'{d:+.3f}' for d in result.val_opener_best) or 'not measured (no validation)'}")
        state = self._state()
        state.setdefault("cold_start", {})[key] = {**result.to_dict(), "seconds": round(time.perf_counter() - started, 1)}
        self._save_state(state)
        return out

    # --- evaluation ----------------------------------------------------------------------------------
    def eval_tasks(self) -> dict[str, list]:
        """The held-out tasks (``full_tasks``, the curve's ``n_tasks`` first) and the validation tasks."""
        if self._tasks is None:
            suite, cfg = _suite(self.suite_name), self.cfg
            e = cfg.evaluate
            test = suite.tasks("test", max(e.full_tasks, e.n_tasks), level=cfg.rollout.level, seed=EVAL_SEED)
            bank_ids = {r.task_id for r in read_episodes(self.bank_episodes)} if self.bank_episodes else set()
            seen = {task_fingerprint(t) for t in tasks_by_id(suite, bank_ids).values()}
            for seed in range(8):  # the training orders of every seed a comparison runs (1000 + seed)
                seeded = cfg.with_overrides({"distill.seed": 1000 + seed})
                seen |= {task_fingerprint(t) for t in task_order(suite, seeded, n_tasks=cfg.distill.tasks_per_step * cfg.distill.steps)}
            validation = validation_tasks(suite, e.full_tasks, level=cfg.rollout.level, exclude=seen) \
                if e.full_tasks else []
            self._tasks = {"test": test, "validation": validation}
        return self._tasks

    def score(self, policies, *, label: str, full: bool, weights: str = "student") -> dict[str, list[dict[str, Any]]]:
        """Task rows of one evaluation point: the curve's held-out tasks, or (``full``) both splits in full."""
        cfg, suite, tasks = self.cfg, _suite(self.suite_name), self.eval_tasks()
        if not full:
            return {"test": score_tasks(policies, tasks["test"][: cfg.evaluate.n_tasks], suite, cfg=cfg, label=label,
                                        weights=weights)}
        out = {}
        for split in ("test", "validation"):
            chosen = tasks[split][: max(cfg.evaluate.full_tasks, cfg.evaluate.n_tasks if split == "test" else 0)]
            rows = score_tasks(policies, chosen, suite, cfg=cfg, label=label, weights=weights, tool_name=True)
            sampled = chosen[: cfg.evaluate.sampled_tasks]
            if sampled:
                extra = score_tasks(policies, sampled, suite, cfg=cfg, label=label, weights=weights,
                                    samples=cfg.evaluate.samples_per_task)
                by_task = {r["task_id"]: r.get("sampled_success") for r in extra}
                for row in rows:
                    if row["task_id"] in by_task:
                        row["sampled_success"] = by_task[row["task_id"]]
            out[split] = rows
        return out

    def save_rows(self, folder: Path, step: int, rows: dict[str, list[dict[str, Any]]]) -> None:
        (folder / "eval").mkdir(parents=True, exist_ok=True)
        for split, split_rows in rows.items():
            (folder / "eval" / f"{split}-step{step:04d}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in split_rows))

    def point_fields(self, rows: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, float]]:
        """A curve point from task rows: the curve's held-out numbers (first ``n_tasks``) and each split's summary."""
        curve_rows = rows["test"][: self.cfg.evaluate.n_tasks]
        metrics = summarize_rows(curve_rows)
        fields = curve_point(metrics)
        for split, split_rows in rows.items():
            fields[split] = summarize_rows(split_rows, prefix=split)
        return fields, metrics

    def base_eval(self) -> dict[str, float]:
        """The base model at step 0, in full (every run's first curve point); its task rows under ``base/eval``."""
        state = self._state()
        if "base_eval" in state and "fields" in state["base_eval"]:
            return state["base_eval"]
        tasks, started = self.eval_tasks(), time.perf_counter()
        self.log(f"[base] scoring the base model on {len(tasks['test'])} held-out and {len(tasks['validation'])} "
                 "validation tasks…")
        policies = build_policies(self.cfg, models_dir=self.ws.models_dir)
        rows = self.score(policies, label="base", full=True, weights="base")
        self.save_rows(self.root / "base", 0, rows)
        fields, metrics = self.point_fields(rows)
        self.log(f"[base] held-out success {metrics['eval/success_rate']:.3f}, mean reward "
                 f"{metrics['eval/mean_reward']:.3f} ({time.perf_counter() - started:.0f} s)")
        state["base_eval"] = {**metrics, "fields": fields}
        self._save_state(state)
        return state["base_eval"]

    # --- one run -------------------------------------------------------------------------------------
    def run(self, spec: RunSpec) -> dict[str, Any]:
        folder = run_dir(self.root, spec.key)
        result_file = folder / "result.json"
        if result_file.exists():
            return json.loads(result_file.read_text())
        folder.mkdir(parents=True, exist_ok=True)
        attempt_file, attempt_started = folder / "attempt.json", time.perf_counter()
        if attempt_file.exists():  # an attempt killed outright (no exception): its time up to its last step
            self.note_wall(spec, json.loads(attempt_file.read_text())["elapsed_s"])
            attempt_file.unlink()
        cfg = self.cfg.with_overrides({**spec.overrides, "distill.seed": 1000 + spec.seed})
        bank_info = self.bank_info()
        base = self.base_eval()
        uses_bank = spec.method in ("lopd", "opsd", "rft")
        composer_init = self.cold_start(cfg) if needs_composer(cfg) else None

        curve_file = folder / "curve.jsonl"
        curve = [json.loads(line) for line in curve_file.read_text().splitlines()] if curve_file.exists() else []
        fresh = not curve and latest_checkpoint(folder / "train") is None
        if not curve:
            curve.append({"step": 0, "episodes": 0, **base["fields"]})
            curve_file.write_text(json.dumps(curve[0]) + "\n")

        run_id = self.registry.comparison_run(
            f"compare-{self.suite_name}", self.mlflow_key(folder, spec, fresh=fresh),
            tags={"method": spec.name, "seed": str(spec.seed)},
            params={**run_params(cfg), "run": spec.name, "budget": self.budget, "eval_every": self.eval_every,
                    **{f"override.{k}": v for k, v in spec.overrides.items()}},
            config=cfg.model_dump(mode="json"))
        self.registry.log_metrics(run_id, {"eval/success_rate": base["eval/success_rate"]}, step=0)
        policies = build_policies(cfg, models_dir=self.ws.models_dir)
        tokens = {"generated": 0, "trajectory": 0}

        def score(step: int, last: bool) -> tuple[dict[str, Any], dict[str, float]]:
            # the final point is always a full evaluation, also when the budget ends the run early
            rows = self.score(policies, label=f"{spec.key}/step{step}", full=last or step in self.full_steps)
            self.save_rows(folder, step, rows)
            return self.point_fields(rows)

        def record_point(point: dict[str, Any], metrics: dict[str, float]) -> None:
            with curve_file.open("a") as f:
                f.write(json.dumps(point) + "\n")
            self.registry.log_metrics(run_id, {"eval/success_rate": metrics["eval/success_rate"],
                                               "eval/mean_reward": metrics["eval/mean_reward"]}, step=point["episodes"])
            self.log(f"[{spec.key}] step {point['step']}/{cfg.distill.steps}: held-out success "
                     f"{metrics['eval/success_rate']:.3f}, mean reward {metrics['eval/mean_reward']:.3f}")

        held_out = HeldOutCurve(cfg, policies, self.suite_name, every=self.eval_every, label=spec.key,
                                done_steps={c["step"] for c in curve}, extra_steps=self.full_steps,
                                on_point=record_point, score=score)

        def on_step(step: int, metrics: dict[str, float], trajectories) -> None:
            tokens["generated"] += sum(t.n_generated for t in trajectories)
            tokens["trajectory"] += sum(t.n_tokens for t in trajectories)
            attempt_file.write_text(json.dumps({"elapsed_s": time.perf_counter() - attempt_started}))
            held_out(step, metrics, trajectories)

        started = time.perf_counter()
        bank = self.bank() if uses_bank else None
        result = train(cfg, suite=_suite(self.suite_name), bank=bank, run_dir=folder / "train", composer_init=composer_init,
                       logger=MlflowMetricLogger(self.registry, run_id), on_step=on_step, policies=policies,
                       models_dir=self.ws.models_dir, progress=True)
        wall = time.perf_counter() - started
        curve = [json.loads(line) for line in curve_file.read_text().splitlines()]
        pretraining = bank_info["episodes"] if uses_bank else 0
        summary = {"run": spec.key, "name": spec.name, "method": spec.method, "seed": spec.seed,
                   "overrides": spec.overrides, "budget": self.budget, "steps": result.last_step + 1,
                   "pretraining_episodes": pretraining,
                   "skill_generations": result.budget.get("skill_generations", 0.0),
                   "episodes": result.budget.get("episodes", 0.0),
                   "final_success": curve[-1]["success_rate"], "final_mean_reward": curve[-1]["mean_reward"],
                   "curve": curve, "wall_s_this_session": round(wall, 1), "resumed": result.resumed,
                   "generated_tokens": tokens["generated"], "trajectory_tokens": tokens["trajectory"],
                   "student_dir": str(result.student_dir), "mlflow_run_id": run_id}
        self.registry.log_metrics(run_id, {"compare/final_success": summary["final_success"],
                                           "compare/wall_s": wall})
        self.registry.end_run(run_id)
        summary["wall_s"] = round(self.recorded_wall(spec) + wall, 1)
        result_file.write_text(json.dumps(summary, indent=2))
        attempt_file.unlink(missing_ok=True)
        return summary

    @staticmethod
    def mlflow_key(folder: Path, spec: RunSpec, *, fresh: bool) -> str:
        """The MLflow identity of a run folder, kept in the folder: a run that starts from nothing gets a
        new one (``<method>-s<seed>/<8 hex>``), so that two comparison roots, or a run deleted and played
        again, never log into one MLflow run; a folder that predates the file resumes under ``spec.key``."""
        key_file = folder / "mlflow_key"
        if key_file.exists():
            return key_file.read_text().strip()
        key = f"{spec.key}/{uuid.uuid4().hex[:8]}" if fresh else spec.key
        key_file.write_text(key + "\n")
        return key

    def run_timed(self, spec: RunSpec) -> dict[str, Any]:
        """:meth:`run`, recording the wall time of an attempt that fails or is interrupted."""
        started = time.perf_counter()
        try:
            return self.run(spec)
        except BaseException:
            self.note_wall(spec, time.perf_counter() - started)
            (run_dir(self.root, spec.key) / "attempt.json").unlink(missing_ok=True)  # counted just now
            raise

    def result(self, runs: list[dict[str, Any]]) -> dict[str, Any]:
        """What the report is made of: the shared assets and the run summaries (with their training signals)."""
        runs = [self._with_signals(r) if r.get("mlflow_run_id") else r for r in runs]
        return {"suite": self.suite_name, "root": str(self.root), "shared": self._state(), "runs": runs,
                "budget": self.budget}

    def _with_signals(self, run: dict[str, Any]) -> dict[str, Any]:
        signals = self.training_signals(run["mlflow_run_id"])  # empty when this store lacks the run
        if not signals and run.get("signals"):
            return run  # results carried to a new root: keep what the run recorded
        tokens = signals.get("rollout/generated_tokens")
        # generated tokens from the per-step metrics: also the steps of an attempt killed before the run ended
        return {**run, "signals": signals, **({"generated_tokens": int(tokens["sum"])} if tokens else {})}

    def training_signals(self, run_id: str) -> dict[str, dict[str, float]]:
        """A run's per-step training metrics (read back from its MLflow run), as first / last / mean / count.

        What the report uses to show *why* a curve moved or did not: on-policy success, how many steps
        updated at all (GRPO skips groups without reward spread), gradient sizes, and LOPD's KL, privilege Δ
        and dual variable β. A step logged twice (a resumed step) counts once, with its last value; steps where
        a metric is undefined (NaN: δ on successes in a step without one) are left out."""
        out = {}
        for key in SIGNALS:
            by_step = self.registry.metric_by_step(run_id, key)
            values = [by_step[s] for s in sorted(by_step) if not math.isnan(by_step[s])]
            if values:
                out[key] = {"first": values[0], "last": values[-1], "mean": statistics.fmean(values),
                            "sum": sum(values), "steps": len(values)}
        return out

    def recorded_wall(self, spec: RunSpec) -> float:
        """Seconds spent in the run's earlier, interrupted attempts (0 for a first attempt)."""
        path = run_dir(self.root, spec.key) / "wall.json"
        return json.loads(path.read_text())["wall_s"] if path.exists() else 0.0

    def note_wall(self, spec: RunSpec, seconds: float) -> None:
        """Accumulate the wall time of interrupted attempts (so resumed runs report their whole cost)."""
        path = run_dir(self.root, spec.key) / "wall.json"
        prior = self.recorded_wall(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"wall_s": prior + seconds}))


def _suite(name: str):
    return get_suite(name)


def split_names(value: str) -> list[str]:
    """``'lopd, grpo,'`` → ``['lopd', 'grpo']`` (the comma-separated method and ablation lists)."""
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_seeds_for(value: str) -> dict[str, int]:
    """``'lopd=3,grpo=3'`` → ``{'lopd': 3, 'grpo': 3}``; a clear error for anything else."""
    seeds: dict[str, int] = {}
    for item in split_names(value):
        name, _, n = item.partition("=")
        if not n.strip().isdigit():
            raise ValueError(f"seeds-for expects name=count pairs like 'lopd=3,sdpo=1' (got {item!r})")
        seeds[name.strip()] = int(n)
    return seeds


def plan_comparison(cfg: Config, *, suite: str, methods: list[str], budget: int, seeds: int, root: Path,
                    ablations: list[str] | None = None, seeds_by_method: dict[str, int] | None = None,
                    lr_grid: list[float] | None = None,
                    eval_every: int | None = None, eval_tasks: int | None = None, seed_episodes: int | None = None,
                    bank_episodes: list[Path] | None = None, log=print,
                    record: bool = True) -> tuple[Comparison, list[RunSpec]]:
    """The comparison and its runs, in order (``plan.json`` under the root records them unless ``record=False``)."""
    comp = Comparison(cfg, suite=suite, budget=budget, root=root, eval_every=eval_every, eval_tasks=eval_tasks,
                      seed_episodes=seed_episodes, bank_episodes=bank_episodes, log=log)
    specs = run_specs(methods, seeds, ablations=ablations, seeds_by_method=seeds_by_method, lr_grid=lr_grid)
    if not record:
        return comp, specs
    (comp.root / "plan.json").write_text(json.dumps({"suite": suite, "budget": comp.budget,
                                                     "steps": comp.cfg.distill.steps,
                                                     "tasks_per_step": comp.cfg.distill.tasks_per_step,
                                                     "eval_every": comp.eval_every,
                                                     "eval_tasks": comp.cfg.evaluate.n_tasks,
                                                     "runs": [asdict(s) for s in specs]}, indent=2))
    return comp, specs


def run_comparison(cfg: Config, *, suite: str, methods: list[str], budget: int, seeds: int, root: Path,
                   ablations: list[str] | None = None, seeds_by_method: dict[str, int] | None = None,
                   lr_grid: list[float] | None = None,
                   eval_every: int | None = None, eval_tasks: int | None = None, seed_episodes: int | None = None,
                   bank_episodes: list[Path] | None = None, log=print, report_only: bool = False) -> dict[str, Any]:
    """Run (or resume) every run of the comparison; returns all run summaries.

    ``report_only``: run nothing, return the runs of this plan that have finished so far (a look at a long
    comparison while it runs, possibly in another process)."""
    comp, specs = plan_comparison(cfg, suite=suite, methods=methods, budget=budget, seeds=seeds, root=root,
                                  ablations=ablations, seeds_by_method=seeds_by_method, lr_grid=lr_grid,
                                  eval_every=eval_every, eval_tasks=eval_tasks, seed_episodes=seed_episodes,
                                  bank_episodes=bank_episodes, log=log, record=not report_only)
    if report_only:
        done = [run_dir(comp.root, s.key) / "result.json" for s in specs]
        results = [json.loads(p.read_text()) for p in done if p.exists()]
        if not results:
            raise RuntimeError(f"no run of this plan has finished yet under {comp.root / 'runs'}")
        log(f"report of {len(results)}/{len(specs)} finished runs")
        return comp.result(results)
    comp.bank_info()
    comp.write_inputs()
    results = []
    for i, spec in enumerate(specs):
        log(f"=== run {i + 1}/{len(specs)}: {spec.key} ===")
        results.append(comp.run_timed(spec))
    return comp.result(results)


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def cold_start_key(cfg: Config) -> str:
    """What a root's cold-started composer depends on: the composer's shape, retrieval, placement, the
    experience budget, the cold start's own steps, learning rate, batch and y*, and ``e2``, the encoder input's
    version (the header on top of the experience's budget), and the opener's weight when it is not 1. A run
    whose settings give another key gets its own cold start instead of silently reusing one trained otherwise."""
    lopd, cold = cfg.distill.lopd, cfg.distill.lopd.cold_start
    return (f"k{lopd.n_latents}-d{lopd.compressor_depth}-j{lopd.n_retrieved}-{lopd.context_placement}-"
            f"{lopd.retrieval_family}-t{lopd.experience_max_tokens}-e2-cs{cold.steps}-lr{cold.lr:g}-b{cold.batch_size}-"
            f"y{cold.y_star}" + (f"-o{cold.opener_weight:g}" if cold.opener_weight != 1 else ""))


def read_episodes(paths: list[Path]) -> list:
    """Trajectories from JSONL files (what `lopd probe-passk --out` and `lopd rollout --out` write)."""
    fields = set(Trajectory.__dataclass_fields__)
    rows = []
    for path in paths:
        if not Path(path).exists():
            raise FileNotFoundError(f"{path}: no such episodes file (JSONL written by `lopd probe-passk --out`)")
        rows += [Trajectory(**{k: v for k, v in json.loads(line).items() if k in fields})
                 for line in Path(path).read_text().splitlines() if line.strip()]
    return rows
