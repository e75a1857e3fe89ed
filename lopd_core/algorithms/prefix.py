"""Shared prompt prefixes: run the part of a prompt that many sequences share once, not once per sequence.

In the agent suites most of every sequence is a prompt that a whole domain shares: the system message with
the tool schemas and the worked examples are 80-90 % of a toolworld episode's tokens (522 of 583 in the
weather domain, 789 of 924 in the calendar one); the rollout's own task and turns are the rest. Attention is
causal, so the keys and values of that prefix are the same for every sequence that starts with it.

- :class:`StudentForwards` gives a step's micro-batches their student log-probs with each shared prefix
  run once per step *with* gradients: the suffix forwards attend to detached copies of the prefix's keys
  and values, their backward passes accumulate gradients on those copies, and :meth:`StudentForwards.finish`
  sends the accumulated gradient through the prefix once. The result is the same gradient as running every
  sequence whole (the same sums, in another order), at the cost of the prefix's activations held over the
  micro-batches of its group (``distill.share_prefix``).
- :class:`FrozenPrefixCache` keeps the frozen teacher's keys and values of prompt prefixes across steps
  (they depend on nothing that trains).
- Which rollouts share a prefix, and where micro-batches are cut, is :mod:`lopd_core.algorithms.grouping`.

What it is not: no losses, no adapter logic beyond "run under the caller's adapter".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lopd_core.algorithms.batch import SequenceBatch
from lopd_core.algorithms.grouping import MIN_SHARED
from lopd_core.algorithms.logprobs import student_logprobs
from lopd_core.models.policy import PolicySet, causal_lm_parts, logprobs_at

KeyValues = list[tuple[Tensor, Tensor]]


# --------------------------------------------------------------------------------------------------
# Forwards behind a prefix
def _cache_keyword(decoder) -> str:
    """``cache`` (transformers ≥ 5.x) or ``past_key_values`` (older): the decoder forward's KV-cache argument."""
    import inspect

    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def prefix_key_values(model, input_ids: Tensor) -> KeyValues:
    """Every layer's keys and values of ``input_ids`` ``[B, L]`` (all real tokens), with grad as the mode allows."""
    decoder, _ = causal_lm_parts(model)
    out = decoder(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


def hidden_after_prefix(model, key_values: KeyValues, attention_mask: Tensor, *, input_ids: Tensor | None = None,
                        inputs_embeds: Tensor | None = None) -> Tensor:
    """Last hidden states of the positions after a prefix whose keys/values are given (a fresh cache each call:
    the forward appends to it); ``attention_mask`` covers prefix and suffix."""
    from transformers import DynamicCache

    decoder, _ = causal_lm_parts(model)
    cache = DynamicCache(ddp_cache_data=key_values)
    return decoder(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=True,
                   **{_cache_keyword(decoder): cache}).last_hidden_state


def expand_rows(key_values: KeyValues, rows: int) -> KeyValues:
    return [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in key_values]


class FrozenPrefixCache:
    """Keys/values of prompt prefixes under a frozen model (the teacher), kept across steps, least recently
    used dropped past ``limit`` entries. Valid only while the weights they came from do not change."""

    def __init__(self, limit: int = 16):
        self.limit, self.entries = limit, OrderedDict()
        self.hits = self.misses = 0

    def rows(self, model, input_ids: Tensor) -> KeyValues:
        """The prefix keys/values of every row of ``input_ids`` ``[B, L]`` (rows with equal ids computed once)."""
        per_row = []
        for row in input_ids:
            key = tuple(row.tolist())
            if key in self.entries:
                self.entries.move_to_end(key)
                self.hits += 1
            else:
                with torch.no_grad():
                    self.entries[key] = prefix_key_values(model, row[None])
                self.misses += 1
                while len(self.entries) > self.limit:
                    self.entries.popitem(last=False)
            per_row.append(self.entries[key])
        if all(kv is per_row[0] for kv in per_row):
            return expand_rows(per_row[0], len(per_row))
        return [(torch.cat([kv[i][0] for kv in per_row]), torch.cat([kv[i][1] for kv in per_row]))
                for i in range(len(per_row[0]))]


# --------------------------------------------------------------------------------------------------
# The student's forwards of one step
def _row_tokens(batch: SequenceBatch, row: int) -> Tensor:
    return batch.input_ids[row, : int(batch.attention_mask[row].sum())]


def _tensor_prefix(a: Tensor, b: Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _sharable(batch: SequenceBatch) -> int:
    """How many leading positions every row of ``batch`` could take from a prefix: before every supervised
    prediction and before each row's last token, and common to all rows."""
    mask = batch.mask.bool()
    cap = int(batch.predict_index[mask].min()) if mask.any() else batch.input_ids.shape[1] - 1
    first = _row_tokens(batch, 0)
    cap = min(cap, *(len(_row_tokens(batch, r)) - 1 for r in range(batch.input_ids.shape[0])))
    return max(0, min([cap, *(_tensor_prefix(first, _row_tokens(batch, r)) for r in range(1, batch.input_ids.shape[0]))]))


def plan_prefixes(batches: Sequence[SequenceBatch], *, min_length: int = MIN_SHARED,
                  keep: float = 0.75) -> list[tuple[int, int]]:
    """``(group, prefix length)`` per micro-batch: consecutive micro-batches join a group when the prefix they
    share keeps at least ``keep`` of both the group's prefix and what the batch could share on its own."""
    groups: list[list[int]] = []
    lengths: list[int] = []
    for i, batch in enumerate(batches):
        own = _sharable(batch)
        if groups:
            ref = _row_tokens(batches[groups[-1][0]], 0)
            shared = min([lengths[-1], own, *(_tensor_prefix(ref, _row_tokens(batch, r))
                                               for r in range(batch.input_ids.shape[0]))])
            if shared >= min_length and shared >= keep * lengths[-1] and shared >= keep * own:
                groups[-1].append(i)
                lengths[-1] = shared
                continue
        groups.append([i])
        lengths.append(own)
    plan = [(0, 0)] * len(batches)
    for g, (members, length) in enumerate(zip(groups, lengths, strict=True)):
        for i in members:
            plan[i] = (g, length if length >= min_length else 0)
    return plan


@dataclass
class _GradPrefix:
    """A prefix run once: its keys/values with their graph, and the detached copies the suffixes attend to."""

    graph: KeyValues
    leaves: KeyValues

    @classmethod
    def run(cls, model, input_ids: Tensor) -> _GradPrefix:
        graph = prefix_key_values(model, input_ids)
        if not torch.is_grad_enabled() or not graph[0][0].requires_grad:
            return cls(graph=[], leaves=[(k.detach(), v.detach()) for k, v in graph])
        return cls(graph=graph, leaves=[(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in graph])

    def backward(self) -> None:
        """Send the gradient the suffixes left on the copies through the prefix (once)."""
        outputs, grads = [], []
        for pair, leaf_pair in zip(self.graph, self.leaves if self.graph else [], strict=True):
            for out, leaf in zip(pair, leaf_pair, strict=True):
                if leaf.grad is not None:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)
        self.graph, self.leaves = [], []


class StudentForwards:
    """The student's log-probs ``[N, V]`` of a step's micro-batches, each shared prompt prefix run once.

    Call :meth:`logprobs` for the micro-batches in order, backpropagating each one's loss before asking for
    the next, then :meth:`finish` before the optimizer step (it sends the prefixes' accumulated gradient
    through them). Without gradients (or with ``share=False``, or under gradient checkpointing, whose
    recomputation does not follow a cache) every micro-batch runs whole, as :func:`student_logprobs` does.
    """

    def __init__(self, policies: PolicySet, batches: Sequence[SequenceBatch], *, share: bool = True,
                 min_length: int = MIN_SHARED):
        self.policies, self.batches = policies, list(batches)
        enabled = share and not policies.gradient_checkpointing
        self.plan = plan_prefixes(self.batches, min_length=min_length) if enabled else [(i, 0) for i in range(len(batches))]
        self._group: int | None = None
        self._prefix: _GradPrefix | None = None
        self.prefix_positions = 0
        """Positions run as shared prefixes (once each), for the metrics."""
        self.saved_positions = 0
        """Positions that did not run again because a prefix was shared."""

    def logprobs(self, index: int) -> Tensor:
        group, length = self.plan[index]
        batch = self.batches[index]
        if length == 0:
            self._flush()
            return student_logprobs(self.policies, batch)
        with self.policies.student() as model:
            if group != self._group:
                self._flush()
                self._prefix = _GradPrefix.run(model, batch.input_ids[:1, :length])
                self._group = group
                self.prefix_positions += length
                self.saved_positions -= length
            self.saved_positions += length * batch.input_ids.shape[0]
            hidden = hidden_after_prefix(model, expand_rows(self._prefix.leaves, batch.input_ids.shape[0]),
                                         batch.attention_mask, input_ids=batch.input_ids[:, length:])
            return logprobs_at(model, hidden, (batch.predict_index - length).clamp(min=0), batch.mask)

    def finish(self) -> None:
        """Backpropagate the pending prefix (call after the last micro-batch's ``loss.backward()``)."""
        self._flush()

    def _flush(self) -> None:
        if self._prefix is not None:
            self._prefix.backward()
        self._prefix, self._group = None, None
