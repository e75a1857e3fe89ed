"""`lopd memory ingest|curate|index|search|status`: the LanceDB experience store by hand.

The cycle runs ``curate`` and ``index`` as two stages, and so do these commands:

- ``curate`` reads the ``trajectories`` table (a scope of ``--cycle-id``s, or everything), applies the
  curation rules and makes the ``curated`` table match the selection; it writes the curation report
  (Markdown + JSON, ``--report``). Cheap: no model runs.
- ``index`` embeds the curated rows that are new or changed, removes near-duplicates, merges them into
  ``experiences`` (a new table version only when something changed) and builds the vector index when
  the table is large. ``--rebuild`` re-embeds everything (after changing ``index.embedder``).
- ``search`` queries ``experiences`` with the leakage rules, as the training step does.
- ``ingest`` loads trajectories from a JSONL file (one Trajectory record per line) through the contract;
  ``status`` prints the tables, versions and indices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from lopd_cli.common import JsonFlag, Overrides, Profile, emit_json, err, fail, load, out, workspace

memory_app = typer.Typer(no_args_is_help=True, help="The LanceDB experience store: curate, index, search.")

CycleIds = Annotated[list[str] | None, typer.Option("--cycle-id", help="Limit to these cycle ids (repeatable); default: all.")]


def _store(profile: str, overrides: list[str] | None):
    from lopd_core.memory.store import ExperienceStore

    cfg = load(profile, overrides)
    workspace(cfg)
    return cfg, ExperienceStore.from_config(cfg)


def _quality_guard(fn):
    """Run ``fn``; turn the errors a person can act on into one clean message and exit code 1."""
    from data_contracts.validate import StageQualityError

    try:
        return fn()
    except StageQualityError as e:
        fail(str(e))
    except (ValueError, FileNotFoundError, ImportError) as e:
        fail(str(e))


class _DuplicateKey(ValueError):
    pass


def preview(value: object, width: int = 60) -> str:
    text = ascii(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _strict_object(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"key {preview(k)} appears twice in one object (JSON readers keep only one of them)")
        out[k] = v
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (write a number, or leave the field out)")


def read_jsonl_records(path: Path) -> tuple[list[tuple[int, dict]], list[dict]]:
    """(line number, record) for every line holding one JSON object, and the unreadable lines with why.

    Strict: the file is split on newlines only, each line must be UTF-8, JSON without NaN/Infinity and
    without repeated keys, and an object; blank lines are skipped."""
    records, unreadable = [], []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            raw = raw.rstrip(b"\r\n")
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                unreadable.append({"line": number, "raw": raw.decode("utf-8", "backslashreplace"),
                                   "why": f"line {number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                                          f"{e.start}); save the file as UTF-8"})
                continue
            try:
                record = json.loads(line, object_pairs_hook=_strict_object, parse_constant=_no_constant)
            except _DuplicateKey as e:
                unreadable.append({"line": number, "raw": line, "why": f"line {number}: {e}"})
                continue
            except ValueError as e:
                unreadable.append({"line": number, "raw": line,
                                   "why": f"line {number}: not valid JSON ({getattr(e, 'msg', e)})"})
                continue
            except RecursionError:
                unreadable.append({"line": number, "raw": line, "why": f"line {number}: JSON nested too deeply"})
                continue
            if not isinstance(record, dict):
                unreadable.append({"line": number, "raw": line,
                                   "why": f"line {number}: not a JSON object (a {type(record).__name__})"})
                continue
            records.append((number, record))
    return records, unreadable


@memory_app.command("ingest")
def ingest(
    path: Annotated[Path, typer.Argument(help="JSONL file: one Trajectory record per line.")],
    cycle_id: Annotated[str, typer.Option(help="Recorded on quarantine rows.")] = "",
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Validate trajectories from a JSONL file and upsert them into the trajectories table.

    Every bad line is quarantined on its own with its line number and reason; the good ones are stored."""
    import pandas as pd

    from data_contracts.convert import records_to_trajectory_frame
    from data_contracts.validate import enforce_bad_share, quarantine_rows
    from lopd_core.config import ConfigError, check_cycle_id

    if not path.exists():
        fail(f"{path}: no such file (expected a JSONL file of trajectory records)")
    if cycle_id:
        try:
            check_cycle_id(cycle_id)
        except ConfigError as e:
            fail(f"--cycle-id: {e}", code=2)
    cfg, store = _store(profile, set_)
    records, unreadable = read_jsonl_records(path)
    if unreadable:
        bad = pd.DataFrame([{"line": u["line"], "raw": u["raw"]} for u in unreadable])
        reasons = {i: {u["why"]} for i, u in enumerate(unreadable)}
        store.write_quarantine(quarantine_rows(bad, reasons, contract="trajectories", stage="ingest",
                                               cycle_id=cycle_id))
    frame = records_to_trajectory_frame([r for _, r in records])
    labels = [f"line {n}" for n, _ in records]
    result = _quality_guard(lambda: store.write_trajectories(frame, stage="ingest", cycle_id=cycle_id,
                                                             row_labels=labels))
    result.n_input += len(unreadable)
    result.n_quarantined += len(unreadable)
    _quality_guard(lambda: enforce_bad_share(n_total=result.n_input, n_bad=result.n_quarantined,
                                             limit=cfg.curation.max_bad_row_fraction, stage="ingest",
                                             contract="trajectories"))
    if as_json:
        emit_json(result.to_dict())
    else:
        out.print(f"trajectories v{result.version}: {result.n_inserted} inserted, {result.n_updated} updated, "
                  f"{result.n_unchanged} unchanged, {result.n_quarantined} quarantined", highlight=False)
        if result.n_quarantined:
            err.print("the quarantined lines are in the quarantine table (stage 'ingest'), each with its line "
                      "number and reason", highlight=False)


