"""LOPD: one training step = teacher phase → student phase → composer phase → dual step on β.

What the step really is (docs/method.md, "One training step" and "Objectives"):

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

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lopd_core import distributed, losses
from lopd_core.algorithms.base import StepInputs, by_length, skipped_metrics, usable_rollouts
from lopd_core.algorithms.batch import SequenceBatch, student_batch, teacher_batch, to_padded
from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs, rewards_tensor, student_logprobs
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.config import DistillConfig, LOPDConfig
from lopd_core.envs.base import Task
from lopd_core.metrics import Timer
from lopd_core.models.composer import ComposerPair, ComposerState, anchor_latents, compose, experience_turns
from lopd_core.models.latent import TeacherPrompt, experiences_prompt, inject_latents, latent_prompt
from lopd_core.models.policy import ENCODER, PolicySet, causal_lm_parts, hidden_states, logprobs_at
from lopd_core.records.experience import Experience, RetrievalQuery
from lopd_core.records.trajectory import Trajectory


def _scalar(value: Tensor) -> float:
    return float(value.detach())


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


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of rollouts: its teacher and student sequences and the composer's (task, experience) pairs."""

    t_batch: SequenceBatch
    s_batch: SequenceBatch
    pairs: list[ComposerPair]
    pair_rows: list[list[int]]
    rewards: Tensor
    targets: Tensor
    """The supervised token ids, flat in mask order."""
    rows: slice
    """Which of the step's rollouts these are."""
    prefix: TeacherPrefix | None = None


@dataclass
class TeacherOutput:
    """What the teacher phase leaves for the others (detached, except the reused forward's graph)."""

    topm_ids: Tensor
    topm_logprobs: Tensor
    token_logprobs: Tensor
    logprobs: Tensor | None = None
    """``[N, V]`` with the composer graph: only when the composer phase reuses this forward."""
    latents: Tensor | None = None


@dataclass(frozen=True)
class StudentOutput:
    """The pre-update student on the teacher's top-M ids and at the sampled tokens (detached)."""

    topm_logprobs: Tensor
    token_logprobs: Tensor


def teacher_prompts(lopd: LOPDConfig, tokenizer, rows: list[Trajectory], tasks: list, experiences: list[list[Experience]],
                    *, latent: bool) -> tuple[list[TeacherPrompt], list[ComposerPair], list[list[int]]]:
    """Each rollout's teacher prompt, and for latents the (task, experience) pairs the composer encodes.

    ``pair_rows[b]`` lists the indices (into the pairs) of row b's experiences, in retrieval order; their K
    latents each fill the row's J·K span. The text teacher gets the experiences' own turns instead."""
    prompts, pairs, pair_rows = [], [], []
    for traj, task, exps in zip(rows, tasks, experiences, strict=True):
        initial = traj.messages[: traj.initial_messages]
        if latent:
            prompts.append(latent_prompt(tokenizer, initial, traj.tools, n_latents=len(exps) * lopd.n_latents,
                                         placeholder_id=tokenizer.pad_token_id, placement=lopd.context_placement))
            pair_rows.append(list(range(len(pairs), len(pairs) + len(exps))))
            pairs.extend(ComposerPair(task.task_id, task.instruction, e) for e in exps)
        else:
            turns = [experience_turns(tokenizer, e, max_tokens=lopd.experience_max_tokens) for e in exps]
            prompts.append(experiences_prompt(tokenizer, initial, traj.tools, turns, placement=lopd.context_placement))
    return prompts, pairs, pair_rows


def privilege_summary(row_delta: Tensor, first_delta: Tensor, rewards: Tensor, *, success_reward: float,
                      failure_reward: float) -> dict[str, float]:
    """Per step: mean token δ on successes and on failures, and δ at the first action token of successes.

    A teacher worth distilling from raises the student's successful actions (``privilege_success`` > 0),
    most of all the first one, where a tool-use episode decides between calling a tool and answering."""
    success, failure = rewards >= success_reward, rewards < failure_reward
    nan = float("nan")
    return {"distill/privilege_success": float(row_delta[success].mean()) if success.any() else nan,
            "distill/privilege_failure": float(row_delta[failure].mean()) if failure.any() else nan,
            "distill/privilege_first_token": float(first_delta[success].mean()) if success.any() else nan,
            "distill/successes_scored": float(success.sum())}


