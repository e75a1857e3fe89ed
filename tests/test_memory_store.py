"""ExperienceStore on a real LanceDB directory: idempotent upserts, version pinning, leakage rules, index."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from test_memory_support import make_trajectory

from data_contracts import SCHEMA_VERSION, StageQualityError
from lopd_core.memory.embedder import make_embedder
from lopd_core.memory.indexing import index_store
from lopd_core.memory.retriever import VECTOR_INDEX, leakage_filter
from lopd_core.memory.store import ExperienceStore, store_status
from lopd_core.records.experience import CONTENT_DIM, RetrievalQuery, Retriever


@pytest.fixture
def store(tmp_path):
    return ExperienceStore(str(tmp_path / "lance"), embedder="hash", vector_index_min_rows=256)


def _experience_rows(n, *, dim=384, seed=0, task_of=lambda i: f"task-{i % 50}", step_of=lambda i: i % 10):
    """Experiences with random unit vectors (the embedder is bypassed: scale and filter tests only)."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    content = rng.standard_normal((n, CONTENT_DIM)).astype(np.float32)
    content /= np.linalg.norm(content, axis=1, keepdims=True)
    return pd.DataFrame([{
        "experience_id": f"x{i}", "trajectory_id": f"x{i}", "episode_id": f"ep{i}", "task_id": task_of(i),
        "suite": "toolworld", "suite_kind": "tool", "family": f"fam{i % 4}", "split": "train", "level": 1,
        "instruction": f"instruction {i}", "text": f"user: instruction {i}", "messages": "[]", "reward": 1.0,
        "step": step_of(i), "cycle_id": "c1", "policy_version": "base", "n_tokens": 10,
        "content_vector": content[i].tolist(), "schema_version": SCHEMA_VERSION, "vector": vectors[i].tolist(),
        "embedder": "hash-384", "embed_field": "task",
    } for i in range(n)])


def _curated_from(trajs):
    """Curated rows built straight from trajectories (bypassing the curation rules) for index tests."""
    from data_contracts import trajectories_to_frame
    from lopd_core.memory.curation import curate_frame

    selected, _ = curate_frame(trajectories_to_frame(trajs), success_threshold_tool=0.0, success_threshold_code=0.0,
                               dedupe_threshold=1.01, per_task_cap=100, balance_families=False)
    return selected


# --------------------------------------------------------------------------------------------------
def test_trajectory_upserts_are_idempotent_and_keep_errored_rollouts(store):
    trajs = [make_trajectory(i) for i in range(4)] + [make_trajectory(9, status="error", reward=0.0)]
    first = store.write_trajectories(trajs, cycle_id="c1")
    assert first.n_inserted == 5 and first.changed
    v = store.version("trajectories")
    again = store.write_trajectories(trajs, cycle_id="c1")
    assert not again.changed and again.n_unchanged == 5 and store.version("trajectories") == v
    assert store.count("trajectories") == 5
    assert store.count("trajectories", where="status = 'error'") == 1

    trajs[0].reward = 0.5
    changed = store.write_trajectories(trajs, cycle_id="c1")
    assert (changed.n_updated, changed.n_unchanged) == (1, 4)
    assert store.version("trajectories") == v + 1 and store.count("trajectories") == 5
    back = {t.trajectory_id: t for t in store.read_trajectories()}
    assert back[trajs[0].trajectory_id] == trajs[0] and back[trajs[4].trajectory_id] == trajs[4]


def test_bad_rows_are_quarantined_and_the_limit_raises_after_writing(store):
    good = [make_trajectory(i) for i in range(3)]
    bad = [make_trajectory(10, reward=7.0), make_trajectory(11, assistant_mask=[1])]
    with pytest.raises(StageQualityError):
        store.write_trajectories(good + bad, cycle_id="c1", max_bad_fraction=0.2)
    assert store.count("trajectories") == 3  # nothing lost: valid rows stored ...
    quarantine = store.read("quarantine")
    assert sorted(quarantine["row_key"]) == sorted(t.trajectory_id for t in bad)  # ... and bad ones kept whole
    assert quarantine["reason"].str.len().gt(0).all()
    v = store.version("quarantine")
    result = store.write_trajectories(good + bad, cycle_id="c1", max_bad_fraction=0.5)
    assert result.n_quarantined == 2 and store.version("quarantine") == v  # same bad rows: no new rows


