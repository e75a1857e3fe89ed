"""LOPD: one training step = teacher phase → student phase → composer phase → dual step on β.

What the step really is (lopd-method.md, "One training step" and "Objectives"):

1. Teacher phase (no grad): the frozen base with the current composer's J·K latents injected into the
   task's user message scores every supervised token; keep its top-M ids and log-probs (M = distill.top_m).
2. Student phase: the student on the plain trajectory; loss = top-M + tail reverse KL(p̃^S ‖ p̃^T) summed
   over supervised tokens / supervised tokens in the batch (global token mean); the teacher is a constant;
   one AdamW step (clip 1.0). The pre-update student's top-M and sampled-token log-probs are kept, detached.
3. Composer phase: the teacher forward again, now with gradients through the latents into χ and the
   encoder LoRA ψ; re-gather the teacher's log-probs on the same top-M ids; loss = per-rollout token mean
   of KL(p̃^S_old ‖ p̃^T), mean over rollouts, + β·(m − Δ) + λ·mean((c_φ − c_φ0)²); one AdamW step on φ.
4. Dual step: β ← max(0, β + η·(m − Δ̂)) with Δ̂ token-weighted, from the composer-phase forward.

Rollouts without a retrieved experience and errored rollouts get no loss (counted in the metrics).

Deviations and options (all in ``distill.lopd``):

- ``reuse_teacher_forward``: φ and the teacher weights do not change during the student phase, so the
  teacher phase and the composer phase compute the same distribution. With this flag the teacher phase
  runs once *with* the composer graph and the composer phase reuses it (the same numbers, one teacher and
  one encoder forward fewer per step, more peak memory); off by default.
- ``margin = 0`` disables the constraint (β stays at β₀, no margin term): the paper's "no margin" ablation.
- ``frozen_composer``: φ stays φ0; steps 3–4 only measure Δ. ``context = 'text'``: the retrieved
  trajectories are given to the teacher as text in the same place; there is no composer to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lopd_core import losses
from lopd_core.algorithms.base import (
    StepInputs,
    Timer,
    clip_and_step,
    gather_tokens,
    make_adamw,
    model_logprobs,
    rewards_tensor,
    skipped_metrics,
    student_logprobs,
    usable_rollouts,
)
from lopd_core.algorithms.batch import SequenceBatch, student_batch, teacher_batch, to_padded
from lopd_core.models.composer import (
    ComposerPair,
    ComposerState,
    anchor_latents,
    compose,
    experience_trajectory_text,
)
from lopd_core.models.latent import TEXT_SEPARATOR, inject_latents, latent_prompt, text_context_prompt
from lopd_core.models.policy import ENCODER, PolicySet, causal_lm_parts, hidden_states, logprobs_at
from lopd_core.records.chat import encode
from lopd_core.records.experience import Experience
from lopd_core.records.trajectory import Trajectory


def _scalar(value: Tensor) -> float:
    return float(value.detach())


def truncated_experience_text(tokenizer, experience: Experience, *, max_tokens: int) -> str:
    ids = encode(tokenizer, experience_trajectory_text(tokenizer, experience))
    return tokenizer.decode(ids[:max_tokens])


@dataclass
class TeacherPrefix:
    """Keys/values of the teacher prompt before the earliest latent span of the batch (no grad).

    Nothing before the span depends on φ (attention is causal), so this part is computed once per batch
    and reused by every teacher forward of the step: the composer-phase forward and its backward then run
    only from the span on. In agent prompts the system message with the tool schemas is most of the prompt.
    """

    length: int
    key_values: list[tuple[Tensor, Tensor]]


def _cache_keyword(decoder) -> str:
    """``cache`` (transformers ≥ 5.x) or ``past_key_values`` (older): the decoder forward's KV-cache argument."""
    import inspect

    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def teacher_prefix(policies: PolicySet, batch: SequenceBatch, *, min_length: int = 8) -> TeacherPrefix | None:
    """The batch's common prefix cache, or None (no span, a very short prefix, or gradient checkpointing on)."""
    if policies.gradient_checkpointing or not batch.span_lengths or min(batch.span_lengths) == 0:
        return None
    length = min(batch.span_starts)
    if length < min_length:
        return None
    with torch.no_grad(), policies.teacher() as teacher:
        decoder, _ = causal_lm_parts(teacher)
        out = decoder(input_ids=batch.input_ids[:, :length], attention_mask=batch.attention_mask[:, :length],
                      use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return TeacherPrefix(length, [(layer.keys, layer.values) for layer in cache.layers])


def latent_teacher_logprobs(policies: PolicySet, composer: ComposerState, batch: SequenceBatch,
                            pairs: list[ComposerPair], pair_rows: list[list[int]], *, max_tokens: int,
                            micro_batch: int = 0, prefix: TeacherPrefix | None = None) -> tuple[Tensor, Tensor]:
    """Teacher log-probs ``[N, V]`` with the composer's latents injected, and the latents ``[P, K, d]``.

    ``pair_rows[b]`` lists the indices (into ``pairs``) of row b's experiences, in retrieval order; their K
    latents each are concatenated into the row's J·K span. With ``prefix`` only the positions from the
    prefix on are run (the same numbers, see :class:`TeacherPrefix`).
    """
    from transformers import DynamicCache

    latents = compose(policies, composer.compressor, pairs, adapter=ENCODER, max_tokens=max_tokens,
                      micro_batch=micro_batch)
    d = latents.shape[-1]
    per_row = [latents[idx].reshape(-1, d) for idx in pair_rows]
    offset = prefix.length if prefix is not None else 0
    with policies.teacher() as teacher:
        embeds = teacher.get_input_embeddings()(batch.input_ids[:, offset:])
        embeds = inject_latents(embeds, per_row, [start - offset for start in batch.span_starts])
        if prefix is None:
            hidden = hidden_states(teacher, inputs_embeds=embeds, attention_mask=batch.attention_mask)
        else:
            decoder, _ = causal_lm_parts(teacher)
            cache = DynamicCache(ddp_cache_data=prefix.key_values)  # a fresh cache: the forward appends to it
            hidden = decoder(inputs_embeds=embeds, attention_mask=batch.attention_mask, use_cache=True,
                             **{_cache_keyword(decoder): cache}).last_hidden_state
        return logprobs_at(teacher, hidden, batch.predict_index - offset, batch.mask), latents


def composer_parameters(policies: PolicySet, composer: ComposerState) -> list[torch.nn.Parameter]:
    return [*policies.adapter_parameters(ENCODER), *composer.compressor.parameters()]


@dataclass
class _Chunk:
    """One micro-batch of rollouts and what each phase leaves for the next (all detached, except ``teacher_lp``
    and ``latents`` when the teacher forward is reused)."""

    t_batch: SequenceBatch
    s_batch: SequenceBatch
    pairs: list[ComposerPair]
    pair_rows: list[list[int]]
    rewards: Tensor
    targets: Tensor
    prefix: TeacherPrefix | None = None
    teacher_topm_logprobs: Tensor | None = None
    teacher_topm_ids: Tensor | None = None
    teacher_token_lp: Tensor | None = None
    teacher_lp: Tensor | None = None
    latents: Tensor | None = None
    student_topm_old: Tensor | None = None
    student_token_old: Tensor | None = None


class LOPD:
    """The LOPD method behind the :class:`~lopd_core.algorithms.base.Algorithm` interface."""

    name = "lopd"
    episodes_per_task = 1

    def __init__(self, cfg, policies: PolicySet, composer: ComposerState | None):
        self.cfg, self.lopd, self.policies, self.composer = cfg, cfg.lopd, policies, composer
        self.uses_latents = self.lopd.context == "latent"
        if self.uses_latents and composer is None:
            raise ValueError("LOPD with distill.lopd.context='latent' needs a composer (cold start it first)")
        self.composer_trainable = self.uses_latents and not self.lopd.frozen_composer
        self.student_optimizer = make_adamw(policies.student_parameters(), lr=cfg.lr_student, weight_decay=cfg.weight_decay)
        self.composer_optimizer = None
        if self.composer_trainable:
            self.composer_optimizer = make_adamw(composer_parameters(policies, composer), lr=self.lopd.lr_composer,
                                                 weight_decay=cfg.weight_decay)

    @property
    def beta(self) -> float:
        return self.composer.beta if self.composer is not None else self.lopd.beta_init

    # ----------------------------------------------------------------------------------------------
    def _prompts_and_pairs(self, rows: list[Trajectory], tasks, experiences: list[list[Experience]]):
        tok, k = self.policies.tokenizer, self.lopd.n_latents
        prompts, pairs, pair_rows = [], [], []
        for traj, task, exps in zip(rows, tasks, experiences, strict=True):
            initial = traj.messages[: traj.initial_messages]
            if self.uses_latents:
                prompts.append(latent_prompt(tok, initial, traj.tools, n_latents=len(exps) * k,
                                             placeholder_id=tok.pad_token_id))
                pair_rows.append(list(range(len(pairs), len(pairs) + len(exps))))
                pairs.extend(ComposerPair(task.task_id, task.instruction, e) for e in exps)
            else:
                text = TEXT_SEPARATOR.join(truncated_experience_text(tok, e, max_tokens=self.lopd.experience_max_tokens)
                                           for e in exps)
                prompts.append(text_context_prompt(tok, initial, traj.tools, text))
        return prompts, pairs, pair_rows

    def _teacher(self, batch, pairs, pair_rows, prefix=None) -> tuple[Tensor, Tensor | None]:
        if not self.uses_latents:
            return model_logprobs(self.policies, None, batch), None
        return latent_teacher_logprobs(self.policies, self.composer, batch, pairs, pair_rows,
                                       max_tokens=self.lopd.experience_max_tokens,
                                       micro_batch=self.lopd.encoder_micro_batch, prefix=prefix)

    def _chunks(self, rows, tasks, experiences) -> list[_Chunk]:
        """Micro-batches of ``distill.micro_batch`` rollouts, each with its own teacher and student tensors."""
        pad, device = self.policies.tokenizer.pad_token_id, self.policies.device
        size = self.cfg.micro_batch or len(rows)
        chunks = []
        for start in range(0, len(rows), size):
            part = slice(start, start + size)
            prompts, pairs, pair_rows = self._prompts_and_pairs(rows[part], tasks[part], experiences[part])
            t_batch = teacher_batch(rows[part], prompts, pad_id=pad, device=device)
            s_batch = student_batch(rows[part], pad_id=pad, device=device)
            chunks.append(_Chunk(t_batch=t_batch, s_batch=s_batch, pairs=pairs, pair_rows=pair_rows,
                                 rewards=rewards_tensor(rows[part], device),
                                 targets=s_batch.target_ids[s_batch.mask.bool()]))
        return chunks

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        cfg, lopd, policies = self.cfg, self.lopd, self.policies
        timer = Timer()
        usable = usable_rollouts(inputs.trajectories)
        chosen = [i for i in usable if inputs.retrieved[i]]
        metrics = skipped_metrics("distill", total=len(inputs.trajectories),
                                  errored=len(inputs.trajectories) - len(usable), without_context=len(usable) - len(chosen))
        if not chosen:
            return {**metrics, "distill/updated": 0.0, "distill/beta": self.beta}
        rows = [inputs.trajectories[i] for i in chosen]
        experiences = [inputs.retrieved[i][: lopd.n_retrieved] for i in chosen]
        chunks = self._chunks(rows, [inputs.tasks[i] for i in chosen], experiences)
        n_tokens = sum(c.s_batch.n_tokens for c in chunks)
        # reusing the teacher forward keeps its graph through the student phase: only without micro-batches
        fused = lopd.reuse_teacher_forward and self.composer_trainable and len(chunks) == 1

        # --- teacher phase: top-M ids and log-probs at every supervised position (no grad) -------------
        with timer("teacher"):
            policies.train_mode(fused)
            for c in chunks:
                c.prefix = teacher_prefix(policies, c.t_batch) if self.uses_latents and lopd.teacher_prefix_cache else None
                with torch.set_grad_enabled(fused):
                    teacher_lp, latents = self._teacher(c.t_batch, c.pairs, c.pair_rows, c.prefix)
                c.teacher_topm_logprobs, c.teacher_topm_ids = teacher_lp.detach().topk(cfg.top_m, dim=-1)
                c.teacher_token_lp = gather_tokens(teacher_lp.detach(), c.targets)
                if fused:  # otherwise only the top-M survives the teacher phase; the [N, V] log-probs are freed
                    c.teacher_lp, c.latents = teacher_lp, latents
                del teacher_lp, latents

        # --- student phase: top-M + tail reverse KL, global token mean, one optimizer step -------------
        with timer("student"):
            policies.train_mode(True)
            student_loss = 0.0
            for c in chunks:  # Σ over micro-batches of (their KL sum / all supervised tokens): the global mean
                s_lp = student_logprobs(policies, c.s_batch)
                student_topm = s_lp.gather(-1, c.teacher_topm_ids)
                kl = losses.topm_tail_reverse_kl(student_topm, c.teacher_topm_logprobs, grad_to="student")
                loss = kl.sum() / n_tokens
                loss.backward()
                student_loss += float(loss.detach())
                c.student_topm_old = student_topm.detach()
                c.student_token_old = gather_tokens(s_lp.detach(), c.targets)
                del s_lp, student_topm, kl, loss
            student_grad_norm = clip_and_step(policies.student_parameters(), self.student_optimizer, max_norm=cfg.grad_clip)

        # --- composer phase: KL on the same ids + β(m − Δ) + λ·anchor, one optimizer step on φ ------------
        with timer("composer"):
            composer_metrics = self._composer_phase(chunks, n_rollouts=len(rows), fused=fused)
        policies.train_mode(False)

        # --- dual step on β (Δ̂ from the composer-phase forward, before the φ step) --------------------
        if self.composer_trainable and lopd.margin > 0:
            self.composer.beta = losses.dual_ascent(self.composer.beta, composer_metrics["distill/privilege_delta"],
                                                    margin=lopd.margin, lr=lopd.dual_lr)

        tail = sum(float((1.0 - c.teacher_topm_logprobs.exp().sum(-1)).sum()) for c in chunks) / max(n_tokens, 1)
        seconds = timer.total()
        return {
            **metrics, **composer_metrics,
            "distill/updated": 1.0,
            "distill/kl_topk": student_loss,
            "distill/student_grad_norm": student_grad_norm,
            "distill/beta": self.beta,
            "distill/supervised_tokens": float(n_tokens),
            "distill/teacher_tokens": float(sum(c.t_batch.n_positions for c in chunks)),
            "distill/teacher_tail_mass": tail,
            "distill/micro_batches": float(len(chunks)),
            "distill/mean_experiences": sum(map(len, experiences)) / len(experiences),
            "distill/time_teacher_s": timer.seconds.get("teacher", 0.0),
            "distill/time_student_s": timer.seconds.get("student", 0.0),
            "distill/time_composer_s": timer.seconds.get("composer", 0.0),
            "distill/tokens_per_s": n_tokens / max(seconds, 1e-9),
        }

    def _composer_phase(self, chunks: list[_Chunk], *, n_rollouts: int, fused: bool) -> dict[str, float]:
        """Per micro-batch: its share of the composer loss (each term is a sum over rollouts / all rollouts)."""
        lopd, beta = self.lopd, self.beta
        n_latent_values = sum(len(c.pairs) for c in chunks) * lopd.n_latents * (self.composer.compressor.spec.hidden_size
                                                                            if self.composer is not None else 0)
        totals = dict.fromkeys(("kl", "margin", "anchor", "loss", "weighted", "tokens", "latent_sq"), 0.0)
        for c in chunks:
            mask, advantage = c.s_batch.mask, losses.outcome_advantage(c.rewards)[:, None]
            if not self.composer_trainable:  # frozen composer / text context: measure Δ, train nothing
                delta = to_padded(losses.privilege_delta(c.teacher_token_lp, c.student_token_old), mask)
            else:
                teacher_lp, latents = c.teacher_lp, c.latents
                if not fused:
                    teacher_lp, latents = self._teacher(c.t_batch, c.pairs, c.pair_rows, c.prefix)
                teacher_topm = teacher_lp.gather(-1, c.teacher_topm_ids)
                kl_tokens = losses.topm_tail_reverse_kl(c.student_topm_old, teacher_topm, grad_to="teacher")
                composer_kl = losses.rollout_token_mean(to_padded(kl_tokens, mask), mask).sum() / n_rollouts
                delta = to_padded(losses.privilege_delta(gather_tokens(teacher_lp, c.targets), c.student_token_old), mask)
                margin_part = losses.rollout_token_mean(delta * advantage, mask).sum() / n_rollouts
                loss = composer_kl
                if lopd.margin > 0:
                    loss = loss + beta * (lopd.margin * mask.shape[0] / n_rollouts - margin_part)
                anchor = torch.zeros((), device=loss.device)
                if lopd.anchor_weight > 0 and self.composer.has_phi0:
                    anchor_target = anchor_latents(self.policies, self.composer, c.pairs, max_tokens=lopd.experience_max_tokens)
                    anchor = (latents - anchor_target.detach()).pow(2).sum() / n_latent_values
                    loss = loss + lopd.anchor_weight * anchor
                with self.policies.composer_backward(latents):
                    loss.backward()
                totals["kl"] += _scalar(composer_kl)
                totals["anchor"] += _scalar(anchor)
                totals["loss"] += _scalar(loss)
                totals["latent_sq"] += float(latents.detach().pow(2).sum())
                c.teacher_lp = c.latents = None
                del teacher_lp, latents, loss
            totals["margin"] += float(losses.rollout_token_mean(delta.detach() * advantage, mask).sum()) / n_rollouts
            totals["weighted"] += float((delta.detach() * advantage * mask).sum())
            totals["tokens"] += float(mask.sum())
        out = {"distill/privilege_delta": totals["weighted"] / max(totals["tokens"], 1.0),
               "distill/margin_delta": totals["margin"], "distill/composer_updated": float(self.composer_trainable)}
        if not self.composer_trainable:
            return out
        grad_norm = clip_and_step(composer_parameters(self.policies, self.composer), self.composer_optimizer,
                                  max_norm=self.cfg.grad_clip)
        return {**out, "distill/composer_kl": totals["kl"], "distill/anchor": totals["anchor"],
                "distill/composer_loss": totals["loss"], "distill/composer_grad_norm": grad_norm,
                "distill/latent_rms": (totals["latent_sq"] / max(n_latent_values, 1)) ** 0.5,
                "distill/anchor_cache_size": float(len(self.composer.anchor_cache))}

    # ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"student_optimizer": self.student_optimizer.state_dict(), "beta": self.beta}
        if self.composer_optimizer is not None:
            state["composer_optimizer"] = self.composer_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.student_optimizer.load_state_dict(state["student_optimizer"])
        if self.composer_optimizer is not None and "composer_optimizer" in state:
            self.composer_optimizer.load_state_dict(state["composer_optimizer"])
        if self.composer is not None:
            self.composer.beta = float(state["beta"])
