"""Held-out evaluation, the forgetting probe and drift metrics — what the promotion gate reads.

- **Held-out success**: greedy (``evaluate.temperature``, default 0) episodes on the *test* split of the
  training suite, a fixed task set per (suite, level, n) so that champion and challenger see the same tasks.
- **Forgetting probe** (docs/architecture.md): (a) held-out tasks of the other built-in suite
  (``eval/probe_success_rate``), and (b) a fixed set of general prompts whose reference answers are the
  *base* model's own greedy answers; the student is scored by the per-token KL(base ‖ student) and the NLL
  increase over the base on those answers (``eval/forgetting_kl``, ``eval/forgetting_delta``, nats/token;
  both 0 for the base itself).
- **Drift**: mean generated tokens per episode (``eval/mean_response_tokens``) and the share of tool calls
  that were malformed or invalid (``eval/malformed_call_rate``); the gate compares them with the champion's.

All metric names are stable; they are logged to MLflow as they are.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lopd_core.config import Config
from lopd_core.envs import get_suite
from lopd_core.envs.base import task_fingerprint
from lopd_core.privilege import action_logprobs, first_call_probabilities, opens_tool_response
from lopd_core.records.chat import render_prompt_ids
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.agent import play
from lopd_core.rollout.engines import make_engine, policy_engine
from lopd_core.rollout.oracle import oracle_episode

EVAL_SEED = 10_007
"""Task seed of the held-out sets (fixed, so every model version is scored on the same tasks)."""

GENERAL_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give three tips for writing a clear email.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How many minutes are there in three and a half hours? Show the calculation.",
    "Translate 'Good morning, how are you?' into French.",
    "What is photosynthesis? Answer briefly.",
    "Name three countries in South America and their capitals.",
    "Describe what a binary search does.",
    "Suggest a healthy breakfast and say why it is healthy.",
    "What causes the seasons on Earth?",
    "Write a one-sentence definition of machine learning.",
    "List the planets of the solar system in order from the sun.",
    "Why should you back up your files? Give two reasons.",
    "What is 17 multiplied by 23?",
]


@dataclass
class EvalResult:
    metrics: dict[str, float]
    trajectories: list[Trajectory] = field(default_factory=list)
    probe_trajectories: list[Trajectory] = field(default_factory=list)


def other_suite(suite_name: str) -> str:
    return {"toolworld": "codegen", "codegen": "toolworld"}.get(suite_name, "")


def episode_metrics(trajectories: list[Trajectory], prefix: str = "eval") -> dict[str, float]:
    if not trajectories:
        return {f"{prefix}/n": 0.0}
    calls = sum(t.n_tool_calls for t in trajectories)
    invalid = sum(t.n_invalid_tool_calls for t in trajectories)
    return {
        f"{prefix}/success_rate": sum(t.success for t in trajectories) / len(trajectories),
        f"{prefix}/mean_reward": statistics.fmean(t.reward for t in trajectories),
        f"{prefix}/mean_response_tokens": statistics.fmean(t.n_generated for t in trajectories),
        f"{prefix}/malformed_call_rate": invalid / calls if calls else 0.0,
        f"{prefix}/error_rate": sum(t.status == "error" for t in trajectories) / len(trajectories),
        f"{prefix}/n": float(len(trajectories)),
    }


def run_suite(model, tokenizer, suite_name: str, *, cfg: Config, split: str, n_tasks: int, seed: int,
              policy_version: str, temperature: float, progress: bool = False, cycle_id: str = "",
              step: int = -1) -> list[Trajectory]:
    """Generate ``n_tasks`` episodes of a suite with the hf engine on ``model`` (already on its device)."""
    suite = get_suite(suite_name)
    tasks = suite.tasks(split, n_tasks, level=cfg.rollout.level, seed=seed)
    engine = make_engine("hf", model, tokenizer, batch_size=cfg.rollout.batch_size)
    return play(cfg.rollout, engine, tokenizer, suite, tasks, seed=seed, temperature=temperature,
                policy_version=policy_version, step=step, cycle_id=cycle_id, progress=progress)


# --------------------------------------------------------------------------------------------------
# Task-level scores (what the comparison's intervals are computed from)
VALIDATION_SEED = 20_011
"""Task seed of the validation split: training phrasings and templates, entity draws of their own. No
training run, bank or cycle uses it (:func:`lopd_core.training.task_order` refuses it)."""


def validation_tasks(suite, n: int, *, level: int, exclude: set[str] = frozenset()) -> list:
    """``n`` validation tasks: the training split's phrasings and templates, drawn with
    :data:`VALIDATION_SEED` (no training order uses it), leaving out any task a training task or a bank
    episode already is (``exclude``: :func:`~lopd_core.envs.base.task_fingerprint` values). Only the task's
    content counts: the same request in another world is another task, so families with few distinct
    requests (e.g. "How many meetings do I have today?") stay in the split."""
    out = [t for t in suite.tasks("train", 2 * n, level=level, seed=VALIDATION_SEED)
           if task_fingerprint(t) not in exclude]
    return out[:n]


def task_cluster(task) -> str:
    """The cluster a task belongs to for resampling: its family and the phrasing template of its request."""
    return f"{task.family}|{task.payload.get('phrasing', '')}"


def episode_transcript(episode: Trajectory, limit: int = 1500) -> str:
    """The agent's own part of an episode as text: its turns and the tool observations (shortened as the
    experience store shortens them), after the prompt, cut at ``limit`` characters. Kept beside a task row so
    that an evaluation can be read, and re-scored, after the run (a hedged answer is found this way)."""
    messages = (episode.messages_lite or episode.messages)[episode.initial_messages:]
    text = "\n".join(f"[{m.get('role')}] {m.get('content') or ''}" for m in messages)
    return text if len(text) <= limit else text[:limit] + " …"


def score_tasks(policies, tasks: list, suite, *, cfg: Config, label: str, weights: str = "student", samples: int = 0,
                tool_name: bool = False) -> list[dict[str, Any]]:
    """One row per task: the greedy episode's reward and success, the mean success of ``samples`` sampled
    episodes (rollout temperature), and the log-probability of the correct tool name on the task's oracle
    first action (``tool_name``: a continuous signal that moves before success does), whether the greedy
    episode's first action invents the tool's reply (opens ``<tool_response>``: the failure a teacher can teach
    that the first-token δ does not see), and the greedy episode's :func:`episode_transcript`. ``weights``:
    the student's or the base's; episodes are played on ``rollout.engine``."""
    def play_all(rows: list, temperature: float, seed: int) -> list[Trajectory]:
        with policy_engine(cfg, policies, weights=weights, version=label) as engine:
            return play(cfg.rollout, engine, policies.tokenizer, suite, rows, seed=seed, temperature=temperature,
                        policy_version=label)

    greedy = play_all(tasks, cfg.evaluate.temperature, EVAL_SEED)
    rows = [{"task_id": t.task_id, "family": t.family, "cluster": task_cluster(t), "split": t.split,
             "reward": e.reward, "success": float(e.success), "response_tokens": float(e.n_generated),
             "invented_reply": float(opens_tool_response(e)), "transcript": episode_transcript(e)}
            for t, e in zip(tasks, greedy, strict=True)]
    if samples:
        sampled = play_all([t for t in tasks for _ in range(samples)], cfg.rollout.temperature, EVAL_SEED + 1)
        for i, row in enumerate(rows):
            row["sampled_success"] = statistics.fmean(float(e.success) for e in sampled[i * samples:(i + 1) * samples])
    if tool_name:
        with_oracle = [(i, t) for i, t in enumerate(tasks) if t.oracle]
        oracle = [oracle_episode(policies.tokenizer, suite, t) for _, t in with_oracle]
        logprobs = action_logprobs(policies, oracle, teacher=None, student=weights == "student")
        for (i, _), score in zip(with_oracle, first_call_probabilities(policies.tokenizer, oracle, logprobs), strict=True):
            rows[i]["tool_name_logprob"] = score.get("tool_name_logprob")
    return rows


def summarize_rows(rows: list[dict[str, Any]], prefix: str = "eval") -> dict[str, float]:
    """The means of the task rows' metrics, named ``<prefix>/<metric>``."""
    out = {}
    for metric, name in (("success", "success_rate"), ("reward", "mean_reward"), ("sampled_success", "sampled_success"),
                         ("tool_name_logprob", "tool_name_logprob"), ("response_tokens", "mean_response_tokens"),
                         ("invented_reply", "invented_reply_rate")):
        values = [r[metric] for r in rows if r.get(metric) is not None]
        if values:
            out[f"{prefix}/{name}"] = statistics.fmean(values)
    out[f"{prefix}/n"] = float(len(rows))
    return out


