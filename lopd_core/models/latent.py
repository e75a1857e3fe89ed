"""Teacher prompts: where the privileged context goes, and latent injection by out-of-place concatenation.

What this module is: the token-level construction of every teacher prompt the algorithms use.

- where the context goes (``distill.lopd.context_placement``): ``user_framing`` — framing text around it
  in the task's user message (the paper's) —, ``system`` — appended to the system message — or
  ``chat_turn`` — as earlier turns of the conversation right before the task; every framing tells the
  agent to call the tools for its own task itself;
- :func:`latent_prompt` renders the trajectory's initial prompt with a placeholder span of ``n_latents``
  positions placed that way. The span is located **by position**: the prompt is rendered with a sentinel
  where the span goes, split at the sentinel and the halves are tokenised separately, so ``span_start``
  is simply ``len(ids_before)``. We never search for a placeholder or pad id (SmolLM2's pad token is
  ``<|im_end|>``, which closes every turn);
- :func:`experiences_prompt`: the text-context teacher, the retrieved experiences' own turns placed the
  same way (as real chat turns for ``chat_turn``, as a plain transcript otherwise);
  :func:`text_context_prompt` puts hand-written text in the task's message (SDPO's sibling + feedback,
  Skill-SD's skill); :func:`system_reference_prompt` puts a reference solution in the system message (OPSD).
- :func:`inject_latents` replaces the token embeddings of each row's span by that row's latents with an
  out-of-place ``torch.cat``, so gradients reach the composer and nothing aliases the embedding output.

What it is not: it does not run models or build attention masks (those come from real sequence lengths in
:mod:`lopd_core.algorithms.batch`). Student and teacher sequences share everything after the prompt
(``Trajectory.continuation_ids()``), so positions map by the prompt-length offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lopd_core.records.chat import SENTINEL, encode, render_text

Placement = Literal["user_framing", "system", "chat_turn"]
PLACEMENTS = ("user_framing", "system", "chat_turn")

CONTEXT_BEFORE = "Here is how a similar task was solved before (a reference, not your task):\n"
CONTEXT_AFTER = ("\nNow solve your own task yourself: call the tools it needs, one at a time, and use only what "
                 "the tools return for it.\n\nYour task:\n")
SYSTEM_HEADER = ("\n\nHow a similar task was solved before (a reference for you; for the user's task, call the "
                 "tools yourself and use only what they return):\n")
CHAT_TURN_LATENT = "Here is how a similar task was solved before (a reference, not my task):\n"
TEXT_SEPARATOR = "\n\n---\n\n"
REFERENCE_SYSTEM_HEADER = "\n\nA reference solution of the user's task (for you only; do not mention it):\n"


@dataclass(frozen=True)
class TeacherPrompt:
    """Token ids of a teacher's initial prompt (ending with the assistant header) and its latent span."""

    ids: list[int]
    span_start: int = 0
    """Index of the first placeholder position (0 with span_length 0 when there is no span)."""
    span_length: int = 0


def _task_message_index(messages: list[dict[str, Any]]) -> int:
    """The user message that states the task: the LAST user message of the initial prompt.

    The spec's "first user message" assumes a system + user prompt; suites that play worked examples as
    earlier chat turns (toolworld's one-shot tool-call demonstrations) put the real task last, and the
    teacher context belongs there, next to the task, not next to a demonstration.
    """
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    raise ValueError("the trajectory's initial messages contain no user message to put the teacher context in "
                     "(expected system + user message(s), see Trajectory.initial_messages)")


def _with_task_message_content(messages: list[dict[str, Any]], build) -> list[dict[str, Any]]:
    i = _task_message_index(messages)
    original = messages[i].get("content") or ""
    if not isinstance(original, str):
        raise ValueError(f"message {i} (the task's user message) has non-text content of type {type(original).__name__}; "
                         "teacher prompts need plain text content")
    return [*messages[:i], {**messages[i], "content": build(original)}, *messages[i + 1:]]


