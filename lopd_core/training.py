"""The training driver: N steps of rollouts → retrieval → the method's step, checkpointed; and the cold start.

Usable from the command line (``lopd distill``) and from the flows; no Prefect here. One step::

    tasks (B/G from the run's task order, cursor in the checkpoint)
      → rollouts on the CURRENT student (the engine holds the live model; G episodes per task)
      → retrieval of J experiences per task (pinned table version, leakage rules in the query)
      → algorithm.step(...)          (LOPD's teacher/student/composer/dual phases, or a baseline)
      → log (rollout/*, memory/*, budget/*, distill/*) → checkpoint every distill.checkpoint_every
      → engine.update_policy(student) so the next batch is on-policy

Budget accounting (docs/method.md): one unit = one episode; ``budget/episodes`` counts the training
episodes (B per step for every method), ``budget/pretraining_episodes`` what the caller spent before
(seeding the bank, cold-start data, OPSD references), ``budget/skill_generations`` Skill-SD's
policy-written skills; ``budget/total_units`` is their sum.

Across continual-learning cycles the teacher and the composer's encoder backbone are always the configured
base model (``model.base``); the student and the composer continue from ``student_init`` /
``composer_init`` (the champion pair's directories; a registry "base" marker directory means "start from the
base"); φ0 and its anchor cache stay those of the first cold start; β is restored from the composer.

Artifacts are plain directories that the registry logs as they are:

``student/``
    ``lopd_student.json`` (``kind`` lora|full, ``base_model``, ``base_model_path``, ``format``) and either a standard peft
    adapter (``adapter_config.json`` + ``adapter_model.safetensors``; load with
    ``PeftModel.from_pretrained(base, dir)``) or a full Hugging Face model folder (+ tokenizer).
``composer/``
    ``lopd_composer.json`` (base model, compressor spec K/depth/heads/gain, β, provenance),
    ``encoder_adapter/`` (ψ, a peft adapter folder), ``compressor.safetensors`` (χ), and after the first
    cold start ``phi0/`` with φ0's ``encoder_adapter/``, ``compressor.safetensors``,
    ``anchor_cache.safetensors`` + ``anchor_keys.json`` (c_φ0 per task+experience pair).

What it is not: curation, indexing or evaluation (other stages), and it never registers models.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lopd_core import distributed
from lopd_core.algorithms import make_algorithm
from lopd_core.algorithms.base import StepInputs
from lopd_core.algorithms.cold_start import (
    ColdStart,
    batches,
    cold_start_examples,
    trajectory_from_experience,
    validation_split,
)
from lopd_core.checkpoint import latest_checkpoint, read_checkpoint, restore_trainer_state, save_checkpoint
from lopd_core.config import Config
from lopd_core.envs import Suite, Task
from lopd_core.evaluation import VALIDATION_SEED
from lopd_core.metrics import InMemoryLogger, MetricLogger, MultiLogger, numeric
from lopd_core.models.composer import (
    ComposerState,
    freeze_phi0,
    load_composer,
    new_composer_state,
    save_composer,
)
from lopd_core.models.policy import PolicySet, build_policy_set
from lopd_core.privilege import probe_teacher
from lopd_core.progress import report as report_progress
from lopd_core.records.experience import Bank, Experience, RetrievalQuery, Retriever, experience_content
from lopd_core.records.trajectory import Trajectory
from lopd_core.registry import is_base_marker
from lopd_core.rollout.agent import play, summarize_trajectories
from lopd_core.rollout.engines import make_engine, training_vllm_engine
from lopd_core.rollout.oracle import oracle_experience
from lopd_core.workspace import Workspace

log = logging.getLogger(__name__)


STEP_LINE_METRICS = ("rollout/success_rate", "distill/kl_topk", "distill/loss", "distill/beta", "distill/step_s")
"""What the one line per training step (the progress bar and the ``lopd_core.training`` log) shows."""


@dataclass
class TrainResult:
    run_dir: Path
    student_dir: Path
    composer_dir: Path | None
    first_step: int
    """First step run by this call (> 0 after a resume)."""
    last_step: int
    """Last completed step (−1 when none)."""
    metrics: dict[str, float]
    """The last step's metrics."""
    history: list[dict[str, float]]
    budget: dict[str, float]
    table_version: int | None
    checkpoint: Path | None
    resumed: bool
    overheads: dict[str, float] = field(default_factory=dict)
    """Seconds this call spent outside the steps' rollouts and updates: ``engine_start`` (building the rollout
    engine), ``gate`` (the privilege gate), ``retrieval``, ``hooks`` (``on_step``: the curve's evaluations),
    ``checkpoint``, ``engine_sync`` (the student's weights into the engine after each step) and ``final_save``
    (the final student and composer folders)."""

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "student_dir": str(self.student_dir),
                "composer_dir": str(self.composer_dir) if self.composer_dir else None, "first_step": self.first_step,
                "last_step": self.last_step, "metrics": self.metrics, "budget": self.budget,
                "table_version": self.table_version, "checkpoint": str(self.checkpoint) if self.checkpoint else None,
                "resumed": self.resumed, "overheads": self.overheads}


