"""Score stored episodes again under the suite's current checker, by replaying them.

A checker that changes (a hedge found, a rule mended) leaves every stored episode scored by the old one: the
probe's episodes that seed an experience bank, a rollout file kept for later. Replaying the agent's own turns
through a fresh environment of the same task gives each episode the reward it would earn now, with no model.

An episode counts as replayed only when the environment gives back exactly what was stored: the same prompt
and, after every agent turn, the same observation (same tools, same world). One that diverges keeps its old
score and is reported with the first difference; so is one whose task cannot be recreated from its id, one
that ended in an error, or one whose replay raises. Nothing is dropped: the output holds every input episode,
in order.

The agent's turns are stepped as stored (a turn that kept the end-of-turn token in its text is stepped with it;
the built-in environments ignore what follows an answer's text).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from lopd_core.envs.base import EpisodeResult, Suite, Task, tasks_by_id
from lopd_core.records.trajectory import Trajectory


@dataclass
class Rescored:
    """The episodes (in input order, rescored where replayed) and what happened to each."""

    episodes: list[Trajectory]
    replayed: int = 0
    changed: list[dict[str, Any]] = field(default_factory=list)
    """One entry per replayed episode whose reward or success changed: ids, family, old and new."""
    kept: list[dict[str, Any]] = field(default_factory=list)
    """Episodes left with their old score, each with the reason (diverged, task not found, error, replay failed,
    other suite)."""

    def summary(self, before: list[Trajectory]) -> dict[str, Any]:
        """Totals and, per family, successes and mean reward before and after (over every episode)."""
        families: dict[str, dict[str, list[Trajectory]]] = defaultdict(lambda: {"before": [], "after": []})
        for old, new in zip(before, self.episodes, strict=True):
            families[old.family]["before"].append(old)
            families[old.family]["after"].append(new)

        def stats(rows: list[Trajectory]) -> dict[str, float]:
            return {"successes": sum(r.success for r in rows),
                    "mean_reward": round(statistics.fmean(r.reward for r in rows), 4) if rows else 0.0}

        return {"episodes": len(self.episodes), "replayed": self.replayed, "changed": len(self.changed),
                "success_flips": {"lost": sum(c["success"] == [True, False] for c in self.changed),
                                  "gained": sum(c["success"] == [False, True] for c in self.changed)},
                "kept": len(self.kept), "kept_reasons": dict(Counter(k["reason"].split(":")[0] for k in self.kept)),
                "families": {f: {"episodes": len(v["before"]), "before": stats(v["before"]), "after": stats(v["after"])}
                             for f, v in sorted(families.items())}}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")


def replay(suite: Suite, task: Task, episode: Trajectory) -> EpisodeResult | str:
    """The episode's agent turns stepped through a fresh environment of ``task``: the checker's result, or
    the first difference from what was stored (a string) when the replay does not reproduce the episode."""
    env = suite.make_env(task)
    try:
        prompt = env.reset(task)
        stored = episode.messages
        n = episode.initial_messages
        if len(prompt) != n or not all(_same(a, b) for a, b in zip(prompt, stored[:n], strict=False)):
            return "diverged: the prompt differs from the stored one (other worked examples, tools or request)"
        for i in range(n, len(stored)):
            message = stored[i]
            if message.get("role") != "assistant":
                continue
            result = env.step(message.get("content") or "")
            if result.done and any(m.get("role") == "assistant" for m in stored[i + 1:]):
                return f"diverged: the episode now ends at turn {i}, the stored one goes on"
            following = stored[i + 1] if i + 1 < len(stored) else None
            if following is None or following.get("role") == "assistant":
                if following is not None and result.observation is not None:
                    return f"diverged: turn {i} now gets an observation the stored episode does not have"
                continue
            if result.observation is None or not _same(following, {"role": result.role or "tool",
                                                                   "content": result.observation}):
                return f"diverged: the observation after turn {i} differs from the stored one"
        return env.result()
    finally:
        if callable(getattr(env, "close", None)):
            env.close()


def rescore_episodes(suite: Suite, episodes: list[Trajectory], *, progress: bool = True) -> Rescored:
    """Every episode scored again under ``suite``'s current checker (see the module docstring)."""
    tasks = tasks_by_id(suite, [e.task_id for e in episodes])
    out = Rescored(episodes=[])
    for episode in tqdm(episodes, desc="rescore", unit="episode", disable=not progress):
        task = tasks.get(episode.task_id)
        reason = ""
        if episode.suite != suite.name:
            reason = f"other suite: the episode is from {episode.suite!r}, not {suite.name!r}"
        elif episode.status == "error":
            reason = f"error: the episode ended in an error ({episode.error[:120]})"
        elif task is None:
            reason = f"task not found: {episode.task_id} cannot be recreated from its id"
        else:
            try:
                result = replay(suite, task, episode)
            except Exception as exc:  # a tool or checker that raises now: the episode keeps its score
                result = f"replay failed: {type(exc).__name__}: {str(exc)[:200]}"
            if isinstance(result, str):
                reason = result
            else:
                out.replayed += 1
                new = replace(episode, reward=float(result.reward), success=bool(result.success),
                              feedback=result.feedback, checklist=dict(result.checklist))
                if new.reward != episode.reward or new.success != episode.success:
                    out.changed.append({"episode_id": episode.episode_id, "task_id": episode.task_id,
                                        "family": episode.family, "reward": [episode.reward, new.reward],
                                        "success": [episode.success, new.success]})
                out.episodes.append(new)
                continue
        out.kept.append({"episode_id": episode.episode_id, "task_id": episode.task_id, "reason": reason})
        out.episodes.append(episode)
    return out
