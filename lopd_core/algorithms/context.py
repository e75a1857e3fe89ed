"""Hand-written privileged contexts of the baselines, as text (docs/method.md, the baselines table).

- OPSD: a reference solution of the same task — the task's successful trajectory from the experience bank
  when there is one, else the task generator's scripted oracle; which one was used is recorded.
- SDPO: a successful *sibling* rollout of the same group plus the environment's feedback on the sample,
  never the sample itself.
- Skill-SD: one natural-language skill (built in :mod:`lopd_core.algorithms.skill_sd`).

What it is not: no models, no prompts' token layout (see :mod:`lopd_core.models.latent`).
"""

from __future__ import annotations

import re
from typing import Literal

from lopd_core.envs.base import Task
from lopd_core.models.composer import experience_text
from lopd_core.records.chat import encode, fit_turns, render_text
from lopd_core.records.experience import RetrievalQuery, Retriever, own_turns
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


_UNMET = re.compile(r"unmet (\w+): (.*)")
_CALL_NAME = re.compile(r'"name":\s*"([^"]+)"')


def redact_feedback(feedback: str) -> str:
    """The verifier's feedback without the expected values: which requirements were unmet, not their answers.

    Toolworld's feedback names each unmet checklist item with its expected value (the call's arguments, the
    answer's words); a teacher shown those can answer without calling a tool at all. Kept: the tool a
    missing call should have used, and that an answer item or a state change was missing."""
    lines = []
    for part in (p.strip() for p in feedback.split(";")):
        match = _UNMET.match(part)
        if not match:
            lines.append(part)
        elif match.group(1) == "call":
            name = _CALL_NAME.search(match.group(2))
            lines.append(f"a required call to `{name.group(1)}` was not made correctly" if name
                         else "a required tool call was not made correctly")
        elif match.group(1) == "answer":
            lines.append("the final answer missed a required item")
        else:
            lines.append(f"a required {match.group(1)} change was not made")
    return "; ".join(dict.fromkeys(lines))


SDPO_FEEDBACK_HEADER = "Feedback from the environment on an attempt:\n"


def sdpo_context(tokenizer, group: list[Trajectory], index: int, *, max_tokens: int, redact: bool = True,
                 placement: str = "user_framing") -> tuple[str | list[dict], bool, bool]:
    """(context, used a sibling, used feedback) for rollout ``index`` of its group; an empty context → no loss.

    The sibling is the best-rewarded *other* successful rollout of the group; the sample's own episode is
    never shown to its teacher. ``redact`` removes the expected values from the feedback (:func:`redact_feedback`).
    ``placement`` 'user_framing' gives the context as text (for the task message); 'chat_turn' as chat turns:
    the sibling's own turns (request, actions, observations, fitted to ``max_tokens``) and the feedback as a
    user turn after them.
    """
    sample = group[index]
    siblings = [t for j, t in enumerate(group) if j != index and t.success and t.status != "error"
                and t.episode_id != sample.episode_id]
    best = max(siblings, key=lambda t: t.reward) if siblings else None
    feedback = sample.feedback.strip()
    if feedback:
        feedback = truncate_tokens(tokenizer, redact_feedback(feedback) if redact else feedback, max_tokens=max_tokens // 2)
    if placement == "chat_turn":
        turns = fit_turns(tokenizer, own_turns(best.messages, instruction=best.instruction),
                          max_tokens=max_tokens) if best is not None else []
        if feedback:
            turns = [*turns, {"role": "user", "content": SDPO_FEEDBACK_HEADER + feedback}]
        return turns, best is not None, bool(feedback)
    parts = []
    if best is not None:
        parts.append("A successful attempt at this task:\n" + trajectory_transcript(tokenizer, best, max_tokens=max_tokens))
    if feedback:
        parts.append(SDPO_FEEDBACK_HEADER + feedback)
    return "\n\n".join(parts), best is not None, bool(feedback)
