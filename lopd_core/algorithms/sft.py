"""Supervised fine-tuning on whole trajectories: the update of the controls that learn from demonstrations.

:func:`supervised_update` is one optimizer step of next-token NLL on every assistant token of the given
trajectories (a global token mean over micro-batches, as every method here), used by RFT (the agent's own
successes) and the capacity control (oracle transcripts). Not here: which trajectories, or when.
"""

from __future__ import annotations

import torch

from lopd_core.algorithms.base import by_length, step_slices
from lopd_core.algorithms.logprobs import gather_tokens, plain_student_batch
from lopd_core.algorithms.optim import clip_and_step
from lopd_core.algorithms.prefix import StudentForwards
from lopd_core.models.policy import PolicySet
from lopd_core.records.trajectory import Trajectory


def supervised_update(policies: PolicySet, optimizer: torch.optim.Optimizer, rows: list[Trajectory], *,
                      micro_batch: int, grad_clip: float, sort_by_length: bool = True,
                      share_prefix: bool = True) -> dict[str, float]:
    """One step of NLL on the assistant tokens of ``rows``; returns the loss (nats/token), grad norm, tokens."""
    rows = [rows[i] for i in by_length(range(len(rows)), rows, enabled=sort_by_length, by_prefix=share_prefix)]
    parts = step_slices(rows, micro_batch, by_prefix=share_prefix)
    batches = [plain_student_batch(policies, rows[part]) for part in parts]
    n_tokens = sum(b.n_tokens for b in batches)
    total = 0.0
    policies.train_mode(True)
    forwards = StudentForwards(policies, batches, share=share_prefix)
    for i, batch in enumerate(batches):
        logprobs = forwards.logprobs(i)
        loss = -gather_tokens(logprobs, batch.target_ids[batch.mask.bool()]).sum() / max(n_tokens, 1)
        loss.backward()
        total += float(loss.detach())
        del logprobs, loss
    forwards.finish()
    grad_norm = clip_and_step(policies.student_parameters(), optimizer, max_norm=grad_clip)
    policies.train_mode(False)
    return {"loss": total, "grad_norm": grad_norm, "tokens": float(n_tokens), "micro_batches": float(len(parts)),
            "padded_positions": float(sum(b.n_padded for b in batches)),
            "prefix_saved_positions": float(forwards.saved_positions)}
