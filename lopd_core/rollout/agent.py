"""The agent loop: multi-turn episodes on a task suite, batched across episodes, as exact trajectories.

One call of :func:`run_episodes` plays every task to the end. Each turn, all live episodes generate
together (one ``engine.generate`` call; the engine batches inside), then every episode's environment
steps on its assistant text. An episode ends when its environment says ``done`` (status ``ok``), when it
reaches ``max_turns`` assistant turns or the ``max_trajectory_tokens`` cap (status ``truncated``), or when
its environment raises (status ``error``: reward 0, the message kept, the rest of the batch unaffected;
an episode whose initial prompt does not fit under the cap is an error with its messages but no tokens).
After scoring, each environment's ``close()`` (when it has one) ends its hold on the episode's tools.

Token alignment (see :mod:`lopd_core.records.trajectory` and :mod:`lopd_core.records.chat`):

- ``token_ids[:prompt_len]`` is the initial prompt rendered once by the chat template;
- every assistant turn contributes the engine's ids *verbatim* (mask 1, the engine's log-probs), cut to
  the episode's remaining budget, then the template text up to the next assistant header (or the
  closing text of the last turn), tokenised through the sentinel split (mask 0, log-prob 0.0);
- so ``tokenizer.decode(token_ids)`` equals the chat-template rendering of ``messages`` without a
  generation prompt, and ``len(token_ids) <= max_trajectory_tokens`` always (plus, for an environment that
  adds context to the prompt with an allowance, the context's length: :func:`_context_allowance`).

The assistant message text is the decoded generation without its end-of-turn token (special tokens the
model emitted mid-turn stay as text, exactly as the ids say). A template that rewrites earlier turns when
later ones arrive (e.g. one that strips reasoning from past turns) breaks the incremental rendering; the
alignment test in the test suite catches that for any new model family.

Timings per episode: ``generate_s`` is the episode's share of the batched generate calls it took part in
(call time / episodes in the call, so the shares add up to the total generate time), ``env_s`` its own
environment time, ``total_s`` the wall time from the start of the call to the end of the episode.

Not here: chat rendering rules (``chat.py``), tool-call parsing and rewards (the environments), sampling
and batching (the engines), persistence (the callers).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from lopd_core.config import RolloutConfig
from lopd_core.envs.base import check_needs
from lopd_core.progress import report as report_progress
from lopd_core.records.chat import end_of_turn_ids, render_prompt_ids, turn_suffix_ids
from lopd_core.records.experience import observation_lite_messages, render_observation_lite
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.engines.base import Engine, SamplingParams

log = logging.getLogger(__name__)

MIN_TURN_TOKENS = 8
"""A new turn starts only when at least this many tokens fit under the trajectory cap."""


# --------------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------------
@dataclass
class _Episode:
    task: Any
    env: Any = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    initial_messages: int = 0
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    closing_len: int = 0
    closing_text: str = ""
    cap: int = 0
    """This episode's trajectory cap: ``max_trajectory_tokens``, plus the context's allowance (:func:`_start`)."""
    status: str = "ok"
    error: str = ""
    finished: bool = False
    n_turns: int = 0
    n_tool_calls: int = 0
    n_invalid_tool_calls: int = 0
    generate_s: float = 0.0
    env_s: float = 0.0
    total_s: float = 0.0

    def extend(self, ids: list[int], mask_value: int, logprobs: list[float] | None = None) -> None:
        self.token_ids.extend(ids)
        self.mask.extend([mask_value] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


def _fail(ep: _Episode, where: str, exc: BaseException) -> None:
    """The episode errored: the message names the suite, the task and where it failed."""
    ep.status, ep.finished = "error", True
    ep.error = f"suite {ep.task.suite}, task {ep.task.task_id}: {where}: {type(exc).__name__}: {exc}"


def _start(ep: _Episode, suite, tokenizer, cap: int) -> None:
    """Reset the environment and render the initial prompt; any failure makes the episode an error."""
    tools = ep.task.tools or None
    try:
        ep.env = suite.make_env(ep.task)
        t0 = time.perf_counter()
        ep.messages = list(ep.env.reset(ep.task))
        ep.env_s += time.perf_counter() - t0
    except Exception as exc:  # an environment bug must not kill the batch
        _fail(ep, "env.reset", exc)
        return
    ep.initial_messages = len(ep.messages)
    try:
        ep.extend(render_prompt_ids(tokenizer, ep.messages, tools), 0)
        closing = turn_suffix_ids(tokenizer, ep.messages, [], [], tools)
    except Exception as exc:
        _fail(ep, "chat template", exc)
        return
    ep.prompt_len = len(ep.token_ids)
    allowance = _context_allowance(ep, tokenizer, tools)
    ep.cap = cap + allowance
    ep.closing_len = len(closing)
    ep.closing_text = tokenizer.decode(closing, clean_up_tokenization_spaces=False)
    if ep.prompt_len + ep.closing_len + MIN_TURN_TOKENS > ep.cap:
        ep.status, ep.finished = "error", True
        extra = f" plus its context's allowance of {allowance}" if allowance else ""
        ep.error = (f"initial prompt of task {ep.task.task_id} is {ep.prompt_len} tokens, too long for "
                    f"rollout.max_trajectory_tokens={cap}{extra}; raise that cap or shorten the task")
        # The record keeps the messages (what was too long) but no tokens: nothing over the cap is stored.
        ep.token_ids, ep.mask, ep.logprobs, ep.prompt_len = [], [], [], 0


def _context_allowance(ep: _Episode, tokenizer, tools) -> int:
    """Tokens the episode may run past the cap: an environment that adds context to the task's prompt (a
    hinted rollout, :class:`~lopd_core.rollout.context.ContextSuite` with an allowance) gets the context's own
    length, at most its ``allowance_tokens``, so the context never takes the room the episode has without it
    (and the episode behind the plain prompt still fits the cap). Every other environment: 0."""
    limit = getattr(ep.env, "allowance_tokens", 0)
    plain = getattr(ep.env, "plain_messages", None)
    if not limit or plain is None:
        return 0
    return min(max(ep.prompt_len - len(render_prompt_ids(tokenizer, plain, tools)), 0), limit)


def _assistant_text(tokenizer, ep: _Episode, ids: list[int], eot_ids: set[int]) -> tuple[str, str]:
    """(message content, text for the environment). The content omits the final end-of-turn token exactly
    when the template's own closing text starts with it (the rule of :func:`chat.turn_suffix_ids`)."""
    decode = lambda x: tokenizer.decode(x, clean_up_tokenization_spaces=False)  # noqa: E731
    if ids and ids[-1] in eot_ids:
        body = decode(ids[:-1])
        if ep.closing_text.startswith(decode(ids[-1:])):
            return body, body
        return decode(ids), body
    text = decode(ids)
    return text, text


