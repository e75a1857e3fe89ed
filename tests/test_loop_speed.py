"""benchmarks.loop_speed's run order and pooled ratio (the timed runs themselves need the vLLM-CPU environment)."""

from __future__ import annotations

import pytest

from benchmarks.loop_speed import pooled_ratio, run_order


def test_rounds_alternate_the_order_so_that_a_linear_drift_weighs_on_both_variants_alike():
    assert run_order(["before", "after"], 1) == [(0, "before"), (0, "after")]
    assert run_order(["before", "after"], 2) == [(0, "before"), (0, "after"), (1, "after"), (1, "before")]
    assert [v for _, v in run_order(["a", "b", "c"], 3)] == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_the_pooled_ratio_cancels_a_linear_drift_that_a_single_pair_does_not():
    # the machine slows by 10 % per run slot; "after" truly takes half the time of "before" (100 s vs 50 s)
    def slow(seconds: float, slot: int) -> float:
        return seconds * (1 + 0.1 * slot)

    rounds = [{"before": {"wall_s": slow(100, 0)}, "after": {"wall_s": slow(50, 1)}},
              {"after": {"wall_s": slow(50, 2)}, "before": {"wall_s": slow(100, 3)}}]
    assert abs(pooled_ratio(rounds[:1], "before", "after") - 2 / 1.1) < 1e-9  # one pair: drift reads as a smaller gain
    assert abs(pooled_ratio(rounds, "before", "after") - 2.0) < 1e-9  # ABBA, pooled: the true 2x
    assert pooled_ratio(rounds, "before", "after_eager") is None


def test_the_fp32_backward_variant_differs_from_after_eager_only_in_bf16_backward():
    from benchmarks.loop_speed import VARIANTS

    eager, fp32 = VARIANTS["after_eager"], VARIANTS["after_eager_fp32"]
    assert {k for k in eager.keys() | fp32.keys() if eager.get(k) != fp32.get(k)} == {"model.bf16_backward"}
    assert (eager["model.bf16_backward"], fp32["model.bf16_backward"]) == ("true", "false")


def test_only_the_tcmalloc_variant_changes_its_subprocess_environment(monkeypatch):
    import benchmarks.loop_speed as loop_speed

    environ = {"PATH": "/bin", "LD_PRELOAD": "libextra.so"}
    assert loop_speed.variant_env("after_eager", environ) == environ
    monkeypatch.setattr(loop_speed, "with_tcmalloc", lambda env: {**env, "LD_PRELOAD": "tc.so:" + env["LD_PRELOAD"]})
    assert loop_speed.variant_env("after_eager_tcmalloc", environ) == {"PATH": "/bin", "LD_PRELOAD": "tc.so:libextra.so"}
    assert loop_speed.VARIANTS["after_eager_tcmalloc"] == loop_speed.VARIANTS["after_eager"]
    assert loop_speed.VARIANTS["before_tcmalloc"] == loop_speed.VARIANTS["before"]
    assert loop_speed.variant_env("before_tcmalloc", environ)["LD_PRELOAD"] == "tc.so:libextra.so"
    monkeypatch.setattr(loop_speed, "with_tcmalloc", lambda env: None)
    with pytest.raises(SystemExit, match="libtcmalloc-minimal4"):
        loop_speed.variant_env("after_eager_tcmalloc", environ)


def _slot(wall: float, tokens: int, step_s: float, generated: int, rollout_s: float, success: float) -> dict:
    return {"wall_s": wall, "phases_s": {"rollouts": rollout_s}, "supervised_tokens": tokens,
            "step_tokens_per_s": tokens / step_s, "generated_tokens": generated,
            "generated_tokens_per_s": generated / rollout_s, "max_rss_gb": 6.0,
            "held_out": {"eval/success_rate": success, "rows": [{"task_id": "t0", "success": success > 0}]}}


def test_the_headline_compares_before_with_the_fast_variant_that_ran_pooled_over_rounds():
    from benchmarks.loop_speed import build_report, headline_variant

    assert headline_variant(["before", "after", "after_eager"]) == "after"
    assert headline_variant(["before", "after_eager_tcmalloc"]) == "after_eager_tcmalloc"
    assert headline_variant(["before"]) is None
    fast = "after_eager_tcmalloc"
    rounds = [{"before": _slot(1000, 100, 50, 500, 400, 0.25), fast: _slot(500, 100, 25, 500, 50, 0.25)},
              {fast: _slot(700, 300, 50, 500, 100, 0.5), "before": _slot(1400, 300, 150, 500, 500, 0.0)}]
    report = build_report(rounds, command="python -m benchmarks.loop_speed …", machine={"cpu_count": 2}, steps=20,
                          eval_tasks=1, opsd_vs_trl=4.0)
    assert report["after_variant"] == fast and report["run_after_s"] == 500 and report["run_before_s"] == 1000
    assert report["speedup"] == pytest.approx(2400 / 1200) and report["speedup_per_round"] == [2.0, 2.0]
    # rates pool as Σ tokens / Σ seconds: before 400 tokens in 200 s, the fast variant 400 in 75 s
    assert report["step_tokens_per_s_ratio"] == pytest.approx((400 / 75) / (400 / 200))
    assert report["vllm_in_loop_vs_hf"] == pytest.approx((1000 / 150) / (1000 / 900))
    assert report["rounds"][1]["before"]["held_out_success"] == 0.0 and report["held_out_tasks_apart"] == 0
    assert report["pooled_wall_s"] == {"before": 2400, fast: 1200} and report["tcmalloc_speedup"] is None


def test_report_only_writes_the_result_again_from_the_slots_an_earlier_run_kept(tmp_path):
    import json

    from benchmarks import loop_speed

    out = tmp_path / "loop_speed.json"
    with pytest.raises(SystemExit, match="slots.jsonl, which does not exist"):
        loop_speed.main(["--root", str(tmp_path), "--report-only", "--out", str(out)])
    slots = [(0, "before", _slot(1000, 100, 50, 500, 400, 0.25)), (0, "after", _slot(400, 100, 20, 500, 50, 0.25)),
             (1, "after", _slot(600, 100, 30, 500, 60, 0.25)), (1, "before", _slot(1200, 100, 60, 500, 480, 0.25))]
    out.with_suffix(".slots.jsonl").write_text("".join(
        json.dumps({"round": r, "variant": v, "command": "python -m benchmarks.loop_speed --rounds 2",
                    "machine": {"omp_num_threads": "2"}, "result": res}) + "\n"
        for r, v, res in slots))
    assert loop_speed.main(["--root", str(tmp_path), "--report-only", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "python -m benchmarks.loop_speed --rounds 2"  # the measuring command, not this one
    assert report["machine"] == {"omp_num_threads": "2"}  # and the machine it ran on
    assert report["speedup"] == pytest.approx(2200 / 1000) and len(report["rounds"]) == 2
