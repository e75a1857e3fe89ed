"""The experience bank: LanceDB tables, embedders, curation, indexing and leakage-safe retrieval.

- :mod:`.in_memory`: a bag-of-words :class:`~lopd_core.records.experience.Retriever` over a list (tests, torch-only paths);
- :mod:`.store`: :class:`~lopd_core.memory.store.ExperienceStore` (tables, contract-checked idempotent
  upserts, versions) and :func:`~lopd_core.memory.store.store_status`;
- :mod:`.curation`: trajectories → ``curated`` with a :class:`~lopd_core.memory.curation.CurationReport`;
- :mod:`.indexing`: ``curated`` → ``experiences`` (embeddings, near-duplicates, vector index);
- :mod:`.retriever`: :class:`~lopd_core.memory.retriever.LanceRetriever` over a pinned table version;
- :mod:`.embedder`: :func:`~lopd_core.memory.embedder.make_embedder` ('minilm', 'hash', a local folder).

Nothing is imported here, so ``import lopd_core.memory`` needs neither LanceDB nor pandas.
"""
