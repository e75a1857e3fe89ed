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
    with pytest.raises(ConfigError, match=r"rollout\.engine.*'hf', 'vllm' or 'vllm-server'"):
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


# --------------------------------------------------------------------------------------------------
# Values that used to be accepted: each refused, naming the field and what to write instead.
BAD_VALUES = [
    ("distill.lopd.lr_student=inf", "distill.lopd.lr_student", "valid number"),
    ("distill.lr_student=.inf", "distill.lr_student", "finite number"),
    ("distill.lr_student=.nan", "distill.lr_student", "finite number"),
    ("distill.lr_student=1e999", "distill.lr_student", "finite number"),
    ("registry.gate_margin=-.inf", "registry.gate_margin", "finite number"),
    ("cycle.retry_delay_seconds=.inf", "cycle.retry_delay_seconds", "finite number"),
    ("curation.family_slack=nan", "curation.family_slack", "valid number"),
    ("distill.family_weights={shop: .inf}", "distill.family_weights.shop", "finite number"),
    ("distill.family_weights={shop: true}", "distill.family_weights.shop", "valid number"),
    ("rollout.temperature=true", "rollout.temperature", "valid number"),
    ("distill.steps=true", "distill.steps", "valid integer"),
    ("distill.steps=3.0", "distill.steps", "valid integer"),
    ("distill.steps='3'", "distill.steps", "valid integer"),
    ("rollout.n_tasks=1.5", "rollout.n_tasks", "valid integer"),
    ("rollout.seed=2e1", "rollout.seed", "valid integer"),
    ("rollout.level=yes", "rollout.level", "valid integer"),
    ("model.gradient_checkpointing=1", "model.gradient_checkpointing", "valid boolean"),
    ("model.gradient_checkpointing='yes'", "model.gradient_checkpointing", "valid boolean"),
    ("curation.balance_families=0", "curation.balance_families", "valid boolean"),
    ("model.base=true", "model.base", "valid string"),
    ("evaluate.probe_suite=3", "evaluate.probe_suite", "valid string"),
    ("model.lora_targets=q_proj", "model.lora_targets", "valid list"),
    ("rollout.suite_dirs=/srv/suites", "rollout.suite_dirs", "valid list"),
    ("distill.lopd.cold_start.lr=.inf", "distill.lopd.cold_start.lr", "finite number"),
]


@pytest.mark.parametrize(("override", "field", "why"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_nonsense_values_are_refused_naming_the_field(override, field, why):
    with pytest.raises(ConfigError) as info:
        load_config("smoke", [override])
    message = str(info.value)
    assert f"{field}: " in message and why in message, message
    assert "(got " in message


def test_typed_values_still_work_from_yaml_and_overrides(tmp_path):
    cfg = load_config("smoke", ["distill.lr_student=1e-4", "distill.steps=3", "distill.lopd.margin=0",
                                "model.gradient_checkpointing=true", "distill.family_weights={shop: 2}",
                                "distill.lopd.lr_student=2.5E-5", "rollout.suite_dirs=[suites]"])
    assert cfg.distill.lr_student == 1e-4 and isinstance(cfg.distill.lr_student, float)
    assert cfg.distill.steps == 3 and cfg.distill.lopd.margin == 0.0 and cfg.model.gradient_checkpointing is True
    assert cfg.distill.family_weights == {"shop": 2.0} and cfg.distill.lopd.lr_student == 2.5e-5
    assert cfg.rollout.suite_dirs == ["suites"]
    path = tmp_path / "p.yaml"
    path.write_text("extends: smoke\ndistill:\n  lr_student: 1e-5\n  lopd:\n    cold_start:\n      lr: 3e-4\n")
    loaded = load_config(str(path))  # YAML 1.1 reads 1e-5 as text: a decimal literal is still a number
    assert loaded.distill.lr_student == 1e-5 and loaded.distill.lopd.cold_start.lr == 3e-4
    with pytest.raises(Exception, match="valid integer"):
        loaded.distill.steps = True  # assignment is checked the same way


def test_a_profile_that_extends_itself_is_a_config_error(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text(f"extends: {path}\ndistill:\n  steps: 2\n")
    with pytest.raises(ConfigError, match=r"profile cycle: .*loop\.yaml -> .*loop\.yaml"):
        load_config(str(path))


def test_a_cycle_of_profiles_names_the_chain(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"extends: {b}\n")
    b.write_text(f"extends: {a}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(a))
    assert str(info.value).startswith(f"profile cycle: {a} -> {b} -> {a};")
    ok = tmp_path / "ok.yaml"  # a chain through shipped profiles that does not loop still loads
    ok.write_text(f"extends: {tmp_path / 'mid.yaml'}\n")
    (tmp_path / "mid.yaml").write_text("extends: smoke\n")
    assert load_config(str(ok)).model.base == "tiny"


def test_extends_must_name_one_profile(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("extends: [smoke, demo]\n")
    with pytest.raises(ConfigError, match="extends must name one profile"):
        load_config(str(path))


@pytest.mark.parametrize("cycle_id", [".", "..", "", "a b", "a/b", "../c1", "c1'", "-c1", ".hidden", "c1\n",
                                      "x" * 129, "cycle\u00e9", "a\\b"])
def test_bad_cycle_ids_are_refused_with_the_rule(cycle_id, tmp_path, monkeypatch):
    from lopd_core.config import check_cycle_id
    from lopd_core.cycle import CycleContext

    with pytest.raises(ConfigError, match=r"is not allowed: use 1 to 128 letters, digits, dots, dashes"):
        check_cycle_id(cycle_id)
    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    with pytest.raises(ValueError, match=r"cycle id .* is not allowed"):
        CycleContext(load_config("smoke"), cycle_id)
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").rglob("cycle.json"))


@pytest.mark.parametrize("cycle_id", ["c1", "20261202T120000", "a.b_c-d", "1", "v1..2", "x" * 128])
def test_good_cycle_ids_pass(cycle_id):
    from lopd_core.config import check_cycle_id

    assert check_cycle_id(cycle_id) == cycle_id


def test_an_unquoted_off_is_the_choice_off():
    """YAML 1.1 reads `--set distill.lopd.privilege_gate=off` as false: a choice field offering "off" takes it."""
    cfg = load_config("smoke", ["distill.lopd.privilege_gate=off", "model.autocast=off"])
    assert cfg.distill.lopd.privilege_gate == "off" and cfg.model.autocast == "off"
    with pytest.raises(ConfigError, match="distill.lopd.privilege_gate"):
        load_config("smoke", ["distill.lopd.privilege_gate=yes"])  # no "on"/"yes" choice: still an error
