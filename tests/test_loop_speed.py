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
    monkeypatch.setattr(loop_speed, "with_tcmalloc", lambda env: None)
    with pytest.raises(SystemExit, match="libtcmalloc-minimal4"):
        loop_speed.variant_env("after_eager_tcmalloc", environ)
