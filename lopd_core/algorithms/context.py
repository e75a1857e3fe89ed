"""Hand-written privileged contexts of the baselines, as text (docs/method.md, the baselines table).

- OPSD: a reference solution of the same task — the task's successful trajectory from the experience bank
  when there is one, else the task generator's scripted oracle; which one was used is recorded.
- SDPO: a successful *sibling* rollout of the same group plus the environment's feedback on the sample,
  never the sample itself.
- Skill-SD: one natural-language skill (built in :mod:`lopd_core.algorithms.skill_sd`).

What it is not: no models, no prompts' token layout (see :mod:`lopd_core.models.latent`).
"""

from __future__ import annotations

from typing import Literal

from lopd_core.envs.base import Task
from lopd_core.models.composer import experience_text
from lopd_core.records.chat import encode, render_text
from lopd_core.records.experience import RetrievalQuery, Retriever
from lopd_core.records.trajectory import Trajectory

ReferenceSource = Literal["bank", "oracle", "none"]
SDPO_FRAMING_BEFORE = "Privileged information about this task (for scoring only):\n"


def truncate_tokens(tokenizer, text: str, *, max_tokens: int) -> str:
    ids = encode(tokenizer, text)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def trajectory_transcript(tokenizer, trajectory: Trajectory, *, max_tokens: int) -> str:
    """The episode after its initial prompt (observation-lite when available), rendered with the chat template."""
    messages = trajectory.messages_lite or trajectory.messages
    turns = [{**m, "content": m.get("content") or ""} for m in messages[trajectory.initial_messages:]]
    if not turns:
        return ""
    text = render_text(tokenizer, turns, None, add_generation_prompt=False)
    return truncate_tokens(tokenizer, text, max_tokens=max_tokens)


def opsd_reference(tokenizer, task: Task, trajectory: Trajectory, retriever: Retriever | None, *, step: int,
                   max_tokens: int, search_k: int = 8) -> tuple[str, ReferenceSource]:
    """The same task's successful trajectory from the bank (never this episode), else ``task.oracle``."""
    if retriever is not None:
        query = RetrievalQuery(instruction=task.instruction, task_id=task.task_id, episode_id=trajectory.episode_id,
                               before_step=step, exclude_same_task=False)
        for exp in retriever.retrieve(query, search_k):
            if exp.task_id == task.task_id:
                return experience_text(tokenizer, exp, max_tokens=max_tokens), "bank"
    if task.oracle:
        return truncate_tokens(tokenizer, task.oracle, max_tokens=max_tokens), "oracle"
    return "", "none"


def sdpo_context(tokenizer, group: list[Trajectory], index: int, *, max_tokens: int) -> tuple[str, bool, bool]:
    """(context text, used a sibling, used feedback) for rollout ``index`` of its group; "" → no loss.

    The sibling is the best-rewarded *other* successful rollout of the group; the sample's own episode is
    never shown to its teacher.
    """
    sample = group[index]
    siblings = [t for j, t in enumerate(group) if j != index and t.success and t.status != "error"
                and t.episode_id != sample.episode_id]
    parts = []
    if siblings:
        best = max(siblings, key=lambda t: t.reward)
        parts.append("A successful attempt at this task:\n" + trajectory_transcript(tokenizer, best, max_tokens=max_tokens))
    if sample.feedback.strip():
        parts.append("Feedback from the environment on an attempt:\n"
                     + truncate_tokens(tokenizer, sample.feedback.strip(), max_tokens=max_tokens // 2))
    return "\n\n".join(parts), bool(siblings), bool(sample.feedback.strip())
