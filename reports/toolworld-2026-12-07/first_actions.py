"""How the final students open some families' tasks, per run and split, from the reports' kept transcripts.

Each report folder keeps every run's final task rows (``final_rows.jsonl``: family, phrasing cluster, reward)
and the transcripts of those episodes (``final_transcripts.jsonl``). A first action is a tool call, an
invented tool reply (it opens ``<tool_response>``: the agent writes the tool's answer itself) or a plain
answer. Seeds of a method (``results.json``'s run names) are pooled; the base model is taken from the first report that has it.

    python reports/toolworld-2026-12-07/first_actions.py reports/toolworld-2026-12-07/claim2 \\
        reports/toolworld-2026-12-07/claim2-opener --family calendar/count_meetings weather/condition
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from lopd_core.compare_report import group_runs
from lopd_core.envs.tools import TOOL_CALL_OPEN, TOOL_RESPONSE_OPEN

KINDS = ("call", "invented", "answer")


def first_kind(transcript: str) -> str:
    """The kind of the transcript's first assistant turn (``[assistant] …``, as the evaluation writes it). Read
    from the transcript, not the rows' ``invented_reply`` column, which evaluations before 2026-12-07 lack."""
    first = transcript.split("[assistant]", 1)[1].lstrip() if "[assistant]" in transcript else ""
    return "invented" if first.startswith(TOOL_RESPONSE_OPEN) else "call" if first.startswith(TOOL_CALL_OPEN) else "answer"


def run_names(folder: Path) -> dict[str, str]:
    """Each run of the report → its method's name (``results.json``); the base model is ``base``."""
    groups = group_runs(json.loads((folder / "results.json").read_text())["runs"])
    return {"base": "base", **{r["run"]: name for name, runs in groups.items() for r in runs}}


def tally(folders: list[Path], family: str) -> dict:
    """``{method: {split: {phrasing: {"tasks", "reward_sum", "call", "invented", "answer"}}}}``, seeds pooled;
    a method found in two reports is kept under ``<report>:<method>``."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: dict.fromkeys(("tasks", "reward_sum", *KINDS), 0))))
    seen: dict[str, str] = {}
    for folder in folders:
        names = run_names(folder)
        rows = {}
        for line in (folder / "final_rows.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows[(r["run"], r["split"], r["task_id"])] = r
        for line in (folder / "final_transcripts.jsonl").read_text().splitlines():
            t = json.loads(line)
            row = rows.get((t["run"], t["split"], t["task_id"]))
            if row is None or row["family"] != family:
                continue
            method = names[t["run"]]
            if seen.setdefault(method, folder.name) != folder.name:
                if method == "base":
                    continue
                method = f"{folder.name}:{method}"
            cell = out[method][t["split"]][row["cluster"].split("|", 1)[1]]
            cell["tasks"] += 1
            cell["reward_sum"] += row["reward"]
            cell[first_kind(t["transcript"])] += 1
    return json.loads(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="report folders (final_rows.jsonl, final_transcripts.jsonl)")
    parser.add_argument("--family", nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    tables = {family: tally(args.reports, family) for family in args.family}
    for family, table in tables.items():
        print(f"{family}: first actions of the final greedy episodes, seeds pooled")
        print(f"{'method':28s} {'split':10s} {'phrasing':40s} tasks  call invented answer  mean reward")
        for method, splits in table.items():
            for split, phrasings in sorted(splits.items()):
                for phrasing, c in phrasings.items():
                    print(f"{method:28s} {split:10s} {phrasing[:40]:40s} {c['tasks']:5d} {c['call']:5d} "
                          f"{c['invented']:8d} {c['answer']:6d}  {c['reward_sum'] / c['tasks']:.3f}")
    if args.out:
        args.out.write_text(json.dumps({"reports": [p.name for p in args.reports], "families": tables}, indent=2) + "\n")


if __name__ == "__main__":
    main()
