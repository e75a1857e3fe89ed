"""A tiny randomly initialised Llama with the real SmolLM2 tokenizer and chat template.

Every fast test runs on it: real forward/backward passes, real generate, the real template and special
tokens (``<|im_end|>`` is both pad and end-of-turn, as in SmolLM2), in milliseconds. It produces noise,
not tool calls; tests that need successful trajectories build them explicitly.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from lopd_core.models.gguf import load_gguf_tokenizer

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def build_tiny_model(tokenizer, *, seed: int = 0, **overrides):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**TINY_CONFIG, **overrides},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def ensure_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Create the tiny model folder once (atomic rename, safe with concurrent test processes)."""
    if (path / "config.json").exists():
        return path
    tokenizer = load_gguf_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.partial")
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path
