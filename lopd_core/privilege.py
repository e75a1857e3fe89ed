"""Is a self-teacher privileged? Its δ on the base model's own successes and failures.

δ = log p_teacher − log p_base at every action token of the base model's sampled episodes: the mean δ on
successes and on failures, δ at the first action token of successes with a 95 % bootstrap interval, the
*opener* δ (δ summed over the first action's first tokens, as many as the tool-call tag has: the log-ratio
of the two models' probabilities of how the first action opens), and, on the task's oracle first action,
the probability of opening a tool call and of the correct tool name under both models. A privileged teacher
raises the successes' actions (δ > 0), most of all the first one, where a tool-use episode decides between
calling a tool and answering; a teacher that is merely less confident everywhere lowers δ on successes and
failures alike.

The first token alone cannot tell a tool call from the agent writing the tool's reply itself: in SmolLM2's
tokenizer ``<tool_call>`` and ``<tool_response>`` share their first three tokens ``<``, ``tool``, ``_``.
The opener δ covers the fork; on failures whose first action opens ``<tool_response>`` (the agent invents
the observation) a positive opener δ means the teacher makes that mistake more likely.

Used by ``lopd probe-teacher`` and by the training loop's privilege gate, which runs only these forward
passes on the bank's successes before the first LOPD step. Not here: any training, any generation.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from typing import Any

import torch

from lopd_core.algorithms.batch import SequenceBatch, student_batch, teacher_batch
from lopd_core.algorithms.context import sdpo_context
from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs, student_logprobs
from lopd_core.algorithms.lopd import (
    latent_teacher_logprobs,
    opener_by_position,
    opener_length,
    teacher_prompts,
)
from lopd_core.algorithms.sdpo import sdpo_teacher_prompt
from lopd_core.config import Config
from lopd_core.envs.base import Suite, Task, tasks_by_id
from lopd_core.envs.tools import TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN
from lopd_core.models.composer import ComposerState
from lopd_core.models.latent import TeacherPrompt
from lopd_core.models.policy import PolicySet
from lopd_core.records.chat import encode
from lopd_core.records.experience import Bank, Experience, RetrievalQuery
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.oracle import oracle_episode


def bootstrap_mean_ci(values: list[float], *, samples: int = 2000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap interval of the mean (``nan`` for no values)."""
    if not values:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(samples))
    lo = means[int((1 - level) / 2 * (samples - 1))]
    hi = means[int((1 + level) / 2 * (samples - 1))]
    return statistics.fmean(values), lo, hi


PromptBuilder = Callable[[list[Trajectory]], tuple[list[TeacherPrompt], Callable[[SequenceBatch], torch.Tensor]]]
"""Given episodes, their teacher prompts and a function that scores a teacher batch ([N, V] log-probs)."""


def _per_row(values: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return list(values.split(mask.sum(1).long().tolist()))


def action_logprobs(policies: PolicySet, episodes: list[Trajectory], *, teacher: PromptBuilder | None,
                    micro_batch: int = 4, student: bool = False) -> list[torch.Tensor]:
    """Per episode, the log-probs of its action tokens: under the base model (``teacher`` None), the student
    (``student``) or a teacher. Episodes are batched by length (less padding); the result keeps their order."""
    order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].token_ids))
    out: list[torch.Tensor | None] = [None] * len(episodes)
    with torch.no_grad():
        for start in range(0, len(order), micro_batch):
            picked = order[start:start + micro_batch]
            rows = [episodes[i] for i in picked]
            if teacher is None:
                batch = student_batch(rows, pad_id=policies.tokenizer.pad_token_id, device=policies.device)
                logprobs = student_logprobs(policies, batch) if student else model_logprobs(policies, None, batch)
            else:
                prompts, score = teacher(rows)
                batch = teacher_batch(rows, prompts, pad_id=policies.tokenizer.pad_token_id, device=policies.device)
                logprobs = score(batch)
            targets = batch.target_ids[batch.mask.bool()]
            for i, values in zip(picked, _per_row(gather_tokens(logprobs, targets), batch.mask), strict=True):
                out[i] = values.float().cpu()
    return out


