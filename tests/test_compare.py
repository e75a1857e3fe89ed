"""`lopd compare` end to end on the tiny model: shared bank, cold start, runs, report, resume."""

import json
import os
import re
import subprocess
import sys

import pytest


def _compare(home, models_dir, report, methods, *extra):
    return subprocess.run(
        [sys.executable, "-m", "lopd_cli", "compare", "--profile", "smoke", "--set",
         f"workspace.models_dir={models_dir}", "--suite", "toolworld", "--methods", methods, "--budget", "4",
         "--eval-every", "1", "--report-dir", str(report), "--json", *extra],
        capture_output=True, text=True, env={**os.environ, "LOPD_HOME": str(home)}, timeout=900)


def test_compare_runs_methods_reports_and_resumes(tmp_path, models_dir, monkeypatch):
    home, report = tmp_path / "ws", tmp_path / "report"
    first = _compare(home, models_dir, report, "lopd,grpo")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert set(summary["final_success"]) == {"lopd", "grpo"} and summary["budget"] == 4
    runs = home / "compare" / "toolworld" / "runs"
    lopd = json.loads((runs / "lopd-s0" / "result.json").read_text())
    grpo = json.loads((runs / "grpo-s0" / "result.json").read_text())
    # same budget, same evaluation points (step 0 = the shared base evaluation), the bank counted for LOPD only
    assert [p["episodes"] for p in lopd["curve"]] == [p["episodes"] for p in grpo["curve"]] == [0, 2, 4]
    assert lopd["curve"][0] == grpo["curve"][0]
    assert lopd["pretraining_episodes"] > 0 and grpo["pretraining_episodes"] == 0
    text = (report / "README.md").read_text()
    assert "Rollouts LOPD needs" in text and (report / "curves.png").stat().st_size > 1000
    # the final table shows the partial-credit reward next to success, from the last evaluation point
    lopd_row = next(line for line in text.splitlines() if line.startswith("| lopd |"))
    assert f"| {lopd['curve'][-1]['mean_reward']:.3f} ± 0.000 |" in lopd_row
    # training signals, read back from each run's MLflow metrics: every step once; LOPD's Δ and β, none for GRPO
    signals = {r["run"]: r["signals"] for r in json.loads((report / "results.json").read_text())["runs"]}
    assert signals["lopd-s0"]["rollout/success_rate"]["steps"] == 2 == signals["grpo-s0"]["distill/updated"]["steps"]
    assert "distill/beta" in signals["lopd-s0"] and "distill/privilege_delta" not in signals["grpo-s0"]
    # each comparison run has params MLflow's compare view can group by
    from lopd_core.config import load_config
    from lopd_core.registry import ModelRegistry

    registry = ModelRegistry(f"sqlite:///{home / 'mlflow.db'}", (home / "mlartifacts").as_uri(),
                             load_config("smoke").registry)
    experiment = registry.experiment_for("compare-toolworld")
    for key, method in (("lopd-s0", "lopd"), ("grpo-s0", "grpo")):
        mlflow_key = (runs / key / "mlflow_key").read_text().strip()  # the run folder's own MLflow identity
        assert mlflow_key.startswith(f"{key}/")
        params = registry.find_run("lopd.compare_run", mlflow_key, experiment).data.params
        assert params["method"] == params["run"] == method and params["budget"] == "4"
    grpo_row = next(line for line in text.split("## Training signals")[1].splitlines() if line.startswith("| grpo |"))
    assert grpo_row.endswith("| – | – | – | – | – |")
    # the committed results name the workspace as $LOPD_HOME, not this machine's directory
    results = (report / "results.json").read_text()
    assert str(home) not in results and "$LOPD_HOME/compare/toolworld/runs/lopd-s0" in results

    # --report-only: the finished runs of a larger plan, nothing run
    partial = _compare(home, models_dir, tmp_path / "partial", "lopd,grpo,none", "--report-only",
                       "--root", str(home / "compare" / "toolworld"))
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert str(home) not in (tmp_path / "partial" / "README.md").read_text()  # the command names $LOPD_HOME
    assert set(json.loads(partial.stdout.strip().splitlines()[-1])["final_success"]) == {"lopd", "grpo"}
    assert not (runs / "none-s0").exists()

    # results carried to another workspace (its MLflow store lacks these runs): the recorded signals are kept
    moved = tmp_path / "moved"
    for run in json.loads((report / "results.json").read_text())["runs"]:
        (moved / "runs" / run["run"]).mkdir(parents=True)
        (moved / "runs" / run["run"] / "result.json").write_text(json.dumps(run))
    elsewhere = _compare(tmp_path / "ws2", models_dir, tmp_path / "moved-report", "lopd,grpo", "--report-only",
                         "--root", str(moved))
    assert elsewhere.returncode == 0, elsewhere.stderr[-3000:]
    kept = {r["run"]: r["signals"] for r in json.loads((tmp_path / "moved-report" / "results.json").read_text())["runs"]}
    assert kept == signals

    # generated tokens read back from the per-step metrics agree with the run's own count (nothing was killed)
    reported = {r["run"]: r for r in json.loads((report / "results.json").read_text())["runs"]}
    assert reported["lopd-s0"]["generated_tokens"] == lopd["generated_tokens"] > 0

    # resume: finished runs are not redone, a new method is added to the same comparison; an attempt of it
    # that was killed outright (SIGKILL: no exception, only its per-step attempt.json) still counts its time
    mtime = (runs / "lopd-s0" / "result.json").stat().st_mtime
    (runs / "none-s0").mkdir()
    (runs / "none-s0" / "attempt.json").write_text(json.dumps({"elapsed_s": 1000.0}))
    second = _compare(home, models_dir, report, "lopd,grpo,none")
    assert second.returncode == 0, second.stderr[-3000:]
    assert (runs / "lopd-s0" / "result.json").stat().st_mtime == mtime
    none = json.loads((runs / "none-s0" / "result.json").read_text())
    assert 1000.0 < none["wall_s"] < 1000.0 + 600 and not (runs / "none-s0" / "attempt.json").exists()
    assert "none" in json.loads(second.stdout.strip().splitlines()[-1])["final_success"]

    # external benchmarks (BFCL single-turn, HumanEval in the sandbox) on a chosen run's final student
    from benchmarks import external_eval

    out = tmp_path / "external.json"
    monkeypatch.setenv("LOPD_HOME", str(home))
    assert external_eval.main(["--root", str(home / "compare" / "toolworld"), "--profile", "smoke", "--runs",
                               "lopd-s0", "--bfcl", "1", "--humaneval", "1", "--out", str(out)]) == 0
    external = json.loads(out.read_text())
    assert [r["run"] for r in external["results"]] == ["base", "lopd-s0"]
    assert all(r["bfcl_l1"]["n"] == 1 and r["humaneval_l1"]["n"] == 1 for r in external["results"])
    assert str(home) not in external["command"] and "$LOPD_HOME/compare/toolworld" in external["command"]
    # --resume keeps the scored rows and adds the runs that are missing (grpo-s0 finished too)
    assert external_eval.main(["--root", str(home / "compare" / "toolworld"), "--profile", "smoke", "--bfcl", "1",
                               "--humaneval", "1", "--out", str(out), "--resume"]) == 0
    resumed = json.loads(out.read_text())["results"]
    assert [r["run"] for r in resumed] == ["base", "grpo-s0", "lopd-s0", "none-s0"]
    assert resumed[0] == external["results"][0] and resumed[2] == external["results"][1]  # kept, not re-scored

    # every task's scores are kept for the paired intervals: the base's full evaluation on both splits, and
    # each run's middle and final points; the report compares every run with the base, per split and family
    root = home / "compare" / "toolworld"
    base_test = [json.loads(line) for line in (root / "base" / "eval" / "test-step0000.jsonl").read_text().splitlines()]
    base_val = [json.loads(line) for line in (root / "base" / "eval" / "validation-step0000.jsonl").read_text().splitlines()]
    assert len(base_test) == len(base_val) == 4 and all("tool_name_logprob" in r for r in base_test)
    assert sum("sampled_success" in r for r in base_val) == 2  # smoke: 2 sampled tasks, 2 samples each
    # a first action that writes the tool's reply itself is counted (the transcript shows it)
    assert all(r["invented_reply"] == float(bool(re.match(r"\s*\[assistant\]\s*<tool_response>", r["transcript"])))
               for r in base_test + base_val)
    assert sorted(p.name for p in (runs / "lopd-s0" / "eval").glob("validation-*")) == ["validation-step0001.jsonl",
                                                                                     "validation-step0002.jsonl"]
    assert "## Against the base model, validation split (4 tasks" in text and "Mean reward per family" in text
    paired = json.loads((report / "results.json").read_text())["paired"]
    assert set(paired["test"]["methods"]) == {"lopd", "grpo", "none"}  # the report of the resumed comparison
    assert paired["validation"]["methods"]["lopd"]["reward"]["tasks"] == 4
    # self_improvement.json gathers the same comparison with probe results (here a hand-written probe file)
    from benchmarks import self_improvement

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"teachers": {"text/chat_turn": {
        "privilege_success": 0.1, "privilege_failure": -0.2, "privilege_first_token": 0.3,
        "first_token_ci95_low": 0.2, "first_token_ci95_high": 0.4, "successes": 3, "failures": 1}}}))
    gathered = tmp_path / "self_improvement.json"
    assert self_improvement.main(["--root", str(root), "--probe", str(probe), "--out", str(gathered),
                                  "--report", str(report / "results.json")]) == 0
    si = json.loads(gathered.read_text())
    assert si["held_out_tasks"] == si["validation_tasks"] == 4 and set(si["methods"]) == {"lopd", "grpo", "none"}
    lopd_si = si["methods"]["lopd"]
    assert lopd_si["delta_reward_vs_base"] == paired["test"]["methods"]["lopd"]["reward"]["mean_diff"]
    assert lopd_si["ci95_low"] <= lopd_si["ci95_high"] and si["methods"]["grpo"]["steps_updated_fraction"] is not None
    base_fields = json.loads((root / "shared.json").read_text())["base_eval"]["fields"]["test"]
    assert si["base"]["mean_reward"] == base_fields["test/mean_reward"]
    assert si["teacher"]["text/chat_turn"]["ci95_low"] == 0.2 and str(home) not in gathered.read_text()
    # LOPD against each other method on the same tasks: the mean of the per-task differences
    from lopd_core.compare_report import final_rows
    from lopd_core.stats import per_task_means

    runs_by = {r["name"]: r for r in json.loads((report / "results.json").read_text())["runs"]}
    for other in ("grpo", "none"):
        ours, theirs = (per_task_means(final_rows(root, runs_by[n], "test"), "reward") for n in ("lopd", other))
        expected = sum(ours[t] - theirs[t] for t in ours) / len(ours)
        assert si["pairs"][f"lopd_minus_{other}"]["test_reward"]["mean_diff"] == pytest.approx(expected, abs=1e-3)
    # the pairs of another run name (a learning-rate grid point is named like lopd@lr3e-4): the same pair, mirrored
    assert self_improvement.main(["--root", str(root), "--out", str(gathered), "--lopd", "grpo"]) == 0
    mirrored = json.loads(gathered.read_text())["pairs"]
    assert set(mirrored) == {"grpo_minus_lopd", "grpo_minus_none"}
    assert mirrored["grpo_minus_lopd"]["test_reward"]["mean_diff"] == pytest.approx(
        -si["pairs"]["lopd_minus_grpo"]["test_reward"]["mean_diff"], abs=1e-3)
    # the report alone (results.json and the final_rows.jsonl beside it) gathers the same figures once the work
    # directory is gone: its root is written as $LOPD_HOME/…, which exists nowhere
    kept = [json.loads(line) for line in (report / "final_rows.jsonl").read_text().splitlines()]
    assert {(r["run"], r["split"]) for r in kept} >= {("base", "test"), ("lopd-s0", "validation")}
    assert all(set(r) >= {"task_id", "family", "reward", "success"} for r in kept)
    assert not any(isinstance(v, str) and k not in ("run", "split", "task_id", "family", "cluster")
                   for r in kept for k, v in r.items())
    # beside them, what the agent did in each of those greedy episodes: its own turns after the prompt
    transcripts = [json.loads(line) for line in (report / "final_transcripts.jsonl").read_text().splitlines()]
    assert {(r["run"], r["split"], r["task_id"]) for r in transcripts} == {(r["run"], r["split"], r["task_id"])
                                                                           for r in kept}
    assert all(r["transcript"].startswith("[assistant] ") for r in transcripts)
    assert "[system]" not in transcripts[0]["transcript"] and "[user]" not in transcripts[0]["transcript"]
    alone = tmp_path / "self_improvement_from_report.json"
    assert self_improvement.main(["--report", str(report / "results.json"), "--out", str(alone)]) == 0
    from_report = json.loads(alone.read_text())
    assert from_report["methods"] == si["methods"] and from_report["pairs"] == si["pairs"]
    assert from_report["base"] == si["base"]
    with pytest.raises(SystemExit, match="no --report"):
        self_improvement.main(["--root", str(tmp_path / "gone"), "--out", str(alone)])

    # per-task held-out outcomes of the base model and a run's final student (same tasks as the evaluations)
    from benchmarks import heldout_tasks

    per_task = tmp_path / "tasks.json"
    assert heldout_tasks.main(["--root", str(home / "compare" / "toolworld"), "--profile", "smoke", "--runs",
                               "lopd-s0", "--out", str(per_task)]) == 0
    tasks = json.loads(per_task.read_text())
    assert tasks["students"]["lopd-s0"]["tasks"] == 4 == len(tasks["per_task"])  # the smoke profile's held-out tasks
    # the same tasks and decoding as the comparison's evaluations: its step-0 and final points come back
    assert abs(tasks["base"]["mean_reward"] - lopd["curve"][0]["mean_reward"]) < 1e-6
    assert abs(tasks["students"]["lopd-s0"]["mean_reward"] - lopd["curve"][-1]["mean_reward"]) < 1e-6
    # --resume replays the base again, keeps lopd-s0 (same replay) and adds grpo-s0
    assert heldout_tasks.main(["--root", str(home / "compare" / "toolworld"), "--profile", "smoke", "--runs",
                               "grpo-s0", "--out", str(per_task), "--resume"]) == 0
    more = json.loads(per_task.read_text())
    assert list(more["students"]) == ["lopd-s0", "grpo-s0"]
    assert more["students"]["lopd-s0"] == tasks["students"]["lopd-s0"]
    assert [t["lopd-s0_feedback"] for t in more["per_task"]] == [t["lopd-s0_feedback"] for t in tasks["per_task"]]
    assert all("grpo-s0_reward" in t for t in more["per_task"])
    assert more["commands"] == [tasks["command"], more["command"]] and "--runs lopd-s0" in tasks["command"]


