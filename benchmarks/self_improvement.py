"""Does the agent improve from its own experience? The figures of one comparison, its probes and the base.

Assembles ``benchmarks/results/self_improvement.json`` from what the experiments left on disk:

- ``--root``: a comparison (``lopd compare``) work directory: each run's result and its final task rows on
  the held-out and validation splits; the paired difference of every method to the base model with the
  cluster-bootstrap interval (:func:`lopd_core.compare_report.paired_intervals`);
- ``--passk``: the ``lopd probe-passk --out`` summaries (per-family pass@k of the base model);
- ``--report``: the comparison report's ``results.json`` (its runs carry the training signals from MLflow). With
  the ``final_rows.jsonl`` the report keeps beside it, it is enough without ``--root``: a committed report can
  be gathered again after the work directory is gone;
- ``--probe``: one or more ``lopd probe-teacher --out`` results (each teacher's privilege on the base's episodes).

``pairs`` holds LOPD against every other method, paired per task on the final full evaluations.

    python -m benchmarks.self_improvement --root $LOPD_HOME/compare/toolworld \\
        --passk runs/probes/passk/passk-toolworld-T0.7-k16-s0.json --probe runs/probes/teacher.json

Nothing is measured here; it only gathers, so it can be re-run whenever a run finishes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from lopd_core.compare_report import TaskRows, paired_intervals
from lopd_core.stats import paired_cluster_bootstrap
from lopd_core.workspace import lopd_home, portable

RESULTS = Path(__file__).parent / "results" / "self_improvement.json"


def load_runs(root: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((root / "runs").glob("*/result.json"))]


def updated_fraction(run: dict[str, Any]) -> float | None:
    signal = run.get("signals", {}).get("distill/updated")
    return signal["mean"] if signal else None


def assemble(root: Path | None, passk: list[Path], probes: list[Path], report: Path | None = None,
             lopd: str = "lopd") -> dict[str, Any]:
    """From the comparison's work directory (``root``), or, once that is gone, from its report alone: the
    report's results.json and the final_rows.jsonl beside it."""
    if root is not None and (root / "shared.json").exists():
        shared = json.loads((root / "shared.json").read_text())
        # the comparison report's results.json carries each run with its training signals read back from MLflow
        runs = json.loads(report.read_text())["runs"] if report is not None else load_runs(root)
        plan = json.loads((root / "plan.json").read_text()) if (root / "plan.json").exists() else {}
        result = {"suite": plan.get("suite", ""), "root": str(root), "runs": runs, "budget": plan.get("budget")}
        rows = TaskRows.from_root(root, runs)
    elif report is not None:
        result = json.loads(report.read_text())
        shared, runs = result["shared"], result["runs"]
        rows = TaskRows.of_result(result, report.parent)
    else:
        raise SystemExit(f"no comparison at {root} (no shared.json) and no --report to read it from instead")
    paired = paired_intervals(result, rows)
    base_fields = shared["base_eval"]["fields"]
    out: dict[str, Any] = {
        "suite": result["suite"], "budget": result["budget"],
        "held_out_tasks": paired.get("test", {}).get("tasks"), "validation_tasks": paired.get("validation", {}).get("tasks"),
        "pass_at_k": {}, "bank": shared.get("bank", {}).get("coverage", {}),
        "base": {"success": base_fields["test"].get("test/success_rate"),
                 "mean_reward": base_fields["test"].get("test/mean_reward"),
                 "validation_reward": base_fields.get("validation", {}).get("validation/mean_reward")},
        "methods": {}, "teacher": {},
    }
    for path in passk:
        summary = json.loads(path.read_text())
        out["pass_at_k"][f"T{summary['temperature']}"] = summary["families"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_name.setdefault(run["name"], []).append(run)
    for name, group in by_name.items():
        test = paired.get("test", {}).get("methods", {}).get(name, {})
        validation = paired.get("validation", {}).get("methods", {}).get(name, {})
        finals = [r["curve"][-1] for r in group]
        fractions = [f for f in (updated_fraction(r) for r in group) if f is not None]
        out["methods"][name] = {
            "seeds": len(group),
            "final_success": test.get("success", {}).get("method_mean"),
            "final_mean_reward": test.get("reward", {}).get("method_mean"),
            "validation_reward": validation.get("reward", {}).get("method_mean"),
            "delta_reward_vs_base": test.get("reward", {}).get("mean_diff"),
            "ci95_low": test.get("reward", {}).get("ci95_low"), "ci95_high": test.get("reward", {}).get("ci95_high"),
            "mde": test.get("reward", {}).get("mde"),
            "validation_delta_reward_vs_base": validation.get("reward", {}).get("mean_diff"),
            "validation_ci95_low": validation.get("reward", {}).get("ci95_low"),
            "validation_ci95_high": validation.get("reward", {}).get("ci95_high"),
            "curve_final_success": statistics.fmean(f["success_rate"] for f in finals),
            "steps_updated_fraction": statistics.fmean(fractions) if fractions else None,
            "per_family": {"test": paired.get("test", {}).get("per_family_reward", {}).get(name, {}),
                           "validation": paired.get("validation", {}).get("per_family_reward", {}).get(name, {})},
        }
    out["pairs"] = lopd_pairs(rows, by_name, lopd)
    for probe in probes:  # e.g. the text teacher's probe and the latent teacher's (a composer cold-started elsewhere)
        teachers = json.loads(probe.read_text())["teachers"]
        for name, row in teachers.items():
            out["teacher"][name] = {"privilege_success": row["privilege_success"],
                                    "privilege_failure": row["privilege_failure"],
                                    "privilege_first_token": row["privilege_first_token"],
                                    "ci95_low": row["first_token_ci95_low"], "ci95_high": row["first_token_ci95_high"],
                                    "successes": row["successes"], "failures": row["failures"]}
    return out


def lopd_pairs(task_rows: TaskRows, by_name: dict[str, list[dict[str, Any]]], lopd: str = "lopd") -> dict[str, Any]:
    """LOPD (the runs named ``lopd``: ``lopd`` itself or a learning-rate grid point such as ``lopd@lr3e-4``)
    against every other method on the same tasks (``<lopd>_minus_<name>``): the paired difference of their
    final full evaluations, each method's seeds averaged per task, with the cluster-bootstrap interval."""
    out: dict[str, Any] = {}
    if lopd not in by_name:
        return out
    rows = {name: {split: task_rows.of(group, split) for split in ("test", "validation")}
            for name, group in by_name.items()}
    for name, group in by_name.items():
        if name == lopd:
            continue
        pair: dict[str, Any] = {"seeds": [len(by_name[lopd]), len(group)]}
        for split in ("test", "validation"):
            if rows[lopd][split] and rows[name][split]:
                d = paired_cluster_bootstrap(rows[lopd][split], rows[name][split], metric="reward")
                pair[f"{split}_reward"] = {k: round(d[k], 3) for k in ("mean_diff", "ci95_low", "ci95_high")}
                pair["tasks"] = d["tasks"]
        if len(pair) > 1:
            out[f"{lopd}_minus_{name}"] = pair
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None,
                        help="the comparison's work directory; without it (or once it is gone), --report alone")
    parser.add_argument("--passk", type=Path, nargs="*", default=[])
    parser.add_argument("--probe", type=Path, nargs="*", default=[])
    parser.add_argument("--report", type=Path, default=None,
                        help="the comparison report's results.json (lopd compare --report-only): runs with their "
                             "training signals (steps_updated_fraction); without it, the runs' result.json files")
    parser.add_argument("--lopd", default="lopd",
                        help="the runs LOPD's pairs are computed for: lopd, or its learning-rate grid point (lopd@lr3e-4)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = {"benchmark": "self_improvement",
              "command": portable("python -m benchmarks.self_improvement " + " ".join(argv or []), lopd_home()),
              **assemble(args.root, args.passk, args.probe, args.report, args.lopd)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(portable(json.dumps(report, indent=2, default=str), lopd_home()) + "\n")
    print(json.dumps({k: report[k] for k in ("suite", "base", "methods")}, indent=2, default=str)[:4000])
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
