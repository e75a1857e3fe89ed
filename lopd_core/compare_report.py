"""The comparison report: learning curves (PNG), final scores, LOPD's rollout-budget ratios (Markdown).

``rollouts_to_reach``: for each baseline, the number of training episodes after which LOPD's held-out
success first reaches that baseline's FINAL mean success, as a share of the baseline's budget (the
paper's "under 30% of the budget" claim). It is computed per LOPD seed (first evaluation point at or above
the target) and reported as mean ± std over the seeds that reached it, with how many did; "not reached"
means LOPD never got there within its own budget. The same ratio with pre-training episodes (the bank)
added to both sides is reported next to it.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from lopd_core.compare import mean_std
from lopd_core.stats import paired_cluster_bootstrap, per_family
from lopd_core.workspace import portable


def group_runs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[r["name"]].append(r)
    return dict(groups)


def mean_curve(runs: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(episodes, mean, std) at every evaluation point all runs share."""
    by_ep: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        for p in r["curve"]:
            by_ep[p["episodes"]].append(p["success_rate"])
    return [(ep, *mean_std(v)) for ep, v in sorted(by_ep.items()) if len(v) == len(runs)]


def first_reach(curve: list[dict[str, Any]], target: float) -> int | None:
    for p in curve:
        if p["episodes"] > 0 and p["success_rate"] >= target - 1e-9:
            return p["episodes"]
    return None


def budget_ratios(groups: dict[str, list[dict[str, Any]]], reference: str = "lopd") -> list[dict[str, Any]]:
    if reference not in groups:
        return []
    lopd_runs = groups[reference]
    rows = []
    for name, runs in groups.items():
        if name == reference or name.startswith("lopd"):
            continue
        target, target_std = mean_std([r["final_success"] for r in runs])
        budget = runs[0]["budget"]
        pre_base = statistics.fmean(r["pretraining_episodes"] + r.get("skill_generations", 0.0) for r in runs)
        reached = [(first_reach(r["curve"], target), r["pretraining_episodes"]) for r in lopd_runs]
        hits = [(ep, pre) for ep, pre in reached if ep is not None]
        ratio = [ep / budget for ep, _ in hits]
        ratio_pre = [(ep + pre) / (budget + pre_base) for ep, pre in hits]
        rows.append({"baseline": name, "baseline_final": target, "baseline_final_std": target_std,
                     "baseline_seeds": len(runs), "budget": budget, "lopd_seeds": len(lopd_runs),
                     "lopd_seeds_reaching": len(hits), "ratio": mean_std(ratio) if ratio else None,
                     "ratio_with_pretraining": mean_std(ratio_pre) if ratio_pre else None})
    return rows


MARKERS = "osD^vP*Xhp<>"


