"""Score a comparison report's final evaluations, and a probe's episodes, again under the temperature checker
(`AnswerItem(unit=..., other=...)`, 2026-12-07): only the weather families' answer item can change.

    python reports/toolworld-2026-12-07/rescore_temperatures.py reports/toolworld-2026-12-07/claim \
        [$LOPD_HOME/probes/passk-toolworld-T0.7-k16-s0.jsonl]

A report's rows are rescored from its final_transcripts.jsonl (the answer is the transcript's last assistant
turn); a row's reward changes by the answer item's share of the checklist (the calls are kept as scored).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from lopd_core.compare_report import TaskRows, paired_intervals
from lopd_core.envs import get_suite
from lopd_core.envs.base import tasks_by_id
from lopd_core.envs.tool_env import SUCCESS_THRESHOLD, AnswerItem


def answer_item(task) -> dict | None:
    items = task.payload["checklist"]["answer"]
    return items[0] if len(items) == 1 and items[0].get("unit") else None


def credited(item: dict, answer: str) -> tuple[bool, bool]:
    """(the checker before, the checker now) on ``answer``."""
    before = AnswerItem(number=item["number"], tolerance=item["tolerance"]).satisfied_by(answer)
    return before, AnswerItem(**item).satisfied_by(answer)


def rescore_report(report: Path) -> None:
    result = json.loads((report / "results.json").read_text())
    rows = [json.loads(line) for line in (report / "final_rows.jsonl").read_text().splitlines()]
    answers = {(t["run"], t["split"], t["task_id"]): t["transcript"].rsplit("[assistant] ", 1)[-1]
               for t in map(json.loads, (report / "final_transcripts.jsonl").read_text().splitlines())}
    tasks = tasks_by_id(get_suite("toolworld"), [r["task_id"] for r in rows])
    changed = Counter()
    for row in rows:
        item = answer_item(tasks[row["task_id"]])
        key = (row["run"], row["split"], row["task_id"])
        if item is None or key not in answers:
            continue
        before, now = credited(item, answers[key])
        if before and not now:
            checklist = tasks[row["task_id"]].payload["checklist"]
            row["reward"] -= 1 / (len(checklist["calls"]) + len(checklist["answer"]))
            row["success"] = float(row["reward"] >= SUCCESS_THRESHOLD)
            changed[row["run"], row["split"]] += 1
            print(f"  {row['run']:10s} {row['split']:10s} {row['family']:22s} no longer credited: {answers[key]!r}")
    for (run, split), n in sorted(changed.items()):
        print(f"{run} {split}: {n} rows lose their answer item")
    by_key: dict = {}
    for row in rows:
        by_key.setdefault((row.pop("run"), row.pop("split")), []).append(row)
    old = paired_intervals(result, TaskRows.from_file(report / "final_rows.jsonl"))
    new = paired_intervals(result, TaskRows(by_key))
    for split in ("test", "validation"):
        base_old = next(iter(old[split]["methods"].values()))["reward"]["base_mean"]
        base_new = next(iter(new[split]["methods"].values()))["reward"]["base_mean"]
        print(f"{split}: base mean reward {base_old:.3f} -> {base_new:.3f}")
        for name in new[split]["methods"]:
            a, b = old[split]["methods"][name]["reward"], new[split]["methods"][name]["reward"]
            print(f"  {name}: mean reward - base {a['mean_diff']:+.3f} [{a['ci95_low']:+.3f}, {a['ci95_high']:+.3f}]"
                  f" -> {b['mean_diff']:+.3f} [{b['ci95_low']:+.3f}, {b['ci95_high']:+.3f}]")


def rescore_probe(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tasks = tasks_by_id(get_suite("toolworld"), [r["task_id"] for r in rows if r["family"].startswith("weather/")])
    kept, lost = Counter(), Counter()
    for r in rows:
        item = answer_item(tasks[r["task_id"]]) if r["task_id"] in tasks else None
        if item is None or not r["success"]:
            continue
        answer = [m["content"] for m in r["messages"] if m["role"] == "assistant"][-1]
        (kept if credited(item, answer)[1] else lost)[r["family"]] += 1
    for family in sorted(set(kept) | set(lost)):
        print(f"{path.name}: {family}: {kept[family] + lost[family]} sampled successes, {lost[family]} no longer credited")


if __name__ == "__main__":
    rescore_report(Path(sys.argv[1]))
    for probe in sys.argv[2:]:
        rescore_probe(Path(probe))
