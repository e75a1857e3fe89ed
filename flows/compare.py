"""`lopd-compare`: LOPD against the baselines under one rollout budget, as a flow with one task per run.

Why: a comparison takes hours; as a flow each run is its own task (visible, retried on transient errors,
skipped when already finished) and the report lands as Prefect artifacts next to the files. How: the
same :mod:`lopd_core.compare` harness as ``lopd compare`` (same root, so the CLI and the flow resume each
other's work); the training runs hold the workspace's training slot (``cycle.concurrency_limit_name``),
so a comparison never trains at the same time as a cycle on the same machine.

Run it: ``python -m flows.compare toolworld lopd,grpo`` (ephemeral Prefect), or as the on-demand
deployment ``prefect deployment run lopd-compare/lopd-compare -p suite=codegen`` under ``lopd serve``.
"""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

from prefect import flow, task

from flows.common import (
    artifact_key,
    claim_flow_run,
    config,
    progress_artifact,
    reap_crashed,
    training_slot,
    transient,
)


def _comparison(profile: str, overrides: list[str], params: dict[str, Any]):
    from lopd_core.compare import parse_seeds_for, plan_comparison, split_names
    from lopd_core.workspace import Workspace

    cfg = config(profile, overrides, suites={"suite": params["suite"]})
    root = Path(params["root"] or Workspace.from_config(cfg.workspace).ensure().home / "compare" / params["suite"])
    return plan_comparison(cfg, suite=params["suite"], methods=split_names(params["methods"]), budget=params["budget"],
                           seeds=params["seeds"], root=root, ablations=split_names(params["ablations"]),
                           seeds_by_method=parse_seeds_for(params["seeds_for"]),
                           eval_every=params["eval_every"] or None, eval_tasks=params["eval_tasks"] or None,
                           seed_episodes=params["seed_episodes"] or None,
                           bank_episodes=[Path(p) for p in params.get("bank_episodes") or []])


@task(name="compare-bank", retry_condition_fn=transient, retries=1, persist_result=False)
def bank_task(profile: str, overrides: list[str], params: dict[str, Any]) -> dict:
    comp, _ = _comparison(profile, overrides, params)
    with progress_artifact("episodes", key=artifact_key("compare", params["suite"], "bank-progress"),
                           description=f"compare {params['suite']}: bank and base evaluation (episodes of each batch)"):
        return {"bank": comp.bank_info(), "base_eval": comp.base_eval()}


@task(name="compare-run", retry_condition_fn=transient, retries=1, persist_result=False)
def run_task(profile: str, overrides: list[str], params: dict[str, Any], key: str) -> dict:
    comp, specs = _comparison(profile, overrides, params)
    with progress_artifact("distill", key=artifact_key("compare", params["suite"], key, "progress"),
                           description=f"compare {params['suite']}: run {key} (training steps)"):
        return comp.run_timed(next(s for s in specs if s.key == key))


@flow(name="lopd-compare", log_prints=True)
def compare_flow(suite: str = "toolworld", methods: str = "lopd,grpo,opsd,sdpo,skill_sd,none", budget: int = 160,
                 seeds: int = 1, seeds_for: str = "", ablations: str = "", eval_every: int = 0, eval_tasks: int = 0,
                 seed_episodes: int = 0, bank_episodes: list[str] | None = None, root: str = "",
                 report_dir: str = "", profile: str = "demo", overrides: list[str] | None = None) -> dict:
    """Every run of the comparison (resuming finished ones), then the report as files and artifacts."""
    from lopd_core.compare_report import machine_description, summarize, write_report

    overrides = list(overrides or [])
    params = {"suite": suite, "methods": methods, "budget": budget, "seeds": seeds, "seeds_for": seeds_for,
              "ablations": ablations, "eval_every": eval_every, "eval_tasks": eval_tasks,
              "seed_episodes": seed_episodes, "bank_episodes": list(bank_episodes or []), "root": root}
    comp, specs = _comparison(profile, overrides, params)  # a bad plan fails here, before any work
    claim_flow_run()
    reap_crashed(comp.cfg)
    from lopd_core.progress import report

    with (training_slot(comp.cfg.cycle.concurrency_limit_name, comp.ws.home),
          progress_artifact("runs", key=artifact_key("compare", suite, "runs"),
                            description=f"compare {suite}: runs finished of {len(specs)}")):
        bank_task(profile, overrides, params)
        runs = []
        for spec in specs:
            runs.append(run_task.with_options(task_run_name=f"run-{spec.key}")(profile, overrides, params, spec.key))
            report("runs", len(runs), len(specs))
    result = comp.result(runs)
    out = Path(report_dir) if report_dir else Path("reports") / f"{suite}-{date.today().isoformat()}"
    command = f"flow lopd-compare, parameters {json.dumps({**params, 'profile': profile, 'overrides': overrides})}"
    summary = summarize(result, write_report(result, out, machine=machine_description(), command=command,
                                                 home=comp.ws.home))
    publish_artifacts(summary, out, n_runs=len(specs))
    return summary


def publish_artifacts(summary: dict, report_dir: Path, *, n_runs: int) -> None:
    """The report (with its curves inlined) as a markdown artifact and the final scores as a table."""
    import base64

    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = f"compare-{summary['suite'].lower().replace('_', '-')}"
    text = (report_dir / "README.md").read_text()
    for png in ("curves.png", "curves_with_pretraining.png"):
        if (report_dir / png).exists():
            inline = base64.b64encode((report_dir / png).read_bytes()).decode()
            text = text.replace(f"]({png})", f"](data:image/png;base64,{inline})")
    create_markdown_artifact(text, key=f"{key}-report", description=f"lopd compare on {summary['suite']}")
    rows = [{"run": name, "seeds": len(values), "final_success": ", ".join(f"{v:.3f}" for v in values)}
            for name, values in summary["final_success"].items()]
    create_table_artifact(rows, key=f"{key}-final", description=f"final held-out success ({n_runs} runs)")


if __name__ == "__main__":
    import sys

    from flows.common import prefect_environment

    prefect_environment("demo")
    print(json.dumps(compare_flow(*(sys.argv[1:3])), indent=2, default=str))