def test_retriever_pinned_at_a_version_does_not_see_later_rows(store):
    store.upsert("experiences", _experience_rows(5), vector_dim=384)
    pinned_version = store.version("experiences")
    pinned = store.retriever(version=pinned_version)
    latest_now = store.retriever()  # pins the latest version at open time
    store.upsert("experiences", _experience_rows(12, seed=0).iloc[5:], vector_dim=384)
    assert store.version("experiences") > pinned_version
    query = RetrievalQuery(instruction="anything", task_id="nope", exclude_same_task=False)
    for retriever in (pinned, latest_now):
        assert retriever.version == pinned_version
        assert {h.experience_id for h in retriever.retrieve(query, 50)} == {f"x{i}" for i in range(5)}
    assert len(store.retriever().retrieve(query, 50)) == 12
    assert len(store.read_experiences(version=pinned_version)) == 5 and len(store.read_experiences()) == 12
    with pytest.raises(ValueError, match="no version 999"):
        store.retriever(version=999)


def test_leakage_rules_each_apply_and_are_prefiltered(store):
    rows = _experience_rows(40, task_of=lambda i: f"task-{i % 4}", step_of=lambda i: i % 8)
    store.upsert("experiences", rows, vector_dim=384)
    retriever = store.retriever()
    assert isinstance(retriever, Retriever)
    target = np.asarray(rows.loc[0, "vector"], dtype=np.float32)

    def hits(where, k=40):
        return retriever.search_vector(target, k=k, where=where)

    q = RetrievalQuery(instruction="", task_id="task-0", episode_id="ep0", before_step=3, exclude_same_task=True)
    got = hits(leakage_filter(q))
    assert got and all(h.episode_id != "ep0" and h.task_id != "task-0" and h.step < 3 for h in got)
    expected = rows[(rows.task_id != "task-0") & (rows.step < 3)]
    assert {h.experience_id for h in got} == set(expected.experience_id)
    # same task allowed: the episode rule alone still removes the query's own episode
    q_same = RetrievalQuery(instruction="", task_id="task-0", episode_id="ep0", exclude_same_task=False)
    got_same = hits(leakage_filter(q_same))
    assert "ep0" not in {h.episode_id for h in got_same} and any(h.task_id == "task-0" for h in got_same)
    assert len(got_same) == 39
    # prefilter, not post-filter: k=1 returns the nearest *allowed* row although the nearest row is excluded
    top = hits(leakage_filter(q), k=1)
    assert len(top) == 1 and top[0].experience_id != "x0" and top[0].experience_id in set(expected.experience_id)
    assert top[0].score == pytest.approx(max(float(np.dot(target, v)) for v in expected.vector), abs=1e-5)
    plan = retriever.explain(q).splitlines()
    knn = next(i for i, line in enumerate(plan) if "KNNVectorDistance" in line)
    leakage = next(i for i, line in enumerate(plan) if "FilterExec" in line and "task_id" in line)
    assert leakage > knn  # in the plan tree, the leakage filter feeds the KNN (it runs before the top-k)


def test_retrieve_embeds_the_instruction_and_records_metrics(store):
    trajs = [make_trajectory(0, instruction="book a flight from paris to rome", task_id="fly-1"),
             make_trajectory(1, instruction="bake a chocolate cake for the party", task_id="cake-1"),
             make_trajectory(2, instruction="book a flight from berlin to rome", task_id="fly-2")]
    store.upsert("curated", _curated_from(trajs))
    index_store(store)
    retriever = store.retriever()
    hits = retriever.retrieve(RetrievalQuery(instruction="book a flight from paris to rome", task_id="fly-1"), 2)
    assert [h.task_id for h in hits] == ["fly-2", "cake-1"] and hits[0].score > hits[1].score
    allowed = retriever.retrieve(RetrievalQuery(instruction="book a flight from paris to rome", task_id="fly-1",
                                                exclude_same_task=False), 1)
    assert allowed[0].task_id == "fly-1" and allowed[0].score == pytest.approx(1.0, abs=1e-5)
    m = retriever.metrics()
    assert m["memory/queries"] == 2 and m["memory/hit_rate"] == 1.0
    assert m["memory/same_task_hit_rate"] == pytest.approx(1 / 3)


