"""Which rollouts share a prompt prefix: order them so those that do sit together, cut micro-batches at group
boundaries (``distill.share_prefix``). Plain token lists in, indices out; no tensors, so the ordering helpers
of :mod:`lopd_core.algorithms.base` can use it without importing the forward code of
:mod:`lopd_core.algorithms.prefix`."""

from __future__ import annotations

from collections.abc import Sequence

MIN_SHARED = 64
"""Prefixes shorter than this many tokens are not worth a separate forward."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefix_groups(sequences: Sequence[Sequence[int]], *, min_length: int = MIN_SHARED) -> list[int]:
    """A group id per sequence: consecutive sequences sharing ≥ ``min_length`` leading tokens with the group's
    first one share the id (order the sequences with :func:`prefix_order` first)."""
    groups: list[int] = []
    first: Sequence[int] | None = None
    for seq in sequences:
        if first is not None and common_prefix(first, seq) >= min_length:
            groups.append(groups[-1])
        else:
            first = seq
            groups.append(groups[-1] + 1 if groups else 0)
    return groups


def prefix_order(sequences: Sequence[Sequence[int]], *, by_length: bool = True,
                 min_length: int = MIN_SHARED) -> list[int]:
    """Indices of ``sequences`` with those sharing a prompt prefix adjacent, shortest first inside a group.

    Sorting the token lists puts sequences with a common prefix next to each other (trie order); groups keep
    the order of their first member's ids, and inside a group sequences go by length (little padding)."""
    lexical = sorted(range(len(sequences)), key=lambda i: list(sequences[i]))
    groups = prefix_groups([sequences[i] for i in lexical], min_length=min_length)
    key = {i: (g, len(sequences[i]) if by_length else 0) for i, g in zip(lexical, groups, strict=True)}
    return sorted(lexical, key=lambda i: key[i])


def grouped_slices(groups: Sequence[int], size: int) -> list[slice]:
    """Consecutive slices of at most ``size`` that never cross a group boundary (``size`` 0: one slice of all,
    as ``distill.micro_batch: 0`` says)."""
    if size <= 0:
        return [slice(0, len(groups))] if groups else []
    out, start = [], 0
    for i in range(1, len(groups) + 1):
        if i == len(groups) or groups[i] != groups[start] or i - start == size:
            out.append(slice(start, i))
            start = i
    return out
