"""The experience record, the retrieval query and the retriever interface every bank implements.

An :class:`Experience` is a successful training-split episode as the experience bank keeps it
(observation-lite: long tool observations shortened). A :class:`Retriever` returns the top-k experiences
for a :class:`RetrievalQuery` under the leakage rules, which :func:`allowed` states once:

- never the current episode (``episode_id``);
- not the same task id when ``exclude_same_task`` (the default);
- only experiences created before ``before_step`` (when given);
- only the task's own family when ``family`` is given;
- train split only.

The LanceDB retriever (:mod:`lopd_core.memory.retriever`) turns the same rules into a SQL prefilter; the
in-memory one (:mod:`lopd_core.memory.in_memory`) applies :func:`allowed`. Plain Python: every layer imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from lopd_core.records.trajectory import Trajectory

CONTENT_DIM = 256
"""Dimension of the near-duplicate ``content_vector`` stored with curated rows and experiences."""


def shorten_observation(text: str, *, max_chars: int) -> str:
    """``text`` if it fits in ``max_chars``, else its head and tail around an omission marker, within max_chars."""
    if max_chars < 16:
        raise ValueError(f"max_chars must be at least 16 (got {max_chars})")
    if len(text) <= max_chars:
        return text
    marker = f" …[{len(text)} chars, shortened]… "
    room = max(max_chars - len(marker), 2)
    head = (room * 2) // 3
    tail = room - head
    return text[:head] + marker + text[len(text) - tail:]


def observation_lite_messages(messages: list[dict[str, Any]], initial_messages: int, *,
                              max_chars: int) -> list[dict[str, Any]]:
    """Messages with every non-assistant message after the initial prompt (tool/env observations) shortened."""
    lite = []
    for i, msg in enumerate(messages):
        if i >= initial_messages and msg.get("role") != "assistant" and isinstance(msg.get("content"), str):
            msg = {**msg, "content": shorten_observation(msg["content"], max_chars=max_chars)}
        lite.append(msg)
    return lite


def render_observation_lite(messages_lite: list[dict[str, Any]]) -> str:
    """Plain-text rendering of an episode for the experience store (the system prompt is left out)."""
    return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in messages_lite if m.get("role") != "system")


def experience_content(messages: list[dict[str, Any]], *, instruction: str, initial_messages: int | None,
                       max_chars: int, messages_lite: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], str]:
    """What an experience keeps of an episode: its own turns, observation-lite, and their plain-text rendering."""
    lite = messages_lite or observation_lite_messages(messages, initial_messages or 0, max_chars=max_chars)
    turns = own_turns(lite, instruction=instruction, initial_messages=initial_messages)
    return turns, render_observation_lite(turns)


def own_turns(messages: list[dict[str, Any]], *, instruction: str,
              initial_messages: int | None = None) -> list[dict[str, Any]]:
    """An episode's own turns: its task request and everything after it.

    Never the system prompt, the tool documentation or the worked examples that opened the episode: those
    are the same for every task of a domain, and kept in an experience they would fill its token budget
    with text every task shares. ``initial_messages`` (the trajectory's own count of prompt messages) finds
    the request directly; without it, the last user message equal to ``instruction`` does (older records
    that stored the whole conversation); failing both, the system messages are dropped.
    """
    if initial_messages and 0 < initial_messages <= len(messages) and \
            messages[initial_messages - 1].get("role") == "user":
        return [dict(m) for m in messages[initial_messages - 1:]]
    wanted = instruction.strip()
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user" and str(messages[i].get("content") or "").strip() == wanted:
            return [dict(m) for m in messages[i:]]
    return [dict(m) for m in messages if m.get("role") != "system"]


@dataclass
class Experience:
    experience_id: str
    """The source trajectory's id."""
    episode_id: str
    task_id: str
    suite: str
    family: str
    instruction: str
    text: str
    """Observation-lite rendering of the trajectory."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Observation-lite chat messages (the composer renders them with the chat template)."""
    reward: float = 1.0
    step: int = -1
    """Training step at which the source episode was generated (-1: before training)."""
    split: str = "train"
    score: float = 0.0
    """Similarity to the query (filled at retrieval)."""


@dataclass
class RetrievalQuery:
    instruction: str
    task_id: str
    episode_id: str = ""
    before_step: int | None = None
    exclude_same_task: bool = True
    family: str = ""
    """Only experiences of this task family (empty: any family)."""


@runtime_checkable
class Retriever(Protocol):
    def retrieve(self, query: RetrievalQuery, k: int) -> list[Experience]:
        """Top-k experiences by cosine similarity that pass the leakage rules (fewer when fewer qualify)."""
        ...


def allowed(exp: Experience, query: RetrievalQuery) -> bool:
    """The leakage rules, in one place."""
    if exp.split != "train" or (query.episode_id and exp.episode_id == query.episode_id):
        return False
    if query.exclude_same_task and exp.task_id == query.task_id:
        return False
    if query.family and exp.family != query.family:
        return False
    return query.before_step is None or exp.step < query.before_step


@dataclass(frozen=True)
class Bank:
    """The experience bank one training run retrieves from, with what it was built from.

    ``version`` is carried here once: the training loop records it in every checkpoint and refuses to resume
    with another, and it must be the version the retriever reads (checked at construction).
    """

    retriever: Retriever
    successes: list[Trajectory]
    """The trajectories the experiences came from (curated: near-duplicates and capped ones left out)."""
    version: int | None
    """The pinned ``experiences`` table version (None for an in-memory bank)."""
    episodes: int
    """Episodes generated to build the bank: pre-training budget."""
    source: Literal["lancedb", "in-memory"]
    stored_successes: Callable[[str, float], list[Trajectory]] | None = None
    """``(suite, threshold)`` → every stored train-split episode of that suite with ``reward >= threshold``,
    curated or not (a LanceDB bank; read only when called): the y* of the composer's cold start under
    ``cold_start.y_star: successes``. None (an in-memory bank, which keeps every success): ``successes``."""

    def __post_init__(self) -> None:
        pinned = getattr(self.retriever, "version", None)
        if self.version is not None and pinned is not None and int(pinned) != int(self.version):
            raise ValueError(f"the bank says experiences version {self.version} but its retriever reads version {pinned}")