def _close(ep: _Episode, tokenizer, before: list[dict[str, Any]], ids: list[int], status: str) -> None:
    ep.extend(turn_suffix_ids(tokenizer, before, ids, [], ep.task.tools or None), 0)
    ep.status, ep.finished = status, True


def _finish_record(ep: _Episode, *, engine_name: str, sampling: dict[str, Any], observation_max_chars: int,
                   policy_version: str, composer_version: str, step: int, cycle_id: str) -> Trajectory:
    task = ep.task
    reward, success, feedback, checklist = 0.0, False, "", {}
    t0 = time.perf_counter()
    if ep.status != "error" and ep.env is not None:
        try:
            res = ep.env.result()
            reward, success = float(res.reward), bool(res.success)
            feedback, checklist = res.feedback, dict(res.checklist)
            if not 0.0 <= reward <= 1.0:
                raise ValueError(f"reward {reward} is outside [0, 1]")
        except Exception as exc:
            _fail(ep, "env.result", exc)
            reward, success, feedback, checklist = 0.0, False, "", {}
    if callable(getattr(ep.env, "close", None)):
        try:
            ep.env.close()
        except Exception as exc:
            _fail(ep, "env.close", exc)
            reward, success = 0.0, False
    ep.env_s += time.perf_counter() - t0
    lite = observation_lite_messages(ep.messages, ep.initial_messages, max_chars=observation_max_chars)
    traj = Trajectory(
        task_id=task.task_id, suite=task.suite, family=task.family, split=task.split, level=task.level,
        instruction=task.instruction, messages=ep.messages, initial_messages=ep.initial_messages,
        tools=list(task.tools), token_ids=ep.token_ids, prompt_len=ep.prompt_len, assistant_mask=ep.mask,
        sampling_logprobs=ep.logprobs, reward=reward, success=success, feedback=feedback, checklist=checklist,
        status=ep.status, error=ep.error, policy_version=policy_version, composer_version=composer_version,
        engine=engine_name, sampling=sampling,
        timings={"generate_s": ep.generate_s, "env_s": ep.env_s, "total_s": ep.total_s},
        n_turns=ep.n_turns, n_tool_calls=ep.n_tool_calls, n_invalid_tool_calls=ep.n_invalid_tool_calls,
        observation_lite=render_observation_lite(lite), messages_lite=lite, cycle_id=cycle_id, step=step,
    )
    traj.validate_alignment()
    return traj


