"""Rollout engines behind one interface (:class:`lopd_core.rollout.engines.base.Engine`).

``make_engine`` builds one by name: ``hf`` (transformers generate on the in-memory model; the CPU default)
or ``vllm`` (vLLM's offline engine loading ``model_path``; imported only when asked for).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lopd_core.models.loading import load_causal_lm, load_tokenizer
from lopd_core.rollout.engines.base import Engine, Generation, SamplingParams
from lopd_core.rollout.engines.hf import HFEngine
from lopd_core.rollout.engines.vllm import VLLMEngine, _is_peft

ENGINES = ("hf", "vllm")

__all__ = ["ENGINES", "Engine", "Generation", "SamplingParams", "make_engine"]


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
