"""The retriever interface the training step uses, and a small in-memory implementation for unit tests.

The LanceDB store (:mod:`lopd_core.memory.store`) implements the same :class:`Retriever` protocol with a
pinned table version. Leakage rules every implementation applies (lopd-method.md):

- never the current episode (``exclude_episode_id``);
- not the same task id when ``exclude_same_task`` (the default);
- only experiences created before ``before_step`` (when given);
- train split only (the store never holds test-split experiences; the in-memory one checks too).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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


def _bag(text: str) -> Counter:
    return Counter(re.findall(r"[a-z0-9]+", text.lower()))


def _cosine(a: Counter, b: Counter) -> float:
    num = sum(a[t] * b[t] for t in a.keys() & b.keys())
    den = math.sqrt(sum(v * v for v in a.values())) * math.sqrt(sum(v * v for v in b.values()))
    return num / den if den else 0.0


class InMemoryRetriever:
    """Bag-of-words cosine over a list of experiences. For unit tests and tiny experiments only."""

    def __init__(self, experiences: list[Experience] | None = None):
        self.experiences: list[Experience] = list(experiences or [])

    def add(self, exp: Experience) -> None:
        self.experiences.append(exp)

    def retrieve(self, query: RetrievalQuery, k: int) -> list[Experience]:
        q = _bag(query.instruction)
        scored = []
        for exp in self.experiences:
            if allowed(exp, query):
                scored.append((_cosine(q, _bag(exp.instruction)), exp))
        scored.sort(key=lambda pair: -pair[0])
        out = []
        for score, exp in scored[:k]:
            hit = Experience(**{**exp.__dict__, "score": score})
            out.append(hit)
        return out
