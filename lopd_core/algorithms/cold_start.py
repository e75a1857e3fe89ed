"""Cold start of the composer: next-token NLL of the base model's own successful trajectories y*.

What it is (docs/method.md, "Cold start of the composer"): prefix tuning through the frozen backbone.
For each y*, its J retrieved experiences are composed into latents, injected into the latent span of y*'s
own initial prompt, and the frozen base model (every adapter off) scores y*'s assistant tokens; the loss
is their NLL (global token mean). Only ψ (the encoder LoRA) and χ (the compressor) are trained, with one
AdamW and separate gradient-norm clips (official code: 30 for the compressor, 3 for the LoRA).

Leakage rule: y* is never among its own retrieved experiences (otherwise the composer learns to copy):
experiences with y*'s episode id or trajectory id are dropped after retrieval, whatever the retriever does,
and the same task id is excluded when ``distill.lopd.exclude_same_task`` is on.

The composer at the end is φ0: :func:`lopd_core.models.composer.freeze_phi0` fixes it and the anchor
latents c_φ0 are cached per (task, experience) pair as joint training meets them.

What it is not: no rollouts (y* come from the trajectories table / seed rollouts) and no file I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from lopd_core.algorithms.batch import student_batch, teacher_batch
from lopd_core.algorithms.logprobs import gather_tokens, model_logprobs
from lopd_core.algorithms.lopd import (
    latent_teacher_logprobs,
    opener_by_position,
    opener_length,
    teacher_prefix,
)
from lopd_core.config import DistillConfig
from lopd_core.metrics import Timer
from lopd_core.models.composer import ComposerPair, ComposerState
from lopd_core.models.latent import latent_prompt
from lopd_core.models.policy import ENCODER, PolicySet
from lopd_core.records.chat import encode, end_of_turn_ids, render_prompt_ids, turn_suffix_ids
from lopd_core.records.experience import Experience, RetrievalQuery, Retriever
from lopd_core.records.trajectory import Trajectory


@dataclass
class ColdStartExample:
    trajectory: Trajectory
    """y*: a successful trajectory of the base model."""
    experiences: list[Experience]
    """Its retrieved experiences (never y* itself)."""


def is_same_episode(experience: Experience, trajectory: Trajectory) -> bool:
    return experience.episode_id == trajectory.episode_id or experience.experience_id == trajectory.trajectory_id


def cold_start_examples(trajectories: list[Trajectory], retriever: Retriever, *, n_retrieved: int,
                        exclude_same_task: bool, success_threshold: float | None = None, same_family: bool = False,
                        ) -> tuple[list[ColdStartExample], dict[str, int]]:
    """Retrieve J experiences for every successful y* (y* itself excluded); also counts what was skipped.

    Success is the environment's flag, or ``reward >= success_threshold`` when a threshold is given (the
    curation thresholds, so that the cold start and the experience bank agree on what a success is).
    """
    examples, skipped = [], {"not_successful": 0, "no_experience": 0}
    for traj in trajectories:
        successful = traj.success if success_threshold is None else traj.reward >= success_threshold
        if not successful or traj.status == "error" or traj.n_generated == 0:
            skipped["not_successful"] += 1
            continue
        query = RetrievalQuery(instruction=traj.instruction, task_id=traj.task_id, episode_id=traj.episode_id,
                               exclude_same_task=exclude_same_task, family=traj.family if same_family else "")
        found = [e for e in retriever.retrieve(query, n_retrieved + 1) if not is_same_episode(e, traj)][:n_retrieved]
        if not found:
            skipped["no_experience"] += 1
            continue
        examples.append(ColdStartExample(traj, found))
    return examples, skipped


class ColdStart:
    """Trains φ = (ψ, χ) by NLL of y* with latents injected; the student and the backbone are untouched."""

    def __init__(self, cfg: DistillConfig, policies: PolicySet, composer: ComposerState):
        self.cfg, self.lopd, self.cold = cfg, cfg.lopd, cfg.lopd.cold_start
        self.policies, self.composer = policies, composer
        self.lora_params = policies.adapter_parameters(ENCODER)
        self.compressor_params = list(composer.compressor.parameters())
        self.optimizer = torch.optim.AdamW(
            [{"params": self.lora_params}, {"params": self.compressor_params}], lr=self.cold.lr,
            weight_decay=cfg.weight_decay)
        self.opener_tokens = opener_length(policies.tokenizer)

    def _weights(self, mask: torch.Tensor) -> torch.Tensor | None:
        """Per supervised token (the order of ``mask.bool()``), the loss weight: ``opener_weight`` on each row's
        first ``opener_tokens`` tokens, 1 elsewhere; None when the weight is 1 (the plain NLL)."""
        if self.cold.opener_weight == 1:
            return None
        return torch.cat([torch.where(torch.arange(int(n), device=mask.device) < self.opener_tokens,
                                      self.cold.opener_weight, 1.0) for n in mask.sum(1).tolist()])

    def _micro_batch(self, examples: list[ColdStartExample]):
        tok, k = self.policies.tokenizer, self.lopd.n_latents
        prompts, pairs, pair_rows = [], [], []
        for ex in examples:
            traj, exps = ex.trajectory, ex.experiences[: self.lopd.n_retrieved]
            if any(is_same_episode(e, traj) for e in exps):
                raise ValueError(f"cold start: trajectory {traj.trajectory_id} is among its own retrieved experiences; "
                                 "the composer would learn to copy it (filter with cold_start_examples)")
            prompts.append(latent_prompt(tok, traj.messages[: traj.initial_messages], traj.tools, n_latents=len(exps) * k,
                                         placeholder_id=tok.pad_token_id, placement=self.lopd.context_placement))
            pair_rows.append(list(range(len(pairs), len(pairs) + len(exps))))
            pairs.extend(ComposerPair(traj.task_id, traj.instruction, e) for e in exps)
        batch = teacher_batch([e.trajectory for e in examples], prompts, pad_id=tok.pad_token_id,
                              device=self.policies.device)
        return batch, pairs, pair_rows

    def validation_nll(self, examples: list[ColdStartExample]) -> dict[str, float | list[float]]:
        """On held-out y*, no grad: ``nll``, the NLL per token with their latents; ``plain``, the same tokens'
        NLL without any context (the student's prompt); ``score``, the NLL weighted as in the loss (what picks
        the composer kept; ``nll`` when ``opener_weight`` is 1); ``opener``, the mean δ (with latents − without)
        at each position of the first action's opener, where a tool call and an invented tool reply part."""
        policies, size = self.policies, self.cfg.micro_batch or len(examples)
        with_latents, plain, weighted, weights, tokens = 0.0, 0.0, 0.0, 0.0, 0
        row_deltas: list[torch.Tensor] = []
        with torch.no_grad():
            for start in range(0, len(examples), size):
                part = examples[start:start + size]
                batch, pairs, pair_rows = self._micro_batch(part)
                teacher_lp, _ = latent_teacher_logprobs(policies, self.composer, batch, pairs, pair_rows,
                                                        max_tokens=self.lopd.experience_max_tokens)
                teacher_tok = gather_tokens(teacher_lp, batch.target_ids[batch.mask.bool()])
                plain_batch = student_batch([e.trajectory for e in part], pad_id=policies.tokenizer.pad_token_id,
                                            device=policies.device)
                plain_tok = gather_tokens(model_logprobs(policies, None, plain_batch),
                                          plain_batch.target_ids[plain_batch.mask.bool()])
                w = self._weights(batch.mask)
                w = torch.ones_like(teacher_tok) if w is None else w
                with_latents -= float(teacher_tok.sum())
                plain -= float(plain_tok.sum())
                weighted -= float((w * teacher_tok).sum())
                weights += float(w.sum())
                tokens += batch.n_tokens
                row_deltas += list((teacher_tok - plain_tok).split(batch.mask.sum(1).long().tolist()))
        return {"nll": with_latents / max(tokens, 1), "plain": plain / max(tokens, 1),
                "score": weighted / max(weights, 1e-9),
                "opener": opener_by_position(row_deltas, self.opener_tokens)}

    def snapshot(self) -> dict:
        """φ's current weights (the best validation point is restored at the end)."""
        return {"lora": [p.detach().clone() for p in self.lora_params],
                "compressor": {k: v.detach().clone() for k, v in self.composer.compressor.state_dict().items()}}

    def restore(self, snapshot: dict) -> None:
        with torch.no_grad():
            for param, value in zip(self.lora_params, snapshot["lora"], strict=True):
                param.copy_(value)
        self.composer.compressor.load_state_dict(snapshot["compressor"])

    def step(self, examples: list[ColdStartExample]) -> dict[str, float]:
        policies, timer = self.policies, Timer()
        size = self.cfg.micro_batch or len(examples)
        parts = [self._micro_batch(examples[i:i + size]) for i in range(0, len(examples), size)]
        n_tokens = sum(batch.n_tokens for batch, _, _ in parts)
        nll, latent_sq, latent_values, positions = 0.0, 0.0, 0, 0
        policies.train_mode(True)
        for batch, pairs, pair_rows in parts:  # Σ over micro-batches of (their NLL sum / all tokens): the global mean
            with timer("forward"):
                prefix = teacher_prefix(policies, batch) if self.lopd.teacher_prefix_cache else None
                teacher_lp, latents = latent_teacher_logprobs(policies, self.composer, batch, pairs, pair_rows,
                                                              max_tokens=self.lopd.experience_max_tokens,
                                                              micro_batch=self.lopd.encoder_micro_batch, prefix=prefix)
                token_lp = gather_tokens(teacher_lp, batch.target_ids[batch.mask.bool()])
                if (w := self._weights(batch.mask)) is not None:
                    token_lp = w * token_lp
                loss = -token_lp.sum() / n_tokens
            with timer("backward"), policies.composer_backward(latents):
                loss.backward()
            nll += float(loss.detach())
            latent_sq += float(latents.detach().pow(2).sum())
            latent_values += latents.numel()
            positions += batch.n_positions
            del teacher_lp, latents, loss
        with timer("backward"):
            norm_compressor = float(torch.nn.utils.clip_grad_norm_(self.compressor_params, self.cold.grad_clip_compressor))
            norm_lora = float(torch.nn.utils.clip_grad_norm_(self.lora_params, self.cold.grad_clip_lora))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        policies.train_mode(False)
        return {"cold_start/nll": nll, "cold_start/grad_norm_compressor": norm_compressor,
                "cold_start/grad_norm_lora": norm_lora, "cold_start/supervised_tokens": float(n_tokens),
                "cold_start/latent_rms": (latent_sq / max(latent_values, 1)) ** 0.5,
                "cold_start/micro_batches": float(len(parts)),
                "cold_start/tokens_per_s": (n_tokens + positions) / max(timer.total(), 1e-9),
                "cold_start/time_s": timer.total()}