def first_action(episode: Trajectory) -> str:
    """The text of the episode's first assistant message ("" when it has none)."""
    messages = episode.messages
    return (messages[episode.initial_messages].get("content") or "") if len(messages) > episode.initial_messages else ""


def first_call_probabilities(tokenizer, oracle_rows: list[Trajectory], logprobs: list[torch.Tensor]) -> list[dict]:
    """On each task's oracle episode: P(the first action token opens a tool call) and P(the correct tool name).

    ``logprobs`` are the oracle episodes' action-token log-probs under one model. The name's probability is
    the product over the name's tokens, given the opening of the call (teacher forcing)."""
    out = []
    opener = TOOL_CALL_OPEN
    for row, lp in zip(oracle_rows, logprobs, strict=True):
        first = first_action(row)
        name_start = first.find('"name": "')
        if not first.startswith(opener) or name_start < 0 or len(lp) == 0:
            out.append({})
            continue
        name_end = first.find('"', name_start + len('"name": "'))
        opener_tokens = len(encode(tokenizer, opener))
        prefix_tokens = len(encode(tokenizer, first[: name_start + len('"name": "')]))
        name_tokens = max(len(encode(tokenizer, first[:name_end])) - prefix_tokens, 0)
        name_logprob = float(lp[prefix_tokens: prefix_tokens + name_tokens].sum())
        out.append({"p_tool_call": math.exp(float(lp[:opener_tokens].sum())), "p_tool_name": math.exp(name_logprob),
                    "tool_name_logprob": name_logprob})
    return out


def opens_tool_response(episode: Trajectory) -> bool:
    """The episode's first action opens with the tool-response tag: the agent writes the tool's reply itself."""
    return first_action(episode).lstrip().startswith(TOOL_RESPONSE_OPEN)


def _fmean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize_privilege(teacher_lp: list[torch.Tensor], base_lp: list[torch.Tensor], episodes: list[Trajectory], *,
                        success_reward: float = 0.8, failure_reward: float = 0.5, opener_tokens: int = 1,
                        oracle_teacher: list[dict] | None = None, oracle_base: list[dict] | None = None) -> dict:
    """δ = teacher − base per action token, summarised by outcome (see the module docstring); the opener δ
    sums the first ``opener_tokens`` action tokens."""
    deltas = [t - b for t, b in zip(teacher_lp, base_lp, strict=True)]
    success = [d for d, e in zip(deltas, episodes, strict=True) if e.reward >= success_reward and len(d)]
    failed = [(d, e) for d, e in zip(deltas, episodes, strict=True) if e.reward < failure_reward and len(d)]
    failure = [d for d, _ in failed]
    invented = [d for d, e in failed if opens_tool_response(e)]
    success_mean, success_lo, success_hi = bootstrap_mean_ci([float(d.mean()) for d in success])
    first_mean, first_lo, first_hi = bootstrap_mean_ci([float(d[0]) for d in success])
    opener_mean, opener_lo, opener_hi = bootstrap_mean_ci([float(d[:opener_tokens].sum()) for d in success])
    out = {
        "successes": len(success), "failures": len(failure),
        "privilege_success": success_mean, "success_ci95_low": success_lo, "success_ci95_high": success_hi,
        "privilege_failure": _fmean([float(d.mean()) for d in failure]),
        "privilege_first_token": first_mean, "first_token_ci95_low": first_lo, "first_token_ci95_high": first_hi,
        "privilege_first_token_failures": _fmean([float(d[0]) for d in failure]),
        "opener_tokens": opener_tokens,
        "privilege_opener": opener_mean, "opener_ci95_low": opener_lo, "opener_ci95_high": opener_hi,
        "privilege_opener_failures": _fmean([float(d[:opener_tokens].sum()) for d in failure]),
        "failures_opening_tool_response": len(invented),
        "privilege_opener_tool_response": _fmean([float(d[:opener_tokens].sum()) for d in invented]),
        # where in the opener δ is won or lost: the mean δ at each of its positions
        "opener_by_token": opener_by_position(success, opener_tokens),
        "opener_by_token_tool_response": opener_by_position(invented, opener_tokens),
    }
    out["balanced_delta"] = out["privilege_success"] - out["privilege_failure"]
    for label, rows in (("teacher", oracle_teacher), ("base", oracle_base)):
        rows = [r for r in rows or [] if r]
        if rows:
            out[f"p_tool_call_{label}"] = statistics.fmean(r["p_tool_call"] for r in rows)
            out[f"p_tool_name_{label}"] = statistics.fmean(r["p_tool_name"] for r in rows)
    return out