def test_empty_store_retriever_returns_nothing(store):
    retriever = store.retriever()
    assert retriever.version == 0 and retriever.retrieve(RetrievalQuery(instruction="x", task_id="t"), 3) == []


@pytest.mark.parametrize("index_type", ["auto", "ivf_pq"])
def test_vector_index_is_built_only_above_the_threshold(store, index_type):
    store.upsert("experiences", _experience_rows(200), vector_dim=384)
    assert store.ensure_vector_index(index_type=index_type)["action"] == "none"
    assert not store.open_table("experiences").list_indices()
    store.upsert("experiences", _experience_rows(300), vector_dim=384)
    before = store.version("experiences")
    info = store.ensure_vector_index(index_type=index_type)
    assert info["action"] == "created" and store.version("experiences") > before
    assert info["index_type"] == ("ivf_flat" if index_type == "auto" else "ivf_pq")
    names = {i.name for i in store.open_table("experiences").list_indices()}
    assert names == {VECTOR_INDEX, "task_id_idx", "episode_id_idx", "step_idx", "split_idx"}
    assert store.ensure_vector_index(index_type=index_type)["action"] == "none"  # nothing new to fold in
    retriever = store.retriever()
    assert retriever.has_vector_index
    rows = _experience_rows(300)
    hits = retriever.search_vector(np.asarray(rows.loc[3, "vector"]), k=3, where="step < 5")
    assert len(hits) == 3 and all(h.step < 5 for h in hits) and hits[0].experience_id == "x3"
    assert not [h for h in retriever.search_vector(np.asarray(rows.loc[7, "vector"]), k=3, where="step < 5")
                if h.experience_id == "x7"]
    # many new rows: folded into the index; the pinned version before it stays readable
    pinned = store.version("experiences")
    store.upsert("experiences", _experience_rows(500).iloc[300:], vector_dim=384)
    assert store.ensure_vector_index(index_type=index_type)["action"] == "optimized"
    assert store.count("experiences", version=pinned) == 300 and store.count("experiences") == 500
    newest = _experience_rows(500).loc[420, "vector"]
    assert store.retriever().search_vector(np.asarray(newest), k=1)[0].experience_id == "x420"


def test_near_duplicates_are_not_inserted(store):
    base = "the customer wants to return the blue shoes bought last week and get a refund to the card"
    answer = ("I looked up order 4411, confirmed the blue shoes were delivered six days ago, opened a return, "
              "printed the label for the customer and issued a refund of 59.90 to the original card")
    trajs = [make_trajectory(0, instruction=base, answer=answer, step=0),
             make_trajectory(1, instruction=base + " please", answer=answer, step=1, task_id="other"),
             make_trajectory(2, instruction="schedule a meeting with anna on friday at noon", step=2)]
    store.upsert("curated", _curated_from(trajs))
    result = index_store(store)
    assert [d["experience_id"] for d in result.near_duplicates] == [trajs[1].trajectory_id]
    assert result.near_duplicates[0]["duplicate_of"] == trajs[0].trajectory_id  # the older one is kept
    assert result.near_duplicates[0]["similarity"] >= store.dedupe_threshold
    assert set(store.read("experiences")["experience_id"]) == {trajs[0].trajectory_id, trajs[2].trajectory_id}
    v = store.version("experiences")
    again = index_store(store)
    assert again.n_embedded == 0 and store.version("experiences") == v and len(again.near_duplicates) == 1