@memory_app.command("curate")
def curate(
    cycle_ids: CycleIds = None,
    report: Annotated[Path | None, typer.Option(help="Where to write the report (.md; a .json sits next to it).")] = None,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Curate stored trajectories into the curated table and write the curation report."""
    from lopd_core.memory.curation import curate_store

    cfg, store = _store(profile, set_)
    result = _quality_guard(lambda: curate_store(store, cfg, cycle_ids=cycle_ids))
    path = report or workspace(cfg).runs_dir / "curation" / f"{'_'.join(cycle_ids) if cycle_ids else 'all'}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(result.to_markdown())
    path.with_suffix(".json").write_text(json.dumps(result.to_dict(), indent=2))
    err.print(f"curation report: {path}", highlight=False)
    if as_json:
        emit_json({**result.to_dict(), "report_path": str(path)})
    else:
        out.print(result.to_markdown(), markup=False, highlight=False)


@memory_app.command("index")
def index(
    cycle_ids: CycleIds = None,
    rebuild: Annotated[bool, typer.Option(help="Re-embed every curated row (after changing index.embedder).")] = False,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Embed curated experiences into the LanceDB experiences table."""
    from lopd_core.memory.indexing import index_store

    cfg, store = _store(profile, set_)
    result = _quality_guard(lambda: index_store(store, cycle_ids=cycle_ids, rebuild=rebuild,
                                                max_bad_fraction=cfg.curation.max_bad_row_fraction))
    if as_json:
        emit_json(result.to_dict())
        return
    out.print(f"experiences v{result.experiences_version} ({result.embedder}): {result.n_embedded} embedded, "
              f"{result.n_inserted} inserted, {result.n_updated} updated, {result.n_unchanged} unchanged, "
              f"{result.n_deleted} deleted, {len(result.near_duplicates)} near-duplicates skipped; "
              f"vector index: {result.vector_index.get('action')}", highlight=False)


@memory_app.command("search")
def search(
    query: Annotated[str, typer.Argument(help="Task instruction to search for.")],
    k: Annotated[int | None, typer.Option("--k", help="Hits to return; default distill.lopd.n_retrieved.")] = None,
    task_id: Annotated[str, typer.Option(help="The querying task's id (excluded unless --allow-same-task).")] = "",
    episode_id: Annotated[str, typer.Option(help="The querying episode (never retrieved).")] = "",
    before_step: Annotated[int | None, typer.Option(help="Only experiences generated before this step.")] = None,
    allow_same_task: Annotated[bool, typer.Option(help="Allow hits of the same task id.")] = False,
    version: Annotated[int | None, typer.Option(help="Pin this experiences-table version.")] = None,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Search the experiences table with the leakage rules applied."""
    from lopd_core.records.experience import RetrievalQuery

    cfg, store = _store(profile, set_)
    retriever = _quality_guard(lambda: store.retriever(version=version))
    exclude = cfg.distill.lopd.exclude_same_task and not allow_same_task and bool(task_id)
    q = RetrievalQuery(instruction=query, task_id=task_id, episode_id=episode_id, before_step=before_step,
                       exclude_same_task=exclude)
    hits = retriever.retrieve(q, k or cfg.distill.lopd.n_retrieved)
    if as_json:
        emit_json({"version": retriever.version, "query": query,
                   "hits": [{"experience_id": h.experience_id, "task_id": h.task_id, "family": h.family,
                             "step": h.step, "score": round(h.score, 4), "instruction": h.instruction} for h in hits]})
        return
    table = Table("score", "task_id", "family", "step", "instruction", title=f"experiences v{retriever.version}")
    for h in hits:
        table.add_row(f"{h.score:.3f}", h.task_id, h.family, str(h.step), h.instruction[:80])
    out.print(table)
    if not hits:
        err.print("no experience passes the leakage rules (or the table is empty)")


@memory_app.command("status")
def status(profile: Profile = "demo", set_: Overrides = None, as_json: JsonFlag = False):
    """Tables, row counts, versions and indices of the store."""
    from lopd_core.memory.store import store_status

    cfg = load(profile, set_)
    info = store_status(workspace(cfg).lance_uri)
    if as_json:
        emit_json(info)
        return
    out.print(json.dumps(info, indent=2, default=str), highlight=False)
