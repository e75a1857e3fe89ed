"""`benchmarks.gpu_compare` (the torch+transformers+peft-only comparison) run for real on the tiny model, on CPU."""

import json

from benchmarks import gpu_compare


def test_gpu_compare_runs_every_method_and_writes_curves(tmp_path, models_dir):
    out = tmp_path / "gpu_compare.json"
    rc = gpu_compare.main(["--device", "cpu", "--model", "tiny", "--suite", "toolworld", "--methods", "lopd,grpo,none",
                           "--steps", "2", "--tasks-per-step", "4", "--seed-episodes", "4", "--eval-tasks", "2",
                           "--cold-start-steps", "1", "--eval-every", "1", "--models-dir", str(models_dir),
                           "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["machine"]["device"] == "cpu" and report["bank_experiences"] >= 2
    assert [r["method"] for r in report["results"]] == ["lopd", "grpo", "none"]
    for row in report["results"]:
        # same budget for every method; the step-0 point is the shared base evaluation
        assert row["train_episodes"] == 8 and [p["episodes"] for p in row["curve"]] == [0, 4, 8]
        assert row["curve"][0]["success_rate"] == report["base_success"]
        assert row["curve"][-1]["success_rate"] == row["final_success"]
    none = report["results"][2]
    assert none["update_s"] == 0.0 and report["results"][0]["update_s"] > 0.0