def validation_split(examples: list[ColdStartExample], *, fraction: float, seed: int
                     ) -> tuple[list[ColdStartExample], list[ColdStartExample]]:
    """(train, validation) by task: a task's y* are all on one side; at least one task stays for training."""
    tasks = sorted({e.trajectory.task_id for e in examples})
    n_val = min(int(round(len(tasks) * fraction)), len(tasks) - 1) if fraction > 0 else 0
    if n_val <= 0:
        return examples, []
    held = set(random.Random(seed).sample(tasks, n_val))
    return ([e for e in examples if e.trajectory.task_id not in held], [e for e in examples if e.trajectory.task_id in held])


def batches(examples: list[ColdStartExample], *, batch_size: int, steps: int, seed: int):
    """``steps`` batches drawn without replacement from a reshuffled order each pass (deterministic per seed)."""
    if not examples:
        raise ValueError("cold start has no usable example: it needs successful trajectories whose retrieval finds at "
                         "least one other experience (of the same family, with distill.lopd.retrieval_family=same); "
                         "seed more episodes into the experience bank")
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        batch = []
        while len(batch) < min(batch_size, len(examples)):
            if not order:
                order = list(range(len(examples)))
                rng.shuffle(order)
            batch.append(examples[order.pop()])
        yield batch