def oracle_rows(tokenizer, suite: Suite, tasks: dict[str, Task], episodes: list[Trajectory]) -> list[Trajectory]:
    """The oracle episode of each episode's task (same prompt, the scripted correct actions), under the
    episode's id, so that a teacher scores it with the context that episode retrieved."""
    return [oracle_episode(tokenizer, suite, tasks[e.task_id], episode_id=e.episode_id) for e in episodes]


def retrieve_contexts(bank: Bank, episodes: list[Trajectory], *, k: int, same_family: bool) -> list[list[Experience]]:
    """Each episode's retrieved experiences: never its own episode or task (as in training)."""
    return [bank.retriever.retrieve(RetrievalQuery(instruction=e.instruction, task_id=e.task_id, episode_id=e.episode_id,
                                                   exclude_same_task=True, family=e.family if same_family else ""), k)
            for e in episodes]


def teacher_builder(cfg: Config, policies: PolicySet, contexts: dict[str, list[Experience]], *,
                    composer: ComposerState | None, framing_only: bool = False) -> PromptBuilder:
    """Teacher prompts for episodes (by episode id → its experiences), and the scorer of their batches."""
    lopd = cfg.distill.lopd
    tok = policies.tokenizer

    def build(rows: list[Trajectory]):
        exps = [[] if framing_only else contexts[r.episode_id] for r in rows]
        if composer is None or framing_only:
            prompts, _, _ = teacher_prompts(lopd, tok, rows, rows, exps, latent=False)
            return prompts, lambda batch: model_logprobs(policies, None, batch)
        prompts, pairs, pair_rows = teacher_prompts(lopd, tok, rows, [_task_of(r) for r in rows], exps, latent=True)
        return prompts, lambda batch: latent_teacher_logprobs(policies, composer, batch, pairs, pair_rows,
                                                              max_tokens=lopd.experience_max_tokens)[0]

    return build


def sdpo_teacher_builder(policies: PolicySet, contexts: dict[str, str | list[dict]]) -> PromptBuilder:
    """SDPO's teacher at its start (the EMA is still the base model): the episode's prompt with its context
    (a successful sibling and the environment's feedback), placed by :func:`~lopd_core.algorithms.sdpo.sdpo_teacher_prompt`."""
    def build(rows: list[Trajectory]):
        prompts = [sdpo_teacher_prompt(policies.tokenizer, r, contexts[r.episode_id]) for r in rows]
        return prompts, lambda batch: model_logprobs(policies, None, batch)

    return build


def sdpo_contexts(cfg: Config, tokenizer, episodes: list[Trajectory], rows: list[Trajectory], *,
                  feedback: str) -> list[str | list[dict]]:
    """Each row's SDPO context: its group is every episode of its task among ``episodes`` (a probe's k
    samples per task), the sibling never the row itself; ``feedback`` 'full' or 'redacted'; placed as
    ``distill.sdpo.context_placement`` says."""
    groups: dict[str, list[Trajectory]] = {}
    for e in episodes:
        groups.setdefault(e.task_id, []).append(e)
    out = []
    for r in rows:
        group = groups.get(r.task_id, [r])
        index = next((i for i, e in enumerate(group) if e.episode_id == r.episode_id), None)
        if index is None:
            group, index = [r, *group], 0
        context, _, _ = sdpo_context(tokenizer, group, index, max_tokens=cfg.distill.lopd.experience_max_tokens,
                                     redact=feedback == "redacted", placement=cfg.distill.sdpo.context_placement)
        out.append(context)
    return out