def test_a_run_played_from_nothing_gets_its_own_mlflow_run(tmp_path):
    from lopd_core.compare import Comparison, RunSpec

    spec = RunSpec("grpo", 0)
    first, again, legacy = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder in (first, again, legacy):
        folder.mkdir()
    key = Comparison.mlflow_key(first, spec, fresh=True)
    assert key.startswith("grpo-s0/") and Comparison.mlflow_key(first, spec, fresh=False) == key  # kept on resume
    assert Comparison.mlflow_key(again, spec, fresh=True) != key  # the same run played again: a new MLflow run
    assert Comparison.mlflow_key(legacy, spec, fresh=False) == "grpo-s0"  # a folder from before resumes its run


def test_heldout_resume_keeps_earlier_runs_only_when_the_base_answers_are_the_same():
    """--resume merges by task; a base replay with another answer (same reward and feedback) drops the old runs."""
    from benchmarks.heldout_tasks import _merge_previous

    settings = {"suite": "toolworld", "profile": "smoke", "eval_tasks": None}

    def task(sha, **runs):
        return {"task_id": "t0", "base_reward": 0.5, "base_feedback": "ok", "base_answer_sha1": sha, **runs}

    previous = {"settings": settings, "students": {"a": {"lost": 1}}, "per_task": [task("x", a_reward=1.0)]}
    students, tasks = _merge_previous(previous, settings, {"b": {"lost": 0}}, [task("x", b_reward=0.0)])
    assert list(students) == ["a", "b"] and tasks == [task("x", a_reward=1.0, b_reward=0.0)]
    students, tasks = _merge_previous(previous, settings, {"b": {"lost": 0}}, [task("y", b_reward=0.0)])
    assert list(students) == ["b"] and tasks == [task("y", b_reward=0.0)]
    # a file written before answers were hashed cannot show the same base answers: its runs are dropped
    old = {**previous, "per_task": [{k: v for k, v in task("x", a_reward=1.0).items() if k != "base_answer_sha1"}]}
    assert list(_merge_previous(old, settings, {"b": {}}, [task("x", b_reward=0.0)])[0]) == ["b"]
    assert list(_merge_previous(previous, {**settings, "eval_tasks": 16}, {"b": {}}, [task("x")])[0]) == ["b"]


