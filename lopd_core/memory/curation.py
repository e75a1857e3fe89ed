"""Curation: stored trajectories → the experience bank's candidates (the ``curated`` table), with a report.

The rules, applied in this order (the first rule a trajectory fails is its drop reason):

1. ``not_train_split``: evaluation tasks never enter the bank;
2. ``status_error`` / ``status_truncated``: only finished episodes (``status == 'ok'``);
3. ``below_success_threshold``: ``reward >= curation.success_threshold_tool`` for tool suites,
   ``>= success_threshold_code`` (1.0: all tests pass) for code suites (:func:`lopd_core.envs.suite_kind`);
4. ``empty_text``: nothing to show (no instruction, or an empty observation-lite rendering);
5. ``duplicate`` / ``near_duplicate``: cosine of the ``content_vector`` (hashed bag of words of instruction +
   observation-lite text) equal to 1 / at least ``curation.dedupe_threshold`` with an *older* kept
   experience. Older = already stored, else smaller ``(step, cycle_id, trajectory_id)``;
6. ``per_task_cap``: at most ``curation.per_task_cap`` experiences per task id, best first (higher reward,
   then fewer tokens, then older);
7. ``family_balance`` (when ``curation.balance_families``): no family larger than ``ceil(median family size ×
   family_slack)``; within a family the candidates are ranked round-robin across its tasks.

Observation-lite: the trajectory's own ``observation_lite`` / ``messages_lite`` when the rollout filled them,
else shortened here (tool observations longer than ``rollout.observation_max_chars`` keep their head and tail).

Scope and idempotency. :func:`curate_store` curates the trajectories of a scope (some cycle ids, or all) and
makes the ``curated`` rows of that scope equal to the selection: new rows are upserted, rows no longer
selected are deleted; rows outside the scope are kept and count against the caps and for near-duplicates.
The selection is a deterministic function of the stored rows, so re-curating changes nothing and writes no
table version. Not here: embeddings for retrieval (:mod:`.indexing`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lopd_core.config import Config
from lopd_core.envs import suite_kind
from lopd_core.memory.embedder import content_embedder
from lopd_core.memory.sql import sql_in
from lopd_core.records.experience import experience_content

if TYPE_CHECKING:
    import pandas as pd

    from lopd_core.memory.store import ExperienceStore

DROP_REASONS = ("not_train_split", "status_error", "status_truncated", "below_success_threshold", "empty_text",
                "duplicate", "near_duplicate", "per_task_cap", "family_balance")
_TRAJECTORY_COLUMNS = ["trajectory_id", "episode_id", "task_id", "suite", "family", "split", "level", "instruction",
                       "messages", "initial_messages", "reward", "status", "policy_version", "observation_lite",
                       "messages_lite", "cycle_id", "step"]


def _normalised(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


# --------------------------------------------------------------------------------------------------
@dataclass
class CurationReport:
    """What curation kept and dropped, and why; per family. ``to_markdown`` renders it."""

    n_input: int = 0
    n_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    per_family: dict[str, dict[str, int]] = field(default_factory=dict)
    per_suite: dict[str, dict[str, int]] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    family_cap: int | None = None
    n_existing_out_of_scope: int = 0
    scope: list[str] | None = None
    n_quarantined_upstream: int = 0
    curated_version: int = 0
    changes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        scope = ", ".join(self.scope) if self.scope else "all stored trajectories"
        lines = [
            "## Curation report", "",
            f"Scope: {scope}. Kept **{self.n_kept}** of {self.n_input} trajectories "
            f"({self.n_existing_out_of_scope} curated experiences outside the scope were kept as they were). "
            f"`curated` table version {self.curated_version}.", "",
            "Success thresholds: " + ", ".join(f"{k} ≥ {v:g}" for k, v in self.thresholds.items())
            + (f"; family cap {self.family_cap}." if self.family_cap is not None else "."),
        ]
        if self.n_quarantined_upstream:
            lines += ["", f"{self.n_quarantined_upstream} trajectories of this scope are in the quarantine table "
                          "(they failed their contract and never reached curation)."]
        if self.changes:
            lines += ["", "Changes to `curated`: " + ", ".join(f"{k} {v}" for k, v in self.changes.items()) + "."]
        lines += ["", "| dropped because | rows |", "|---|---:|"]
        lines += [f"| {reason} | {n} |" for reason, n in self.dropped.items() if n] or ["| (nothing dropped) | 0 |"]
        reasons = [r for r in DROP_REASONS if any(f.get(r) for f in self.per_family.values())]
        lines += ["", "| family | input | kept | " + " | ".join(reasons) + " |",
                  "|---|---:|---:|" + "---:|" * len(reasons)]
        for family, counts in sorted(self.per_family.items()):
            cells = [str(counts.get("input", 0)), str(counts.get("kept", 0)), *(str(counts.get(r, 0)) for r in reasons)]
            lines.append(f"| {family or '(none)'} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
def _experience_row(t: dict[str, Any], *, kind: str, max_chars: int) -> dict[str, Any]:
    from data_contracts.models import SCHEMA_VERSION

    messages = json.loads(t["messages"]) if isinstance(t.get("messages"), str) else list(t.get("messages") or [])
    lite = json.loads(t["messages_lite"]) if isinstance(t.get("messages_lite"), str) else list(t.get("messages_lite") or [])
    initial = t.get("initial_messages")
    turns, text = experience_content(messages, instruction=t["instruction"], max_chars=max_chars, messages_lite=lite,
                                     initial_messages=None if initial is None else int(initial))
    return {
        "experience_id": t["trajectory_id"], "trajectory_id": t["trajectory_id"], "episode_id": t["episode_id"],
        "task_id": t["task_id"], "suite": t["suite"], "suite_kind": kind, "family": t.get("family") or "",
        "split": t["split"], "level": int(t["level"]), "instruction": t["instruction"], "text": text,
        "messages": json.dumps(turns, ensure_ascii=False, sort_keys=True), "reward": float(t["reward"]),
        "step": int(t["step"]), "cycle_id": t.get("cycle_id") or "", "policy_version": t["policy_version"],
        "n_tokens": int(t.get("n_tokens") or 0), "content_vector": None, "schema_version": SCHEMA_VERSION,
    }


def _age(row: dict[str, Any]) -> tuple:
    return (row["step"], row["cycle_id"], row["experience_id"])


def _quality(row: dict[str, Any]) -> tuple:
    return (-row["reward"], row["n_tokens"], *_age(row))


def curate_frame(trajectories: pd.DataFrame, *, success_threshold_tool: float, success_threshold_code: float,
                 dedupe_threshold: float, per_task_cap: int, balance_families: bool = True,
                 family_slack: float = 2.0, observation_max_chars: int = 400,
                 existing: pd.DataFrame | None = None) -> tuple[pd.DataFrame, CurationReport]:
    """Select experiences from a trajectories frame (pure; see the module docstring for the rules).

    ``trajectories`` needs the columns of the trajectories contract used here plus ``n_tokens`` (defaults to
    the length of ``token_ids`` when that column is present). ``existing``: curated rows that stay (they are
    never dropped, but count against the caps and are near-duplicate anchors). Returns the selected rows in
    :class:`data_contracts.ExperienceSchema` form (unvalidated) and the report.
    """
    import pandas as pd

    from data_contracts.models import ExperienceSchema, contract_columns

    thresholds = {"tool": success_threshold_tool, "code": success_threshold_code}
    report = CurationReport(n_input=len(trajectories), dropped={r: 0 for r in DROP_REASONS},
                            thresholds={f"{k} suites": v for k, v in thresholds.items()})
    family_counts: dict[str, Counter] = defaultdict(Counter)
    suite_counts: dict[str, Counter] = defaultdict(Counter)

    def drop(row: dict[str, Any], reason: str) -> None:
        report.dropped[reason] += 1
        family_counts[row.get("family") or ""][reason] += 1
        suite_counts[row["suite"]][reason] += 1

    # --- 1-4: per-trajectory filters ------------------------------------------------------------
    candidates = []
    for t in trajectories.to_dict(orient="records"):
        if "n_tokens" not in t:
            t["n_tokens"] = len(t.get("token_ids") if t.get("token_ids") is not None else [])
        family_counts[t.get("family") or ""]["input"] += 1
        suite_counts[t["suite"]]["input"] += 1
        kind = suite_kind(t["suite"])
        if t["split"] != "train":
            drop(t, "not_train_split")
        elif t["status"] != "ok":
            drop(t, f"status_{t['status']}" if f"status_{t['status']}" in DROP_REASONS else "status_error")
        elif float(t["reward"]) < thresholds[kind]:
            drop(t, "below_success_threshold")
        else:
            row = _experience_row(t, kind=kind, max_chars=observation_max_chars)
            if not row["instruction"].strip() or not row["text"].strip():
                drop(t, "empty_text")
            else:
                candidates.append(row)

    anchors = [] if existing is None else existing.to_dict(orient="records")
    report.n_existing_out_of_scope = len(anchors)
    embedder = content_embedder()
    if candidates:
        vectors = embedder.encode([f"{r['instruction']}\n{r['text']}" for r in candidates])
        for row, vec in zip(candidates, vectors, strict=True):
            row["content_vector"] = vec.tolist()

    # --- 5: duplicates against anchors and older candidates ----------------------------------------
    # Greedy, oldest first: O(candidates × kept) dot products, fine for a cycle's worth of rows.
    kept = np.empty((len(anchors) + len(candidates), embedder.dim), dtype=np.float32)
    n_kept = 0
    for a in anchors:
        kept[n_kept] = np.asarray(a["content_vector"], dtype=np.float32)
        n_kept += 1
    kept_texts = {_normalised(f"{a['instruction']}\n{a['text']}") for a in anchors}
    unique = []
    for row in sorted(candidates, key=_age):
        vec = np.asarray(row["content_vector"], dtype=np.float32)
        text = _normalised(f"{row['instruction']}\n{row['text']}")
        best = float(np.max(kept[:n_kept] @ vec)) if n_kept else -1.0
        if text in kept_texts:
            drop(row, "duplicate")
        elif best >= dedupe_threshold:
            drop(row, "near_duplicate")
        else:
            unique.append(row)
            kept[n_kept] = vec
            n_kept += 1
            kept_texts.add(text)

    # --- 6: per-task cap, best first ---------------------------------------------------------------
    per_task_existing = Counter(a["task_id"] for a in anchors)
    by_task: dict[str, list] = defaultdict(list)
    for row in unique:
        by_task[row["task_id"]].append(row)
    capped = []
    for task_id, rows in by_task.items():
        slots = max(0, per_task_cap - per_task_existing[task_id])
        ranked = sorted(rows, key=_quality)
        for rank, row in enumerate(ranked):
            if rank < slots:
                row["_task_rank"] = rank
                capped.append(row)
            else:
                drop(row, "per_task_cap")

    # --- 7: family balance ------------------------------------------------------------------------
    selected = capped
    if balance_families and capped:
        sizes = Counter(a.get("family") or "" for a in anchors) + Counter(r["family"] for r in capped)
        report.family_cap = math.ceil(float(np.median(list(sizes.values()))) * family_slack)
        anchor_sizes = Counter(a.get("family") or "" for a in anchors)
        selected = []
        by_family: dict[str, list] = defaultdict(list)
        for row in capped:
            by_family[row["family"]].append(row)
        for family, rows in by_family.items():
            slots = max(0, report.family_cap - anchor_sizes[family])
            ranked = sorted(rows, key=lambda r: (r["_task_rank"], *_quality(r)))
            selected.extend(ranked[:slots])
            for row in ranked[slots:]:
                drop(row, "family_balance")

    for row in selected:
        row.pop("_task_rank", None)
        family_counts[row["family"]]["kept"] += 1
        suite_counts[row["suite"]]["kept"] += 1
    report.n_kept = len(selected)
    report.per_family = {f: dict(c) for f, c in family_counts.items()}
    report.per_suite = {s: dict(c) for s, c in suite_counts.items()}
    selected.sort(key=_age)
    return pd.DataFrame(selected, columns=contract_columns(ExperienceSchema)), report


# --------------------------------------------------------------------------------------------------
def _scope_filter(cycle_ids: list[str] | None) -> str | None:
    return sql_in("cycle_id", cycle_ids) if cycle_ids else None


def curate_store(store: ExperienceStore, cfg: Config, *, cycle_ids: list[str] | None = None,
                 stage: str = "curate") -> CurationReport:
    """Curate the stored trajectories of ``cycle_ids`` (None: all) into the ``curated`` table.

    ``cfg`` is the whole :class:`lopd_core.config.Config` (``curation`` and ``rollout.observation_max_chars``).
    """
    import pandas as pd

    where = _scope_filter(cycle_ids)
    columns = {c: c for c in _TRAJECTORY_COLUMNS} | {"n_tokens": "array_length(token_ids)"}
    trajectories = store.read("trajectories", where=where, columns=columns)
    curated = store.read("curated")
    in_scope = curated["cycle_id"].isin(cycle_ids) if cycle_ids else pd.Series(True, index=curated.index, dtype=bool)
    c = cfg.curation
    selected, report = curate_frame(
        trajectories, success_threshold_tool=c.success_threshold_tool, success_threshold_code=c.success_threshold_code,
        dedupe_threshold=c.dedupe_threshold, per_task_cap=c.per_task_cap, balance_families=c.balance_families,
        family_slack=c.family_slack, observation_max_chars=cfg.rollout.observation_max_chars,
        existing=curated[~in_scope],
    )
    report.scope = list(cycle_ids) if cycle_ids else None
    quarantine_where = "contract = 'trajectories'" + (f" AND {where}" if where else "")
    report.n_quarantined_upstream = store.count("quarantine", where=quarantine_where)
    write = store.write_validated("curated", selected, stage=stage, cycle_id=",".join(cycle_ids or []),
                                  max_bad_fraction=c.max_bad_row_fraction)
    stale = sorted(set(curated.loc[in_scope, "experience_id"]) - set(selected["experience_id"]))
    deleted = store.delete_keys("curated", stale)
    report.curated_version = store.version("curated")
    report.changes = {"inserted": write.n_inserted, "updated": write.n_updated, "deleted": deleted.n_deleted,
                      "unchanged": write.n_unchanged, "quarantined": write.n_quarantined}
    return report