def _task_of(row: Trajectory) -> Task:
    return Task(task_id=row.task_id, suite=row.suite, family=row.family, split=row.split, level=row.level,
                instruction=row.instruction, tools=row.tools)


def probe_teacher(cfg: Config, policies: PolicySet, suite: Suite, episodes: list[Trajectory], bank: Bank, *,
                  composer: ComposerState | None, max_successes: int = 64, max_failures: int = 64,
                  framing_only: bool = False, seed: int = 0, sdpo_feedback: str | None = None,
                  base_cache: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """δ of one teacher on the base model's own successes and failures (see the module docstring).

    ``composer`` None probes the text-context teacher (``distill.lopd.context_placement`` decides where the
    experiences go); ``framing_only`` the framing without any experience (the control); ``sdpo_feedback``
    ('full' or 'redacted') SDPO's teacher instead, its context from the episodes of the row's own task.
    ``base_cache`` keeps the base model's log-probs by episode (and oracle episode) id across the teachers
    of one probe."""
    lopd = cfg.distill.lopd
    rng = random.Random(seed)
    successes = [e for e in episodes if e.reward >= lopd.success_reward and e.status == "ok" and e.n_generated]
    failures = [e for e in episodes if e.reward < lopd.failure_reward and e.status == "ok" and e.n_generated]
    rows = rng.sample(successes, min(max_successes, len(successes))) + rng.sample(failures, min(max_failures, len(failures)))
    if sdpo_feedback is not None:
        found = sdpo_contexts(cfg, policies.tokenizer, episodes, rows, feedback=sdpo_feedback)
    else:
        found = retrieve_contexts(bank, rows, k=lopd.n_retrieved, same_family=lopd.retrieval_family == "same")
    with_context = [(r, f) for r, f in zip(rows, found, strict=True) if f or framing_only]
    rows = [r for r, _ in with_context]
    contexts = {r.episode_id: f for r, f in with_context}
    builder = (sdpo_teacher_builder(policies, contexts) if sdpo_feedback is not None else
               teacher_builder(cfg, policies, contexts, composer=composer, framing_only=framing_only))
    cache = base_cache if base_cache is not None else {}

    def base_logprobs(rows: list[Trajectory], prefix: str) -> list[torch.Tensor]:
        missing = [r for r in rows if prefix + r.episode_id not in cache]
        for row, lp in zip(missing, action_logprobs(policies, missing, teacher=None), strict=True):
            cache[prefix + row.episode_id] = lp
        return [cache[prefix + r.episode_id] for r in rows]

    teacher_lp = action_logprobs(policies, rows, teacher=builder)
    base_lp = base_logprobs(rows, "")
    tasks = {i: t for i, t in tasks_by_id(suite, [r.task_id for r in rows]).items() if t.oracle}
    with_oracle = [r for r in rows if r.task_id in tasks]
    oracle = oracle_rows(policies.tokenizer, suite, tasks, with_oracle)
    teacher_oracle = first_call_probabilities(policies.tokenizer, oracle, action_logprobs(policies, oracle, teacher=builder))
    base_oracle = first_call_probabilities(policies.tokenizer, oracle, base_logprobs(oracle, "oracle/"))
    summary = summarize_privilege(teacher_lp, base_lp, rows, success_reward=lopd.success_reward,
                                  failure_reward=lopd.failure_reward, opener_tokens=opener_length(policies.tokenizer),
                                  oracle_teacher=teacher_oracle,
                                  oracle_base=base_oracle)
    summary["without_context"] = len(found) - len(with_context)
    return summary