@dataclass
class ColdStartResult:
    composer_dir: Path
    steps: int
    """Steps run (fewer than cold_start.steps when it stopped early)."""
    examples: int
    skipped: dict[str, int]
    nll_first: float
    nll_last: float
    history: list[dict[str, float]] = field(default_factory=list)
    validation_examples: int = 0
    val_nll_first: float = float("nan")
    """Validation NLL per token with the latents, before the first step."""
    val_nll_best: float = float("nan")
    """The best validation NLL with the latents (the composer kept)."""
    val_nll_without_latents: float = float("nan")
    """The same tokens' NLL under the base model without any context: the latents help when below it."""
    best_step: int = 0
    stopped_early: bool = False
    val_opener_first: list[float] = field(default_factory=list)
    """Validation δ (with latents − without) at each position of the first action's opener, before the first step."""
    val_opener_best: list[float] = field(default_factory=list)
    """The same for the composer kept: a position well below 0 is a teacher at the wrong fork (see is_privileged)."""

    def to_dict(self) -> dict[str, Any]:
        return {"composer_dir": str(self.composer_dir), "steps": self.steps, "examples": self.examples,
                "skipped": self.skipped, "nll_first": self.nll_first, "nll_last": self.nll_last,
                "validation_examples": self.validation_examples, "val_nll_first": self.val_nll_first,
                "val_nll_best": self.val_nll_best, "val_nll_without_latents": self.val_nll_without_latents,
                "best_step": self.best_step, "stopped_early": self.stopped_early,
                "val_opener_first": self.val_opener_first, "val_opener_best": self.val_opener_best}