class LOPD:
    """The LOPD method behind the :class:`~lopd_core.algorithms.base.Algorithm` interface."""

    name = "lopd"
    episodes_per_task = 1

    def __init__(self, cfg: DistillConfig, policies: PolicySet, composer: ComposerState | None):
        self.cfg, self.lopd, self.policies, self.composer = cfg, cfg.lopd, policies, composer
        self.uses_latents = self.lopd.context == "latent"
        if self.uses_latents and composer is None:
            raise ValueError("LOPD with distill.lopd.context='latent' needs a composer (cold start it first)")
        self.composer_trainable = self.uses_latents and not self.lopd.frozen_composer
        self.margin = self.lopd.margin if self.lopd.margin_form == "signed" else self.lopd.balanced_margin
        """m of the configured margin form (0 = no constraint)."""
        self.student_optimizer = make_adamw(policies.student_parameters(), lr=cfg.student_lr(), weight_decay=cfg.weight_decay)
        self.composer_optimizer = None
        if self.composer_trainable:
            self.composer_optimizer = make_adamw(composer_parameters(policies, composer), lr=self.lopd.lr_composer,
                                                 weight_decay=cfg.weight_decay)

    @property
    def beta(self) -> float:
        return self.composer.beta if self.composer is not None else self.lopd.beta_init

    # ----------------------------------------------------------------------------------------------
    def _prompts_and_pairs(self, rows: list[Trajectory], tasks, experiences: list[list[Experience]]):
        return teacher_prompts(self.lopd, self.policies.tokenizer, rows, tasks, experiences,
                               latent=self.uses_latents)

    def _teacher(self, batch, pairs, pair_rows, prefix=None) -> tuple[Tensor, Tensor | None]:
        if not self.uses_latents:
            return model_logprobs(self.policies, None, batch), None
        return latent_teacher_logprobs(self.policies, self.composer, batch, pairs, pair_rows,
                                       max_tokens=self.lopd.experience_max_tokens,
                                       micro_batch=self.lopd.encoder_micro_batch, prefix=prefix)

    def _micro_batches(self, rows, tasks, experiences, *, offset: int = 0, first_index: int = 0,
                       own: set[int] | None = None) -> list[MicroBatch]:
        """Micro-batches of ``distill.micro_batch`` rollouts, each with its own teacher and student tensors;
        ``offset`` places their rows after the step's other rows (re-scored bank successes). Only the
        micro-batches in ``own`` (indices from ``first_index``; None = all) get their teacher prefix cache:
        the others are another rank's to compute."""
        pad, device = self.policies.tokenizer.pad_token_id, self.policies.device
        size = self.cfg.micro_batch or len(rows)
        out = []
        for start in range(0, len(rows), size):
            part = slice(start, min(start + size, len(rows)))
            prompts, pairs, pair_rows = self._prompts_and_pairs(rows[part], tasks[part], experiences[part])
            t_batch = teacher_batch(rows[part], prompts, pad_id=pad, device=device)
            s_batch = student_batch(rows[part], pad_id=pad, device=device)
            computed = own is None or first_index + len(out) in own
            prefix = (teacher_prefix(self.policies, t_batch)
                      if computed and self.uses_latents and self.lopd.teacher_prefix_cache else None)
            out.append(MicroBatch(t_batch=t_batch, s_batch=s_batch, pairs=pairs, pair_rows=pair_rows,
                                  rewards=rewards_tensor(rows[part], device),
                                  targets=s_batch.target_ids[s_batch.mask.bool()],
                                  rows=slice(part.start + offset, part.stop + offset), prefix=prefix))
        return out

    def _rescored_successes(self, inputs: StepInputs, rows: list[Trajectory]):
        """Bank successes to re-score when the step has none of its own (balanced margin only).

        Their retrieval excludes their own episode and task; they enter Δ, never the KL or the student."""
        lopd = self.lopd
        if (lopd.margin_form != "balanced" or not lopd.rescore_successes or inputs.retriever is None
                or any(t.reward >= lopd.success_reward for t in rows) or not inputs.bank_successes):
            return [], [], []
        rng = random.Random(inputs.step)
        picked = rng.sample(inputs.bank_successes, min(lopd.rescore_successes, len(inputs.bank_successes)))
        queries = [RetrievalQuery(instruction=t.instruction, task_id=t.task_id, episode_id=t.episode_id,
                                  exclude_same_task=True, family=t.family if lopd.retrieval_family == "same" else "")
                   for t in picked]
        found = [inputs.retriever.retrieve(q, lopd.n_retrieved) for q in queries]
        kept = [(t, e) for t, e in zip(picked, found, strict=True) if e]
        return ([t for t, _ in kept], [Task(task_id=t.task_id, suite=t.suite, family=t.family, split=t.split, level=t.level,
                      instruction=t.instruction) for t, _ in kept],
                [e for _, e in kept])

    def step(self, inputs: StepInputs) -> dict[str, Any]:
        lopd, policies = self.lopd, self.policies
        timer = Timer()
        usable = usable_rollouts(inputs.trajectories)
        chosen = by_length([i for i in usable if inputs.retrieved[i]], inputs.trajectories, enabled=self.cfg.sort_by_length)
        metrics = skipped_metrics("distill", total=len(inputs.trajectories),
                                  errored=len(inputs.trajectories) - len(usable), without_context=len(usable) - len(chosen))
        if not chosen:
            return {**metrics, "distill/updated": 0.0, "distill/beta": self.beta}
        rows = [inputs.trajectories[i] for i in chosen]
        experiences = [inputs.retrieved[i][: lopd.n_retrieved] for i in chosen]
        # with several processes (lopd_core.distributed) every rank builds every micro-batch's tensors (the
        # step's normalisers come from all of them) and runs the forwards of its own share only
        size = self.cfg.micro_batch or len(rows)
        extra_rows, extra_tasks, extra_experiences = self._rescored_successes(inputs, rows)
        n_main = -(-len(rows) // size)
        own = set(distributed.mine(n_main + (-(-len(extra_rows) // (self.cfg.micro_batch or max(len(extra_rows), 1)))
                                             if extra_rows else 0)))
        with timer("teacher"):  # the prefix caches of the teacher prompts are built here
            batches = self._micro_batches(rows, [inputs.tasks[i] for i in chosen], experiences, own=own)
            extra = (self._micro_batches(extra_rows, extra_tasks, extra_experiences, offset=len(rows),
                                         first_index=len(batches), own=own) if extra_rows else [])
        every = [*batches, *extra]
        mine_main = [i for i in sorted(own) if i < len(batches)]
        mine_extra = [i for i in sorted(own) if i >= len(batches)]
        n_tokens = sum(b.s_batch.n_tokens for b in batches)
        # reusing the teacher forward keeps its graph through the student phase: only without micro-batches
        fused = (lopd.reuse_teacher_forward and self.composer_trainable and len(batches) == 1 and not extra
                 and not distributed.active())

        # --- teacher phase: top-M ids and log-probs at every supervised position (no grad) -------------
        with timer("teacher"):
            policies.train_mode(fused)
            teacher = [self._teacher_phase(every[i], keep_graph=fused) for i in [*mine_main, *mine_extra]]

        # --- student phase: top-M + tail reverse KL, global token mean, one optimizer step -------------
        with timer("student"):
            policies.train_mode(True)
            student, student_loss, student_grad_norm = self._student_phase(
                [batches[i] for i in mine_main], teacher, n_tokens=n_tokens, extra=[every[i] for i in mine_extra])

        # --- composer phase: KL on the same ids + β(m − Δ) + λ·anchor, one optimizer step on φ ------------
        with timer("composer"):
            composer_metrics = self._composer_phase([every[i] for i in [*mine_main, *mine_extra]], teacher, student,
                                                    n_rollouts=len(rows), every=every,
                                                    indices=[*mine_main, *mine_extra])
        policies.train_mode(False)

        # --- dual step on β (Δ̂ from the composer-phase forward, before the φ step) --------------------
        if self.composer_trainable and self.margin > 0 and composer_metrics["distill/margin_signal"]:
            self.composer.beta = losses.dual_ascent(self.composer.beta, composer_metrics["distill/dual_estimate"],
                                                    margin=self.margin, lr=lopd.dual_lr)

        tail = distributed.all_sum(sum(float((1.0 - t.topm_logprobs.exp().sum(-1)).sum())
                                       for t in teacher[: len(mine_main)])) / max(n_tokens, 1)
        seconds = timer.total()
        return {
            **metrics, **composer_metrics,
            "distill/updated": 1.0,
            "distill/kl_topk": distributed.all_sum(student_loss),
            "distill/student_grad_norm": student_grad_norm,
            "distill/beta": self.beta,
            "distill/supervised_tokens": float(n_tokens),
            "distill/teacher_tokens": float(sum(b.t_batch.n_positions for b in batches)),
            "distill/padded_positions": float(sum(b.t_batch.n_padded + b.s_batch.n_padded for b in batches)),
            "distill/teacher_tail_mass": tail,
            "distill/micro_batches": float(len(batches)),
            "distill/mean_experiences": sum(map(len, experiences)) / len(experiences),
            "distill/rescored_successes": float(len(extra_rows)),
            "distill/extra_forwards": float(2 * len(extra_rows) * (2 if self.composer_trainable else 1)),
            "distill/time_teacher_s": timer.seconds.get("teacher", 0.0),
            "distill/time_student_s": timer.seconds.get("student", 0.0),
            "distill/time_composer_s": timer.seconds.get("composer", 0.0),
            "distill/tokens_per_s": n_tokens / max(seconds, 1e-9),
        }

    def _teacher_phase(self, batch: MicroBatch, *, keep_graph: bool) -> TeacherOutput:
        """The teacher's top-M support and its log-prob of the sampled tokens (the ``[N, V]`` log-probs are
        freed unless the composer phase reuses this forward)."""
        with torch.set_grad_enabled(keep_graph):
            logprobs, latents = self._teacher(batch.t_batch, batch.pairs, batch.pair_rows, batch.prefix)
        topm_logprobs, topm_ids = logprobs.detach().topk(self.cfg.top_m, dim=-1)
        out = TeacherOutput(topm_ids=topm_ids, topm_logprobs=topm_logprobs,
                            token_logprobs=gather_tokens(logprobs.detach(), batch.targets))
        if keep_graph:
            out.logprobs, out.latents = logprobs, latents
        return out

    def _student_phase(self, batches: list[MicroBatch], teacher: list[TeacherOutput], *, n_tokens: int,
                       extra: list[MicroBatch] = ()) -> tuple[list[StudentOutput], float, float]:
        """One optimizer step on the student; returns the pre-update student outputs (of ``extra`` rows too,
        which get no loss), the loss and the grad norm."""
        outputs, total = [], 0.0
        for batch, t in zip(batches, teacher, strict=False):  # Σ (micro-batch KL sum / all tokens): the global mean
            s_lp = student_logprobs(self.policies, batch.s_batch)
            student_topm = s_lp.gather(-1, t.topm_ids)
            kl = losses.topm_tail_reverse_kl(student_topm, t.topm_logprobs, grad_to="student")
            loss = kl.sum() / n_tokens
            loss.backward()
            total += float(loss.detach())
            outputs.append(StudentOutput(topm_logprobs=student_topm.detach(),
                                         token_logprobs=gather_tokens(s_lp.detach(), batch.targets)))
            del s_lp, student_topm, kl, loss
        for batch, t in zip(extra, teacher[len(batches):], strict=True):
            with torch.no_grad():
                s_lp = student_logprobs(self.policies, batch.s_batch)
            outputs.append(StudentOutput(topm_logprobs=s_lp.gather(-1, t.topm_ids),
                                         token_logprobs=gather_tokens(s_lp, batch.targets)))
            del s_lp
        distributed.all_reduce_grads(self.policies.student_parameters())
        grad_norm = clip_and_step(self.policies.student_parameters(), self.student_optimizer, max_norm=self.cfg.grad_clip)
        return outputs, total, grad_norm

    def _composer_phase(self, batches: list[MicroBatch], teacher: list[TeacherOutput], student: list[StudentOutput],
                        *, n_rollouts: int, every: list[MicroBatch] | None = None,
                        indices: list[int] | None = None) -> dict[str, float]:
        """Per micro-batch its share of :func:`lopd_core.losses.composer_objective`, then one step on φ.

        Rows past ``n_rollouts`` are re-scored bank successes: they enter Δ only. Without a trainable composer
        (frozen φ, text context) it only measures Δ from the teacher phase. ``every`` is the step's whole list
        of micro-batches and ``indices`` the positions of ``batches`` in it (several processes: each computes
        its own share; the weights and sizes come from all of them)."""
        lopd = self.lopd
        every = batches if every is None else every
        indices = list(range(len(batches))) if indices is None else indices
        rewards = torch.cat([b.rewards for b in every])
        weights = losses.margin_weights(rewards, form=lopd.margin_form, success_reward=lopd.success_reward,
                                        failure_reward=lopd.failure_reward)
        n_anchor = sum(len(b.pairs) for b in every) * lopd.n_latents * (self.composer.compressor.spec.hidden_size
                                                                        if self.composer is not None else 0)
        gain = self.composer.compressor.spec.latent_gain if self.composer is not None else None
        anchor_scale = 1.0 / gain ** 2 if lopd.anchor_units == "embedding_rms" and gain else 1.0
        totals = dict.fromkeys(("kl", "margin", "anchor", "loss", "latent_sq"), 0.0)
        per_batch: dict[int, tuple] = {}  # index → (row means, first tokens, flat δ, flat advantages or None)
        for index, batch, t, s_out in zip(indices, batches, teacher, student, strict=True):
            mask, rescored = batch.s_batch.mask, batch.rows.start >= n_rollouts
            if not self.composer_trainable:
                delta = to_padded(losses.privilege_delta(t.token_logprobs, s_out.token_logprobs), mask)
                totals["margin"] += float(losses.privilege_margin(delta, mask, weights[batch.rows]))
            else:
                logprobs, latents = t.logprobs, t.latents
                if logprobs is None:
                    logprobs, latents = self._teacher(batch.t_batch, batch.pairs, batch.pair_rows, batch.prefix)
                kl_tokens = losses.topm_tail_reverse_kl(s_out.topm_logprobs, logprobs.gather(-1, t.topm_ids),
                                                        grad_to="teacher")
                delta = to_padded(losses.privilege_delta(gather_tokens(logprobs, batch.targets), s_out.token_logprobs),
                                  mask)
                anchor_target = None
                if lopd.anchor_weight > 0 and self.composer.has_phi0:
                    anchor_target = anchor_latents(self.policies, self.composer, batch.pairs,
                                                   max_tokens=lopd.experience_max_tokens)
                objective = losses.composer_objective(
                    to_padded(kl_tokens, mask) * (0.0 if rescored else 1.0), delta, mask, weights[batch.rows],
                    n_rollouts=n_rollouts, beta=self.beta, margin=self.margin, latents=latents,
                    anchor_latents=anchor_target, anchor_weight=lopd.anchor_weight, n_anchor_values=max(n_anchor, 1),
                    anchor_scale=anchor_scale, margin_share=0.0 if rescored else None)
                with self.policies.composer_backward(latents):
                    objective.loss.backward()
                for key in ("kl", "margin", "anchor", "loss"):
                    totals[key] += _scalar(getattr(objective, key))
                totals["latent_sq"] += float(latents.detach().pow(2).sum())
                t.logprobs = t.latents = None
                del logprobs, latents, objective
            detached = delta.detach()
            flat = (None if rescored else
                    (detached[mask.bool()].cpu(),
                     losses.outcome_advantage(batch.rewards)[:, None].expand_as(mask)[mask.bool()].cpu()))
            per_batch[index] = (losses.rollout_token_mean(detached, mask).cpu(), detached[:, 0].cpu(), flat)
        if distributed.active():
            totals = {k: distributed.all_sum(v) for k, v in totals.items()}
        per_batch = distributed.gather_by_index(per_batch)
        ordered = [per_batch[i] for i in sorted(per_batch)]
        device = rewards.device
        row_mean, row_first = [m.to(device) for m, _, _ in ordered], [f.to(device) for _, f, _ in ordered]
        flat_delta = [flat[0].to(device) for _, _, flat in ordered if flat is not None]
        flat_advantage = [flat[1].to(device) for _, _, flat in ordered if flat is not None]
        delta_hat = float(losses.token_weighted_margin(torch.cat(flat_delta), torch.cat(flat_advantage),
                                                       torch.ones(sum(len(d) for d in flat_delta), device=rewards.device)))
        out = {"distill/privilege_delta": delta_hat, "distill/margin_delta": totals["margin"],
               "distill/dual_estimate": delta_hat if lopd.margin_form == "signed" else totals["margin"],
               "distill/margin_signal": float(bool((weights != 0).any())),
               "distill/composer_updated": float(self.composer_trainable),
               **privilege_summary(torch.cat(row_mean), torch.cat(row_first), rewards,
                                   success_reward=lopd.success_reward, failure_reward=lopd.failure_reward)}
        if not self.composer_trainable:
            return out
        distributed.all_reduce_grads(composer_parameters(self.policies, self.composer))
        grad_norm = clip_and_step(composer_parameters(self.policies, self.composer), self.composer_optimizer,
                                  max_norm=self.cfg.grad_clip)
        return {**out, "distill/composer_kl": totals["kl"], "distill/anchor": totals["anchor"],
                "distill/anchor_raw": totals["anchor"] / anchor_scale,
                "distill/composer_loss": totals["loss"], "distill/composer_grad_norm": grad_norm,
                "distill/latent_rms": (totals["latent_sq"] / max(n_anchor, 1)) ** 0.5,
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
