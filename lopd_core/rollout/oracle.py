"""Scripted episodes: a task's oracle solution played through its real environment, as an exact trajectory.

:func:`scripted_trajectory` builds a :class:`~lopd_core.records.trajectory.Trajectory` from given assistant
replies the way the agent loop builds one from sampled ids: the initial prompt rendered once, each reply
tokenised and closed with the end-of-turn id (assistant mask 1), the template text between turns from
:func:`lopd_core.records.chat.turn_suffix_ids` (mask 0). :func:`oracle_episode` plays ``task.oracle`` (the
suite's scripted correct solution) through the environment, so the verifier scores it and the observations
are the real tool responses.

Uses: the capacity control (fine-tuning on oracle transcripts of training tasks), the oracle fallback of
LOPD's retrieval (``distill.lopd.oracle_fallback``), and tests. What it is not: a rollout — nothing samples.
"""

from __future__ import annotations

import re
from typing import Any

from lopd_core.envs.base import Suite, Task
from lopd_core.records.chat import encode, end_of_turn_ids, render_prompt_ids, turn_suffix_ids
from lopd_core.records.experience import Experience, experience_content
from lopd_core.records.trajectory import Trajectory

_RESPONSE = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)


def scripted_trajectory(tokenizer, *, initial: list[dict[str, Any]], replies: list[str],
                        observations: list[dict[str, Any]], task: Task, reward: float, success: bool,
                        feedback: str = "", sampling_logprob: float = 0.0, **fields) -> Trajectory:
    """``replies[k]`` is assistant turn k; ``observations[k]`` the message that followed it (fewer at the end)."""
    if len(observations) > len(replies):
        raise ValueError(f"{len(replies)} replies cannot be followed by {len(observations)} observations")
    tools = list(task.tools)
    prompt = render_prompt_ids(tokenizer, initial, tools)
    ids, mask, logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
    eot = end_of_turn_ids(tokenizer)[-1]
    messages = list(initial)
    for k, reply in enumerate(replies):
        generated = [*encode(tokenizer, reply), eot]
        following = [observations[k]] if k < len(observations) else []
        suffix = turn_suffix_ids(tokenizer, messages, generated, following, tools)
        ids += generated + suffix
        mask += [1] * len(generated) + [0] * len(suffix)
        logprobs += [sampling_logprob] * len(generated) + [0.0] * len(suffix)
        messages = [*messages, {"role": "assistant", "content": reply}, *following]
    return Trajectory(task_id=task.task_id, suite=task.suite, family=task.family, split=task.split, level=task.level,
                      instruction=task.instruction, messages=messages, initial_messages=len(initial), tools=tools,
                      token_ids=ids, prompt_len=len(prompt), assistant_mask=mask, sampling_logprobs=logprobs,
                      reward=reward, success=success, feedback=feedback, n_turns=len(replies),
                      n_tool_calls=sum(o.get("role") == "tool" for o in observations), messages_lite=messages, **fields)


def oracle_replies(task: Task) -> list[str]:
    """The assistant turns of the task's oracle solution: ``task.oracle_turns``, else ``task.oracle`` split at
    its tool responses (empty when the task has no oracle)."""
    return list(task.oracle_turns) or [part.strip() for part in _RESPONSE.split(task.oracle) if part.strip()]


def oracle_episode(tokenizer, suite: Suite, task: Task, **fields) -> Trajectory:
    """The task's oracle solution played through its environment: the verifier's reward, the real observations.

    The replies are ``task.oracle_turns``, else ``task.oracle`` split at its tool responses."""
    if not task.oracle and not task.oracle_turns:
        raise ValueError(f"task {task.task_id} has no oracle solution")
    env = suite.make_env(task)
    try:
        initial = env.reset(task)
        replies = oracle_replies(task)
        observations = []
        for reply in replies:
            result = env.step(reply)
            if result.observation is not None and not result.done:
                observations.append({"role": result.role, "content": result.observation})
        outcome = env.result()
    finally:
        if callable(getattr(env, "close", None)):
            env.close()
    return scripted_trajectory(tokenizer, initial=initial, replies=replies, observations=observations[: len(replies)],
                               task=task, reward=outcome.reward, success=outcome.success, feedback=outcome.feedback,
                               policy_version="oracle", **fields)


def oracle_experience(tokenizer, suite: Suite, task: Task, *, max_chars: int) -> Experience:
    """The task's oracle solution as an experience (its own turns, observation-lite)."""
    episode = oracle_episode(tokenizer, suite, task)
    turns, text = experience_content(episode.messages, instruction=task.instruction,
                                     initial_messages=episode.initial_messages, max_chars=max_chars)
    return Experience(experience_id=f"oracle/{task.task_id}", episode_id=f"oracle/{task.task_id}",
                      task_id=task.task_id, suite=task.suite, family=task.family, instruction=task.instruction,
                      text=text, messages=turns, reward=episode.reward, split="train")
