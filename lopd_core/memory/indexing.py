"""Indexing: curated rows → the ``experiences`` table (embedding, near-duplicate removal, vector index).

:func:`index_store` makes the ``experiences`` rows of a scope (cycle ids, or all) mirror the ``curated``
rows of that scope:

- a curated row that is new, changed, or was embedded by another embedder / embed field is (re-)embedded —
  unchanged rows are not embedded again, so re-indexing costs a read and writes no table version;
- **near-duplicates at insert time**: before embedding, each row's ``content_vector`` is compared with every
  experience that stays in the table and with the rows of this batch inserted before it (oldest first);
  cosine ≥ ``curation.dedupe_threshold`` means it is not inserted (and is removed if it was there). The
  pairs are reported in :class:`IndexResult.near_duplicates`, nothing is dropped silently;
- experiences whose curated row disappeared from the scope are deleted;
- the rows are checked against :class:`data_contracts.IndexedExperienceSchema` on the way in;
- finally :func:`~lopd_core.memory.retriever.ensure_vector_index` builds or refreshes the ANN index.

What is embedded: ``index.embed_field='task'`` → the instruction (the official code); ``'task_and_trajectory'``
→ instruction + observation-lite trajectory (the paper). The query side always embeds the instruction.

A table never mixes embedders: indexing with a different ``index.embedder`` than the table's fails with a
message naming ``--rebuild``, which re-embeds every row (same dimension: as new versions of the same table,
so pinned versions stay readable; another dimension: the table is dropped and recreated, and its old
versions are gone — the message says so).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lopd_core.memory.sql import sql_in
from lopd_core.memory.store import content_hash

if TYPE_CHECKING:
    import pandas as pd

    from lopd_core.memory.store import ExperienceStore


@dataclass
class IndexResult:
    experiences_version: int
    """The ``experiences`` version after indexing: what a training run should pin."""
    embedder: str
    n_curated: int = 0
    n_embedded: int = 0
    n_inserted: int = 0
    n_updated: int = 0
    n_unchanged: int = 0
    n_deleted: int = 0
    n_quarantined: int = 0
    near_duplicates: list[dict[str, Any]] = field(default_factory=list)
    vector_index: dict[str, Any] = field(default_factory=dict)
    embed_seconds: float = 0.0
    total_seconds: float = 0.0
    rebuilt: bool = False

    @property
    def experiences_per_second(self) -> float:
        return self.n_embedded / self.total_seconds if self.total_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "experiences_per_second": self.experiences_per_second}


def embed_text(row: dict[str, Any], embed_field: str) -> str:
    if embed_field == "task":
        return row["instruction"]
    return f"Task to solve:\n{row['instruction']}\n\nReference past trajectory:\n{row['text']}"


def _table_embedding(store: ExperienceStore) -> tuple[str, int] | None:
    if not store.has_table("experiences"):
        return None
    table = store.db.open_table("experiences")
    first = table.search().select(["embedder"]).limit(1).to_list()
    return (first[0]["embedder"] if first else "", table.schema.field("vector").type.list_size)


def _check_embedder(store: ExperienceStore, embedder, *, rebuild: bool) -> bool:
    """True when the table must be dropped (rebuild with another dimension)."""
    found = _table_embedding(store)
    if found is None:
        return False
    name, dim = found
    if dim != embedder.dim:
        if not rebuild:
            raise ValueError(
                f"the experiences table holds {dim}-d vectors ({name or 'empty'}) but index.embedder "
                f"'{store.embedder_name}' makes {embedder.dim}-d ones; run `lopd memory index --rebuild` to re-embed "
                "(the table is recreated and its earlier versions are dropped), or point workspace.lance_uri elsewhere"
            )
        return True
    if name and name != embedder.name and not rebuild:
        raise ValueError(
            f"the experiences table was embedded with '{name}', index.embedder is '{store.embedder_name}' "
            f"({embedder.name}); a table never mixes embedders: run `lopd memory index --rebuild` to re-embed it"
        )
    return False


def _anchor_vectors(store: ExperienceStore, exclude: set[str]) -> tuple[list[str], np.ndarray]:
    frame = store.read("experiences", columns=["experience_id", "content_vector"])
    keep = ~frame["experience_id"].isin(exclude)
    ids = frame.loc[keep, "experience_id"].tolist()
    vectors = np.stack([np.asarray(v, dtype=np.float32) for v in frame.loc[keep, "content_vector"]]) if ids else None
    return ids, vectors if vectors is not None else np.zeros((0, 1), dtype=np.float32)


def near_duplicates(rows: list[dict[str, Any]], anchor_ids: list[str], anchors: np.ndarray, *,
                    threshold: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``rows`` (oldest first) into (kept, duplicate records) by content-vector cosine ≥ ``threshold``."""
    dim = anchors.shape[1] if len(anchor_ids) else (len(rows[0]["content_vector"]) if rows else 1)
    kept_ids = list(anchor_ids)
    kept = np.zeros((len(anchor_ids) + len(rows), dim), dtype=np.float32)
    kept[:len(anchor_ids)] = anchors if len(anchor_ids) else kept[:0]
    n = len(anchor_ids)
    survivors, dups = [], []
    for row in rows:
        vec = np.asarray(row["content_vector"], dtype=np.float32)
        sims = kept[:n] @ vec if n else np.zeros(0)
        best = int(np.argmax(sims)) if n else -1
        if n and sims[best] >= threshold:
            dups.append({"experience_id": row["experience_id"], "duplicate_of": kept_ids[best],
                         "similarity": round(float(sims[best]), 4)})
            continue
        survivors.append(row)
        kept[n] = vec
        kept_ids.append(row["experience_id"])
        n += 1
    return survivors, dups


