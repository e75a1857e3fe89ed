"""The engine interface: token ids in, sampled token ids and their sampling log-probs out.

Engines work on token ids, never on text, so that the trajectory the trainer sees is exactly what was
sampled (see :mod:`lopd_core.records.trajectory`). Chat rendering and tool parsing live in the agent
loop, not here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable


@dataclass
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 160
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation of a sequence ends after any of these ids (it is kept in the output)."""
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    """Sampling log-prob of each generated token under the engine's sampling distribution."""
    finish_reason: Literal["stop", "length"]


@runtime_checkable
class Engine(Protocol):
    name: str

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One generation per prompt (batched inside the engine)."""
        ...

    def update_policy(self, model: Any, version: str) -> None:
        """Load new student weights (a full model or a peft adapter) so the next batch is on-policy."""
        ...
