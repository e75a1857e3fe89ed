"""Which held-out tasks did training change? Per-task outcomes of the base model and of each run's final student.

A comparison's curve is one number per evaluation point; when it stays flat (or falls) this says why, task by
task: the base model and the final student of each ``--runs`` run play the comparison's held-out tasks
greedily (the same tasks, seed and decoding as its evaluations) and for every task the reward, the success
and whether the student's answer differs from the base model's are recorded.

    python -m benchmarks.heldout_tasks --root $LOPD_HOME/compare/codegen --profile demo-codegen --eval-tasks 16 \
        --runs lopd-s0 grpo-s0

Per run it reports how many answers changed, how many tasks were gained and lost (success), how many changed
reward up and down, and the mean reward; per task the family, the rewards and the verifier's feedback.
Writes ``benchmarks/results/heldout_tasks_<suite>.json``; ``--resume`` keeps the runs already there (when the base
model's replay comes out the same) and adds ``--runs``, so a run finished later costs one replay, not all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _answer(trajectory) -> str:
    return "\n".join(m.get("content") or json.dumps(m.get("tool_calls", ""))
                     for m in trajectory.messages[trajectory.initial_messages:] if m["role"] == "assistant")


def _rates(trajectories: list) -> dict[str, float]:
    from lopd_core.evaluation import episode_metrics

    metrics = episode_metrics(trajectories)
    return {"mean_reward": metrics["eval/mean_reward"], "success_rate": metrics["eval/success_rate"]}


def compare_to_base(base: list, student: list) -> dict[str, float]:
    """Counts of a student's episodes against the base model's, task by task (same task order)."""
    pairs = list(zip(base, student, strict=True))
    return {"tasks": len(pairs),
            "answers_changed": sum(_answer(b) != _answer(s) for b, s in pairs),
            "gained": sum(s.success and not b.success for b, s in pairs),
            "lost": sum(b.success and not s.success for b, s in pairs),
            "reward_up": sum(s.reward > b.reward + 1e-9 for b, s in pairs),
            "reward_down": sum(s.reward < b.reward - 1e-9 for b, s in pairs),
            **_rates(student)}


def _merge_previous(previous: dict, settings: dict, students: dict, tasks: list[dict]) -> tuple[dict, list[dict]]:
    """The runs of an earlier result that this one did not replay, kept where both replayed the same base."""
    fields = ("task_id", "base_reward", "base_feedback", "base_answer_sha1")  # a file without hashes never matches
    same_base = [tuple(t.get(f) for f in fields) for t in previous.get("per_task", [])] == \
        [tuple(t[f] for f in fields) for t in tasks]
    if previous.get("settings") != settings or not same_base:
        print(f"--resume: the earlier result has other settings or another base replay; keeping only {list(students)}")
        return students, tasks
    kept = [run for run in previous["students"] if run not in students]
    print(f"--resume: kept {', '.join(kept) or 'no runs'} from the earlier result")
    merged = [{**t, **{k: v for k, v in old.items() if k.rsplit("_", 1)[0] in kept}}
              for t, old in zip(tasks, previous["per_task"], strict=True)]
    return {**{run: previous["students"][run] for run in kept}, **students}, merged


def main(argv: list[str] | None = None) -> int:
    from lopd_core.compare import final_dir, run_dir
    from lopd_core.config import load_config
    from lopd_core.evaluation import evaluate
    from lopd_core.training import build_policies
    from lopd_core.workspace import Workspace, portable

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="a `lopd compare` work directory")
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--suite", default=None, help="default: the root's folder name")
    parser.add_argument("--eval-tasks", type=int, default=None,
                        help="held-out tasks, as the comparison's --eval-tasks (default: the profile's evaluate.n_tasks)")
    parser.add_argument("--runs", nargs="+", required=True, help="runs whose final student is played (e.g. lopd-s0)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in --out (same settings, same base-model replay) and add --runs")
    args = parser.parse_args(argv)

    suite = args.suite or args.root.name
    missing = [r for r in args.runs if not (run_dir(args.root, r) / "result.json").exists()]
    if missing:
        parser.error(f"no finished run {', '.join(missing)} under {args.root / 'runs'}")
    overrides = {"rollout.suite": suite, "evaluate.probe_n_tasks": 0, "evaluate.probe_prompts": 0}
    cfg = load_config(args.profile, overrides | ({"evaluate.n_tasks": args.eval_tasks} if args.eval_tasks else {}))
    ws = Workspace.from_config(cfg.workspace)
    policies = build_policies(cfg, models_dir=ws.models_dir)
    started = time.perf_counter()

    def play(scope, name):
        return evaluate(scope, policies.tokenizer, cfg=cfg, suite_name=suite, policy_version=name,
                        with_probe=False).trajectories

    base = play(policies.teacher, "base")
    episodes = {}
    for run in args.runs:
        policies.load_student(final_dir(args.root, run) / "student")
        episodes[run] = play(policies.student, run)
        print(run, json.dumps(compare_to_base(base, episodes[run])), flush=True)
    base_answers = [_answer(b) for b in base]
    tasks = [{"task_id": b.task_id, "family": b.family, "base_reward": b.reward, "base_feedback": b.feedback[:200],
              "base_answer_sha1": hashlib.sha1(base_answers[i].encode()).hexdigest(),
              **{f"{run}_reward": eps[i].reward for run, eps in episodes.items()},
              **{f"{run}_changed": _answer(eps[i]) != base_answers[i] for run, eps in episodes.items()},
              **{f"{run}_feedback": eps[i].feedback[:200] for run, eps in episodes.items()}}
             for i, b in enumerate(base)]
    out = args.out or RESULTS / f"heldout_tasks_{suite}.json"
    settings = {"suite": suite, "profile": args.profile, "eval_tasks": args.eval_tasks}
    students = {run: compare_to_base(base, eps) for run, eps in episodes.items()}
    command = portable("python -m benchmarks.heldout_tasks " + " ".join(argv or []), ws.home)
    commands = [command]
    if args.resume and out.exists():
        previous = json.loads(out.read_text())
        students, tasks = _merge_previous(previous, settings, students, tasks)
        if set(students) - set(episodes):  # runs kept from the earlier result: name the commands that played them
            commands = [*previous.get("commands", [previous.get("command", "?")]), command]
    out.write_text(json.dumps({
        "benchmark": f"heldout_tasks_{suite}", "command": command, "commands": commands,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(time.perf_counter() - started, 1),
        "settings": settings, "base": _rates(base), "students": students, "per_task": tasks}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