def trajectory_from_experience(tokenizer, experience: Experience) -> Trajectory:
    """Re-render an experience's messages into ids with an assistant mask (the way the agent loop builds them).

    Only for experiences without their sampled ids: the assistant text is re-tokenised, so the ids may differ
    from what the policy sampled (observation-lite tool responses are shortened, too).
    """

    messages = [{**m, "content": m.get("content") or ""} for m in experience.messages]
    first_assistant = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first_assistant is None or first_assistant == 0:
        raise ValueError(f"experience {experience.experience_id} has no assistant turn after a prompt; "
                         "it cannot be a cold-start target")
    prompt = render_prompt_ids(tokenizer, messages[:first_assistant])
    ids, mask = list(prompt), [0] * len(prompt)
    eot = end_of_turn_ids(tokenizer)[-1]
    k = first_assistant
    while k < len(messages):
        generated = [*encode(tokenizer, messages[k]["content"]), eot]
        j = k + 1
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        following = messages[k + 1:j]
        kwargs = {"add_generation_prompt": True} if not following and j < len(messages) else {}
        suffix = turn_suffix_ids(tokenizer, messages[:k], generated, following, None, **kwargs)
        ids += generated + suffix
        mask += [1] * len(generated) + [0] * len(suffix)
        k = j
    return Trajectory(task_id=experience.task_id, suite=experience.suite, family=experience.family, split="train",
                      level=1, instruction=experience.instruction, messages=messages, initial_messages=first_assistant,
                      tools=[], token_ids=ids, prompt_len=len(prompt), assistant_mask=mask,
                      sampling_logprobs=[0.0] * len(ids), reward=experience.reward, success=True,
                      episode_id=experience.episode_id, trajectory_id=experience.experience_id, step=experience.step)
