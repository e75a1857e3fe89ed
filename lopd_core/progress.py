"""Progress of the long loops, for whoever watches: the library reports, an orchestrator listens.

The library calls :func:`report` where a unit of work ends (``"episodes"``: an episode of a rollout batch
finished; ``"distill"``: a training step done). Nothing happens unless a listener is installed for the current
context with :func:`reporting` — the Prefect flows install one that updates a progress artifact of the
running task (``flows.common.progress_artifact``). A listener must not raise: it runs inside the loop. Listeners are
context-local (a ``ContextVar``), so two tasks in two threads each hear only their own work.

What it is not: logging (the per-step lines go to the ``lopd_core`` loggers) or metrics (MLflow).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

Listener = Callable[[str, int, int], None]
"""``listener(name, done, total)``."""

_LISTENERS: ContextVar[tuple[Listener, ...]] = ContextVar("lopd_progress_listeners", default=())


def report(name: str, done: int, total: int) -> None:
    """``done`` of ``total`` units of ``name`` are finished (a no-op without a listener)."""
    for listener in _LISTENERS.get():
        listener(name, done, total)


@contextlib.contextmanager
def reporting(listener: Listener) -> Iterator[None]:
    """Call ``listener`` for every :func:`report` made in this context until the block ends."""
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield
    finally:
        _LISTENERS.reset(token)
