"""The teacher-privilege probe (lopd_core.privilege, `lopd probe-teacher`): its δ figures are what they say.

The pieces the probe's numbers rest on are checked against values computed another way: the base model's
and the text teacher's action log-probs against plain forward passes of the model on the sequences they
should score, the summary of δ = log p_teacher − log p_base against hand-made values, and the probabilities
of the oracle's first call against the tokens they multiply. The CLI runs once on the tiny model.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lopd_core.algorithms.synthetic import experience_of, make_trajectory
from lopd_core.config import load_config
from lopd_core.models.composer import experience_turns
from lopd_core.models.latent import experiences_prompt
from lopd_core.models.policy import build_policy_set
from lopd_core.privilege import (
    action_logprobs,
    bootstrap_mean_ci,
    first_call_probabilities,
    summarize_privilege,
)
from lopd_core.records.chat import encode

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def rows_of(tok, n: int):
    return [make_trajectory(tok, task_id=f"t{i}", instruction=f"What is {i}+3?" + " Be brief." * i,
                            replies=[CALL, f"It is {i + 3}." + " Done." * i],
                            observations=[f"<tool_response>{i + 3}</tool_response>"], reward=float(i % 2))
            for i in range(n)]


def forward_logprobs(policies, ids: list[int], positions: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = policies.base(input_ids=torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits[[p - 1 for p in positions]], -1)
    return expected[torch.arange(len(positions)), [ids[p] for p in positions]]


@pytest.fixture(scope="module")
def policies(models_dir):
    cfg = load_config("smoke")
    torch.manual_seed(0)
    return build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")


def test_summary_of_deltas_matches_hand_computed_values():
    rows = [make_trajectory_stub(1.0), make_trajectory_stub(0.25), make_trajectory_stub(0.6)]
    base = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.0, -1.0]), torch.tensor([-1.0])]
    teacher = [torch.tensor([-0.5, -2.5, -2.0]), torch.tensor([-3.0, -1.5]), torch.tensor([0.0])]
    # δ: success [+0.5, −0.5, +1.0], failure [−2.0, −0.5], partial credit [+1.0] (counted as neither)
    got = summarize_privilege(teacher, base, rows)
    assert (got["successes"], got["failures"]) == (1, 1)
    assert got["privilege_success"] == pytest.approx(1.0 / 3) and got["privilege_failure"] == pytest.approx(-1.25)
    assert got["balanced_delta"] == pytest.approx(1.0 / 3 + 1.25)
    assert got["privilege_first_token"] == pytest.approx(0.5) == got["first_token_ci95_low"]  # one success
    assert got["success_ci95_low"] == pytest.approx(1.0 / 3) == got["success_ci95_high"]
    assert math.isnan(summarize_privilege(teacher[:1], base[:1], rows[:1])["privilege_failure"])  # undefined, not 0
    mean, lo, hi = bootstrap_mean_ci([0.0, 1.0] * 20)
    assert mean == 0.5 and lo < 0.5 < hi and hi - lo < 0.5


def test_opener_delta_sums_the_first_action_tokens_and_names_failures_that_invent_the_tool_reply():
    rows = [make_trajectory_stub(1.0, "<tool_call>\n{}"), make_trajectory_stub(0.0, "<tool_response>\n42"),
            make_trajectory_stub(0.0, "It is 42.")]
    base = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.0, -1.0])]
    teacher = [torch.tensor([-1.0, -1.0, -5.0]), torch.tensor([-1.0, -0.25, -9.0]), torch.tensor([-3.0, -1.0])]
    got = summarize_privilege(teacher, base, rows, opener_tokens=2)
    # δ: success [0, +1, −2]; the invented reply [0, +0.75, −8]; the direct answer [−2, 0]
    assert got["privilege_first_token"] == 0.0 and got["privilege_opener"] == pytest.approx(1.0)
    assert got["privilege_opener_failures"] == pytest.approx((0.75 - 2.0) / 2)
    assert got["failures_opening_tool_response"] == 1 and got["privilege_opener_tool_response"] == pytest.approx(0.75)
    assert got["opener_by_token"] == pytest.approx([0.0, 1.0]) and got["opener_by_token_tool_response"] == pytest.approx([0.0, 0.75])
    assert math.isnan(summarize_privilege(teacher[:1], base[:1], rows[:1])["privilege_opener_tool_response"])


def test_the_opener_is_the_tool_call_tag_which_shares_its_first_tokens_with_the_tool_reply_tag(policies):
    from lopd_core.algorithms.lopd import opener_length
    from lopd_core.records.chat import encode

    tok = policies.tokenizer
    call, reply = encode(tok, "<tool_call>"), encode(tok, "<tool_response>")
    assert opener_length(tok) == len(call) > 1 and call[0] == reply[0]  # the first token cannot tell them apart
    assert call[: opener_length(tok)] != reply[: opener_length(tok)]  # the opener can


def make_trajectory_stub(reward: float, first_action: str = ""):
    from types import SimpleNamespace

    return SimpleNamespace(reward=reward, initial_messages=1,
                           messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": first_action}])


def test_base_and_text_teacher_logprobs_are_the_models_own(policies):
    tok = policies.tokenizer
    rows = rows_of(tok, 5)  # five rows: two micro-batches of the probe (four at a time), of different lengths
    base = action_logprobs(policies, rows, teacher=None)
    for row, got in zip(rows, base, strict=True):
        positions = [i for i, m in enumerate(row.assistant_mask) if m]
        torch.testing.assert_close(got, forward_logprobs(policies, row.token_ids, positions), atol=1e-4, rtol=1e-4)

    cfg = load_config("smoke").with_overrides({"distill.lopd.context_placement": "chat_turn"})
    contexts = {r.episode_id: [experience_of(rows[(i + 1) % 5])] for i, r in enumerate(rows)}

    def builder(batch_rows):
        turns = [[experience_turns(tok, e, max_tokens=64) for e in contexts[r.episode_id]] for r in batch_rows]
        prompts = [experiences_prompt(tok, r.messages[: r.initial_messages], r.tools, t, placement="chat_turn")
                   for r, t in zip(batch_rows, turns, strict=True)]
        from lopd_core.algorithms.logprobs import model_logprobs

        return prompts, lambda batch: model_logprobs(policies, None, batch)

    teacher = action_logprobs(policies, rows, teacher=builder)
    for row, got in zip(rows, teacher, strict=True):
        prompt = builder([row])[0][0].ids
        shift = len(prompt) - row.prompt_len
        positions = [i + shift for i, m in enumerate(row.assistant_mask) if m]
        torch.testing.assert_close(got, forward_logprobs(policies, [*prompt, *row.token_ids[row.prompt_len:]], positions),
                                   atol=1e-4, rtol=1e-4)
    assert cfg.distill.lopd.context_placement == "chat_turn"


def test_sdpo_probe_teacher_sees_a_sibling_and_the_feedback_full_or_redacted(policies):
    from lopd_core.algorithms.sdpo import sdpo_teacher_prompt
    from lopd_core.privilege import sdpo_contexts, sdpo_teacher_builder

    tok, cfg = policies.tokenizer, load_config("smoke")
    group = [make_trajectory(tok, task_id="t-add", instruction="What is 2+3?", replies=[CALL, "It is 5."],
                             observations=["<tool_response>5</tool_response>"], reward=r) for r in (1.0, 0.0)]
    group[1].feedback = 'unmet answer: "5"'
    other = make_trajectory(tok, task_id="t-other", instruction="Hi", replies=["Hello."], reward=0.0)
    full = sdpo_contexts(cfg, tok, [*group, other], [group[1], group[0], other], feedback="full")
    redacted = sdpo_contexts(cfg, tok, [*group, other], [group[1]], feedback="redacted")
    assert "successful attempt" in full[0] and '"5"' in full[0] and '"5"' not in redacted[0]  # the answer is hidden
    assert full[1] == "" and full[2] == ""  # no other success in its group and no feedback: no teacher
    got = action_logprobs(policies, [group[1]], teacher=sdpo_teacher_builder(policies, {group[1].episode_id: full[0]}))[0]
    prompt = sdpo_teacher_prompt(tok, group[1], full[0]).ids  # the model's own forward on that prompt
    shift = len(prompt) - group[1].prompt_len
    positions = [i + shift for i, m in enumerate(group[1].assistant_mask) if m]
    torch.testing.assert_close(got, forward_logprobs(policies, [*prompt, *group[1].token_ids[group[1].prompt_len:]],
                                                     positions), atol=1e-4, rtol=1e-4)

    # as chat turns: the sibling's own request, call and observation, then the feedback, then the task
    turns = sdpo_contexts(cfg.with_overrides({"distill.sdpo.context_placement": "chat_turn"}), tok, [*group, other],
                          [group[1]], feedback="redacted")[0]
    assert [m["role"] for m in turns][0] == "user" and turns[0]["content"] == "What is 2+3?"
    assert any(CALL in (m.get("content") or "") for m in turns) and turns[-1]["role"] == "user"
    assert "Feedback from the environment" in turns[-1]["content"] and '"5"' not in turns[-1]["content"]
    text = tok.decode(sdpo_teacher_prompt(tok, group[1], turns).ids)
    assert text.index(CALL) < text.index("Feedback from the environment") < text.rindex("What is 2+3?")
    assert "Privileged information" not in text  # no framing text in the task message


def test_first_call_probabilities_multiply_the_call_opening_and_the_name_tokens(policies):
    tok = policies.tokenizer
    row = rows_of(tok, 1)[0]
    lp = action_logprobs(policies, [row], teacher=None)
    got = first_call_probabilities(tok, [row], lp)[0]
    opener = len(encode(tok, "<tool_call>"))
    prefix = len(encode(tok, CALL[: CALL.index('"add"') + 1]))
    name = len(encode(tok, CALL[: CALL.index('"add"') + 4])) - prefix
    assert got["p_tool_call"] == pytest.approx(math.exp(float(lp[0][:opener].sum())))
    assert got["tool_name_logprob"] == pytest.approx(float(lp[0][prefix:prefix + name].sum()))
    direct = make_trajectory(tok, task_id="t9", instruction="Hi", replies=["Hello."])
    assert first_call_probabilities(tok, [direct], action_logprobs(policies, [direct], teacher=None)) == [{}]


def test_probe_teacher_cli_scores_every_requested_teacher(tmp_path, models_dir):
    from lopd_core.envs import get_suite
    from lopd_core.rollout.oracle import oracle_episode

    tok_cfg = load_config("smoke")
    suite = get_suite("toolworld")
    policies = build_policy_set(tok_cfg.model, tok_cfg.distill.lopd, models_dir, device="cpu")
    tasks = [t for t in suite.tasks("train", 40, level=1, seed=2) if t.family == "weather/condition"][:3]
    episodes = [oracle_episode(policies.tokenizer, suite, t) for t in tasks]  # successes of one family
    failed = oracle_episode(policies.tokenizer, suite, tasks[0])
    failed.reward, failed.success, failed.episode_id = 0.0, False, "failed-0"
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(e.to_json() + "\n" for e in [*episodes, failed]))
    done = subprocess.run([sys.executable, "-m", "lopd_cli", "probe-teacher", "--profile", "smoke", "--set",
                           f"workspace.models_dir={models_dir}", "--set", "distill.lopd.retrieval_family=same",
                           "--episodes", str(path), "--placements", "chat_turn,user_framing", "--cold-start", "--sdpo",
                           "--json"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "LOPD_HOME": str(tmp_path / "ws")})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    sdpo = {name: report["teachers"].pop(name) for name in ("sdpo/user_framing/full", "sdpo/user_framing/redacted")}
    assert set(report["teachers"]) == {f"{kind}/{p}" for kind in ("text", "framing_only", "latent")
                                      for p in ("chat_turn", "user_framing")}
    for row in sdpo.values():  # every episode has the verifier's feedback, so every one has a teacher
        assert row["successes"] == 3 and row["failures"] == 1 and math.isfinite(row["privilege_failure"])
    for name, row in report["teachers"].items():
        assert row["successes"] == 3 and row["failures"] == 1, name
        assert math.isfinite(row["privilege_success"]) and 0 < row["p_tool_call_base"] <= 1
    # the framing-only control of chat turns is the plain prompt: its δ is exactly zero
    assert report["teachers"]["framing_only/chat_turn"]["privilege_success"] == pytest.approx(0.0, abs=1e-6)


def test_probe_teacher_retrieves_from_a_comparison_store_when_given_one(tmp_path, models_dir):
    """``--store``: the latent teacher retrieves from the store's curated experiences (the bank a comparison's
    runs train with), and its cold start learns from every stored success; a store without experiences fails."""
    from lopd_core.envs import get_suite
    from lopd_core.memory.curation import curate_store
    from lopd_core.memory.indexing import index_store
    from lopd_core.memory.store import ExperienceStore
    from lopd_core.rollout.oracle import oracle_episode

    cfg = load_config("smoke").with_overrides({"curation.success_threshold_tool": 0.8, "curation.per_task_cap": 1})
    suite = get_suite("toolworld")
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    tasks = [t for t in suite.tasks("train", 60, level=1, seed=2) if t.family == "weather/condition"][:3]
    episodes = [oracle_episode(policies.tokenizer, suite, t) for t in tasks for _ in range(2)]
    for i, e in enumerate(episodes):
        e.episode_id = e.trajectory_id = f"bank/{i:04d}"
    failed = oracle_episode(policies.tokenizer, suite, tasks[0])
    failed.reward, failed.success, failed.episode_id, failed.trajectory_id = 0.0, False, "failed-0", "failed-0"
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(e.to_json() + "\n" for e in [*episodes, failed]))
    store = ExperienceStore.from_config(cfg.with_overrides({"workspace.home": str(tmp_path / "root")}),
                                        uri=str(tmp_path / "root" / "lance"))
    store.write_trajectories([*episodes, failed], cycle_id="bank")
    curate_store(store, cfg.with_overrides({"curation.balance_families": False}))
    version = index_store(store).experiences_version
    curated = store.count("experiences")
    assert curated == len(tasks) < len(episodes)  # one per task

    def probe(*args):
        return subprocess.run([sys.executable, "-m", "lopd_cli", "probe-teacher", "--profile", "smoke", "--set",
                               f"workspace.models_dir={models_dir}", "--set", "curation.success_threshold_tool=0.8",
                               "--episodes", str(path), "--no-text", "--placements", "chat_turn", *args, "--json"],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "LOPD_HOME": str(tmp_path / "ws")})

    done = probe("--store", str(tmp_path / "root" / "lance"), "--cold-start")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bank"] == "lancedb" and report["bank_version"] == version and report["bank_successes"] == curated
    assert report["cold_start"]["chat_turn"]["examples"] == len(episodes)  # every stored success is a y*
    row = report["teachers"]["latent/chat_turn"]
    assert row["successes"] == len(episodes) and row["failures"] == 1 and math.isfinite(row["privilege_success"])
    empty = probe("--store", str(tmp_path / "nothing"))
    assert empty.returncode == 2 and "holds no experiences" in " ".join(empty.stderr.split())


def test_a_stored_toolworld_experience_shows_its_tool_call_to_the_encoder_and_the_text_teacher(tiny_tokenizer):
    """With the real SmolLM2 tokenizer and the demo's 256-token budget: the experience as the curation stage
    stores it keeps its own request and tool call, no worked example and no default system prompt, and the
    call is inside the encoder input and the text teacher's prompt of another task of the same family."""
    import pandas as pd

    from data_contracts.convert import trajectories_to_frame
    from lopd_core.envs import get_suite
    from lopd_core.memory.curation import curate_frame
    from lopd_core.models.composer import encoder_ids
    from lopd_core.records.experience import Experience
    from lopd_core.rollout.oracle import oracle_episode

    cfg = load_config("demo")
    suite = get_suite("toolworld")
    for domain in ("bank", "calendar", "shop", "weather"):
        tasks = [t for t in suite.tasks("train", 40, level=1, seed=1) if t.family.startswith(domain)][:2]
        episode = oracle_episode(tiny_tokenizer, suite, tasks[0])
        frame = trajectories_to_frame([episode])
        kept, _ = curate_frame(frame, success_threshold_tool=0.8, success_threshold_code=1.0, dedupe_threshold=0.97,
                               per_task_cap=2)
        row = kept.iloc[0]
        experience = Experience(experience_id=row["experience_id"], episode_id=row["episode_id"], task_id=row["task_id"],
                                suite=row["suite"], family=row["family"], instruction=row["instruction"],
                                text=row["text"], messages=json.loads(row["messages"]))
        call = next(m["content"] for m in episode.messages[episode.initial_messages:] if m["role"] == "assistant")
        assert call.startswith("<tool_call>")
        encoded = tiny_tokenizer.decode(encoder_ids(tiny_tokenizer, tasks[1].instruction, experience,
                                                    max_tokens=cfg.distill.lopd.experience_max_tokens))
        assert call in encoded and experience.instruction in encoded
        assert "SmolLM" not in encoded and "helpful AI assistant" not in encoded  # no default system prompt
        worked = suite.make_env(tasks[0]).reset(tasks[0])[1]["content"]  # the domain's first worked example
        assert worked not in encoded
        initial = suite.make_env(tasks[1]).reset(tasks[1])
        turns = [experience_turns(tiny_tokenizer, experience, max_tokens=cfg.distill.lopd.experience_max_tokens)]
        for placement in ("chat_turn", "user_framing", "system"):
            prompt = tiny_tokenizer.decode(experiences_prompt(tiny_tokenizer, initial, tasks[1].tools, turns,
                                                              placement=placement).ids)
            assert call in prompt and experience.instruction in prompt, (domain, placement)
        assert pd.notna(row["text"])