def test_compare_flow_runs_each_run_as_a_task_and_publishes_the_report(tmp_path, models_dir, monkeypatch):
    """The Prefect flow (ephemeral server): one task per run, the report on disk and as artifacts."""
    from lopd_core.config import load_config
    from lopd_core.workspace import Workspace

    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    overrides = [f"workspace.models_dir={models_dir}"]
    for k, v in Workspace.from_config(load_config("smoke", overrides).workspace).ensure().prefect_env().items():
        monkeypatch.setenv(k, v)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, TaskRunFilter

    from flows.compare import compare_flow

    report = tmp_path / "report"
    summary = compare_flow(suite="toolworld", methods="lopd,none", budget=2, eval_every=1, report_dir=str(report),
                           profile="smoke", overrides=overrides)
    assert set(summary["final_success"]) == {"lopd", "none"} and summary["budget"] == 2
    assert summary["budget_ratios"] and summary["budget_ratios"][0]["baseline"] == "none"
    assert (report / "README.md").exists() and (report / "curves.png").stat().st_size > 1000
    with get_client(sync_client=True) as client:
        names = sorted(t.name for t in client.read_task_runs(task_run_filter=TaskRunFilter()))
        arts = {a.key: a for a in client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
                "compare-toolworld-report", "compare-toolworld-final", "compare-toolworld-runs",
                "compare-toolworld-lopd-s0-progress", "compare-toolworld-bank-progress"])))}
    assert {"run-lopd-s0", "run-none-s0"} <= set(names) and any(n.startswith("compare-bank") for n in names)
    assert "data:image/png;base64," in arts["compare-toolworld-report"].data
    assert "Rollouts LOPD needs" in arts["compare-toolworld-report"].data
    assert {r["run"] for r in json.loads(arts["compare-toolworld-final"].data)} == {"lopd", "none"}
    # progress a user can watch: runs finished, each run's training steps, the bank's episodes
    assert arts["compare-toolworld-runs"].type == "progress" and float(arts["compare-toolworld-runs"].data) == 100.0
    assert float(arts["compare-toolworld-lopd-s0-progress"].data) == 100.0
    assert float(arts["compare-toolworld-bank-progress"].data) > 0