def index_store(store: ExperienceStore, *, cycle_ids: list[str] | None = None, rebuild: bool = False,
                max_bad_fraction: float | None = None, stage: str = "index") -> IndexResult:
    """Sync ``experiences`` with ``curated`` for a scope (see the module docstring); returns what it did."""
    from data_contracts.models import ExperienceSchema, contract_columns

    start = time.perf_counter()
    embedder = store.embedder
    if _check_embedder(store, embedder, rebuild=rebuild):
        store.db.drop_table("experiences")
    where = sql_in("cycle_id", cycle_ids) if cycle_ids else None
    curated = store.read("curated", where=where).to_dict(orient="records")
    curated_columns = contract_columns(ExperienceSchema)
    existing = store.read("experiences", where=where, columns=[*curated_columns, "embedder", "embed_field"])

    def fingerprint(row: dict[str, Any], name: str, embed_field: str) -> str:
        return content_hash(row, curated_columns) + name + embed_field

    stored = {r["experience_id"]: fingerprint(r, r["embedder"], r["embed_field"])
              for r in existing.to_dict(orient="records")}
    curated_ids = {r["experience_id"] for r in curated}
    to_index = [r for r in curated if rebuild or stored.get(r["experience_id"]) != fingerprint(
        r, embedder.name, store.embed_field)]
    stale = set(stored) - curated_ids
    to_index.sort(key=lambda r: (r["step"], r["cycle_id"], r["experience_id"]))

    anchor_ids, anchors = _anchor_vectors(store, {r["experience_id"] for r in to_index} | stale)
    survivors, dups = near_duplicates(to_index, anchor_ids, anchors, threshold=store.dedupe_threshold)
    stale |= {d["experience_id"] for d in dups if d["experience_id"] in stored}

    embed_start = time.perf_counter()
    vectors = embedder.encode([embed_text(r, store.embed_field) for r in survivors],
                              batch_size=store.embed_batch_size)
    embed_seconds = time.perf_counter() - embed_start
    frame = _indexed_frame(survivors, vectors, embedder_name=embedder.name, embed_field=store.embed_field)
    write = store.write_validated("experiences", frame, stage=stage, cycle_id=",".join(cycle_ids or []),
                                  max_bad_fraction=max_bad_fraction, vector_dim=embedder.dim)
    deleted = store.delete_keys("experiences", sorted(stale))
    vector_index = store.ensure_vector_index()
    return IndexResult(
        experiences_version=store.version("experiences"), embedder=embedder.name, n_curated=len(curated),
        n_embedded=len(survivors), n_inserted=write.n_inserted, n_updated=write.n_updated,
        n_unchanged=len(curated) - len(to_index), n_deleted=deleted.n_deleted, n_quarantined=write.n_quarantined,
        near_duplicates=dups, vector_index=vector_index, embed_seconds=embed_seconds,
        total_seconds=time.perf_counter() - start, rebuilt=rebuild,
    )


def _indexed_frame(rows: list[dict[str, Any]], vectors: np.ndarray, *, embedder_name: str,
                   embed_field: str) -> pd.DataFrame:
    import pandas as pd

    from data_contracts.models import IndexedExperienceSchema, contract_columns

    out = [{**row, "vector": vec.tolist(), "embedder": embedder_name, "embed_field": embed_field}
           for row, vec in zip(rows, vectors, strict=True)]
    return pd.DataFrame(out, columns=contract_columns(IndexedExperienceSchema))