def test_a_codegen_experience_shows_its_code_to_the_encoder_even_beside_a_long_request(tiny_tokenizer):
    """With the real SmolLM2 tokenizer and the demo's 256-token budget: the encoder's header (the current
    task, here a codegen request with its example) comes on top of the experience's budget, so an experience
    whose answer is code plus a sentence of prose, as the model writes them, keeps its code. Before, the
    header was taken out of the budget and the answer turn was dropped whole (seen in a run's inputs.md)."""
    from lopd_core.envs import get_suite
    from lopd_core.models.composer import encoder_ids, experience_text
    from lopd_core.records.experience import Experience
    from lopd_core.rollout.oracle import oracle_episode

    budget = load_config("demo").distill.lopd.experience_max_tokens
    suite = get_suite("codegen")
    tasks = suite.tasks("train", 40, level=1, seed=0)
    # the family with the longest request, and another task of it as the current one
    longest = max(tasks, key=lambda t: len(tiny_tokenizer.encode(t.instruction)))
    current = next(t for t in suite.tasks("train", 40, level=1, seed=1) if t.family == longest.family)
    episode = oracle_episode(tiny_tokenizer, suite, longest)
    code = episode.messages[-1]["content"]
    assert code.startswith("```python")
    answer = code + ("\n\nThis function walks the input once and builds the result in a new list, leaving the "
                     "argument unchanged, and returns it.")
    messages = [*episode.messages[:-1], {"role": "assistant", "content": answer}]
    experience = Experience(experience_id="e0", episode_id="ep0", task_id=longest.task_id, suite="codegen",
                            family=longest.family, instruction=longest.instruction, text=answer, messages=messages)
    ids = encoder_ids(tiny_tokenizer, current.instruction, experience, max_tokens=budget)
    encoded = tiny_tokenizer.decode(ids)
    assert code.strip("`\n").removeprefix("python") in encoded
    assert current.instruction in encoded and longest.instruction in encoded
    # the experience's part is exactly what a text teacher is shown of it, within the budget
    shown = experience_text(tiny_tokenizer, experience, max_tokens=budget)
    assert encoded.endswith(shown) and len(tiny_tokenizer.encode(shown)) <= budget