def test_run_order_is_seed_major_then_ablations_and_names_are_checked():
    import pytest

    from lopd_core.compare import run_specs

    specs = run_specs(["lopd", "grpo", "sdpo"], 3, seeds_by_method={"sdpo": 1}, ablations=["lopd_m0", "lopd_k8"])
    assert [s.key for s in specs] == ["lopd-s0", "grpo-s0", "sdpo-s0", "lopd-s1", "grpo-s1", "lopd-s2", "grpo-s2",
                                      "lopd_m0-s0", "lopd_k8-s0"]
    assert specs[-1].overrides == {"distill.method": "lopd", "distill.lopd.n_latents": 8}
    from lopd_core.compare import ABLATIONS
    from lopd_core.config import load_config

    for name, overrides in ABLATIONS.items():  # every ablation names real fields with valid values
        cfg = load_config("demo").with_overrides(overrides)
        for key, value in overrides.items():
            got = cfg
            for part in key.split("."):
                got = getattr(got, part)
            assert got == value, (name, key, got)
    with pytest.raises(ValueError, match="unknown ablation 'lopd_k9'"):
        run_specs(["lopd"], 1, ablations=["lopd_k9"])
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        run_specs(["ppo"], 1)
    # --seeds-for also gives an ablation more seeds (seed-major after the methods); a name the plan does not
    # run is an error
    more = run_specs(["lopd"], 1, ablations=["lopd_text", "lopd_m0"], seeds_by_method={"lopd_text": 3})
    assert [s.key for s in more] == ["lopd-s0", "lopd_text-s0", "lopd_m0-s0", "lopd_text-s1", "lopd_text-s2"]
    with pytest.raises(ValueError, match="seeds-for names lopd_txt, which this comparison does not run"):
        run_specs(["lopd"], 1, ablations=["lopd_text"], seeds_by_method={"lopd_txt": 3})
    # the learning-rate grid: one seed per method and rate, on the method's own learning-rate field
    grid = run_specs(["lopd", "rft_hinted", "none"], 1, lr_grid=[3e-5, 3e-4])
    assert [s.key for s in grid[3:]] == ["lopd@lr3e-5-s0", "rft_hinted@lr3e-5-s0", "lopd@lr3e-4-s0",
                                          "rft_hinted@lr3e-4-s0"]
    assert grid[4].overrides == {"distill.method": "rft", "distill.rft.hint": True, "distill.rft.lr_student": 3e-5}
    assert grid[4].method == "rft"
    cfg = load_config("demo").with_overrides({"distill.lr_student": 1e-4, **grid[5].overrides})
    assert cfg.distill.student_lr() == 3e-4  # the grid's rate wins over the shared one
    # --seeds-for gives a grid point more seeds too (seed-major after the grid's seed 0); a misspelt one fails
    more = run_specs(["lopd", "grpo"], 1, lr_grid=[3e-4], seeds_by_method={"lopd@lr3e-4": 3})
    assert [s.key for s in more] == ["lopd-s0", "grpo-s0", "lopd@lr3e-4-s0", "grpo@lr3e-4-s0",
                                     "lopd@lr3e-4-s1", "lopd@lr3e-4-s2"]
    assert more[-1].overrides == more[2].overrides
    with pytest.raises(ValueError, match="seeds-for names lopd@lr3e-5.*grid points: lopd@lr3e-4, grpo@lr3e-4"):
        run_specs(["lopd", "grpo"], 1, lr_grid=[3e-4], seeds_by_method={"lopd@lr3e-5": 3})