def identical_curves(groups: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Sets of runs whose mean curves are the same point for point (they overlap in the plot)."""
    by_curve: dict[tuple, list[str]] = {}
    for name, runs in sorted(groups.items()):
        by_curve.setdefault(tuple((ep, round(m, 9)) for ep, m, _ in mean_curve(runs)), []).append(name)
    return [names for names in by_curve.values() if len(names) > 1]


def plot(groups: dict[str, list[dict[str, Any]]], path: Path, *, title: str, with_pretraining: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    curves = {name: mean_curve(runs) for name, runs in groups.items()}
    ordered = [(name, groups[name]) for name in sorted(groups, key=lambda n: (n != "lopd", n)) if curves[name]]
    for i, (name, runs) in enumerate(ordered):
        curve = curves[name]
        shift = statistics.fmean(r["pretraining_episodes"] for r in runs) if with_pretraining else 0.0
        xs = [ep + shift for ep, _, _ in curve]
        mu = [m for _, m, _ in curve]
        sd = [s for _, _, s in curve]
        style = "-" if not name.startswith("lopd_") else "--"
        # distinct markers, drawn first = largest: identical curves stay visible as nested markers
        line, = ax.plot(xs, mu, style, marker=MARKERS[i % len(MARKERS)], ms=3 + 1.5 * (len(ordered) - i),
                        mfc="none", lw=2.2 if name == "lopd" else 1.3, label=f"{name} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(xs, [a - b for a, b in zip(mu, sd, strict=True)], [a + b for a, b in zip(mu, sd, strict=True)],
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("rollouts consumed (episodes" + (", incl. pre-training)" if with_pretraining else ", training only)"))
    ax.set_ylabel("held-out success rate")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(ms) -> str:
    if ms is None:
        return "not reached"
    m, s = ms
    return f"{m:.0%} ± {s:.0%}"


def write_report(result: dict[str, Any], out_dir: Path, *, machine: str, command: str,
                 home: Path | None = None) -> Path:
    """README.md, the two PNGs, results.json and the final evaluations' task rows (``final_rows.jsonl``, enough
    to recompute every paired interval without the work directory) under ``out_dir``; paths under ``home``
    (the workspace) are written as ``$LOPD_HOME/…`` so that a committed report names no machine's directories."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(result["runs"])
    suite = result["suite"]
    plot(groups, out_dir / "curves.png", title=f"{suite}: held-out success vs training rollouts (mean ± std)")
    plot(groups, out_dir / "curves_with_pretraining.png", title=f"{suite}: incl. pre-training episodes",
         with_pretraining=True)
    shared = result.get("shared", {})
    bank = shared.get("bank", {})
    base = shared.get("base_eval", {})
    lines = [f"# LOPD vs baselines on `{suite}`", "",
             f"Command: `{command}`  ", f"Machine: {machine}  ",
             f"Budget: {result['budget']} training episodes per run; held-out evaluation on "
             f"{int(base.get('eval/n', 0))} test tasks (greedy).  ",
             f"Experience bank: {bank.get('successes')} successes in {bank.get('episodes')} base-model episodes → "
             f"{bank.get('experiences')} experiences (pre-training budget of lopd and opsd).  ",
             f"Base model held-out success: {base.get('eval/success_rate', float('nan')):.3f} "
             f"(mean reward {base.get('eval/mean_reward', float('nan')):.3f})", "",
             "![curves](curves.png)", "", "What each model reads: [inputs.md](inputs.md). Every final evaluation's "
             f"task scores: [{FINAL_ROWS}]({FINAL_ROWS}); what the agent did in each greedy episode: "
             f"[{FINAL_TRANSCRIPTS}]({FINAL_TRANSCRIPTS}) (evaluations made since 2026-12-07).", ""]
    lines += [f"Identical curves (they overlap in the plot): {', '.join(names)}.  " for names in identical_curves(groups)]
    lines += ["", "## Final held-out success", "",
              "Mean reward is the verifier's partial credit (share of tests passed, of checks met), so it moves "
              "before success does.", "",
              "| run | seeds | final success (mean ± std) | final mean reward | best point | wall time / run | "
              "generated tokens / run | pre-training episodes |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in sorted(groups.items(), key=lambda kv: (kv[0].startswith("lopd_"), kv[0])):
        m, s = mean_std([r["final_success"] for r in runs])
        best = max(p["success_rate"] for r in runs for p in r["curve"])
        wall = statistics.fmean(r["wall_s"] for r in runs)
        toks = statistics.fmean(r["generated_tokens"] for r in runs)
        rm, rs = mean_std([r["curve"][-1].get("mean_reward", float("nan")) for r in runs])
        lines.append(f"| {name} | {len(runs)} | {m:.3f} ± {s:.3f} | {rm:.3f} ± {rs:.3f} | {best:.3f} | "
                     f"{wall / 60:.1f} min | {toks:,.0f} | {runs[0]['pretraining_episodes']} |")
    ratios = budget_ratios(groups)
    if ratios:
        lines += ["", "## Rollouts LOPD needs to reach each baseline's final score", "",
                  "Share of the baseline's budget (training episodes) after which LOPD's held-out success first "
                  "reaches the baseline's final mean; mean ± std over the LOPD seeds that reached it.", "",
                  "| baseline | baseline final | LOPD seeds reaching | share of budget | share incl. pre-training |",
                  "|---|---|---|---|---|"]
        base_success = base.get("eval/success_rate", 0.0)
        for r in ratios:
            trivial = " (≤ base model: trivially reached)" if r["baseline_final"] <= base_success + 1e-9 else ""
            lines.append(f"| {r['baseline']} (n={r['baseline_seeds']}){trivial} | {r['baseline_final']:.3f} ± "
                         f"{r['baseline_final_std']:.3f} | {r['lopd_seeds_reaching']}/{r['lopd_seeds']} | "
                         f"{_fmt(r['ratio'])} | {_fmt(r['ratio_with_pretraining'])} |")
    rows = TaskRows.of_result(result)
    paired = paired_intervals(result, rows)
    result["paired"] = paired
    lines += intervals_section(paired)
    lines += signals_section(groups)
    lines += ["", "![curves incl. pre-training](curves_with_pretraining.png)", "", "## Curves (all points)", ""]
    for r in result["runs"]:
        pts = ", ".join(f"{p['episodes']}:{p['success_rate']:.3f}" for p in r["curve"])
        lines.append(f"- `{r['run']}`: {pts}")
    def scrub(text: str) -> str:
        return portable(text, home) if home is not None else text

    (out_dir / "results.json").write_text(scrub(json.dumps(result, indent=2, default=str)))
    rows.write(out_dir / FINAL_ROWS)  # scores and task ids only: no path to scrub
    rows.write_transcripts(out_dir / FINAL_TRANSCRIPTS)
    inputs = Path(result["root"]) / "inputs.md" if result.get("root") else None
    if inputs is not None and inputs.exists():
        (out_dir / "inputs.md").write_text(scrub(inputs.read_text()))
    path = out_dir / "README.md"
    path.write_text(scrub("\n".join(lines) + "\n"))
    return path


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def final_rows(root: Path, run: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """A finished run's task rows of its last full evaluation on ``split`` (empty when it has none)."""
    files = sorted((Path(root) / "runs" / run["run"] / "eval").glob(f"{split}-step*.jsonl"))
    return _rows(files[-1]) if files else []


FINAL_ROWS = "final_rows.jsonl"  # beside a report's results.json
FINAL_TRANSCRIPTS = "final_transcripts.jsonl"  # the greedy episodes behind those rows, as text
EVAL_SPLITS = ("validation", "test")
_ROW_TEXT = ("task_id", "family", "cluster")  # the only text a compact row keeps; the rest are its scores


class TaskRows:
    """The task rows of the final full evaluation of the base model (``"base"``) and of each run, per split.

    Read from a comparison's work directory, or from the ``final_rows.jsonl`` its report writes beside
    ``results.json``: a committed report is enough to recompute every paired interval after the work
    directory is gone. A compact row keeps the task's id, family and cluster and its numeric scores."""

    def __init__(self, rows: dict[tuple[str, str], list[dict[str, Any]]]):
        self._rows = {key: value for key, value in rows.items() if value}

    @classmethod
    def from_root(cls, root: Path, runs: list[dict[str, Any]]) -> TaskRows:
        root = Path(root)
        rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for split in EVAL_SPLITS:
            rows["base", split] = _rows(root / "base" / "eval" / f"{split}-step0000.jsonl")
            for run in runs:
                rows[run["run"], split] = final_rows(root, run, split)
        return cls(rows)

    @classmethod
    def from_file(cls, path: Path) -> TaskRows:
        rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for number, row in enumerate(_rows(Path(path)), 1):
            try:
                rows[row.pop("run"), row.pop("split")].append(row)
            except KeyError as missing:
                raise ValueError(f"{path}, line {number}: a task row without {missing}") from None
        return cls(dict(rows))

    @classmethod
    def of_result(cls, result: dict[str, Any], report_dir: Path | None = None) -> TaskRows:
        """From the comparison's work directory while it exists, else from the report's ``final_rows.jsonl``."""
        root = Path(result["root"]) if result.get("root") else None
        if root is not None and (root / "base" / "eval").is_dir():
            return cls.from_root(root, result["runs"])
        if report_dir is not None and (Path(report_dir) / FINAL_ROWS).exists():
            return cls.from_file(Path(report_dir) / FINAL_ROWS)
        return cls({})

    def base(self, split: str) -> list[dict[str, Any]]:
        return self._rows.get(("base", split), [])

    def of(self, runs: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
        """All runs' (one method's seeds') rows on ``split``."""
        return [row for run in runs for row in self._rows.get((run["run"], split), [])]

    def write(self, path: Path) -> Path | None:
        if not self._rows:
            return None
        lines = [json.dumps({"run": run, "split": split, **{k: v for k, v in row.items()
                                                            if k in _ROW_TEXT or isinstance(v, (int, float, bool))}})
                 for (run, split), rows in sorted(self._rows.items()) for row in rows]
        path.write_text("\n".join(lines) + "\n")
        return path

    def write_transcripts(self, path: Path) -> Path | None:
        """The transcript of each row's greedy episode (``episode_transcript``), keyed like the rows, so that
        a report's answers can be read and re-scored after the work directory is gone; None when no row has
        one (evaluations made before transcripts were kept)."""
        lines = [json.dumps({"run": run, "split": split, "task_id": row["task_id"], "reward": row.get("reward"),
                             "transcript": row["transcript"]})
                 for (run, split), rows in sorted(self._rows.items()) for row in rows if row.get("transcript")]
        if not lines:
            return None
        path.write_text("\n".join(lines) + "\n")
        return path


def paired_intervals(result: dict[str, Any], rows: TaskRows | None = None) -> dict[str, Any]:
    """Per split and method: the paired difference to the base model on the final full evaluation (seeds
    averaged per task), its cluster-bootstrap interval and MDE, for mean reward and success; per family, the
    mean reward of each method and the base. Empty when the comparison kept no task rows."""
    rows = rows if rows is not None else TaskRows.of_result(result)
    out: dict[str, Any] = {}
    for split in EVAL_SPLITS:
        base = rows.base(split)
        if not base:
            continue
        methods: dict[str, Any] = {}
        families: dict[str, dict[str, float]] = {"base": per_family(base, "reward")}
        for name, runs in group_runs(result["runs"]).items():
            method = rows.of(runs, split)
            if not method:
                continue
            methods[name] = {metric: paired_cluster_bootstrap(method, base, metric=metric)
                             for metric in ("reward", "success")}
            methods[name]["seeds"] = len(runs)
            families[name] = per_family(method, "reward")
        out[split] = {"tasks": len(base), "methods": methods, "per_family_reward": families}
    return out


def intervals_section(paired: dict[str, Any]) -> list[str]:
    """The paired, cluster-bootstrap comparison with the base model, per split, and the per-family rewards."""
    lines = []
    for split, block in paired.items():
        lines += ["", f"## Against the base model, {split} split ({block['tasks']} tasks, final evaluation)", "",
                  "Paired per task (each method's seeds averaged per task), 95 % interval from a bootstrap over "
                  "(family, phrasing) clusters; MDE = the smallest difference this spread would detect (5 %, 80 % "
                  "power).", "",
                  "| run | seeds | mean reward − base [95 %] | MDE | success − base [95 %] |", "|---|---|---|---|---|"]
        for name, m in block["methods"].items():
            r, s = m["reward"], m["success"]
            lines.append(f"| {name} | {m['seeds']} | {r['mean_diff']:+.3f} [{r['ci95_low']:+.3f}, {r['ci95_high']:+.3f}] | "
                         f"{r['mde']:.3f} | {s['mean_diff']:+.3f} [{s['ci95_low']:+.3f}, {s['ci95_high']:+.3f}] |")
        fams = block["per_family_reward"]
        names = list(fams)
        all_families = sorted({f for v in fams.values() for f in v})
        lines += ["", f"Mean reward per family ({split}):", "", "| family | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        for family in all_families:
            lines.append(f"| {family} | " + " | ".join(f"{fams[n].get(family, float('nan')):.3f}" for n in names) + " |")
    return lines


def _signal(runs: list[dict[str, Any]], key: str, field: str, fmt: str) -> str:
    values = [r["signals"][key][field] for r in runs if key in r.get("signals", {})]
    return format(statistics.fmean(values), fmt) if values else "–"


def signals_section(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per-step training metrics of every run (mean over its seeds): what moved while the curves did or did not."""
    if not any(r.get("signals") for runs in groups.values() for r in runs):
        return []
    lines = ["", "## Training signals", "",
             "Per-step metrics from each run's MLflow run, averaged over its seeds: on-policy success of the "
             "training rollouts, the share of steps that updated the student at all, the student's gradient norm, "
             "and for LOPD the top-M KL to the teacher, the margin Δ the constraint asks to be ≥ m (balanced: mean "
             "δ on successes − on failures; signed: the paper's), the teacher's δ on the step's successes and at "
             "their first action token, and the dual variable β at the end.", "",
             "| run | train success (mean over steps) | steps with an update | student grad norm (mean) | "
             "KL top-M first → last | Δ mean | δ successes | δ first token | β last |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in sorted(groups.items(), key=lambda kv: (kv[0].startswith("lopd_"), kv[0])):
        kl = (f"{_signal(runs, 'distill/kl_topk', 'first', '.4f')} → {_signal(runs, 'distill/kl_topk', 'last', '.4f')}"
              if any("distill/kl_topk" in r.get("signals", {}) for r in runs) else "–")
        lines.append(f"| {name} | {_signal(runs, 'rollout/success_rate', 'mean', '.3f')} | "
                     f"{_signal(runs, 'distill/updated', 'mean', '.0%')} | "
                     f"{_signal(runs, 'distill/student_grad_norm', 'mean', '.3g')} | {kl} | "
                     f"{_signal(runs, 'distill/margin_delta', 'mean', '.4f')} | "
                     f"{_signal(runs, 'distill/privilege_success', 'mean', '.4f')} | "
                     f"{_signal(runs, 'distill/privilege_first_token', 'mean', '.3f')} | "
                     f"{_signal(runs, 'distill/beta', 'last', '.3f')} |")
    return lines


def machine_description() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"


def summarize(result: dict[str, Any], report: Path) -> dict[str, Any]:
    """The short form of a comparison: final scores per run and LOPD's budget ratios."""
    groups = group_runs(result["runs"])
    return {"suite": result["suite"], "report": str(report), "root": result["root"], "budget": result["budget"],
            "final_success": {n: [r["final_success"] for r in rs] for n, rs in groups.items()},
            "budget_ratios": budget_ratios(groups)}