def _with_context(messages: list[dict[str, Any]], placement: Placement, *, text: str,
                  turns: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The initial messages with privileged context placed: ``text`` (framed) in the task's user message or the
    system message, or — ``chat_turn`` — ``turns`` as earlier turns of the conversation (or, without turns, a
    user turn carrying ``text``) right before the task."""
    if placement == "user_framing":
        return _with_task_message_content(messages, lambda original: f"{CONTEXT_BEFORE}{text}{CONTEXT_AFTER}{original}")
    if placement == "system":
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": (messages[0].get("content") or "") + SYSTEM_HEADER + text},
                    *messages[1:]]
        return [{"role": "system", "content": SYSTEM_HEADER.lstrip() + text}, *messages]
    if placement == "chat_turn":
        i = _task_message_index(messages)
        inserted = turns if turns is not None else [{"role": "user", "content": f"{CHAT_TURN_LATENT}{text}"}]
        return [*messages[:i], *inserted, *messages[i:]]
    raise ValueError(f"context placement {placement!r} is not one of {', '.join(PLACEMENTS)} "
                     "(distill.lopd.context_placement)")


def latent_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                  n_latents: int, placeholder_id: int, placement: Placement = "user_framing") -> TeacherPrompt:
    """The initial prompt with ``n_latents`` placeholder positions, placed as ``placement`` says.

    ``user_framing`` (the paper's): inside framing text in the task's user message; ``system``: appended to
    the system message; ``chat_turn``: a user turn of its own right before the task. ``placeholder_id`` only
    fills the span (its embeddings are replaced); any id works because the span is known by position.
    """
    if n_latents < 1:
        raise ValueError(f"n_latents must be ≥ 1 for a latent prompt, got {n_latents}")
    probe = _with_context(messages, placement, text=SENTINEL)
    text = render_text(tokenizer, probe, tools)
    if text.count(SENTINEL) != 1:
        raise ValueError("the chat template rendered the latent-span sentinel "
                         f"{text.count(SENTINEL)} times; expected exactly once (does the template drop user content?)")
    before, after = text.split(SENTINEL)
    ids_before = encode(tokenizer, before)
    ids = [*ids_before, *([placeholder_id] * n_latents), *encode(tokenizer, after)]
    return TeacherPrompt(ids=ids, span_start=len(ids_before), span_length=n_latents)


def plain_turns(turns: list[dict[str, Any]]) -> str:
    """Turns as ``Role: content`` lines: a transcript inside a message, without nested chat-template markers."""
    return "\n".join(f"{str(m.get('role', '')).capitalize()}: {m.get('content') or ''}" for m in turns)


def place_experiences(messages: list[dict[str, Any]], experiences: list[list[dict[str, Any]]], *,
                      placement: Placement) -> list[dict[str, Any]]:
    """The initial messages with the retrieved experiences' own turns placed as ``placement`` says.

    ``chat_turn`` plays them as earlier turns of the conversation, like the suite's worked examples (what a
    small model follows best); ``user_framing`` and ``system`` give them as a plain transcript. No
    experiences = the framing alone (the probe's control)."""
    if placement == "chat_turn":
        return _with_context(messages, placement, text="", turns=[m for turns in experiences for m in turns])
    return _with_context(messages, placement, text=TEXT_SEPARATOR.join(plain_turns(t) for t in experiences))


def experiences_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       experiences: list[list[dict[str, Any]]], *, placement: Placement) -> TeacherPrompt:
    """The text-context teacher's prompt (:func:`place_experiences`, rendered)."""
    return TeacherPrompt(ids=encode(tokenizer, render_text(tokenizer, place_experiences(messages, experiences,
                                                                                        placement=placement), tools)))


def text_context_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        context: str, *, framing_before: str = CONTEXT_BEFORE,
                        framing_after: str = CONTEXT_AFTER) -> TeacherPrompt:
    """The initial prompt with hand-written privileged ``context`` in the task's user message (SDPO, Skill-SD)."""
    modified = _with_task_message_content(messages, lambda original: f"{framing_before}{context}{framing_after}{original}")
    return TeacherPrompt(ids=encode(tokenizer, render_text(tokenizer, modified, tools)))


def system_reference_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            reference: str) -> TeacherPrompt:
    """The initial prompt with a reference solution appended to the system message (OPSD)."""
    if messages and messages[0].get("role") == "system":
        modified = [{**messages[0], "content": (messages[0].get("content") or "") + REFERENCE_SYSTEM_HEADER + reference},
                    *messages[1:]]
    else:
        modified = [{"role": "system", "content": REFERENCE_SYSTEM_HEADER.lstrip() + reference}, *messages]
    return TeacherPrompt(ids=encode(tokenizer, render_text(tokenizer, modified, tools)))


def inject_latents(token_embeds: Tensor, latents: list[Tensor | None], span_starts: list[int]) -> Tensor:
    """Replace each row's placeholder span by its latents: ``[B, T, d]`` → ``[B, T, d]``, out of place.

    ``latents[b]`` is ``[n_b, d]`` (J·K latents of row b, or None for a row without a span) and occupies
    positions ``span_starts[b] : span_starts[b] + n_b``. Rows are rebuilt with ``torch.cat`` — never an
    in-place write into the embedding output, which autograd may still need and which may alias the
    embedding table's gradient buffer.
    """
    if len(latents) != token_embeds.shape[0] or len(span_starts) != token_embeds.shape[0]:
        raise ValueError(f"inject_latents got {len(latents)} latent blocks and {len(span_starts)} span starts "
                         f"for a batch of {token_embeds.shape[0]} rows")
    rows = []
    for row, block, start in zip(token_embeds, latents, span_starts, strict=True):
        if block is None or block.shape[0] == 0:
            rows.append(row)
            continue
        end = start + block.shape[0]
        if start < 0 or end > row.shape[0]:
            raise ValueError(f"latent span [{start}, {end}) does not fit a row of {row.shape[0]} positions")
        rows.append(torch.cat([row[:start], block.to(row.dtype), row[end:]], dim=0))
    return torch.stack(rows, dim=0)
