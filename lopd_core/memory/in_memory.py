"""An in-memory :class:`~lopd_core.records.experience.Retriever`: bag-of-words cosine over a list.

For tests and for the torch-only paths (``benchmarks/gpu_compare.py``, ``lopd distill`` without a LanceDB
store); the pipeline's retriever is :class:`lopd_core.memory.retriever.LanceRetriever`. The leakage rules
are :func:`lopd_core.records.experience.allowed`.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from lopd_core.records.experience import Experience, RetrievalQuery, allowed


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
