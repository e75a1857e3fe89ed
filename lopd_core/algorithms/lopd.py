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

- ``reuse_teacher_forward`` (on): φ and the teacher weights do not change before the composer's optimizer
  step, so the teacher phase and the composer phase compute the same distribution. Each micro-batch then
  runs its teacher forward once *with* the composer graph: its detached top-M supervises the student, its
  graph gives the composer's loss right after (the same numbers, one teacher and one encoder forward fewer
  per micro-batch; one micro-batch's graph held through the student's forward). Off: the three phases run
  one after another over all micro-batches, as listed above.
- ``distill.share_prefix`` (on): rollouts sharing a prompt prefix are batched together; the student runs each
  shared prefix once per step with gradients and the frozen teacher once per run
  (:mod:`lopd_core.algorithms.prefix`).
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
from lopd_core.algorithms.base import StepInputs, by_length, skipped_metrics, step_slices, usable_rollouts
from lopd_core.algorithms.batch import SequenceBatch, student_batch, teacher_batch, to_padded
from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs, rewards_tensor
from lopd_core.algorithms.optim import clip_and_step, make_adamw
from lopd_core.algorithms.prefix import (
    FrozenPrefixCache,
    StudentForwards,
    hidden_after_prefix,
    prefix_key_values,
)
from lopd_core.config import DistillConfig, LOPDConfig
from lopd_core.envs.base import Task
from lopd_core.envs.tools import TOOL_CALL_OPEN
from lopd_core.metrics import Timer
from lopd_core.models.composer import ComposerPair, ComposerState, anchor_latents, compose, experience_turns
from lopd_core.models.latent import TeacherPrompt, experiences_prompt, inject_latents, latent_prompt
from lopd_core.models.policy import ENCODER, PolicySet, hidden_states, logprobs_at
from lopd_core.records.chat import encode
from lopd_core.records.experience import Experience, RetrievalQuery
from lopd_core.records.trajectory import Trajectory


def _scalar(value: Tensor) -> float:
    return float(value.detach())


@dataclass
class TeacherPrefix:
    """Keys/values of the teacher prompt before the earliest latent span of the batch (no grad).

    Nothing before the span depends on φ or on anything else that trains (attention is causal), so this
    part comes from the run's :class:`~lopd_core.algorithms.prefix.FrozenPrefixCache` and is reused by every
    teacher forward of the step: the composer-phase forward and its backward then run
    only from the span on. In agent prompts the system message with the tool schemas is most of the prompt.
    """

    length: int
    key_values: list[tuple[Tensor, Tensor]]


def teacher_prefix(policies: PolicySet, batch: SequenceBatch, *, min_length: int = 8,
                   cache: FrozenPrefixCache | None = None) -> TeacherPrefix | None:
    """The batch's common prefix cache, or None (no span, a very short prefix, or gradient checkpointing on).

    With ``cache`` (kept by the method for the whole run: the teacher is frozen) each distinct prompt prefix
    is computed once per run instead of once per micro-batch and step."""
    if policies.gradient_checkpointing or not batch.span_lengths or min(batch.span_lengths) == 0:
        return None
    length = min(batch.span_starts)
    if length < min_length:
        return None
    with torch.no_grad(), policies.teacher() as teacher:
        if cache is not None:
            return TeacherPrefix(length, cache.rows(teacher, batch.input_ids[:, :length]))
        return TeacherPrefix(length, prefix_key_values(teacher, batch.input_ids[:, :length]))


def latent_teacher_logprobs(policies: PolicySet, composer: ComposerState, batch: SequenceBatch,
                            pairs: list[ComposerPair], pair_rows: list[list[int]], *, max_tokens: int,
                            micro_batch: int = 0, prefix: TeacherPrefix | None = None) -> tuple[Tensor, Tensor]:
    """Teacher log-probs ``[N, V]`` with the composer's latents injected, and the latents ``[P, K, d]``.

    ``pair_rows[b]`` lists the indices (into ``pairs``) of row b's experiences, in retrieval order; their K
    latents each are concatenated into the row's J·K span. With ``prefix`` only the positions from the
    prefix on are run (the same numbers, see :class:`TeacherPrefix`).
    """
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
            hidden = hidden_after_prefix(teacher, prefix.key_values, batch.attention_mask, inputs_embeds=embeds)
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


def opener_length(tokenizer) -> int:
    """Tokens of the tool-call tag: how many first action tokens the opener δ sums."""
    return len(encode(tokenizer, TOOL_CALL_OPEN))


def opener_by_position(row_deltas: list[Tensor], opener_tokens: int) -> list[float]:
    """The mean δ at each of the first ``opener_tokens`` positions over rows (per row, its action tokens' δ);
    nan where no row is that long. One definition for the teacher probe and the cold start's validation."""
    out = []
    for i in range(opener_tokens):
        values = [float(d[i]) for d in row_deltas if len(d) > i]
        out.append(sum(values) / len(values) if values else float("nan"))
    return out


