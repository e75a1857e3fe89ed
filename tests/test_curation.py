"""Curation rules, the report, and the curate → index → retrieve stages on a real LanceDB directory."""

from __future__ import annotations

import json

import pytest
from test_memory_support import make_trajectory

from data_contracts import ExperienceSchema, trajectories_to_frame, validate_frame
from lopd_core.envs import suite_kind
from lopd_core.memory.curation import curate_frame, curate_store
from lopd_core.memory.indexing import index_store
from lopd_core.memory.store import ExperienceStore
from lopd_core.records.experience import RetrievalQuery

RULES = dict(success_threshold_tool=0.8, success_threshold_code=1.0, dedupe_threshold=0.97, per_task_cap=2,
             balance_families=False)


def _curate(trajs, **overrides):
    return curate_frame(trajectories_to_frame(trajs), **{**RULES, **overrides})


def _distinct(i, **kw):
    """Trajectories with clearly different texts (no near-duplicates among them)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
             "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
    w = [f"{words[(i * 7 + j) % len(words)]}{i}" for j in range(6)]
    return make_trajectory(i, instruction=f"{' '.join(w)} request {i}", answer=f"{' '.join(reversed(w))} done {i}", **kw)


def test_success_threshold_depends_on_the_suite_kind():
    assert suite_kind("toolworld") == "tool" and suite_kind("codegen") == "code"
    assert suite_kind("my-code-plugin.yaml") == "code" and suite_kind("no-such-suite") == "tool"
    trajs = [_distinct(0, reward=0.8), _distinct(1, reward=0.79), _distinct(2, suite="codegen", reward=0.99),
             _distinct(3, suite="codegen", reward=1.0)]
    selected, report = _curate(trajs)
    assert sorted(selected["trajectory_id"]) == sorted([trajs[0].trajectory_id, trajs[3].trajectory_id])
    assert report.dropped["below_success_threshold"] == 2
    assert dict(zip(selected["trajectory_id"], selected["suite_kind"], strict=True)) == {
        trajs[0].trajectory_id: "tool", trajs[3].trajectory_id: "code"}
    assert report.per_suite["codegen"] == {"input": 2, "below_success_threshold": 1, "kept": 1}


def test_only_finished_train_episodes_become_experiences():
    trajs = [_distinct(0), _distinct(1, split="test"), _distinct(2, status="error"), _distinct(3, status="truncated")]
    selected, report = _curate(trajs)
    assert selected["trajectory_id"].tolist() == [trajs[0].trajectory_id]
    assert {k: v for k, v in report.dropped.items() if v} == {"not_train_split": 1, "status_error": 1,
                                                              "status_truncated": 1}
    valid, quarantine = validate_frame(selected, ExperienceSchema)
    assert quarantine.empty and len(valid) == 1


def test_duplicates_and_near_duplicates_keep_the_older_one():
    text = "the customer wants to return the blue shoes bought last week and get a refund to the card"
    answer = ("I looked up order 4411, confirmed the blue shoes were delivered six days ago, opened a return, "
              "printed the label for the customer and issued a refund of 59.90 to the original card")
    trajs = [make_trajectory(0, instruction=text, answer=answer, step=1, task_id="a"),
             make_trajectory(1, instruction=text, answer=answer + ".", step=5, task_id="b"),  # same words
             make_trajectory(2, instruction=text + " please", answer=answer, step=3, task_id="c"),  # near
             _distinct(3, step=9)]
    selected, report = _curate(trajs)
    assert sorted(selected["task_id"]) == ["a", trajs[3].task_id]  # step 1 is the oldest of the three
    assert report.dropped["duplicate"] == 1 and report.dropped["near_duplicate"] == 1


def test_per_task_cap_keeps_the_best_and_counts_existing_experiences():
    trajs = [_distinct(i, task_id="same", reward=r, n_generated=n)
             for i, (r, n) in enumerate([(0.9, 3), (1.0, 8), (1.0, 4), (0.85, 2)])]
    selected, report = _curate(trajs)
    assert set(selected["trajectory_id"]) == {trajs[1].trajectory_id, trajs[2].trajectory_id}  # the reward-1.0 pair
    assert report.dropped["per_task_cap"] == 2
    existing, _ = _curate([_distinct(10, task_id="same")])
    selected, report = _curate(trajs, existing=existing)
    assert selected["trajectory_id"].tolist() == [trajs[2].trajectory_id] and report.dropped["per_task_cap"] == 3


def test_family_balance_caps_large_families_round_robin_across_tasks():
    big = [_distinct(i, family="shop", task_id=f"shop-{i % 3}") for i in range(9)]
    small = [_distinct(20 + 2 * k + i, family=f, task_id=f"{f}-{i}") for k, f in enumerate(("bank", "weather"))
             for i in range(2)]
    selected, report = _curate(big + small, balance_families=True, family_slack=1.5, per_task_cap=3)
    # family sizes 9, 2, 2 → median 2 × 1.5 → cap 3
    assert report.family_cap == 3 and report.dropped["family_balance"] == 6
    shop = selected[selected.family == "shop"]
    assert len(shop) == 3 and sorted(shop.task_id) == ["shop-0", "shop-1", "shop-2"]  # one per task first
    assert report.per_family["shop"] == {"input": 9, "kept": 3, "family_balance": 6}
    assert report.per_family["bank"]["kept"] == 2


def test_an_experience_keeps_its_own_turns_observation_lite():
    long_obs = "x" * 1000
    made, _ = _curate([_distinct(0, observation=long_obs)], observation_max_chars=100)
    kept = json.loads(made.loc[0, "messages"])
    # the task request, the agent's actions and the tool observation: never the system prompt
    assert [m["role"] for m in kept] == ["user", "assistant", "tool", "assistant"]
    assert kept[0]["content"] == made.loc[0, "instruction"]
    tool_message = next(m for m in kept if m["role"] == "tool")
    assert len(tool_message["content"]) <= 100 and "shortened" in tool_message["content"]
    assert "shortened" in made.loc[0, "text"] and "helpful agent" not in made.loc[0, "text"]
    # the rollout's own observation-lite messages are used when it filled them (its worked examples dropped)
    lite = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a worked example"},
            {"role": "assistant", "content": "its answer"}, {"role": "user", "content": "the real request"},
            {"role": "assistant", "content": "done"}]
    given = make_trajectory(1, instruction="the real request", messages_lite=lite, initial_messages=4)
    used, _ = _curate([given])
    assert json.loads(used.loc[0, "messages"]) == lite[3:]


def test_report_counts_and_markdown():
    trajs = [_distinct(0), _distinct(1, reward=0.1), _distinct(2, split="test", family="bank")]
    _, report = _curate(trajs)
    assert (report.n_input, report.n_kept) == (3, 1)
    assert report.per_family == {"shop": {"input": 2, "kept": 1, "below_success_threshold": 1},
                                 "bank": {"input": 1, "not_train_split": 1}}
    md = report.to_markdown()
    assert "Kept **1** of 3" in md and "| below_success_threshold | 1 |" in md and "| not_train_split | 1 |" in md
    assert "| shop | 2 | 1 |" in md and "tool suites ≥ 0.8" in md
    assert json.loads(json.dumps(report.to_dict()))["dropped"]["not_train_split"] == 1


# --------------------------------------------------------------------------------------------------
@pytest.fixture
def stored(tmp_path, smoke_config):
    # the paper's thresholds, whatever the smoke profile uses for its random model
    cfg = smoke_config.with_overrides({"workspace.lance_uri": str(tmp_path / "lance"),
                                       "curation.success_threshold_tool": 0.8,
                                       "curation.success_threshold_code": 1.0})
    store = ExperienceStore.from_config(cfg)
    c1 = [_distinct(i, cycle_id="c1", step=-1, task_id=f"t{i}") for i in range(6)]
    c1 += [_distinct(50, cycle_id="c1", reward=0.2), _distinct(51, cycle_id="c1", status="error")]
    store.write_trajectories(c1, cycle_id="c1")
    return store, cfg, c1


def test_curate_and_index_are_idempotent_and_write_no_new_versions(stored):
    store, cfg, c1 = stored
    report = curate_store(store, cfg)
    assert report.n_kept == 6 and report.changes["inserted"] == 6
    result = index_store(store)
    assert result.n_embedded == 6 and result.n_inserted == 6
    versions = {t: store.version(t) for t in ("trajectories", "curated", "experiences", "quarantine")}
    again = curate_store(store, cfg)
    assert again.changes == {"inserted": 0, "updated": 0, "deleted": 0, "unchanged": 6, "quarantined": 0}
    assert again.to_dict() | {"changes": {}} == report.to_dict() | {"changes": {}}
    result2 = index_store(store)
    assert result2.n_embedded == 0 and result2.n_unchanged == 6
    assert {t: store.version(t) for t in versions} == versions
    assert store.count("curated") == 6 and store.count("experiences") == 6


def test_scoped_curation_keeps_other_cycles_and_follows_changes(stored):
    store, cfg, c1 = stored
    curate_store(store, cfg, cycle_ids=["c1"])
    index_store(store, cycle_ids=["c1"])
    c2 = [_distinct(100 + i, cycle_id="c2", step=i, task_id="t0") for i in range(3)]  # task t0 is full (cap 2)
    store.write_trajectories(c2, cycle_id="c2")
    report = curate_store(store, cfg, cycle_ids=["c2"])
    assert report.n_existing_out_of_scope == 6 and report.n_kept == 1 and report.dropped["per_task_cap"] == 2
    assert store.count("curated", where="cycle_id = 'c1'") == 6
    # a stored trajectory whose reward is corrected is curated out again, and the experience follows
    c1[1].reward = 0.0
    store.write_trajectories(c1, cycle_id="c1")
    report = curate_store(store, cfg, cycle_ids=["c1"])
    assert report.changes["deleted"] == 1
    result = index_store(store)
    assert result.n_deleted == 1 and result.n_embedded == 1  # the c2 row is new to experiences
    assert c1[1].trajectory_id not in set(store.read("experiences")["experience_id"])


def test_stages_end_to_end_retrieval_respects_leakage(stored):
    store, cfg, c1 = stored
    curate_store(store, cfg)
    version = index_store(store).experiences_version
    retriever = store.retriever(version=version)
    query = RetrievalQuery(instruction=c1[2].instruction, task_id=c1[2].task_id, episode_id=c1[2].episode_id)
    hits = retriever.retrieve(query, cfg.distill.lopd.n_retrieved + 2)
    assert len(hits) == 3 and c1[2].task_id not in {h.task_id for h in hits}
    assert all(h.split == "train" and h.reward >= 0.8 for h in hits)
    allowed = retriever.retrieve(RetrievalQuery(instruction=c1[2].instruction, task_id=c1[2].task_id,
                                                exclude_same_task=False), 1)
    assert allowed[0].experience_id == c1[2].trajectory_id and allowed[0].messages  # observation-lite messages
