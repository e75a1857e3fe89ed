"""Log-probs, micro-batches and per-rollout tensors shared by every training method.

Temperature-1 log-probs from the trainer's own forward pass at the supervised positions of a
:class:`~lopd_core.algorithms.batch.SequenceBatch` (flat, in mask order), with the adapter the caller asks
for live on the shared base; the (teacher, student) tensors of a step's micro-batches, whose gradients add up to
the step's. Not here: the losses (:mod:`lopd_core.losses`) and the method interface (:mod:`.base`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lopd_core.algorithms.batch import SequenceBatch, student_batch, teacher_batch
from lopd_core.models.policy import PolicySet, hidden_states, logprobs_at
from lopd_core.records.trajectory import Trajectory


def paired_micro_batches(policies: PolicySet, rows: list[Trajectory], prompts: list, size: int, *,
                         by_prefix: bool = False) -> tuple[list[tuple[SequenceBatch, SequenceBatch]], int]:
    """(teacher, student) batches per micro-batch of ``rows`` (teacher ``prompts[i]`` for ``rows[i]``), and the
    step's total supervised token count that every slice's loss sum is divided by. ``by_prefix``: slices
    stop at prompt-prefix groups (:func:`lopd_core.algorithms.base.step_slices`)."""
    from lopd_core.algorithms.base import step_slices

    pad, device = policies.tokenizer.pad_token_id, policies.device
    batches = [(teacher_batch(rows[part], prompts[part], pad_id=pad, device=device),
                student_batch(rows[part], pad_id=pad, device=device))
               for part in step_slices(rows, size, by_prefix=by_prefix)]
    return batches, sum(s_batch.n_tokens for _, s_batch in batches)


def rewards_tensor(trajectories: list[Trajectory], device) -> Tensor:
    return torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32, device=device)


def student_logprobs(policies: PolicySet, batch: SequenceBatch) -> Tensor:
    """The student's temperature-1 log-probs ``[N, V]`` at the supervised positions (grad as the mode allows)."""
    with policies.student() as model:
        hidden = hidden_states(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return logprobs_at(model, hidden, batch.predict_index, batch.mask)


def model_logprobs(policies: PolicySet, adapter: str | None, batch: SequenceBatch, *, inputs_embeds: Tensor | None = None) -> Tensor:
    """Log-probs ``[N, V]`` of the shared base with ``adapter`` live (None = the frozen teacher)."""
    with policies.adapter(adapter) as model:
        if inputs_embeds is None:
            hidden = hidden_states(model, input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        else:
            hidden = hidden_states(model, inputs_embeds=inputs_embeds, attention_mask=batch.attention_mask)
        return logprobs_at(model, hidden, batch.predict_index, batch.mask)


def gather_tokens(logprobs: Tensor, ids: Tensor) -> Tensor:
    """``logprobs`` ``[N, V]`` at ``ids`` ``[N]`` → ``[N]``, or at ``ids`` ``[N, M]`` → ``[N, M]``."""
    if ids.dim() == 1:
        return logprobs.gather(-1, ids[:, None])[:, 0]
    return logprobs.gather(-1, ids)


def plain_student_batch(policies: PolicySet, trajectories: list[Trajectory]) -> SequenceBatch:
    return student_batch(trajectories, pad_id=policies.tokenizer.pad_token_id, device=policies.device)
