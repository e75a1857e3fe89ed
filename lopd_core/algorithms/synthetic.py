"""Constructed trajectories and experiences for unit tests and benchmarks (not for training runs).

What it is: :func:`make_trajectory` builds a :class:`~lopd_core.records.trajectory.Trajectory` from a system
prompt, a request and scripted replies exactly as the agent loop would have
(:func:`lopd_core.rollout.oracle.scripted_trajectory`), so that the alignment a teacher relies on is
exercised exactly. :func:`sized_trajectory` pads the texts to
reach given prompt / reply lengths (benchmarks on SmolLM2-135M at the demo sizes).

What it is not: a rollout. Nothing here samples from a model; rewards and sampling log-probs are given.
"""

from __future__ import annotations

import random

from lopd_core.envs.base import Task
from lopd_core.records.experience import Experience
from lopd_core.records.trajectory import Trajectory
from lopd_core.rollout.oracle import scripted_trajectory

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
    task = Task(task_id=task_id, suite=suite, family=family, split="train", level=1, instruction=instruction,
                tools=list(tools or []))
    kwargs = {"episode_id": episode_id} if episode_id else {}
    return scripted_trajectory(tokenizer, initial=[{"role": "system", "content": system},
                                                   {"role": "user", "content": instruction}],
                               replies=replies, observations=[{"role": "tool", "content": o} for o in observations],
                               task=task, reward=reward, success=reward >= 0.8, feedback=feedback, status=status,
                               sampling_logprob=sampling_logprob, **kwargs)


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
