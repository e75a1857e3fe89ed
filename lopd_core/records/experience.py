"""The experience record, the retrieval query and the retriever interface every bank implements.

An :class:`Experience` is a successful training-split episode as the experience bank keeps it
(observation-lite: long tool observations shortened). A :class:`Retriever` returns the top-k experiences
for a :class:`RetrievalQuery` under the leakage rules, which :func:`allowed` states once:

- never the current episode (``episode_id``);
- not the same task id when ``exclude_same_task`` (the default);
- only experiences created before ``before_step`` (when given);
- train split only.

The LanceDB retriever (:mod:`lopd_core.memory.retriever`) turns the same rules into a SQL prefilter; the
in-memory one (:mod:`lopd_core.memory.in_memory`) applies :func:`allowed`. Plain Python: every layer imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from lopd_core.records.trajectory import Trajectory

CONTENT_DIM = 256
"""Dimension of the near-duplicate ``content_vector`` stored with curated rows and experiences."""


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
    return query.before_step is None or exp.step < query.before_step


@dataclass(frozen=True)
class Bank:
    """The experience bank one training run retrieves from, with what it was built from.

    ``version`` is carried here once: the training loop records it in every checkpoint and refuses to resume
    with another, and it must be the version the retriever reads (checked at construction).
    """

    retriever: Retriever
    successes: list[Trajectory]
    """The trajectories the experiences came from: the y* of the composer's cold start."""
    version: int | None
    """The pinned ``experiences`` table version (None for an in-memory bank)."""
    episodes: int
    """Episodes generated to build the bank: pre-training budget."""
    source: Literal["lancedb", "in-memory"]

    def __post_init__(self) -> None:
        pinned = getattr(self.retriever, "version", None)
        if self.version is not None and pinned is not None and int(pinned) != int(self.version):
            raise ValueError(f"the bank says experiences version {self.version} but its retriever reads version {pinned}")

