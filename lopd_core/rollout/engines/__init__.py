"""Rollout engines behind one interface (:class:`lopd_core.rollout.engines.base.Engine`).

``make_engine`` builds one by name: ``hf`` (transformers generate on the in-memory model; the CPU default)
or ``vllm`` (vLLM's offline engine loading ``model_path``; imported only when asked for).

:func:`policy_engine` is what the pipeline uses: an engine that samples from the student's or the base
weights of a :class:`~lopd_core.models.policy.PolicySet`. One vLLM engine per process serves every stage
(vLLM does not free an ``LLM`` on delete, and building one takes a minute): it is created once per
(model, dtype, context length) and re-synced to the weights each use asks for.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from lopd_core.config import Config
from lopd_core.models.loading import load_causal_lm, load_tokenizer
from lopd_core.models.policy import PolicySet
from lopd_core.models.precision import on_gpu
from lopd_core.rollout.engines.base import Engine, Generation, SamplingParams
from lopd_core.rollout.engines.hf import HFEngine
from lopd_core.rollout.engines.server import ServerEngine
from lopd_core.rollout.engines.vllm import VLLMEngine, _is_peft

ENGINES = ("hf", "vllm", "vllm-server")

__all__ = ["ENGINES", "Engine", "Generation", "SamplingParams", "engine_sync", "make_engine", "policy_engine",
           "training_vllm_engine"]


def make_engine(name: str, model: Any = None, tokenizer: Any = None, *, batch_size: int = 8, dtype: str = "float32",
                device: str = "auto", model_path: str | Path | None = None, policy_version: str = "base",
                **engine_kwargs) -> Engine:
    """Build the engine ``name``.

    ``hf`` generates with ``model`` (loaded from ``model_path`` with ``dtype``/``device`` when None) and
    ``tokenizer`` (loaded from ``model_path`` when None). ``vllm`` loads the base weights from
    ``model_path`` itself (default: the folder ``model``, or its peft base, was loaded from); a peft
    ``model`` given here is synced into it at once (see
    :meth:`lopd_core.rollout.engines.vllm.VLLMEngine.update_policy`). Extra keyword arguments go to the
    engine class (e.g. ``policy_sync``, ``max_model_len``, ``enable_prompt_embeds`` for vllm).
    """
    if name == "hf":
        if model is None or tokenizer is None:
            if model_path is None:
                raise ValueError("the hf engine needs a model and tokenizer, or a model_path to load them from")

            model = model if model is not None else load_causal_lm(model_path, dtype=dtype, device=device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_path)
        return HFEngine(model, tokenizer, batch_size=batch_size, policy_version=policy_version, **engine_kwargs)
    if name == "vllm":
        if model_path is None and model is not None:  # the folder the (base of the) student was loaded from
            base = model.get_base_model() if _is_peft(model) else model
            candidate = getattr(base, "name_or_path", "") or ""
            model_path = candidate if candidate and (Path(candidate) / "config.json").exists() else None
        if model_path is None:
            raise ValueError("the vllm engine loads the base model itself: pass model_path (a Hugging Face model folder)")

        vllm_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "auto")
        engine = VLLMEngine(model_path, batch_size=batch_size, dtype=vllm_dtype, device=device,
                            policy_version=policy_version, **engine_kwargs)
        if model is not None and _is_peft(model):
            engine.update_policy(model, policy_version)
        return engine
    raise ValueError(f"unknown engine '{name}': choose one of {', '.join(ENGINES)} (rollout.engine)")


_SHARED: dict[tuple, Engine] = {}


def shared_vllm_engine(model_path: str | Path, *, dtype: str, device: str, max_model_len: int,
                       batch_size: int, policy_sync: str | None = None, eager: bool = False) -> Engine:
    """The process's vLLM engine for this model, dtype, context length, sync mode and compilation (created on
    first use; vLLM does not free an ``LLM`` on delete, so a process builds one and keeps it)."""
    key = (str(model_path), dtype, device, max_model_len, policy_sync, eager)
    if key not in _SHARED:
        vllm_dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(dtype, "auto")
        _SHARED[key] = VLLMEngine(model_path, batch_size=batch_size, dtype=vllm_dtype, device=device,
                                  max_model_len=max_model_len, policy_sync=policy_sync, enforce_eager=eager)
    engine = _SHARED[key]
    engine.batch_size = batch_size
    return engine


def engine_dtype(cfg: Config) -> str:
    """The engine's weights dtype: ``rollout.engine_dtype``, the model's (``model.dtype``) for 'model', and for
    'auto' bf16 where the device multiplies it natively, else fp32."""
    if cfg.rollout.engine_dtype == "auto":
        from lopd_core.models.precision import native_bf16

        return "bfloat16" if native_bf16(cfg.model.device) else "float32"
    return cfg.model.dtype if cfg.rollout.engine_dtype == "model" else cfg.rollout.engine_dtype


def engine_sync(cfg: Config) -> str:
    """How the vllm engine follows the student (``rollout.engine_sync``; 'auto' resolved here): adapter
    hot-loading for a LoRA student on a GPU, a weight reload for a fully fine-tuned student and on CPU."""
    if cfg.rollout.engine_sync != "auto":
        return cfg.rollout.engine_sync
    return "lora" if cfg.model.student == "lora" and on_gpu(cfg.model.device) else "weights"


def training_vllm_engine(cfg: Config, policies: PolicySet) -> Engine:
    """The process's one vLLM engine for this configuration (created on first use, then reused by bank
    seeding, evaluation and training): the base weights in ``engine_dtype``, synced the ``engine_sync`` way;
    with ``rollout.engine: vllm-server`` the client of that server (adapter sync)."""
    if cfg.rollout.engine == "vllm-server":
        key = ("server", cfg.rollout.server_url, cfg.rollout.server_adapter_dir)
        if key not in _SHARED:
            _SHARED[key] = ServerEngine(cfg.rollout.server_url, adapter_dir=cfg.rollout.server_adapter_dir,
                                        batch_size=cfg.rollout.batch_size)
        _SHARED[key].batch_size = cfg.rollout.batch_size
        return _SHARED[key]
    return shared_vllm_engine(policies.base_path, dtype=engine_dtype(cfg), device=cfg.model.device,
                              max_model_len=cfg.rollout.max_trajectory_tokens + cfg.context_allowance() + 16,
                              batch_size=cfg.rollout.batch_size, policy_sync=engine_sync(cfg),
                              eager=cfg.rollout.engine_eager)


@contextlib.contextmanager
def policy_engine(cfg: Config, policies: PolicySet, *, weights: str = "student", version: str = ""):
    """An engine sampling from the student's (``weights="student"``) or the base weights, for one use.

    ``hf`` generates with the shared model inside the matching scope; ``vllm`` is the process's shared
    engine, synced to those weights (merged LoRA deltas, or the base as it is) before it is handed out."""
    scope = policies.teacher if weights == "base" else policies.student
    with scope() as model:
        if cfg.rollout.engine == "hf":
            yield HFEngine(model, policies.tokenizer, batch_size=cfg.rollout.batch_size, policy_version=version or weights)
            return
        engine = training_vllm_engine(cfg, policies)
        if weights == "base" and getattr(engine, "holds_base", False):
            engine.policy_version = version or weights  # loaded from the base folder and never re-synced since
        elif weights == "base" and isinstance(engine, ServerEngine):
            engine.use_base()  # the server holds the base weights: requests name the base model
            engine.policy_version = version or weights
        else:
            engine.update_policy(model, version or weights)
            engine.holds_base = weights == "base"
        yield engine
