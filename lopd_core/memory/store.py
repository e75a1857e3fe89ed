"""ExperienceStore: the LanceDB tables of the pipeline, with contract-checked, idempotent writes.

Tables (one LanceDB directory or object-store URI, ``workspace.lance_uri``):

===============  ===============  =================================================================
table            key              rows
===============  ===============  =================================================================
trajectories     trajectory_id    every rollout, errored and truncated ones included
curated          experience_id    the curation stage's selection (no embeddings), see curation.py
experiences      experience_id    curated rows + retrieval ``vector`` (what the retriever searches)
evaluations      eval_row_id      scored evaluation items
quarantine       quarantine_id    rows that failed their contract, whole, with the failed checks
===============  ===============  =================================================================

Every write goes through the contract of :data:`data_contracts.CONTRACTS` (invalid rows → quarantine,
:class:`data_contracts.StageQualityError` past the bad-share limit) and is an **idempotent upsert**: rows are
keyed, each stored row carries a ``row_hash`` of its content, and only new or changed rows are sent to
``merge_insert``. A write that changes nothing writes nothing, so **no new table version** appears (LanceDB
itself commits a version for every ``merge_insert``, even an empty one — hence the check before it).

Versions: every change is a LanceDB table version. A training run records ``store.version("experiences")``
and reads exactly that version through :meth:`ExperienceStore.retriever` (see :mod:`.retriever`).

Not here: curation rules (:mod:`.curation`), embedding and near-duplicate logic (:mod:`.indexing`),
leakage filters (:mod:`.retriever`). LanceDB, pyarrow and pandas are imported inside, so importing
``lopd_core`` never needs them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from lopd_core.config import Config
from lopd_core.memory.embedder import make_embedder
from lopd_core.memory.retriever import RESULT_COLUMNS, LanceRetriever, ensure_vector_index
from lopd_core.memory.sql import sql_in
from lopd_core.workspace import Workspace, _local_path

if TYPE_CHECKING:
    import pandas as pd

TABLES = ("trajectories", "curated", "experiences", "evaluations", "quarantine")
PIN_TAG = "pinned-v"
"""Tag prefix of a table version a registered model was trained on (``pinned-v12``)."""
ROW_HASH = "row_hash"
_KEY_CHUNK = 500
_SCALAR_DTYPES = {"str": "string", "string[pyarrow]": "string", "string[python]": "string", "string": "string",
                  "int64": "int64", "float64": "float64", "bool": "bool"}


@dataclass
class WriteResult:
    """What one write did. ``version`` is the table version after it (unchanged when nothing changed)."""

    table: str
    version: int
    n_input: int = 0
    n_inserted: int = 0
    n_updated: int = 0
    n_unchanged: int = 0
    n_deleted: int = 0
    n_quarantined: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.n_inserted or self.n_updated or self.n_deleted)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changed": self.changed}


def _canonical(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return [_canonical(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def content_hash(row: dict[str, Any], columns: list[str]) -> str:
    blob = json.dumps([_canonical(row[c]) for c in columns], sort_keys=True, default=str, allow_nan=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def arrow_schema(table: str, *, vector_dim: int | None = None):
    """The Arrow schema of a table, derived from its pandera contract (+ ``row_hash``)."""
    import pyarrow as pa

    from data_contracts.models import ARROW_LIST_TYPES, CONTRACTS

    fields = []
    for name, column in CONTRACTS[table].to_schema().columns.items():
        dtype = str(column.dtype)
        if name == "vector":
            if not vector_dim:
                raise ValueError("the experiences table needs the embedder's dimension (vector_dim)")
            fields.append(pa.field(name, pa.list_(pa.float32(), vector_dim)))
        elif name in ARROW_LIST_TYPES:
            fields.append(pa.field(name, pa.list_(pa.from_numpy_dtype(ARROW_LIST_TYPES[name]))))
        elif dtype in _SCALAR_DTYPES:
            fields.append(pa.field(name, pa.type_for_alias(_SCALAR_DTYPES[dtype]), nullable=column.nullable))
        else:
            raise TypeError(f"contract column {table}.{name}: no Arrow type for pandera dtype {dtype}")
    fields.append(pa.field(ROW_HASH, pa.string()))
    return pa.schema(fields)


class ExperienceStore:
    """The pipeline's LanceDB tables. Safe to create many times; nothing is opened until used."""

    def __init__(self, uri: str, *, embedder: str = "hash", embed_field: str = "task",
                 vector_index_min_rows: int = 5000, embed_batch_size: int = 64,
                 dedupe_threshold: float = 0.97, device: str = "cpu", storage_options: dict[str, str] | None = None):
        self.uri = str(uri)
        self.storage_options = dict(storage_options or {})
        self.embedder_name = embedder
        self.embed_field = embed_field
        self.vector_index_min_rows = vector_index_min_rows
        self.embed_batch_size = embed_batch_size
        self.dedupe_threshold = dedupe_threshold
        self.device = device
        self._db = None

    @classmethod
    def from_config(cls, cfg: Config, *, uri: str | None = None) -> ExperienceStore:
        """A store at ``cfg.workspace``'s LanceDB URI (or ``uri``: e.g. a comparison root's own store) with the
        ``index``/``curation`` settings of ``cfg``."""
        ws = Workspace.from_config(cfg.workspace).ensure()
        uri = str(uri) if uri is not None else ws.lance_uri
        return cls(uri, embedder=cfg.index.embedder, embed_field=cfg.index.embed_field,
                   vector_index_min_rows=cfg.index.vector_index_min_rows,
                   embed_batch_size=cfg.index.embed_batch_size, dedupe_threshold=cfg.curation.dedupe_threshold,
                   device="cpu" if cfg.model.device == "auto" else cfg.model.device,
                   storage_options=ws.storage_options(uri))

    # ---------------------------------------------------------------------------------------------
    @property
    def db(self):
        if self._db is None:
            try:
                import lancedb
            except ImportError as e:
                raise ImportError("the experience store needs lancedb: pip install -r requirements/cpu.txt") from e
            self._db = lancedb.connect(self.uri, storage_options=self.storage_options or None)
        return self._db

    @property
    def embedder(self):
        return make_embedder(self.embedder_name, device=self.device)

    def table_names(self) -> list[str]:
        names, token = [], None
        while True:
            page = self.db.list_tables(page_token=token)
            names.extend(page.tables)
            token = page.page_token
            if not token:
                return names

    def has_table(self, name: str) -> bool:
        return name in self.table_names()

    def open_table(self, name: str, *, version: int | None = None):
        if name not in TABLES:
            raise ValueError(f"unknown table '{name}' (tables: {', '.join(TABLES)})")
        if not self.has_table(name):
            raise FileNotFoundError(f"{self.uri}: table '{name}' does not exist yet (nothing was written to it)")
        tbl = self.db.open_table(name)
        if version is not None:
            available = [v["version"] for v in tbl.list_versions()]
            if version not in available:
                raise ValueError(
                    f"table '{name}' has no version {version} (available: {available[:3]}…{available[-3:]}); "
                    "old versions are only removed by an explicit cleanup"
                )
            tbl.checkout(version)
        return tbl

    def _ensure_table(self, name: str, *, vector_dim: int | None = None):
        if self.has_table(name):
            return self.db.open_table(name)
        return self.db.create_table(name, schema=arrow_schema(name, vector_dim=vector_dim), exist_ok=True)

    def version(self, name: str) -> int:
        """The latest version of a table; 0 when the table does not exist."""
        return self.db.open_table(name).version if self.has_table(name) else 0

    def list_versions(self, name: str) -> list[dict[str, Any]]:
        if not self.has_table(name):
            return []
        return [{"version": v["version"], "timestamp": str(v["timestamp"]),
                 "rows": int(v.get("metadata", {}).get("total_rows", -1))}
                for v in self.db.open_table(name).list_versions()]

    def keep_versions(self, name: str, *, keep: timedelta, pinned: Iterable[int] = ()) -> dict[str, Any]:
        """Remove the versions of ``name`` older than ``keep``, never one in ``pinned``.

        ``pinned`` are the versions registered models were trained on: each gets the tag ``pinned-v<N>``
        (listed by LanceDB, and Lance refuses to clean a tagged version up), a tag whose version is no longer
        pinned is removed, and as cleanup takes an age rather than a list, every version newer than the
        oldest pinned one stays too. Compaction comes with it (``optimize``): one more version."""
        if not self.has_table(name):
            return {"table": name, "versions_before": 0, "versions_after": 0, "removed": 0, "pinned": []}
        tbl = self.db.open_table(name)
        stamps = {int(v["version"]): v["timestamp"] for v in tbl.list_versions()}
        pins = sorted({int(v) for v in pinned} & set(stamps))
        tags = tbl.tags.list()
        for tag, info in tags.items():
            if tag.startswith(PIN_TAG) and int(info["version"]) not in pins:
                tbl.tags.delete(tag)
        for v in pins:
            if f"{PIN_TAG}{v}" not in tags:
                tbl.tags.create(f"{PIN_TAG}{v}", v)
        age = keep  # list_versions' timestamps are naive local times
        if pins:
            age = max(keep, datetime.now() - stamps[pins[0]] + timedelta(seconds=1))
        tbl.optimize(cleanup_older_than=age)
        after = sorted(int(v["version"]) for v in tbl.list_versions())
        return {"table": name, "versions_before": len(stamps), "versions_after": len(after),
                "removed": len(set(stamps) - set(after)), "oldest_kept": after[0], "pinned": pins,
                "kept_for_s": round(age.total_seconds(), 1)}

    def count(self, name: str, *, where: str | None = None, version: int | None = None) -> int:
        if not self.has_table(name):
            return 0
        return self.open_table(name, version=version).count_rows(where)

    def read(self, name: str, *, where: str | None = None, columns: list[str] | dict[str, str] | None = None,
             version: int | None = None) -> pd.DataFrame:
        """Rows of a table as a contract frame (no ``row_hash``); an empty frame for a missing table.

        ``columns`` may map output names to SQL expressions, e.g. ``{"n_tokens": "array_length(token_ids)"}``.
        """
        import pandas as pd

        from data_contracts.models import CONTRACTS, contract_columns

        selection = columns or contract_columns(CONTRACTS[name])
        wanted = list(selection)
        if not self.has_table(name):
            return pd.DataFrame(columns=wanted)
        tbl = self.open_table(name, version=version)
        query = tbl.search().select(selection).limit(None)
        if where:
            query = query.where(where)
        frame = query.to_arrow().to_pandas()
        return frame[[c for c in wanted if c in frame.columns]]

    # ---------------------------------------------------------------------------------------------
    def _existing_hashes(self, tbl, key: str, keys: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for start in range(0, len(keys), _KEY_CHUNK):
            chunk = keys[start:start + _KEY_CHUNK]
            rows = tbl.search().where(sql_in(key, chunk)).select([key, ROW_HASH]).limit(len(chunk)).to_arrow()
            found.update(zip(rows[key].to_pylist(), rows[ROW_HASH].to_pylist(), strict=True))
        return found

    def upsert(self, name: str, frame: pd.DataFrame, *, vector_dim: int | None = None, stage: str = "",
               cycle_id: str = "") -> WriteResult:
        """Merge already-valid contract rows on the table key; only new or changed rows are written.

        A row the storage refuses never costs the others: when the batch write fails, each row is converted
        on its own, the convertible ones are merged together (one by one if that fails again), and a row that
        still fails is quarantined with the storage's error (``stage``/``cycle_id`` are recorded on it). If no
        row at all can be written the error is not about a row (the disk, the table): it is raised. A
        quarantine row the storage refuses is raised too (it has nowhere else to go).
        """
        from data_contracts.models import CONTRACTS, contract_columns, contract_key, contract_volatile

        contract = CONTRACTS[name]
        key, columns = contract_key(contract), contract_columns(contract)
        hashed = [c for c in columns if c not in contract_volatile(contract)]
        if frame is None or len(frame) == 0:
            return WriteResult(name, self.version(name))
        records = [{c: _canonical(v) for c, v in row.items()} for row in frame[columns].to_dict(orient="records")]
        for row in records:
            row[ROW_HASH] = content_hash(row, hashed)
        by_key = {str(r[key]): r for r in records}
        if len(by_key) != len(records):
            raise ValueError(f"upsert into '{name}': the frame repeats {key} values; validate it first")
        tbl = self._ensure_table(name, vector_dim=vector_dim)
        existing = self._existing_hashes(tbl, key, list(by_key))
        fresh = [r for k, r in by_key.items() if k not in existing]
        changed = [r for k, r in by_key.items() if k in existing and existing[k] != r[ROW_HASH]]
        result = WriteResult(name, tbl.version, n_input=len(records), n_inserted=len(fresh), n_updated=len(changed),
                             n_unchanged=len(records) - len(fresh) - len(changed))
        if fresh or changed:
            failed = self._merge_rows(tbl, name, key, fresh + changed)
            if failed:
                failed_keys = {str(r[key]) for r, _ in failed}
                result.n_inserted -= sum(str(r[key]) in failed_keys for r in fresh)
                result.n_updated -= sum(str(r[key]) in failed_keys for r in changed)
                result.n_quarantined += self._quarantine_refused(name, key, columns, failed, stage=stage,
                                                                 cycle_id=cycle_id)
            result.version = tbl.version
        return result

    def _merge_rows(self, tbl, name: str, key: str, rows: list[dict[str, Any]]) -> list[tuple[dict, str]]:
        """Merge ``rows``; return the (row, error) pairs the storage refused (see :meth:`upsert`)."""
        import pyarrow as pa

        def merge(batch: list[dict[str, Any]]) -> None:
            data = pa.Table.from_pylist(batch, schema=tbl.schema)
            tbl.merge_insert(key).when_matched_update_all().when_not_matched_insert_all().execute(data)

        try:
            merge(rows)
            return []
        except Exception as batch_error:  # noqa: BLE001 - narrowed below, row by row
            schema = tbl.schema
            failed: list[tuple[dict, str]] = []
            convertible: list[dict[str, Any]] = []
            for row in rows:
                try:
                    pa.Table.from_pylist([row], schema=schema)
                    convertible.append(row)
                except (pa.ArrowException, ValueError, TypeError, OverflowError) as err:
                    failed.append((row, f"{type(err).__name__}: {err}"))
            if not convertible:
                return failed  # every row is unconvertible on its own: row problems, not the table's
            refused: list[tuple[dict, str]] = []

            def settle(batch: list[dict[str, Any]]) -> int:
                """Merge ``batch``, halving it on failure down to single rows; return the rows written."""
                try:
                    merge(batch)
                    return len(batch)
                except Exception as err:  # noqa: BLE001 - reported with the row, or raised below
                    if len(batch) == 1:
                        refused.append((batch[0], f"{type(err).__name__}: {err}"))
                        return 0
                    mid = len(batch) // 2
                    return settle(batch[:mid]) + settle(batch[mid:])

            if not settle(convertible):
                raise batch_error
            return failed + refused

    def _quarantine_refused(self, name: str, key: str, columns: list[str], failed: list[tuple[dict, str]], *,
                            stage: str, cycle_id: str) -> int:
        import pandas as pd

        from data_contracts.models import preview
        from data_contracts.validate import quarantine_rows

        if name == "quarantine":
            first, error = failed[0]
            raise ValueError(f"the quarantine table refused {len(failed)} row(s), e.g. quarantine_id "
                             f"{preview(first[key])}: {preview(error, 300)}")
        bad = pd.DataFrame([{c: row[c] for c in columns} for row, _ in failed], columns=columns)
        reasons = {i: {f"storage: LanceDB refused the row ({preview(error, 300)}); the contract let it through, "
                       "so report it as a contract gap"} for i, (_, error) in enumerate(failed)}
        self.write_quarantine(quarantine_rows(bad, reasons, contract=name, key=key, stage=stage, cycle_id=cycle_id))
        return len(failed)

    def delete_keys(self, name: str, keys: list[str]) -> WriteResult:
        """Delete rows by key (no version when none of the keys is present)."""
        from data_contracts.models import CONTRACTS, contract_key

        if not keys or not self.has_table(name):
            return WriteResult(name, self.version(name))
        tbl = self.db.open_table(name)
        key = contract_key(CONTRACTS[name])
        present = list(self._existing_hashes(tbl, key, list(keys)))
        for start in range(0, len(present), _KEY_CHUNK):
            tbl.delete(sql_in(key, present[start:start + _KEY_CHUNK]))
        return WriteResult(name, tbl.version, n_input=len(keys), n_deleted=len(present))

    def write_validated(self, name: str, frame: pd.DataFrame, *, stage: str, cycle_id: str = "",
                        max_bad_fraction: float | None = None, vector_dim: int | None = None,
                        row_labels: list[str] | None = None) -> WriteResult:
        """Validate against the table's contract, quarantine bad rows, upsert good ones; then apply the limit.

        Both the valid rows and the quarantine rows (those of the contract and those the storage refused, see
        :meth:`upsert`) are written *before* the bad-share limit can raise
        :class:`data_contracts.StageQualityError`, so a failing stage still loses nothing. ``row_labels`` (one
        per row, e.g. ``"line 7"``) prefix the quarantine reasons.
        """
        from data_contracts.models import CONTRACTS
        from data_contracts.validate import enforce_bad_share, validate_frame

        contract = CONTRACTS[name]
        valid, quarantine = validate_frame(frame, contract, stage=stage, cycle_id=cycle_id, row_labels=row_labels)
        self.write_quarantine(quarantine)
        result = self.upsert(name, valid, vector_dim=vector_dim, stage=stage, cycle_id=cycle_id)
        result.n_input, result.n_quarantined = len(frame), len(quarantine) + result.n_quarantined
        if max_bad_fraction is not None:
            enforce_bad_share(n_total=len(frame), n_bad=result.n_quarantined, limit=max_bad_fraction, stage=stage,
                              contract=contract.Config.name, valid=valid, quarantine=quarantine)
        return result

    def write_quarantine(self, quarantine: pd.DataFrame) -> WriteResult:
        return self.upsert("quarantine", quarantine)

    # ---------------------------------------------------------------------------------------------
    def write_trajectories(self, trajectories, *, stage: str = "rollouts", cycle_id: str = "",
                           max_bad_fraction: float | None = None, row_labels: list[str] | None = None) -> WriteResult:
        """Store rollouts (a list of :class:`Trajectory` or a trajectories frame), errored ones included."""
        import pandas as pd

        from data_contracts.convert import trajectories_to_frame

        frame = trajectories if isinstance(trajectories, pd.DataFrame) else trajectories_to_frame(trajectories)
        return self.write_validated("trajectories", frame, stage=stage, cycle_id=cycle_id,
                                    max_bad_fraction=max_bad_fraction, row_labels=row_labels)

    def read_trajectories(self, *, where: str | None = None, version: int | None = None) -> list:
        from data_contracts.convert import frame_to_trajectories

        return frame_to_trajectories(self.read("trajectories", where=where, version=version))

    def read_experiences(self, *, where: str | None = None, version: int | None = None) -> list:
        """The ``experiences`` rows as :class:`~lopd_core.records.experience.Experience` records (no vectors)."""
        from data_contracts.convert import frame_to_experiences

        columns = [c for c in RESULT_COLUMNS if c != "_distance"]
        return frame_to_experiences(self.read("experiences", where=where, columns=columns, version=version))

    def write_evaluations(self, frame: pd.DataFrame, *, stage: str = "evaluate", cycle_id: str = "",
                          max_bad_fraction: float | None = None) -> WriteResult:
        return self.write_validated("evaluations", frame, stage=stage, cycle_id=cycle_id,
                                    max_bad_fraction=max_bad_fraction)

    # ---------------------------------------------------------------------------------------------
    def ensure_vector_index(self, *, min_rows: int | None = None, index_type: str = "auto") -> dict[str, Any]:
        """Build or refresh the ANN index of ``experiences`` (see :func:`lopd_core.memory.retriever.ensure_vector_index`)."""
        table = self.db.open_table("experiences") if self.has_table("experiences") else None
        return ensure_vector_index(table, min_rows=self.vector_index_min_rows if min_rows is None else min_rows,
                                   index_type=index_type)

    def retriever(self, *, version: int | None = None, **search_options) -> LanceRetriever:
        """A :class:`~lopd_core.records.experience.Retriever` over ``experiences`` pinned at ``version`` (None = latest now).

        The table is checked out at that version, so rows indexed later — by this process or another — are
        invisible to the retriever; a table embedded with another embedder than ``index.embedder`` is refused.
        """
        if not self.has_table("experiences"):
            if version:
                raise ValueError(f"{self.uri}: no experiences table, so version {version} cannot be pinned")
            return LanceRetriever(None, embedder=self.embedder, version=0, **search_options)
        table = self.open_table("experiences", version=version)
        if version is None:
            table.checkout(table.version)  # freeze: later writes must not leak into this retriever
        embedder = self.embedder
        first = table.search().select(["embedder"]).limit(1).to_list()
        if first and first[0]["embedder"] != embedder.name:
            raise ValueError(
                f"the experiences table (version {table.version}) was embedded with '{first[0]['embedder']}', "
                f"but index.embedder is '{self.embedder_name}' ({embedder.name}); set index.embedder to match, "
                "or rebuild the table with `lopd memory index --rebuild`"
            )
        return LanceRetriever(table, embedder=embedder, version=table.version, **search_options)

    def status(self) -> dict[str, Any]:
        tables = {}
        for name in TABLES:
            if not self.has_table(name):
                tables[name] = {"rows": 0, "version": 0}
                continue
            tbl = self.db.open_table(name)
            tables[name] = {"rows": tbl.count_rows(), "version": tbl.version, "n_versions": len(tbl.list_versions()),
                            "indices": [f"{i.name}:{i.index_type}" for i in tbl.list_indices()]}
        info: dict[str, Any] = {"uri": self.uri, "available": True, "tables": tables}
        if tables["experiences"]["rows"]:
            exp = self.read("experiences", columns=["suite", "family", "embedder"])
            info["experiences"] = {"by_suite": exp["suite"].value_counts().to_dict(),
                                   "by_family": exp["family"].value_counts().to_dict(),
                                   "embedders": sorted(exp["embedder"].unique().tolist())}
        if tables["trajectories"]["rows"]:
            traj = self.read("trajectories", columns=["status", "split"])
            info["trajectories"] = {"by_status": traj["status"].value_counts().to_dict(),
                                    "by_split": traj["split"].value_counts().to_dict()}
        if tables["quarantine"]["rows"]:
            q = self.read("quarantine", columns=["contract", "stage"])
            info["quarantine"] = {"by_contract": q["contract"].value_counts().to_dict(),
                                  "by_stage": q["stage"].value_counts().to_dict()}
        return info


def store_status(uri: str) -> dict[str, Any]:
    """Counts, versions and indices of every table, for ``lopd status``; never raises for a missing store."""
    local = _local_path(str(uri))
    if local is not None and not local.exists():
        return {"uri": str(uri), "available": False, "reason": "no LanceDB directory yet (nothing stored)"}
    try:
        import lancedb  # noqa: F401
    except ImportError:
        return {"uri": str(uri), "available": False, "reason": "lancedb is not installed"}
    return ExperienceStore(uri).status()