# --------------------------------------------------------------------------------------------------
# General-prompt probe
def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return render_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])


@torch.no_grad()
def base_reference_answers(base_model, tokenizer, prompts: list[str], *, max_new_tokens: int = 48) -> list[list[int]]:
    """The base model's greedy answers (token ids) to the general prompts."""
    device = next(base_model.parameters()).device
    answers = []
    for prompt in prompts:
        ids = torch.tensor([_chat_ids(tokenizer, prompt)], device=device)
        out = base_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answers.append(out[0, ids.shape[1]:].tolist())
    return answers


@torch.no_grad()
def _answer_logprobs(model, tokenizer, prompt: str, answer: list[int]) -> torch.Tensor:
    """Log-softmax over the vocabulary at each answer position: [len(answer), V]."""
    device = next(model.parameters()).device
    prompt_ids = _chat_ids(tokenizer, prompt)
    ids = torch.tensor([prompt_ids + answer], device=device)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start:start + len(answer)], dim=-1)


Scope = Callable[[], contextlib.AbstractContextManager]
"""A zero-argument callable returning a context manager that yields a model with the right weights live
(e.g. ``PolicySet.student`` / ``PolicySet.teacher`` on a shared LoRA base; ``fixed(model)`` for a plain one)."""


def fixed(model) -> Scope:
    return lambda: contextlib.nullcontext(model)


