import pytest

from lopd_core.config import PROFILES, ConfigError, load_config


@pytest.mark.parametrize("profile", PROFILES)
def test_shipped_profiles_load(profile):
    cfg = load_config(profile)
    assert cfg.name == profile
    assert cfg.distill.top_m >= 1


def test_profile_sizes_follow_the_method_table():
    smoke, demo, gpu = (load_config(p) for p in ("smoke", "demo", "gpu"))
    assert (smoke.distill.tasks_per_step, demo.distill.tasks_per_step, gpu.distill.tasks_per_step) == (2, 8, 32)
    assert (smoke.distill.lopd.n_retrieved, smoke.distill.lopd.n_latents) == (1, 4)
    assert (demo.distill.lopd.n_retrieved, demo.distill.lopd.n_latents) == (2, 16)
    assert (gpu.distill.lopd.n_retrieved, gpu.distill.lopd.n_latents, gpu.distill.lopd.compressor_depth) == (3, 32, 8)
    assert (smoke.distill.top_m, demo.distill.top_m, gpu.distill.top_m) == (8, 20, 20)
    assert gpu.model.student == "full" and demo.model.student == "lora"
    assert gpu.distill.lopd.margin == 0.05 and gpu.distill.lopd.anchor_weight == 0.2 and gpu.distill.lopd.dual_lr == 0.5


def test_bad_value_names_the_field():
    with pytest.raises(ConfigError, match=r"distill\.top_m") as e:
        load_config("smoke", ["distill.top_m=0"])
    assert "greater than or equal to 1" in str(e.value)


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"rollout\.engine.*'hf' or 'vllm'"):
        load_config("smoke", ["rollout.engine=sglang"])


def test_unknown_field_is_an_error():
    with pytest.raises(ConfigError, match=r"distill\.lopd\.marginn: unknown field"):
        load_config("smoke", {"distill.lopd.marginn": 0.1})


def test_cross_field_rule_names_both_fields():
    with pytest.raises(ConfigError, match=r"distill\.tasks_per_step \(6\).*distill\.group_size \(4\)"):
        load_config("demo", ["distill.method=grpo", "distill.tasks_per_step=6"])


def test_profile_from_path_with_extends(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("extends: smoke\ndistill:\n  steps: 7\n")
    cfg = load_config(str(path))
    assert cfg.distill.steps == 7 and cfg.model.base == "tiny" and cfg.name == "mine"


def test_missing_profile_is_explained():
    with pytest.raises(ConfigError, match="neither a shipped profile"):
        load_config("no-such-profile")


def test_config_hash_is_stable_and_sensitive():
    a, b = load_config("smoke"), load_config("smoke")
    assert a.hash() == b.hash()
    assert a.hash() != a.with_overrides(["distill.steps=9"]).hash()