# --------------------------------------------------------------------------------------------------
def sampling_params(rollout: RolloutConfig, tokenizer, *, seed: int | None,
                    temperature: float | None = None) -> SamplingParams:
    """The sampling parameters of a rollout section (``temperature`` overrides it, e.g. 0 for greedy evaluation).

    The stop ids are the tokenizer's end-of-turn ids, written out so that every record of the sampling
    parameters (trajectories, summaries) shows what was used.
    """
    return SamplingParams(temperature=rollout.temperature if temperature is None else temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens,
                          stop_token_ids=end_of_turn_ids(tokenizer), seed=seed)


class EpisodesFailed(RuntimeError):
    """Every episode of a batch errored: the run produced nothing to learn from or to score."""

    def __init__(self, trajectories: list[Trajectory]) -> None:
        self.trajectories = trajectories
        reasons = sorted({t.error for t in trajectories})
        shown = "; ".join(reasons[:3]) + (f" (and {len(reasons) - 3} other reasons)" if len(reasons) > 3 else "")
        super().__init__(f"all {len(trajectories)} episodes errored: {shown}")


def play(rollout: RolloutConfig, engine: Engine, tokenizer, suite, tasks: list, *, seed: int | None,
         temperature: float | None = None, policy_version: str = "base", step: int = -1, cycle_id: str = "",
         progress: bool = False) -> list[Trajectory]:
    """:func:`run_episodes` with the turn, length and sampling settings of a ``rollout`` config section.

    Every caller that plays episodes (the cycle's rollouts, bank seeding, training steps, evaluation, the
    CLI) goes through here, so the settings are read from the config in one place. Fails loudly: a suite whose
    declared needs (:class:`lopd_core.envs.base.SuiteNeeds`) the settings do not meet raises
    :class:`~lopd_core.envs.base.SuiteNeedsError` before any episode runs, and a batch whose every episode
    errored raises :class:`EpisodesFailed` with the reasons (it carries the trajectories).
    """
    check_needs(suite, rollout, levels={t.level for t in tasks})
    trajectories = run_episodes(engine, tokenizer, suite, tasks, max_turns=rollout.max_turns,
                                max_trajectory_tokens=rollout.max_trajectory_tokens,
                                sampling=sampling_params(rollout, tokenizer, seed=seed, temperature=temperature),
                                observation_max_chars=rollout.observation_max_chars, policy_version=policy_version,
                                step=step, cycle_id=cycle_id, progress=progress)
    if trajectories and all(t.status == "error" for t in trajectories):
        raise EpisodesFailed(trajectories)
    for problem in episode_problems(trajectories):
        log.warning(problem)
    return trajectories


