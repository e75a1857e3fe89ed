"""Rescore the count families' successes of a probe's episodes with the count checker (`only=True`).

    python reports/toolworld-2026-12-07/rescore_counts.py $LOPD_HOME/probes/passk-toolworld-T0.7-k16-s0.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from lopd_core.envs import get_suite
from lopd_core.envs.base import tasks_by_id
from lopd_core.envs.tool_env import AnswerItem

COUNTS = ("calendar/count_meetings", "shop/count_orders")

rows = [r for line in open(sys.argv[1]) if (r := json.loads(line))["family"] in COUNTS and r["success"]]
tasks = tasks_by_id(get_suite("toolworld"), [r["task_id"] for r in rows])
before, after = defaultdict(set), defaultdict(set)
for r in rows:
    answer = [m["content"] for m in r["messages"] if m["role"] == "assistant"][-1]
    item, = tasks[r["task_id"]].payload["checklist"]["answer"]
    ok = AnswerItem(number=item["number"], only=True).satisfied_by(answer)
    before[r["family"]].add(r["task_id"])
    if ok:
        after[r["family"]].add(r["task_id"])
    print(f"{r['family']}  {r['task_id']}  count {item['number']:g}  credited now: {ok}  {answer!r}")
for family in COUNTS:
    print(f"{family}: tasks with a success {len(before[family])} -> {len(after[family])}")