def general_prompt_forgetting(student: Scope, base: Scope, tokenizer, prompts: list[str],
                              references: list[list[int]]) -> dict[str, float]:
    """Per-token KL(base ‖ student) and NLL(student) − NLL(base) on the base's own answers."""
    kl_sum, dnll_sum, n = 0.0, 0.0, 0
    for prompt, answer in zip(prompts, references, strict=True):
        if not answer:
            continue
        with student() as model:
            lp_s = _answer_logprobs(model, tokenizer, prompt, answer)
        with base() as model:
            lp_b = _answer_logprobs(model, tokenizer, prompt, answer)
        target = torch.tensor(answer, device=lp_s.device).unsqueeze(-1)
        kl_sum += (lp_b.exp() * (lp_b - lp_s)).sum().item()
        dnll_sum += (lp_b.gather(-1, target) - lp_s.gather(-1, target)).sum().item()
        n += len(answer)
    if n == 0:
        return {}
    return {"eval/forgetting_kl": kl_sum / n, "eval/forgetting_delta": dnll_sum / n}


def cached_references(cache_file: Path, base_model, tokenizer, prompts: list[str]) -> list[list[int]]:
    """Reference answers are computed once per base model and cached next to the workspace's runs."""
    if cache_file.exists():
        data = json.loads(cache_file.read_text())
        if data.get("prompts") == prompts:
            return data["answers"]
    answers = base_reference_answers(base_model, tokenizer, prompts)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps({"prompts": prompts, "answers": answers}))
    return answers


# --------------------------------------------------------------------------------------------------
def evaluate(student: Scope, tokenizer, *, cfg: Config, suite_name: str, policy_version: str, base: Scope | None = None,
             reference_cache: Path | None = None, progress: bool = False, with_probe: bool = True,
             cycle_id: str = "") -> EvalResult:
    """Held-out success + drift metrics on ``suite_name``, and (``with_probe``) the forgetting probe.

    ``student`` / ``base`` are scopes (see :data:`Scope`); ``base`` enables the general-prompt probe.
    """
    def episodes(suite: str, n: int) -> list[Trajectory]:
        with student() as model:
            model.eval()
            return run_suite(model, tokenizer, suite, cfg=cfg, split="test", n_tasks=n, seed=EVAL_SEED,
                             policy_version=policy_version, temperature=cfg.evaluate.temperature,
                             progress=progress, cycle_id=cycle_id)

    trajectories = episodes(suite_name, cfg.evaluate.n_tasks)
    metrics: dict[str, Any] = episode_metrics(trajectories)
    probe_trajs: list[Trajectory] = []
    if with_probe:
        probe_name = cfg.evaluate.probe_suite if cfg.evaluate.probe_suite != "auto" else other_suite(suite_name)
        if probe_name and cfg.evaluate.probe_n_tasks:
            probe_trajs = episodes(probe_name, cfg.evaluate.probe_n_tasks)
            metrics["eval/probe_success_rate"] = episode_metrics(probe_trajs, "probe")["probe/success_rate"]
        if base is not None and cfg.evaluate.probe_prompts:
            prompts = GENERAL_PROMPTS[: cfg.evaluate.probe_prompts]
            with base() as base_model:
                refs = (cached_references(reference_cache, base_model, tokenizer, prompts) if reference_cache
                        else base_reference_answers(base_model, tokenizer, prompts))
            metrics.update(general_prompt_forgetting(student, base, tokenizer, prompts, refs))
    return EvalResult(metrics=metrics, trajectories=trajectories, probe_trajectories=probe_trajs)