# --------------------------------------------------------------------------------------------------
# Models and artifacts
def _share(tasks: list, rank: int, world_size: int) -> list:
    """This process's contiguous share of a step's tasks (one process: all of them)."""
    per = -(-len(tasks) // world_size)
    return tasks[rank * per:(rank + 1) * per]


def build_policies(cfg: Config, *, models_dir: Path | None = None) -> PolicySet:
    """The run's models: the configured base (teacher, encoder backbone) + the student, untrained."""

    models_dir = models_dir or Workspace.from_config(cfg.workspace).ensure().models_dir
    return build_policy_set(cfg.model, cfg.distill.lopd, models_dir)


def load_student_init(policies: PolicySet, student_init: Path | None) -> None:
    if student_init is not None and not is_base_marker(student_init):
        policies.load_student(Path(student_init))


def load_composer_init(policies: PolicySet, cfg: Config, composer_init: Path | None) -> ComposerState | None:
    if composer_init is None or is_base_marker(composer_init):
        return None
    return load_composer(policies, Path(composer_init), cfg.distill.lopd)


def save_student(policies: PolicySet, directory: Path) -> Path:
    return policies.save_student(Path(directory))


def needs_composer(cfg: Config) -> bool:
    return cfg.distill.method == "lopd" and cfg.distill.lopd.context == "latent"


def _make_engine(cfg: Config, policies: PolicySet):
    """The training loop's engine: hf on the live student, or the process's shared vLLM engine (the loop
    syncs it to the student before the first step and after every step)."""
    if cfg.rollout.engine in ("vllm", "vllm-server"):
        return training_vllm_engine(cfg, policies)
    return make_engine("hf", policies.student_module(), policies.tokenizer, batch_size=cfg.rollout.batch_size)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# One step's helpers
def task_order(suite: Suite, cfg: Config, *, n_tasks: int, tasks: list | None = None) -> list:
    """The run's training tasks (the data cursor indexes this list, wrapping around).

    With ``distill.family_weights`` the tasks are a weighted draw without replacement from a 4× larger set of
    the suite's training tasks (weight 0 leaves a family out; unnamed families weigh 1), deterministic in
    ``distill.seed``: the same order for every method of a comparison."""
    if cfg.distill.seed == VALIDATION_SEED:
        raise ValueError(f"distill.seed {VALIDATION_SEED} is the validation split's task seed; training on it would "
                         "score the model on tasks it trained on. Use another seed")
    if tasks is not None:
        pool = list(tasks)
    elif not cfg.distill.family_weights:
        pool = suite.tasks("train", n_tasks, level=cfg.rollout.level, seed=cfg.distill.seed)
    else:
        weights = cfg.distill.family_weights
        candidates = suite.tasks("train", 4 * n_tasks, level=cfg.rollout.level, seed=cfg.distill.seed)
        rng = random.Random(cfg.distill.seed)
        keyed = [(rng.random() ** (1.0 / weights.get(t.family, 1.0)), i) for i, t in enumerate(candidates)
                 if weights.get(t.family, 1.0) > 0]
        pool = [candidates[i] for _, i in sorted(keyed, reverse=True)[:n_tasks]]
    if not pool:
        raise ValueError(f"suite '{getattr(suite, 'name', suite)}' returned no training tasks; check rollout.suite/level "
                         "and distill.family_weights")
    return pool


def retrieve_for(retriever: Retriever | None, tasks: list, trajectories: list[Trajectory], *, step: int, k: int,
                 exclude_same_task: bool, group_size: int, same_family: bool = False,
                 fallback: Callable[[Task], Experience] | None = None) -> tuple[list[list[Experience]], dict[str, float]]:
    """J experiences per task (one query per group), the leakage rules in the query; plus memory/* metrics.

    ``same_family`` keeps retrieval inside the task's family (a task whose family has no experience gets
    none: no distillation loss, never another family's experiences). ``fallback(task)`` (the oracle
    fallback) gives such a task one experience instead, counted in ``memory/fallback_contexts``.
    """
    if retriever is None:
        return [[] for _ in trajectories], {"memory/hit_rate": 0.0}
    queries = [RetrievalQuery(instruction=tasks[i].instruction, task_id=tasks[i].task_id,
                              episode_id=trajectories[i].episode_id, before_step=step,
                              exclude_same_task=exclude_same_task, family=tasks[i].family if same_family else "")
               for i in range(0, len(trajectories), group_size)]
    if hasattr(retriever, "retrieve_batch"):
        per_group = retriever.retrieve_batch(queries, k)
    else:
        per_group = [retriever.retrieve(q, k) for q in queries]
    # never a rollout of this step: an experience with the same episode id as any sibling is dropped
    step_episodes = {t.episode_id for t in trajectories}
    per_group = [[e for e in hits if e.episode_id not in step_episodes] for hits in per_group]
    hits = [e for group in per_group for e in group]
    same = sum(e.task_id == q.task_id for q, group in zip(queries, per_group, strict=True) for e in group)
    metrics = {"memory/hit_rate": sum(bool(g) for g in per_group) / len(per_group),
               "memory/mean_retrieved": len(hits) / len(per_group),
               "memory/same_task_rate": same / len(hits) if hits else 0.0,
               "memory/mean_score": sum(e.score for e in hits) / len(hits) if hits else 0.0,
               "memory/fallback_contexts": 0.0}
    if fallback is not None:
        for g, group in enumerate(per_group):
            if not group:
                per_group[g] = [fallback(tasks[g * group_size])]
                metrics["memory/fallback_contexts"] += 1.0
    return [per_group[i // group_size] for i in range(len(trajectories))], metrics


def rollout_metrics(trajectories: list[Trajectory], wall_s: float) -> dict[str, float]:
    return numeric(summarize_trajectories(trajectories, wall_s=wall_s))


def experiences_from_trajectories(trajectories: list[Trajectory], cfg: Config, *, kind: str) -> list[Experience]:
    """Successful finished train-split episodes as observation-lite experiences (the in-memory bank's rule).

    The success threshold is ``curation.success_threshold_tool`` for tool suites and ``…_code`` for code
    suites; the full curation stage (dedupe, caps, family balance) lives in :mod:`lopd_core.memory.curation`.
    """

    threshold = cfg.curation.success_threshold(kind)
    out = []
    for t in trajectories:
        if t.split != "train" or t.status != "ok" or t.reward < threshold:
            continue
        turns, text = experience_content(t.messages, instruction=t.instruction, initial_messages=t.initial_messages,
                                         max_chars=cfg.rollout.observation_max_chars, messages_lite=t.messages_lite)
        out.append(Experience(experience_id=t.trajectory_id, episode_id=t.episode_id, task_id=t.task_id, suite=t.suite,
                              family=t.family, instruction=t.instruction, text=text, messages=turns, reward=t.reward,
                              step=t.step, split=t.split))
    return out


class NotPrivilegedError(ValueError):
    """The teacher does not raise the base model's successful actions: distilling from it would not help."""


GATE_SUCCESSES = 8
"""How many bank successes the privilege gate scores (forward passes only)."""
GATE_TOLERANCE = -0.02
"""The most a privileged teacher may lower, on average, any token of the successes' first-action opener."""


def is_privileged(summary: dict) -> bool:
    """A :func:`~lopd_core.privilege.summarize_privilege` summary of successes: privileged when the mean token δ
    is not credibly negative (the upper end of its 95 % interval, ``success_ci95_high``, is ≥ 0; the mean
    itself for summaries without it) and no position of the first action's opener (``opener_by_token``; the
    first token alone when absent) is lowered below :data:`GATE_TOLERANCE`.

    The opener is where a tool call and an invented tool reply part: a teacher that raises the first token
    but lowers ``call`` after ``<tool_`` teaches the student to write the tool's reply itself. The mean δ
    over all tokens did not tell the teachers apart (report 2026-12-07 §11): on the gate's 8 bank successes the
    text teacher, whose distillation lifted the student, scores −0.040 [−0.090, +0.006] and the latent
    teacher, whose distillation did not, +0.008; a rule asking for a positive mean refused the useful one."""
    high = summary.get("success_ci95_high", summary["privilege_success"])
    if math.isnan(high):
        high = summary["privilege_success"]
    return high >= 0 and min(_opener(summary)) >= GATE_TOLERANCE


def _opener(summary: dict) -> list[float]:
    """The opener's per-position δ, positions no success reaches (nan) left out."""
    opener = [d for d in summary.get("opener_by_token") or [] if not math.isnan(d)]
    return opener or [summary["privilege_first_token"]]


def privilege_gate(cfg: Config, policies: PolicySet, suite: Suite, bank: Bank, *,
                   composer: ComposerState | None) -> dict[str, float]:
    """Before the first LOPD step: the teacher's δ on the bank's successes (the base model's own actions).

    Privileged: see :func:`is_privileged`. When it is not, ``distill.lopd.privilege_gate`` decides: ``stop``
    raises :class:`NotPrivilegedError` with the figures, ``warn`` logs them and trains anyway."""
    lopd = cfg.distill.lopd
    summary = probe_teacher(cfg, policies, suite, bank.successes, bank, composer=composer,
                            max_successes=GATE_SUCCESSES, max_failures=0)
    success, first = summary["privilege_success"], summary["privilege_first_token"]
    if summary["successes"] == 0:
        log.warning("privilege gate: no bank success could be scored (none has another experience of its family to "
                    "retrieve); the teacher is not checked")
        return {"privileged": float("nan"), "successes": 0.0}
    privileged = is_privileged(summary)
    opener = _opener(summary)
    result = {"privileged": float(privileged), "privilege_success": success,
              "privilege_success_ci95_high": summary["success_ci95_high"], "privilege_first_token": first,
              "privilege_opener_min": min(opener), "successes": float(summary["successes"])}
    if not privileged:
        teacher = "latent" if composer is not None else "text"
        message = (f"the {teacher} teacher is not privileged on the bank's successes: mean δ {success:+.3f} per action "
                   f"token (95 % interval up to {summary['success_ci95_high']:+.3f}; below 0 fails); δ at the first "
                   f"action's opening tokens {', '.join(f'{d:+.3f}' for d in opener)} ({summary['successes']} "
                   f"successes scored; a position below {GATE_TOLERANCE} fails, e.g. a teacher that favours an "
                   "invented <tool_response> over <tool_call>); distilling from it would move the student away "
                   "from what it already does right. Check `lopd probe-teacher`, distill.lopd.context_placement "
                   "and the bank, or set distill.lopd.privilege_gate=warn to train anyway")
        if lopd.privilege_gate == "stop":
            raise NotPrivilegedError(message)
        log.warning(message)
    return result


# --------------------------------------------------------------------------------------------------
def train(cfg: Config, *, suite: Suite, bank: Bank | None, run_dir: Path, student_init: Path | None = None,
          composer_init: Path | None = None, logger: MetricLogger | None = None, resume: bool = True,
          progress: bool = True, on_step: Callable[[int, dict[str, float], list[Trajectory]], None] | None = None,
          policies: PolicySet | None = None, engine=None, tasks: list | None = None,
          pretraining_episodes: int | None = None, models_dir: Path | None = None,
          on_checkpoint: Callable[[Path], None] | None = None) -> TrainResult:
    """Run ``cfg.distill.steps`` steps of ``cfg.distill.method`` (resuming from ``run_dir``'s latest checkpoint).

    ``bank`` is what retrieval reads (None: no retrieval, for the methods without privileged context); its
    pinned table version is recorded in every checkpoint and a resume with another version is refused.
    ``pretraining_episodes`` defaults to the bank's seed episodes. ``on_step(step, metrics, trajectories)``
    is called after every step (the cycle stores the trajectories, the comparison evaluates);
    ``on_checkpoint(path)`` after every checkpoint and after the final folders are written (the cycle pushes
    them to shared storage).
    """
    d = cfg.distill
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _seed_everything(d.seed)
    # several processes (torchrun): each plays its share of the step's tasks, all hold the gathered batch,
    # the LOPD step splits its forwards and sums gradients (lopd_core.distributed); rank 0 alone logs and writes
    rank, world_size = distributed.world()
    if world_size > 1 and d.method != "lopd":
        raise ValueError(f"distill.method '{d.method}' runs in one process only; of the methods, lopd runs on "
                         f"several (this is process {rank} of {world_size})")
    lead = rank == 0

    # --- resume or start: weights come from the checkpoint, else from the init directories -----------
    info = None
    if resume and (latest := latest_checkpoint(run_dir)) is not None:
        info = read_checkpoint(latest)
        if info.method != d.method:
            raise ValueError(f"{latest} was written by method '{info.method}', but distill.method is '{d.method}'; "
                             "use another run directory or --no-resume")
        if bank is not None and bank.version is not None and info.table_version is not None \
                and info.table_version != bank.version:
            raise ValueError(f"{latest} was trained on experiences table version {info.table_version}, but the bank "
                             f"is pinned at version {bank.version}; resume with the pinned version or use --no-resume")
    policies = policies or build_policies(cfg, models_dir=models_dir)
    load_student_init(policies, info.student_dir if info else student_init)
    composer = load_composer_init(policies, cfg, info.composer_dir if info else composer_init)
    if needs_composer(cfg) and (composer is None or not composer.has_phi0):
        raise ValueError("LOPD with latent context needs a cold-started composer: pass composer_init=<directory written "
                         "by lopd_core.training.cold_start> (`lopd distill --cold-start` does both)")
    algorithm = make_algorithm(d, policies, composer=composer if needs_composer(cfg) else None, engine=engine)
    start_step, cursor, budget = 0, 0, {"episodes": 0.0, "skill_generations": 0.0}
    if info is not None:
        restore_trainer_state(info, algorithm)
        start_step, cursor, budget = info.step + 1, info.cursor, {**budget, **info.budget}
    if pretraining_episodes is None:
        pretraining_episodes = bank.episodes if bank is not None else 0
    budget["pretraining_episodes"] = float(pretraining_episodes or budget.get("pretraining_episodes", 0.0))
    retriever = bank.retriever if bank is not None else None
    table_version = bank.version if bank is not None else None
    overheads = dict.fromkeys(("engine_start", "gate", "retrieval", "hooks", "checkpoint", "engine_sync"), 0.0)
    clock = time.perf_counter()
    gate = {}
    if d.method == "lopd" and start_step == 0 and d.lopd.privilege_gate != "off" and bank is not None and bank.successes:
        gate = privilege_gate(cfg, policies, suite, bank, composer=composer if needs_composer(cfg) else None)
    overheads["gate"] = time.perf_counter() - clock

    g = algorithm.episodes_per_task
    tasks_per_step = d.tasks_per_step // g
    pool = task_order(suite, cfg, n_tasks=max(tasks_per_step * d.steps, 1), tasks=tasks)
    rollout_suite = algorithm.rollout_suite(suite) if hasattr(algorithm, "rollout_suite") else suite
    plays = getattr(algorithm, "plays_rollouts", True)
    clock = time.perf_counter()
    engine = engine or _make_engine(cfg, policies)
    overheads["engine_start"] = time.perf_counter() - clock
    engine.update_policy(policies.student_module(), f"{run_dir.name}/step{start_step - 1}" if start_step else "init")
    logger = MultiLogger(logger, history := InMemoryLogger())
    tok = policies.tokenizer
    fallback = None
    if d.method == "lopd" and d.lopd.oracle_fallback:
        def fallback(task: Task) -> Experience:
            return oracle_experience(tok, suite, task, max_chars=cfg.rollout.observation_max_chars)
    checkpoint, last_metrics = (info.path if info else None), {}

    # the run's training-episode budget is steps × B; extra episodes (GRPO's top-ups) are paid from it, so a
    # method that plays more per step takes fewer steps and every method ends with at most the same episodes
    episode_budget = float(d.steps * tasks_per_step * g)
    step_cost = float(tasks_per_step * g)  # what a step adds to budget["episodes"], played or not
    last_step = start_step - 1
    bar = tqdm(range(start_step, d.steps), desc=f"{d.method} steps", unit="step", disable=not progress or not lead)
    for step in bar:
        if budget["episodes"] + step_cost > episode_budget:
            log.info("%s: the episode budget (%d = steps x B) is spent after %d of %d steps (%d episodes played, "
                     "top-ups included); the run ends here", d.method, episode_budget, step, d.steps, budget["episodes"])
            break
        # --- rollouts: B/G tasks × G episodes on the current student -----------------------------------
        step_tasks = [pool[(cursor + k) % len(pool)] for k in range(tasks_per_step)]
        cursor += tasks_per_step
        episode_tasks = [t for t in step_tasks for _ in range(g)]
        started = time.perf_counter()
        version = f"{run_dir.name}/step{step - 1}" if step else "init"
        share = _share(step_tasks, rank, world_size)  # contiguous, so the gathered batch keeps the task order
        trajectories = play(cfg.rollout, engine, tok, rollout_suite, [t for t in share for _ in range(g)],
                            seed=d.seed * 1_000_003 + step + 7_919 * rank, policy_version=version, step=step,
                            cycle_id=run_dir.name) if plays else []
        if world_size > 1:
            trajectories = [t for part in distributed.gather_objects(trajectories) for t in part]
        top_ups = []

        def play_more(groups: int, step=step, version=version, top_ups=top_ups,
                      played_so_far=len(trajectories)) -> tuple[list, list[Trajectory]]:
            """The next ``groups`` tasks of the order, G episodes each (GRPO's top-up), paid from the budget."""
            nonlocal cursor
            left = episode_budget - budget["episodes"] - played_so_far - len(top_ups)
            groups = max(0, min(groups, int(left // g)))
            if not groups:  # the budget is spent: no top-up
                return [], []
            more = [pool[(cursor + k) % len(pool)] for k in range(groups)]
            cursor += groups
            more_tasks = [t for t in more for _ in range(g)]
            played = play(cfg.rollout, engine, tok, rollout_suite, more_tasks, step=step, policy_version=version,
                          seed=d.seed * 1_000_003 + step + 7 * (len(top_ups) + 1), cycle_id=run_dir.name)
            top_ups.extend(played)
            return more_tasks, played
        metrics = rollout_metrics(trajectories, time.perf_counter() - started)
        if step == 0:
            metrics.update({f"gate/{k}": v for k, v in gate.items()})

        # --- retrieval: J experiences per task, pinned table, leakage rules ----------------------------
        clock = time.perf_counter()
        retrieved, memory_metrics = retrieve_for(retriever, episode_tasks, trajectories, step=step,
                                                 k=d.lopd.n_retrieved, exclude_same_task=d.lopd.exclude_same_task,
                                                 group_size=g, same_family=d.lopd.retrieval_family == "same",
                                                 fallback=fallback)
        metrics.update(memory_metrics)
        overheads["retrieval"] += time.perf_counter() - clock

        # --- the method's step ---------------------------------------------------------------------------
        started = time.perf_counter()
        metrics.update(numeric(algorithm.step(StepInputs(step=step, trajectories=trajectories, tasks=episode_tasks,
                                                         retrieved=retrieved, retriever=retriever, group_size=g,
                                                         bank_successes=bank.successes if bank is not None else [],
                                                         play_more=play_more))))
        metrics["distill/step_s"] = time.perf_counter() - started

        # --- budget, log, checkpoint, on-policy engine -------------------------------------------------
        trajectories = trajectories + top_ups
        budget["episodes"] += len(trajectories) if plays else len(episode_tasks)
        budget["skill_generations"] += metrics.get("budget/skill_generations", 0.0)
        metrics.update({"budget/episodes_step": float(len(trajectories) if plays else len(episode_tasks)),
                        "budget/episodes": budget["episodes"],
                        "budget/pretraining_episodes": budget["pretraining_episodes"],
                        "budget/skill_generations": budget["skill_generations"],
                        "budget/total_units": budget["episodes"] + budget["skill_generations"]
                        + budget["pretraining_episodes"]})
        # the run's last step: the configured last, or the budget cannot pay for another (the curve evaluates it)
        final = step + 1 == d.steps or budget["episodes"] + step_cost > episode_budget
        metrics["budget/last_step"] = float(final)
        last_metrics = metrics
        if lead:
            logger.log(metrics, step=step)
        # the step's trajectories are handed over BEFORE its checkpoint: a crash in between re-runs the step
        # (same seeds, same ids), a crash after it never loses them
        clock = time.perf_counter()
        if on_step is not None and lead:
            on_step(step, metrics, trajectories)
        overheads["hooks"] += time.perf_counter() - clock
        clock = time.perf_counter()
        last_step = step
        if lead and ((step + 1) % d.checkpoint_every == 0 or final):
            checkpoint = save_checkpoint(run_dir, step=step, policies=policies, algorithm=algorithm, cfg=cfg,
                                         cursor=cursor, composer=composer if needs_composer(cfg) else None,
                                         table_version=table_version, budget=budget, keep=d.keep_checkpoints)
            if on_checkpoint is not None:
                on_checkpoint(checkpoint)
        overheads["checkpoint"] += time.perf_counter() - clock
        clock = time.perf_counter()
        engine.update_policy(policies.student_module(), f"{run_dir.name}/step{step}")
        overheads["engine_sync"] += time.perf_counter() - clock
        shown = {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in STEP_LINE_METRICS if k in metrics}
        bar.set_postfix(shown)
        log.info("%s step %d/%d: %s", d.method, step + 1, d.steps, ", ".join(f"{k} {v}" for k, v in shown.items()))
        report_progress("distill", step + 1, d.steps)
    bar.close()

    # --- final artifacts (plain directories for the registry) --------------------------------------------
    clock = time.perf_counter()
    student_dir = run_dir / "final" / "student"
    if lead:
        student_dir = save_student(policies, student_dir)
    composer_dir = None
    if composer is not None and lead:
        composer.info.setdefault("joint_steps", 0)
        composer.info["joint_steps"] = int(composer.info["joint_steps"]) + (last_step + 1 - start_step)
        composer_dir = run_dir / "final" / "composer"
        save_composer(policies, composer, composer_dir)
    if lead and on_checkpoint is not None:
        on_checkpoint(run_dir / "final")
    overheads["final_save"] = time.perf_counter() - clock
    return TrainResult(run_dir=run_dir, student_dir=student_dir, composer_dir=composer_dir, first_step=start_step,
                       last_step=last_step, metrics=last_metrics, history=[m for _, m in history.records],
                       budget=budget, table_version=table_version, checkpoint=checkpoint, resumed=info is not None,
                       overheads=overheads)


# --------------------------------------------------------------------------------------------------
def cold_start(cfg: Config, *, retriever: Retriever, out_dir: Path, trajectories: list[Trajectory] | None = None,
               experiences: list[Experience] | None = None, composer_init: Path | None = None,
               policies: PolicySet | None = None, logger: MetricLogger | None = None, progress: bool = True,
               models_dir: Path | None = None, success_threshold: float | None = None) -> ColdStartResult:
    """Cold-start the composer on successful base-model trajectories and write it (with φ0) to ``out_dir``.

    ``trajectories`` (preferred: the sampled ids) or ``experiences`` (re-rendered with the chat template)
    are the y*; each y*'s experiences come from ``retriever`` with y* itself excluded. A ``composer_init``
    that already has φ0 continues training φ and keeps its φ0 (φ0 is fixed at the first cold start).
    ``success_threshold`` (default: the environment's success flag) selects the usable y* by reward.
    """
    lopd, cold = cfg.distill.lopd, cfg.distill.lopd.cold_start
    _seed_everything(cfg.distill.seed)
    policies = policies or build_policies(cfg, models_dir=models_dir)
    composer = load_composer_init(policies, cfg, composer_init) or new_composer_state(policies, lopd, seed=cfg.distill.seed)
    if trajectories is None:
        if experiences is None:
            raise ValueError("cold_start needs trajectories or experiences (the base model's successful episodes)")
        trajectories = [trajectory_from_experience(policies.tokenizer, e) for e in experiences]
    examples, skipped = cold_start_examples(trajectories, retriever, n_retrieved=lopd.n_retrieved,
                                            exclude_same_task=lopd.exclude_same_task,
                                            success_threshold=success_threshold,
                                            same_family=lopd.retrieval_family == "same")
    train_examples, val_examples = validation_split(examples, fraction=cold.validation_fraction, seed=cfg.distill.seed)
    val_examples = val_examples[: cold.max_validation_examples]
    history: list[dict[str, float]] = []
    val = {"first": float("nan"), "best": float("nan"), "plain": float("nan"), "best_step": 0, "stopped": False,
           "opener_first": [], "opener_best": []}
    if cold.steps > 0:
        trainer = ColdStart(cfg.distill, policies, composer)
        best = None
        if val_examples:
            first = trainer.validation_nll(val_examples)
            val.update(first=first["nll"], plain=first["plain"], best=first["nll"], score=first["score"],
                       opener_first=first["opener"], opener_best=first["opener"])
            best, waited = trainer.snapshot(), 0
        for i, batch in enumerate(tqdm(batches(train_examples, batch_size=cold.batch_size, steps=cold.steps,
                                               seed=cfg.distill.seed),
                                       total=cold.steps, desc="cold start", unit="step", disable=not progress)):
            metrics = trainer.step(batch)
            if val_examples and ((i + 1) % cold.eval_every == 0 or i + 1 == cold.steps):
                got = trainer.validation_nll(val_examples)
                metrics.update({"cold_start/val_nll": got["nll"], "cold_start/val_nll_without_latents": val["plain"],
                                "cold_start/val_score": got["score"], "cold_start/val_opener_min": min(got["opener"]),
                                **{f"cold_start/val_opener_{j}": d for j, d in enumerate(got["opener"])}})
                if got["score"] < val["score"] - 1e-6:
                    val.update(best=got["nll"], score=got["score"], best_step=i + 1, opener_best=got["opener"])
                    best, waited = trainer.snapshot(), 0
                else:
                    waited += 1
            history.append(metrics)
            if logger is not None:
                logger.log(metrics, step=i)
            if val_examples and cold.patience and waited >= cold.patience:
                val["stopped"] = True
                break
        if best is not None:
            trainer.restore(best)
    if not composer.has_phi0:
        freeze_phi0(policies, composer)
    nll = [m["cold_start/nll"] for m in history]
    composer.info["cold_start"] = {"steps": len(history), "examples": len(examples), "nll_first": nll[0] if nll else None,
                                   "nll_last": nll[-1] if nll else None, "val_nll_best": val["best"],
                                   "val_nll_without_latents": val["plain"], "best_step": val["best_step"],
                                   "val_opener_first": val["opener_first"], "val_opener_best": val["opener_best"],
                                   "opener_weight": cold.opener_weight}
    save_composer(policies, composer, Path(out_dir))
    return ColdStartResult(composer_dir=Path(out_dir), steps=len(history), examples=len(examples), skipped=skipped,
                           nll_first=nll[0] if nll else float("nan"), nll_last=nll[-1] if nll else float("nan"),
                           history=history, validation_examples=len(val_examples), val_nll_first=val["first"],
                           val_nll_best=val["best"], val_nll_without_latents=val["plain"], best_step=val["best_step"],
                           stopped_early=val["stopped"], val_opener_first=val["opener_first"],
                           val_opener_best=val["opener_best"])