def test_the_gate_refuses_a_teacher_that_lowers_the_tool_call_at_its_fork():
    from lopd_core.training import is_privileged

    # the comparison's cold-started composer (report 2026-12-07 §9): the first token raised, `call` after
    # `<tool_` lowered by 0.19 — a teacher that favours the invented tool reply
    fork = {"privilege_success": 0.011, "privilege_first_token": 0.216,
            "opener_by_token": [0.216, -0.010, -0.000, -0.192, -0.001]}
    assert not is_privileged(fork)
    assert is_privileged({**fork, "opener_by_token": [0.216, -0.010, 0.0, 0.05, 0.0]})
    assert not is_privileged({**fork, "privilege_success": -0.001, "opener_by_token": [0.3, 0.0, 0.0, 0.1, 0.0]})
    # the text teacher on the bank's successes (§11): a slightly negative mean whose interval reaches 0 passes
    # with its opener right; one whose interval stays below 0 does not
    text = {"privilege_success": -0.024, "success_ci95_high": 0.002, "privilege_first_token": 0.45,
            "opener_by_token": [0.45, 0.001, 0.0, 0.093, 0.0]}
    assert is_privileged(text)
    assert not is_privileged({**text, "success_ci95_high": -0.004})
    assert not is_privileged({**fork, "success_ci95_high": 0.019})  # the latent teacher: a positive mean, the fork
    # a summary without the per-position opener falls back on the first token
    assert is_privileged({"privilege_success": 0.01, "privilege_first_token": 0.0})
    assert not is_privileged({"privilege_success": 0.01, "privilege_first_token": -0.03})