def privilege_summary(row_delta: Tensor, first_delta: Tensor, opener_delta: Tensor, rewards: Tensor, *,
                      success_reward: float, failure_reward: float) -> dict[str, float]:
    """Per step: mean token δ on successes and on failures, δ at the first action token of successes, and the
    opener δ (summed over the first action's first tokens, as many as the tool-call tag has) of successes and
    of failures.

    A teacher worth distilling from raises the student's successful actions (``privilege_success`` > 0),
    most of all the first one, where a tool-use episode decides between calling a tool and answering. The
    first token alone does not see every fork: ``<tool_call>`` and ``<tool_response>`` (the agent inventing
    the tool's reply) share their first tokens, which the opener δ covers."""
    success, failure = rewards >= success_reward, rewards < failure_reward
    nan = float("nan")
    return {"distill/privilege_success": float(row_delta[success].mean()) if success.any() else nan,
            "distill/privilege_failure": float(row_delta[failure].mean()) if failure.any() else nan,
            "distill/privilege_first_token": float(first_delta[success].mean()) if success.any() else nan,
            "distill/privilege_opener": float(opener_delta[success].mean()) if success.any() else nan,
            "distill/privilege_opener_failure": float(opener_delta[failure].mean()) if failure.any() else nan,
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
        self.teacher_prefixes = FrozenPrefixCache()
        """The frozen teacher's prompt prefixes before the latent span, kept for the whole run."""

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

    def _slices(self, rows: list[Trajectory]) -> list[slice]:
        return step_slices(rows, self.cfg.micro_batch, by_prefix=self.cfg.share_prefix) if rows else []

    def _micro_batches(self, rows, tasks, experiences, parts: list[slice], *, offset: int = 0, first_index: int = 0,
                       own: set[int] | None = None) -> list[MicroBatch]:
        """One :class:`MicroBatch` per slice of ``parts``, each with its own teacher and student tensors;
        ``offset`` places their rows after the step's other rows (re-scored bank successes). Only the
        micro-batches in ``own`` (indices from ``first_index``; None = all) get their teacher prefix cache:
        the others are another rank's to compute."""
        pad, device = self.policies.tokenizer.pad_token_id, self.policies.device
        out = []
        for part in parts:
            prompts, pairs, pair_rows = self._prompts_and_pairs(rows[part], tasks[part], experiences[part])
            t_batch = teacher_batch(rows[part], prompts, pad_id=pad, device=device)
            s_batch = student_batch(rows[part], pad_id=pad, device=device)
            computed = own is None or first_index + len(out) in own
            prefix = (teacher_prefix(self.policies, t_batch, cache=self.teacher_prefixes)
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
        chosen = by_length([i for i in usable if inputs.retrieved[i]], inputs.trajectories,
                           enabled=self.cfg.sort_by_length, by_prefix=self.cfg.share_prefix)
        metrics = skipped_metrics("distill", total=len(inputs.trajectories),
                                  errored=len(inputs.trajectories) - len(usable), without_context=len(usable) - len(chosen))
        if not chosen:
            return {**metrics, "distill/updated": 0.0, "distill/beta": self.beta}
        rows = [inputs.trajectories[i] for i in chosen]
        experiences = [inputs.retrieved[i][: lopd.n_retrieved] for i in chosen]
        # with several processes (lopd_core.distributed) every rank builds every micro-batch's tensors (the
        # step's normalisers come from all of them) and runs the forwards of its own share only
        extra_rows, extra_tasks, extra_experiences = self._rescored_successes(inputs, rows)
        main_parts = self._slices(rows)
        extra_parts = self._slices(extra_rows)
        own = set(distributed.mine(len(main_parts) + len(extra_parts)))
        with timer("teacher"):  # the prefix caches of the teacher prompts are built here
            batches = self._micro_batches(rows, [inputs.tasks[i] for i in chosen], experiences, main_parts, own=own)
            extra = (self._micro_batches(extra_rows, extra_tasks, extra_experiences, extra_parts, offset=len(rows),
                                         first_index=len(batches), own=own) if extra_rows else [])
        every = [*batches, *extra]
        mine_main = [i for i in sorted(own) if i < len(batches)]
        mine = [*mine_main, *(i for i in sorted(own) if i >= len(batches))]
        n_tokens = sum(b.s_batch.n_tokens for b in batches)
        student = _StudentPhase(self, [every[i] for i in mine], n_main=len(mine_main), n_tokens=n_tokens)
        composer = _ComposerPhase(self, every, n_rollouts=len(rows))
        # one teacher forward per micro-batch, kept with its composer graph for the composer's loss: φ and the
        # teacher's weights do not change before the composer's optimizer step
        fused = lopd.reuse_teacher_forward and self.composer_trainable
        teacher: list[TeacherOutput] = []
        if fused:
            policies.train_mode(True)
            for k, i in enumerate(mine):
                with timer("teacher"):
                    teacher.append(self._teacher_phase(every[i], keep_graph=True))
                with timer("student"):
                    s_out = student.forward(k, teacher[-1])
                with timer("composer"):
                    composer.add(i, every[i], teacher[-1], s_out)
        else:
            # --- teacher phase: top-M ids and log-probs at every supervised position (no grad) ---------
            with timer("teacher"):
                policies.train_mode(False)
                teacher = [self._teacher_phase(every[i], keep_graph=False) for i in mine]
            # --- student phase: top-M + tail reverse KL, global token mean ------------------------------
            with timer("student"):
                policies.train_mode(True)
                outputs = [student.forward(k, t) for k, t in enumerate(teacher)]
            # --- composer phase: the teacher forward again with the composer graph ---------------------
            with timer("composer"):
                for i, t, s_out in zip(mine, teacher, outputs, strict=True):
                    composer.add(i, every[i], t, s_out)
        with timer("student"):  # one optimizer step on the student
            student_loss, student_grad_norm = student.finish()
        with timer("composer"):  # KL on the same ids + β(m − Δ) + λ·anchor: one optimizer step on φ
            composer_metrics = composer.finish()
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
            "distill/prefix_saved_positions": float(student.forwards.saved_positions),
            "distill/teacher_prefix_misses": float(self.teacher_prefixes.misses),
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


class _StudentPhase:
    """The student's share of a step: per micro-batch the top-M + tail reverse KL against the teacher (a global
    token mean), backpropagated at once; :meth:`finish` takes the one optimizer step. The micro-batches past
    ``n_main`` are re-scored bank successes: their pre-update student outputs are needed, never a loss."""

    def __init__(self, method: LOPD, batches: list[MicroBatch], *, n_main: int, n_tokens: int):
        self.method, self.n_main, self.n_tokens, self.total = method, n_main, n_tokens, 0.0
        share = method.cfg.share_prefix
        self.forwards = StudentForwards(method.policies, [b.s_batch for b in batches[:n_main]], share=share)
        self.extra = StudentForwards(method.policies, [b.s_batch for b in batches[n_main:]], share=share)
        self.batches = batches

    def forward(self, k: int, t: TeacherOutput) -> StudentOutput:
        batch = self.batches[k]
        if k >= self.n_main:
            with torch.no_grad():
                s_lp = self.extra.logprobs(k - self.n_main)
            return StudentOutput(topm_logprobs=s_lp.gather(-1, t.topm_ids), token_logprobs=gather_tokens(s_lp, batch.targets))
        s_lp = self.forwards.logprobs(k)
        student_topm = s_lp.gather(-1, t.topm_ids)
        kl = losses.topm_tail_reverse_kl(student_topm, t.topm_logprobs, grad_to="student")
        loss = kl.sum() / self.n_tokens  # Σ (micro-batch KL sum / all tokens): the global mean
        loss.backward()
        self.total += float(loss.detach())
        return StudentOutput(topm_logprobs=student_topm.detach(), token_logprobs=gather_tokens(s_lp.detach(), batch.targets))

    def finish(self) -> tuple[float, float]:
        """The shared prefixes' backward, the gradient all-reduce and the optimizer step: (loss, grad norm)."""
        self.forwards.finish()
        self.extra.finish()
        policies, cfg = self.method.policies, self.method.cfg
        distributed.all_reduce_grads(policies.student_parameters())
        grad_norm = clip_and_step(policies.student_parameters(), self.method.student_optimizer, max_norm=cfg.grad_clip)
        return self.total, grad_norm


class _ComposerPhase:
    """Per micro-batch its share of :func:`lopd_core.losses.composer_objective` (:meth:`add`), then one step on
    φ (:meth:`finish`).

    Rows past ``n_rollouts`` are re-scored bank successes: they enter Δ only. Without a trainable composer
    (frozen φ, text context) it only measures Δ from the teacher phase. ``every`` is the step's whole list of
    micro-batches (several processes: each adds its own share; the weights and sizes come from all of them)."""

    def __init__(self, method: LOPD, every: list[MicroBatch], *, n_rollouts: int):
        self.method, self.n_rollouts = method, n_rollouts
        lopd, composer = method.lopd, method.composer
        self.rewards = torch.cat([b.rewards for b in every])
        self.weights = losses.margin_weights(self.rewards, form=lopd.margin_form, success_reward=lopd.success_reward,
                                             failure_reward=lopd.failure_reward)
        hidden = composer.compressor.spec.hidden_size if composer is not None else 0
        self.n_anchor = sum(len(b.pairs) for b in every) * lopd.n_latents * hidden
        gain = composer.compressor.spec.latent_gain if composer is not None else None
        self.anchor_scale = 1.0 / gain ** 2 if lopd.anchor_units == "embedding_rms" and gain else 1.0
        self.totals = dict.fromkeys(("kl", "margin", "anchor", "loss", "latent_sq"), 0.0)
        self.opener_tokens = opener_length(method.policies.tokenizer)
        self.per_batch: dict[int, tuple] = {}  # index → (row means, first tokens, openers, (flat δ, flat advantages) or None)

    def add(self, index: int, batch: MicroBatch, t: TeacherOutput, s_out: StudentOutput) -> None:
        method, lopd, totals = self.method, self.method.lopd, self.totals
        mask, rescored = batch.s_batch.mask, batch.rows.start >= self.n_rollouts
        if not method.composer_trainable:
            delta = to_padded(losses.privilege_delta(t.token_logprobs, s_out.token_logprobs), mask)
            totals["margin"] += float(losses.privilege_margin(delta, mask, self.weights[batch.rows]))
        else:
            logprobs, latents = t.logprobs, t.latents
            if logprobs is None:
                logprobs, latents = method._teacher(batch.t_batch, batch.pairs, batch.pair_rows, batch.prefix)
            kl_tokens = losses.topm_tail_reverse_kl(s_out.topm_logprobs, logprobs.gather(-1, t.topm_ids),
                                                    grad_to="teacher")
            delta = to_padded(losses.privilege_delta(gather_tokens(logprobs, batch.targets), s_out.token_logprobs), mask)
            anchor_target = None
            if lopd.anchor_weight > 0 and method.composer.has_phi0:
                anchor_target = anchor_latents(method.policies, method.composer, batch.pairs,
                                               max_tokens=lopd.experience_max_tokens)
            objective = losses.composer_objective(
                to_padded(kl_tokens, mask) * (0.0 if rescored else 1.0), delta, mask, self.weights[batch.rows],
                n_rollouts=self.n_rollouts, beta=method.beta, margin=method.margin, latents=latents,
                anchor_latents=anchor_target, anchor_weight=lopd.anchor_weight, n_anchor_values=max(self.n_anchor, 1),
                anchor_scale=self.anchor_scale, margin_share=0.0 if rescored else None)
            with method.policies.composer_backward(latents):
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
        self.per_batch[index] = (losses.rollout_token_mean(detached, mask).cpu(), detached[:, 0].cpu(),
                                 detached[:, : self.opener_tokens].sum(1).cpu(), flat)

    def finish(self) -> dict[str, float]:
        method, lopd = self.method, self.method.lopd
        totals = self.totals
        if distributed.active():
            totals = {k: distributed.all_sum(v) for k, v in totals.items()}
        per_batch = distributed.gather_by_index(self.per_batch)
        ordered = [per_batch[i] for i in sorted(per_batch)]
        device = self.rewards.device
        row_mean, row_first, row_opener = ([part[i].to(device) for part in ordered] for i in range(3))
        flat_delta = [flat[0].to(device) for *_, flat in ordered if flat is not None]
        flat_advantage = [flat[1].to(device) for *_, flat in ordered if flat is not None]
        delta_hat = float(losses.token_weighted_margin(torch.cat(flat_delta), torch.cat(flat_advantage),
                                                       torch.ones(sum(len(d) for d in flat_delta), device=device)))
        out = {"distill/privilege_delta": delta_hat, "distill/margin_delta": totals["margin"],
               "distill/dual_estimate": delta_hat if lopd.margin_form == "signed" else totals["margin"],
               "distill/margin_signal": float(bool((self.weights != 0).any())),
               "distill/composer_updated": float(method.composer_trainable),
               **privilege_summary(torch.cat(row_mean), torch.cat(row_first), torch.cat(row_opener), self.rewards,
                                   success_reward=lopd.success_reward, failure_reward=lopd.failure_reward)}
        if not method.composer_trainable:
            return out
        params = composer_parameters(method.policies, method.composer)
        distributed.all_reduce_grads(params)
        grad_norm = clip_and_step(params, method.composer_optimizer, max_norm=method.cfg.grad_clip)
        return {**out, "distill/composer_kl": totals["kl"], "distill/anchor": totals["anchor"],
                "distill/anchor_raw": totals["anchor"] / self.anchor_scale,
                "distill/composer_loss": totals["loss"], "distill/composer_grad_norm": grad_norm,
                "distill/latent_rms": (totals["latent_sq"] / max(self.n_anchor, 1)) ** 0.5,
                "distill/anchor_cache_size": float(len(method.composer.anchor_cache))}