def test_a_table_never_mixes_embedders(tmp_path):
    uri = str(tmp_path / "lance")
    first = ExperienceStore(uri, embedder="hash")
    first.upsert("curated", _curated_from([make_trajectory(i) for i in range(3)]))
    index_store(first)
    other = ExperienceStore(uri, embedder="hash-64")
    with pytest.raises(ValueError, match="--rebuild"):
        index_store(other)
    with pytest.raises(ValueError, match="embedded with 'hash-384'"):
        other.retriever()
    rebuilt = index_store(other, rebuild=True)
    assert rebuilt.rebuilt and rebuilt.n_embedded == 3
    assert other.read("experiences")["embedder"].unique().tolist() == ["hash-64"]
    assert len(other.retriever().retrieve(RetrievalQuery(instruction="task", task_id="x"), 5)) == 3


def test_store_status_counts_tables(store, tmp_path):
    assert store_status(str(tmp_path / "missing"))["available"] is False
    store.write_trajectories([make_trajectory(0), make_trajectory(1, reward=9.0)])
    info = store_status(store.uri)
    assert info["available"] and info["tables"]["trajectories"]["rows"] == 1
    assert info["tables"]["quarantine"]["rows"] == 1 and info["quarantine"]["by_contract"] == {"trajectories": 1}
    assert info["tables"]["experiences"] == {"rows": 0, "version": 0}


def test_hash_embedder_is_deterministic_and_normalised():
    emb = make_embedder("hash")
    a = emb.encode(["book a flight to rome", "Book a FLIGHT to Rome!", "bake bread"])
    assert a.shape == (3, 384) and a.dtype == np.float32
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert float(a[0] @ a[1]) == pytest.approx(1.0, abs=1e-6) and float(a[0] @ a[2]) < 0.5
    # the same text gives the same vector in another call, batch and embedder instance
    assert np.array_equal(a[0], make_embedder("hash-384").encode(["x", "book a flight to rome"], batch_size=1)[1])


def test_make_embedder_rejects_unknown_names():
    with pytest.raises(ValueError, match="index.embedder"):
        make_embedder("sentence-transformers/all-MiniLM-L6-v2")


def test_a_real_tiny_model_episode_round_trips_through_the_store(tiny_model, tiny_tokenizer, tmp_path):
    """Token ids, mask and log-probs from a real (tiny, random) model survive LanceDB exactly."""
    import torch

    from lopd_core.records.chat import render_prompt_ids
    from lopd_core.records.trajectory import Trajectory

    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Say hi."}]
    prompt = render_prompt_ids(tiny_tokenizer, messages)
    torch.manual_seed(0)
    with torch.no_grad():
        out = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=True, top_k=20,
                                  output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=tiny_tokenizer.pad_token_id)
    generated = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(score[0].float(), -1)[tok]) for score, tok in zip(out.scores, generated,
                                                                                           strict=True)]
    traj = Trajectory(task_id="hi", suite="toolworld", family="chat", split="train", level=1, instruction="Say hi.",
                      messages=[*messages, {"role": "assistant", "content": tiny_tokenizer.decode(generated)}],
                      initial_messages=2, tools=[], token_ids=prompt + generated, prompt_len=len(prompt),
                      assistant_mask=[0] * len(prompt) + [1] * len(generated),
                      sampling_logprobs=[0.0] * len(prompt) + logprobs, reward=0.0, success=False,
                      trajectory_id="tiny-0", episode_id="tiny-ep-0")
    traj.validate_alignment()
    store = ExperienceStore(str(tmp_path / "lance"))
    assert store.write_trajectories([traj]).n_inserted == 1
    (back,) = store.read_trajectories()
    assert back == traj  # exact ids, mask and float log-probs


