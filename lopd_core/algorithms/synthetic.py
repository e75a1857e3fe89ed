"""Constructed trajectories and experiences for unit tests and benchmarks (not for training runs).

What it is: :func:`make_trajectory` builds a :class:`~lopd_core.records.trajectory.Trajectory` the way the
agent loop does — the initial prompt rendered once with the real chat template, each assistant reply
tokenised and closed with the end-of-turn id and marked in ``assistant_mask``, and the template text
between turns (tool responses, next assistant header) from :func:`lopd_core.records.chat.turn_suffix_ids` —
so that the alignment a teacher relies on is exercised exactly. :func:`sized_trajectory` pads the texts to
reach given prompt / reply lengths (benchmarks on SmolLM2-135M at the demo sizes).

What it is not: a rollout. Nothing here samples from a model; rewards and sampling log-probs are given.
"""

from __future__ import annotations

import random

from lopd_core.envs.base import Task
from lopd_core.records.chat import encode, end_of_turn_ids, render_prompt_ids, turn_suffix_ids
from lopd_core.records.experience import Experience
from lopd_core.records.trajectory import Trajectory

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def make_trajectory(tokenizer, *, task_id: str, instruction: str, replies: list[str], observations: list[str] | None = None,
                    reward: float = 1.0, system: str = "You are a careful assistant.", tools: list | None = None,
                    sampling_logprob: float = -1.0, status: str = "ok", feedback: str = "", suite: str = "toy",
                    family: str = "toy", episode_id: str | None = None) -> Trajectory:
    """A multi-turn trajectory: ``replies[k]`` is assistant turn k, ``observations[k]`` the tool response after it."""
    observations = list(observations or [])
    if len(observations) not in (len(replies) - 1, len(replies)) and observations:
        raise ValueError(f"{len(replies)} replies need {len(replies) - 1} observations between them")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": instruction}]
    prompt = render_prompt_ids(tokenizer, messages, tools)
    ids, mask, logprobs = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
    eot = end_of_turn_ids(tokenizer)[-1]
    for k, reply in enumerate(replies):
        generated = [*encode(tokenizer, reply), eot]
        following = [{"role": "tool", "content": observations[k]}] if k < len(observations) else []
        suffix = turn_suffix_ids(tokenizer, messages, generated, following, tools)
        ids += generated + suffix
        mask += [1] * len(generated) + [0] * len(suffix)
        logprobs += [sampling_logprob] * len(generated) + [0.0] * len(suffix)
        messages = [*messages, {"role": "assistant", "content": reply}, *following]
    kwargs = {"episode_id": episode_id} if episode_id else {}
    return Trajectory(task_id=task_id, suite=suite, family=family, split="train", level=1, instruction=instruction,
                      messages=messages, initial_messages=2, tools=list(tools or []), token_ids=ids, prompt_len=len(prompt),
                      assistant_mask=mask, sampling_logprobs=logprobs, reward=reward, success=reward >= 0.8,
                      feedback=feedback, status=status, n_turns=len(replies), messages_lite=messages, **kwargs)


def task_of(trajectory: Trajectory, *, oracle: str = "") -> Task:
    return Task(task_id=trajectory.task_id, suite=trajectory.suite, family=trajectory.family, split="train", level=1,
                instruction=trajectory.instruction, tools=trajectory.tools, oracle=oracle)


def experience_of(trajectory: Trajectory) -> Experience:
    """The experience a curated trajectory becomes (observation-lite = the messages here)."""
    text = "\n".join(f"{m['role']}: {m['content']}" for m in trajectory.messages)
    return Experience(experience_id=trajectory.trajectory_id, episode_id=trajectory.episode_id, task_id=trajectory.task_id,
                      suite=trajectory.suite, family=trajectory.family, instruction=trajectory.instruction, text=text,
                      messages=trajectory.messages, reward=trajectory.reward)


def filler(n_words: int, *, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def sized_trajectory(tokenizer, *, index: int, prompt_tokens: int, reply_tokens: int, turns: int = 2,
                     reward: float = 1.0) -> Trajectory:
    """A trajectory whose prompt and replies have roughly the given token counts (NATO words ≈ 1–2 tokens each).

    Like an agent prompt, most of the prompt is the system message (tool documentation); the user message
    (the task) is about a fifth of it.
    """
    system = "Tool documentation: " + filler(max(2 * prompt_tokens // 5, 1), seed=-index - 1)
    instruction = f"Task {index}: " + filler(max(prompt_tokens // 10, 1), seed=index)
    per_turn = max(reply_tokens // turns, 1)
    replies = [filler(max(per_turn // 2, 1), seed=1000 * index + k) for k in range(turns)]
    observations = [f"<tool_response>{filler(8, seed=7 * index + k)}</tool_response>" for k in range(turns - 1)]
    return make_trajectory(tokenizer, task_id=f"bench-{index}", instruction=instruction, replies=replies,
                           observations=observations, reward=reward, system=system)