def episode_problems(trajectories: list[Trajectory], limit: int = 5) -> list[str]:
    """What went wrong outside the policy's control, one line per episode (at most ``limit``, then a count):
    episodes that errored, and tools that raised an exception other than ``ToolError`` (a bug in the suite's
    tools, or a value they do not handle; the agent saw it as an error and the episode was scored)."""
    found = [t.error for t in trajectories if t.status == "error"]
    found += [f"suite {t.suite}, task {t.task_id}: tool raised an unexpected exception: {crash}"
              for t in trajectories for crash in t.checklist.get("tool_exceptions", [])[:1]]
    if len(found) > limit:
        found = [*found[:limit], f"... and {len(found) - limit} more episodes with problems"]
    return found


def run_episodes(engine: Engine, tokenizer, suite, tasks: list, *, max_turns: int, max_trajectory_tokens: int,
                 sampling: SamplingParams, observation_max_chars: int = 400, policy_version: str = "base",
                 composer_version: str = "none", step: int = -1, cycle_id: str = "",
                 progress: bool = False) -> list[Trajectory]:
    """Play every task to the end and return one :class:`Trajectory` per task, in the order of ``tasks``.

    ``sampling.stop_token_ids`` defaults to the tokenizer's end-of-turn ids; ``sampling.seed`` (when set)
    seeds turn ``k``'s batched generate call with ``seed + k``, so the same tasks, seed and weights give
    the same trajectories. Vary the seed between calls (e.g. per training step) for fresh samples.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be at least 1 (got {max_turns})")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be at least 1 (got {sampling.max_new_tokens})")
    from tqdm.auto import tqdm

    eot_ids = set(end_of_turn_ids(tokenizer))
    stop_ids = list(sampling.stop_token_ids) or sorted(eot_ids)
    sampling = replace(sampling, stop_token_ids=stop_ids)
    cap = max_trajectory_tokens
    start = time.perf_counter()
    episodes = [_Episode(task=t) for t in tasks]
    bar = tqdm(total=len(episodes), desc="episodes", unit="ep", disable=not progress, leave=False)

    done = [0]  # not bar.n: a disabled bar does not count

    def mark_done(ep: _Episode) -> None:
        ep.total_s = time.perf_counter() - start
        bar.update(1)
        done[0] += 1
        report_progress("episodes", done[0], len(episodes))

    try:
        for ep in episodes:
            _start(ep, suite, tokenizer, cap)
            if ep.finished:
                mark_done(ep)
        _play(episodes, engine, tokenizer, sampling, max_turns=max_turns, eot_ids=eot_ids,
              mark_done=mark_done)
    finally:
        bar.close()

    sampling_record = sampling.to_dict()
    return [
        _finish_record(ep, engine_name=engine.name, sampling=sampling_record,
                       observation_max_chars=observation_max_chars, policy_version=policy_version,
                       composer_version=composer_version, step=step, cycle_id=cycle_id)
        for ep in episodes
    ]


def _play(episodes: list[_Episode], engine: Engine, tokenizer, sampling: SamplingParams, *, max_turns: int,
          eot_ids: set[int], mark_done) -> None:
    """The turn loop: generate for all live episodes together, then step each environment."""
    turn = 0
    while live := [ep for ep in episodes if not ep.finished]:
        # --- generate: every live episode together, each cut to the room it has left under the cap
        budgets = [min(sampling.max_new_tokens, ep.cap - len(ep.token_ids) - ep.closing_len) for ep in live]
        params = replace(sampling, max_new_tokens=max(budgets),
                         seed=None if sampling.seed is None else sampling.seed + turn)
        t0 = time.perf_counter()
        generations = engine.generate([ep.token_ids for ep in live], params)
        share = (time.perf_counter() - t0) / len(live)
        if len(generations) != len(live):
            raise RuntimeError(f"engine {engine.name} returned {len(generations)} generations for {len(live)} prompts")
        turn += 1

        # --- step every environment on its assistant text
        for ep, gen, budget in zip(live, generations, budgets, strict=True):
            ep.generate_s += share
            ids, logprobs = list(gen.token_ids[:budget]), list(gen.logprobs[:budget])
            content, env_text = _assistant_text(tokenizer, ep, ids, eot_ids)
            before = list(ep.messages)
            ep.messages.append({"role": "assistant", "content": content})
            ep.extend(ids, 1, logprobs)
            ep.n_turns += 1
            t_env = time.perf_counter()
            try:
                result = ep.env.step(env_text)
            except Exception as exc:
                ep.env_s += time.perf_counter() - t_env
                _close(ep, tokenizer, before, ids, "error")
                _fail(ep, f"env.step (turn {ep.n_turns})", exc)
                mark_done(ep)
                continue
            ep.env_s += time.perf_counter() - t_env
            ep.n_tool_calls += int(result.tool_calls)
            ep.n_invalid_tool_calls += int(result.invalid_tool_calls)
            if result.done:
                _close(ep, tokenizer, before, ids, "ok")
            elif ep.n_turns >= max_turns:
                _close(ep, tokenizer, before, ids, "truncated")
            else:
                _continue(ep, tokenizer, before, ids, result, ep.cap)
            if ep.finished:
                mark_done(ep)


def _continue(ep: _Episode, tokenizer, before: list[dict[str, Any]], ids: list[int], result, cap: int) -> None:
    """Append the observation and the next assistant header, or stop (truncated) when the next turn would
    not fit under the cap; the observation is then left out of both the messages and the ids."""
    tools = ep.task.tools or None
    if result.observation is None:  # another assistant turn follows directly
        next_messages: list[dict[str, Any]] = []
        suffix = turn_suffix_ids(tokenizer, before, ids, [], tools, add_generation_prompt=True)
    else:
        next_messages = [{"role": result.role or "tool", "content": result.observation}]
        suffix = turn_suffix_ids(tokenizer, before, ids, next_messages, tools)
    if len(ep.token_ids) + len(suffix) + ep.closing_len + MIN_TURN_TOKENS > cap:
        _close(ep, tokenizer, before, ids, "truncated")
        return
    ep.messages.extend(next_messages)
    ep.extend(suffix, 0)


# --------------------------------------------------------------------------------------------------
def summarize_trajectories(trajectories: list[Trajectory], *, wall_s: float | None = None) -> dict[str, Any]:
    """Stable ``rollout/*`` metrics of a batch of episodes (success rate, reward, throughput, statuses)."""
    n = len(trajectories)
    generated = sum(t.n_generated for t in trajectories)
    generate_s = sum(t.timings.get("generate_s", 0.0) for t in trajectories)
    calls = sum(t.n_tool_calls for t in trajectories)
    invalid = sum(t.n_invalid_tool_calls for t in trajectories)
    turns = sum(t.n_turns for t in trajectories)
    statuses = {s: sum(t.status == s for t in trajectories) for s in ("ok", "truncated", "error")}
    metrics: dict[str, Any] = {
        "rollout/n_episodes": n,
        "rollout/success_rate": (sum(t.success for t in trajectories) / n) if n else 0.0,
        "rollout/mean_reward": (sum(t.reward for t in trajectories) / n) if n else 0.0,
        "rollout/generated_tokens": generated,
        "rollout/generate_s": generate_s,
        "rollout/generated_tokens_per_s": generated / generate_s if generate_s > 0 else 0.0,
        "rollout/mean_turns": turns / n if n else 0.0,
        "rollout/mean_tokens": (sum(t.n_tokens for t in trajectories) / n) if n else 0.0,
        "rollout/tool_calls": calls,
        "rollout/invalid_tool_calls": invalid,
        "rollout/invalid_calls_per_turn": invalid / turns if turns else 0.0,
        **{f"rollout/status_{k}": v for k, v in statuses.items()},
    }
    if wall_s is not None:
        metrics["rollout/wall_s"] = wall_s
        metrics["rollout/episode_tokens_per_s_wall"] = generated / wall_s if wall_s > 0 else 0.0
    return metrics