def test_report_names_the_curves_that_overlap_in_the_plot(tmp_path):
    from lopd_core.compare_report import group_runs, identical_curves, write_report

    def run(name, seed, points):
        return {"run": f"{name}-s{seed}", "name": name, "seed": seed, "final_success": points[-1],
                "curve": [{"episodes": 8 * i, "success_rate": p, "mean_reward": p} for i, p in enumerate(points)],
                "wall_s": 60.0, "generated_tokens": 100, "pretraining_episodes": 0, "budget": 8}

    runs = [run("lopd", 0, [0.25, 0.5]), run("grpo", 0, [0.25, 0.25]), run("none", 0, [0.25, 0.25]),
            run("opsd", 0, [0.25, 0.25]), run("opsd", 1, [0.25, 0.5])]  # opsd's mean differs: 0.25, 0.375
    assert identical_curves(group_runs(runs)) == [["grpo", "none"]]

    result = {"suite": "toolworld", "budget": 8, "runs": runs,
              "shared": {"base_eval": {"eval/n": 4, "eval/success_rate": 0.25, "eval/mean_reward": 0.25}}}
    text = write_report(result, tmp_path, machine="test", command="lopd compare").read_text()
    assert "Identical curves (they overlap in the plot): grpo, none." in text
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_task_rows_kept_beside_a_report_round_trip_and_name_a_bad_line(tmp_path):
    from lopd_core.compare_report import TaskRows

    def row(task, reward):
        return {"task_id": task, "family": "bank/account_of", "cluster": "bank/account_of/p0", "reward": reward,
                "success": reward >= 0.8, "messages": [{"role": "assistant", "content": "long transcript"}],
                "response": "text that a compact row drops"}

    rows = TaskRows({("base", "test"): [row("t0", 0.0), row("t1", 1.0)], ("lopd-s0", "test"): [row("t0", 1.0)],
                     ("lopd-s1", "test"): [row("t0", 0.5)], ("grpo-s0", "validation"): []})
    path = rows.write(tmp_path / "final_rows.jsonl")
    back = TaskRows.from_file(path)
    runs = [{"run": "lopd-s0"}, {"run": "lopd-s1"}]
    assert [r["reward"] for r in back.of(runs, "test")] == [1.0, 0.5] and back.of(runs, "validation") == []
    assert back.base("test")[1] == {"task_id": "t1", "family": "bank/account_of", "cluster": "bank/account_of/p0",
                                    "reward": 1.0, "success": True}  # no transcript, no free text
    assert TaskRows({}).write(tmp_path / "none.jsonl") is None and not (tmp_path / "none.jsonl").exists()
    assert rows.write_transcripts(tmp_path / "t.jsonl") is None  # rows evaluated before transcripts were kept
    rows = TaskRows({("base", "test"): [{**row("t0", 0.0), "transcript": "[assistant] There are 2 meetings."}],
                     ("lopd-s0", "test"): [row("t0", 1.0)]})
    kept = [json.loads(line) for line in rows.write_transcripts(tmp_path / "t.jsonl").read_text().splitlines()]
    assert kept == [{"run": "base", "split": "test", "task_id": "t0", "reward": 0.0,
                     "transcript": "[assistant] There are 2 meetings."}]
    assert "transcript" not in TaskRows.from_file(rows.write(tmp_path / "r.jsonl")).base("test")[0]
    (tmp_path / "bad.jsonl").write_text(path.read_text() + json.dumps({"run": "lopd-s0", "reward": 1.0}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl, line 5: a task row without 'split'"):
        TaskRows.from_file(tmp_path / "bad.jsonl")


def test_an_evaluation_transcript_is_the_agents_own_part_with_shortened_observations():
    from test_memory_support import make_trajectory

    from lopd_core.evaluation import episode_transcript

    episode = make_trajectory(3, answer="There are 2 meetings.", observation="x" * 900)
    text = episode_transcript(episode)
    assert text.startswith('[assistant] <tool_call>{"name": "lookup"') and text.endswith("[assistant] There are 2 meetings.")
    assert "helpful agent" not in text and "task number 3" not in text  # no system prompt, no request
    lite = [*episode.messages[:3], {"role": "tool", "content": "xxx …"}, episode.messages[4]]
    assert "x" * 900 not in episode_transcript(make_trajectory(3, answer="Two.", observation="x" * 900,
                                                               messages_lite=lite))
    cut = episode_transcript(episode, limit=40)
    assert len(cut) == 42 and cut.endswith(" …")


def test_a_cold_start_trained_with_other_settings_is_not_reused():
    from lopd_core.compare import cold_start_key
    from lopd_core.config import load_config

    cfg = load_config("demo").with_overrides({"distill.lopd.context_placement": "chat_turn"})
    key = cold_start_key(cfg)
    assert key == cold_start_key(load_config("demo").with_overrides({"distill.lopd.context_placement": "chat_turn",
                                                                      "distill.lr_student": 3e-4}))
    for field, value in [("distill.lopd.cold_start.steps", 160), ("distill.lopd.cold_start.lr", 3e-5),
                         ("distill.lopd.cold_start.batch_size", 4), ("distill.lopd.n_latents", 8),
                         ("distill.lopd.context_placement", "system"), ("distill.lopd.cold_start.opener_weight", 10)]:
        assert cold_start_key(cfg.with_overrides({field: value})) != key, field
    # the plain NLL keeps the keys of the composers cold-started before the opener weight existed
    assert not key.endswith("-o1") and "-o" not in key.rsplit("-y", 1)[-1]
