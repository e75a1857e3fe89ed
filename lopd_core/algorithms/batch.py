"""Trajectories → padded tensors for the student and for any teacher, aligned token for token.

The student sees ``trajectory.token_ids`` as they were sampled. A teacher sees its own prompt (latent
span, reference text, …) followed by ``trajectory.continuation_ids()``: everything after the initial
prompt is identical, so supervised token ``i`` of the student sits at ``i − prompt_len + len(teacher
prompt)`` in the teacher's sequence. Supervised tokens are the assistant tokens (``assistant_mask == 1``);
the hidden state that predicts token ``i`` is the one at position ``i − 1``.

Every batch lays its supervised tokens out the same way, ``[B, S]`` (rollout, k-th supervised token of
that rollout), with a float ``mask``: per-token tensors of the student and of a teacher therefore align by
construction, and the flat order ``tensor[mask.bool()]`` is the same for both. Sequences are padded to the
right; attention masks come from the real lengths, never from comparing ids with the pad id (SmolLM2's pad
id ``<|im_end|>`` also ends every turn).

What it is not: no model calls, no prompt rendering (see :mod:`lopd_core.models.latent`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lopd_core.models.latent import TeacherPrompt
from lopd_core.records.trajectory import Trajectory


@dataclass
class SequenceBatch:
    input_ids: Tensor
    """``[B, T]`` right-padded token ids."""
    attention_mask: Tensor
    """``[B, T]`` 1 on real positions."""
    predict_index: Tensor
    """``[B, S]`` position whose hidden state predicts each supervised token (0 on padding)."""
    target_ids: Tensor
    """``[B, S]`` the supervised (sampled) token ids."""
    mask: Tensor
    """``[B, S]`` float, 1 on real supervised tokens."""
    behaviour_logprobs: Tensor
    """``[B, S]`` the engine's sampling log-probs of the supervised tokens (IS corrections, diagnostics)."""
    span_starts: list[int]
    span_lengths: list[int]

    @property
    def n_tokens(self) -> int:
        return int(self.mask.sum().item())

    @property
    def n_positions(self) -> int:
        return int(self.attention_mask.sum().item())

    @property
    def n_padded(self) -> int:
        """Padding positions: the forward's wasted work (``distill.sort_by_length`` keeps it small)."""
        return self.attention_mask.numel() - self.n_positions


def supervised_positions(trajectory: Trajectory) -> list[int]:
    trajectory.validate_alignment()
    return [i for i, m in enumerate(trajectory.assistant_mask) if m]


def _build(sequences: list[list[int]], supervised: list[list[int]], targets: list[list[int]],
           behaviour: list[list[float]], spans: list[tuple[int, int]], *, pad_id: int, device) -> SequenceBatch:
    b = len(sequences)
    width = max(len(s) for s in sequences)
    n_sup = max((len(p) for p in supervised), default=0)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    predict = torch.zeros((b, n_sup), dtype=torch.long)
    target = torch.full((b, n_sup), pad_id, dtype=torch.long)
    mask = torch.zeros((b, n_sup), dtype=torch.float32)
    behaviour_t = torch.zeros((b, n_sup), dtype=torch.float32)
    for row, (seq, pos, tgt, beh) in enumerate(zip(sequences, supervised, targets, behaviour, strict=True)):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[row, : len(seq)] = 1
        if pos:
            predict[row, : len(pos)] = torch.tensor(pos, dtype=torch.long) - 1
            target[row, : len(pos)] = torch.tensor(tgt, dtype=torch.long)
            mask[row, : len(pos)] = 1.0
            behaviour_t[row, : len(pos)] = torch.tensor(beh, dtype=torch.float32)
    return SequenceBatch(input_ids.to(device), attention.to(device), predict.to(device), target.to(device),
                         mask.to(device), behaviour_t.to(device), [s for s, _ in spans], [n for _, n in spans])


def student_batch(trajectories: list[Trajectory], *, pad_id: int, device) -> SequenceBatch:
    """The plain trajectories, as the student sampled them."""
    sequences, supervised, targets, behaviour = [], [], [], []
    for traj in trajectories:
        pos = supervised_positions(traj)
        if pos and pos[0] < 1:
            raise ValueError(f"trajectory {traj.trajectory_id}: token 0 is marked as generated; a prompt must precede it")
        sequences.append(list(traj.token_ids))
        supervised.append(pos)
        targets.append([traj.token_ids[i] for i in pos])
        behaviour.append([float(traj.sampling_logprobs[i]) for i in pos])
    return _build(sequences, supervised, targets, behaviour, [(0, 0)] * len(trajectories), pad_id=pad_id, device=device)


def teacher_batch(trajectories: list[Trajectory], prompts: list[TeacherPrompt], *, pad_id: int, device) -> SequenceBatch:
    """Each trajectory's continuation behind its teacher prompt; supervised positions shifted by the offset."""
    if len(prompts) != len(trajectories):
        raise ValueError(f"{len(prompts)} teacher prompts for {len(trajectories)} trajectories")
    sequences, supervised, targets, behaviour, spans = [], [], [], [], []
    for traj, prompt in zip(trajectories, prompts, strict=True):
        pos = supervised_positions(traj)
        offset = len(prompt.ids) - traj.prompt_len
        sequences.append([*prompt.ids, *traj.continuation_ids()])
        supervised.append([i + offset for i in pos])
        targets.append([traj.token_ids[i] for i in pos])
        behaviour.append([float(traj.sampling_logprobs[i]) for i in pos])
        spans.append((prompt.span_start, prompt.span_length))
    return _build(sequences, supervised, targets, behaviour, spans, pad_id=pad_id, device=device)


def to_padded(flat: Tensor, mask: Tensor) -> Tensor:
    """Scatter per-token values in flat ``mask`` order (``[N, …]``) back to ``[B, S, …]`` (zeros on padding)."""
    out = flat.new_zeros((*mask.shape, *flat.shape[1:]))
    return out.index_put((*torch.nonzero(mask.bool(), as_tuple=True),), flat)
