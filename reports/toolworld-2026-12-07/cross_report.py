"""Pair the runs of one comparison report with those of another, task by task (same task ids).

A comparison root is lost when a machine's workspace is wiped; its report keeps every run's final task rows
(``final_rows.jsonl``). A run made later on a rebuilt root (same bank command, same evaluation seeds, so the
same task ids) can then be paired against the earlier runs. The base model is scored in both, so the script
first says how far the two bases agree: a difference there is the machine's, not a method's.

    python reports/toolworld-2026-12-07/cross_report.py reports/toolworld-2026-12-07/claim2 \\
        reports/toolworld-2026-12-07/claim2-opener --new lopd_opener --old lopd_text lopd@lr3e-4 grpo rft
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lopd_core.compare_report import FINAL_ROWS, TaskRows, group_runs
from lopd_core.stats import paired_cluster_bootstrap


class Report:
    """A report folder: its runs (``results.json``) and their final task rows (``final_rows.jsonl``)."""

    def __init__(self, folder: Path):
        self.groups = group_runs(json.loads((folder / "results.json").read_text())["runs"])
        self.rows = TaskRows.from_file(folder / FINAL_ROWS)

    def seeds(self, name: str) -> list[dict]:
        if name not in self.groups:
            raise SystemExit(f"no run named {name!r}; the report has {sorted(self.groups)}")
        return self.groups[name]

    def of(self, name: str, split: str) -> list[dict]:
        """Every seed's rows of the runs called ``name``; the bootstrap averages seeds per task."""
        return self.rows.of(self.seeds(name), split)


def fmt(p: dict) -> str:
    return f"{p['mean_diff']:+.3f} [{p['ci95_low']:+.3f}, {p['ci95_high']:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="the earlier report folder (with final_rows.jsonl)")
    parser.add_argument("new", type=Path, help="the later report folder")
    parser.add_argument("--new", dest="new_names", nargs="+", required=True, help="run names in the later report")
    parser.add_argument("--old", dest="old_names", nargs="+", default=[], help="run names in the earlier report")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    old, new = Report(args.old), Report(args.new)
    out: dict = {}
    for split in ("test", "validation"):
        ob = {r["task_id"]: r for r in old.rows.base(split)}
        nb = {r["task_id"]: r for r in new.rows.base(split)}
        shared = sorted(set(ob) & set(nb))
        same = sum(ob[t]["reward"] == nb[t]["reward"] for t in shared)
        section = {"base_tasks_shared": len(shared), "base_same_reward": same,
                   "base_mean_reward_old": sum(ob[t]["reward"] for t in shared) / max(len(shared), 1),
                   "base_mean_reward_new": sum(nb[t]["reward"] for t in shared) / max(len(shared), 1),
                   "pairs": {}}
        print(f"[{split}] base: {same}/{len(shared)} tasks with the same reward; mean "
              f"{section['base_mean_reward_old']:.3f} (old) vs {section['base_mean_reward_new']:.3f} (new)")
        for name in args.new_names:
            rows, seeds = new.of(name, split), new.seeds(name)
            for label, base_rows in (("new base", new.rows.base(split)), ("old base", old.rows.base(split))):
                p = paired_cluster_bootstrap(rows, base_rows)
                section["pairs"][f"{name} - {label}"] = {**p, "seeds": len(seeds)}
                print(f"  {name} ({len(seeds)} seeds) - {label}: {fmt(p)}")
            for other in args.old_names:
                p = paired_cluster_bootstrap(rows, old.of(other, split))
                n_other = len(old.seeds(other))
                section["pairs"][f"{name} - {other}"] = {**p, "seeds": len(seeds), "other_seeds": n_other}
                print(f"  {name} - {other} ({n_other} seeds, old report): {fmt(p)}")
        out[split] = section
    if args.out:
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