# --------------------------------------------------------------------------------------------------
# A row the storage refuses never costs the rows around it.
def test_a_row_the_storage_refuses_is_quarantined_and_the_good_rows_are_stored(store, monkeypatch):
    """The original failure: a token id ≥ 2³¹ passed the contract and crashed the int32 write, losing 400 rows.
    The contract now bounds ids; here the bound is lifted to stand for any gap between contract and storage."""
    import data_contracts.models as models

    good = [make_trajectory(i) for i in range(400)]
    unstorable = make_trajectory(999, token_ids=[11, 12, 13, 14, 2**31, 101, 102, 7])
    assert store.write_trajectories([unstorable]).n_quarantined == 1  # the contract refuses it ...
    monkeypatch.setattr(models, "MAX_TOKEN_ID", 2**40)  # ... a contract that did not would reach the storage
    result = store.write_trajectories(good[:200] + [unstorable] + good[200:], cycle_id="c1")
    assert (result.n_inserted, result.n_quarantined, store.count("trajectories")) == (400, 1, 400)
    refused = store.read("quarantine", where="reason LIKE 'storage:%'")
    assert refused["row_key"].tolist() == [unstorable.trajectory_id]
    assert "ArrowInvalid" in refused["reason"].iloc[0] and "2147483648" in refused["reason"].iloc[0]
    assert json.loads(refused["payload"].iloc[0])["token_ids"][4] == 2**31  # kept whole
    # one quarantine row per bad row: its id hashes the row, so the storage's reason replaced the contract's
    assert store.count("quarantine") == 1
    v = store.version("quarantine")
    again = store.write_trajectories(good + [unstorable], cycle_id="c1")  # idempotent: nothing new
    assert not again.changed and again.n_quarantined == 1 and store.version("quarantine") == v


def test_rows_an_older_table_schema_cannot_hold_are_quarantined_one_by_one(store):
    """A table created with a narrower column (schema drift): the rows that fit are stored, the others
    quarantined with the storage's error, in one write."""
    import pyarrow as pa

    from lopd_core.memory.store import arrow_schema

    schema = arrow_schema("trajectories")
    narrow = schema.set(schema.get_field_index("level"), pa.field("level", pa.int8(), nullable=False))
    store.db.create_table("trajectories", schema=narrow)
    rows = [make_trajectory(i, level=1) for i in range(50)] + [make_trajectory(60, level=300),
                                                               make_trajectory(61, level=1000)]
    result = store.write_trajectories(rows)
    assert (result.n_inserted, result.n_quarantined) == (50, 2) and store.count("trajectories") == 50
    refused = store.read("quarantine")
    assert sorted(refused["row_key"]) == [rows[50].trajectory_id, rows[51].trajectory_id]
    assert all(r.startswith("storage: LanceDB refused the row") for r in refused["reason"])


def test_old_versions_are_removed_except_the_pinned_ones_and_their_tags_follow(store):
    """index.keep_versions_days: versions older than the window go, a registered model's version stays (and
    every newer one: cleanup takes an age), tagged pinned-v<N>; an unpinned tag is removed."""
    import time
    from datetime import timedelta

    for i in range(5):
        store.write_trajectories([make_trajectory(i)], cycle_id=f"c{i}")
        if i == 1:
            time.sleep(1.5)  # the pin keeps versions from 1 s before it (cleanup takes an age, not a list)
    versions = [v["version"] for v in store.list_versions("trajectories")]  # the empty table, then a row each
    pinned = versions[3]  # the first after the pause: 3 rows
    time.sleep(0.2)
    out = store.keep_versions("trajectories", keep=timedelta(seconds=0.1), pinned=[pinned, 999])
    left = [v["version"] for v in store.list_versions("trajectories")]
    assert out["pinned"] == [pinned] and out["removed"] == 3 and left[0] == pinned
    assert set(versions[:3]).isdisjoint(left) and set(versions[3:]) <= set(left)
    assert store.count("trajectories", version=pinned) == 3  # still readable
    tbl = store.db.open_table("trajectories")
    assert tbl.tags.list()[f"pinned-v{pinned}"]["version"] == pinned
    # unpinned: the tag goes and the next cleanup removes the version
    time.sleep(0.2)
    again = store.keep_versions("trajectories", keep=timedelta(seconds=0.1), pinned=[])
    assert again["pinned"] == [] and pinned not in [v["version"] for v in store.list_versions("trajectories")]
    assert not tbl.tags.list() and store.count("trajectories") == 5
    # a generous window removes nothing
    assert store.keep_versions("trajectories", keep=timedelta(days=30))["removed"] == 0
