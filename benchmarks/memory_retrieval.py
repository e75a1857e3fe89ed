"""Retrieval latency with the leakage filters, and indexing throughput against the embedder's encode rate.

What it measures (writes ``benchmarks/results/memory_retrieval.json``):

1. **Retrieval latency** at each table size (default 10k and 100k experiences): ``LanceRetriever.search_vector``
   with the full leakage predicate (split, not this episode, not this task, ``step < before_step``) as a
   LanceDB prefilter, k = 3, on the ANN + scalar indices the store builds above
   ``index.vector_index_min_rows`` (``--index-type`` picks the ANN index; default the store's 'auto').
   p50 / p99 over the query set, median over ``--repeats`` runs. Baselines in the same process: the same
   queries without any filter (``ratio_vs_unfiltered``) and exact filtered search (``recall_at_k`` of the
   ANN result against it). Random 384-d unit vectors clustered around n/200 centres (the embedder is not
   in this loop; its per-query cost is reported separately as ``query_embed_ms``) with realistic filter
   columns: 2 experiences per task, unique episodes, steps in [-1, 200).
2. **Indexing throughput**: ``index_store`` (read curated rows, near-duplicate check, MiniLM embedding, contract
   validation, merge into LanceDB) in experiences/s, against ``MiniLM.encode`` alone on the same texts
   (texts/s). ``ratio`` = index rate / encode rate (1.0 = the store adds nothing).

The tables for (1) are written straight to LanceDB in Arrow batches (no contract validation: it is a
scale test of search, and validating 100k synthetic rows would only measure pandera).

    python -m benchmarks.memory_retrieval            # 10k and 100k, 500 queries, 3 repeats
    python -m benchmarks.memory_retrieval --quick    # 2k and 10k, 100 queries, 2 repeats, 64 texts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

DIM = 384
K = 3
RESULTS = Path(__file__).resolve().parent / "results" / "memory_retrieval.json"


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _clustered(rng: np.random.Generator, centers: np.ndarray, n: int, *, noise: float = 0.06) -> np.ndarray:
    """Unit vectors scattered around ``centers`` (cosine to their centre ≈ 0.65), like embeddings of task
    families; uniform random vectors would have no neighbours worth finding."""
    v = centers[rng.integers(0, len(centers), n)] + noise * rng.standard_normal((n, centers.shape[1]))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def build_table(store, n: int, *, centers: np.ndarray, seed: int, batch: int = 20_000) -> dict:
    """``n`` synthetic experiences written in Arrow batches; returns the filter-column layout."""
    import pyarrow as pa

    from data_contracts.models import SCHEMA_VERSION
    from lopd_core.memory.store import arrow_schema
    from lopd_core.records.experience import CONTENT_DIM

    rng = np.random.default_rng(seed)
    schema = arrow_schema("experiences", vector_dim=DIM)
    n_tasks = max(1, n // 2)
    table = None
    for start in range(0, n, batch):
        m = min(batch, n - start)
        ids = [f"x{start + i}" for i in range(m)]
        tasks = rng.integers(0, n_tasks, m)
        columns = {
            "experience_id": ids, "trajectory_id": ids, "episode_id": [f"ep{start + i}" for i in range(m)],
            "task_id": [f"task-{t}" for t in tasks], "suite": ["toolworld"] * m, "suite_kind": ["tool"] * m,
            "family": [f"family-{t % 8}" for t in tasks], "split": ["train"] * m, "level": [1] * m,
            "instruction": [f"instruction of task {t}" for t in tasks],
            "text": [f"user: instruction of task {t}\nassistant: done" for t in tasks], "messages": ["[]"] * m,
            "reward": rng.uniform(0.8, 1.0, m), "step": rng.integers(-1, 200, m), "cycle_id": ["bench"] * m,
            "policy_version": ["base"] * m, "n_tokens": rng.integers(50, 1000, m),
            "content_vector": list(_unit(rng, m, CONTENT_DIM)), "schema_version": [SCHEMA_VERSION] * m,
            "vector": list(_clustered(rng, centers, m)), "embedder": ["hash-384"] * m, "embed_field": ["task"] * m,
            "row_hash": ids,
        }
        data = pa.Table.from_pydict(columns, schema=schema)
        if table is None:
            table = store.db.create_table("experiences", data=data, schema=schema)
        else:
            table.add(data)
    return {"n_tasks": n_tasks}


def _percentiles(samples_ms: list[float]) -> dict:
    arr = np.asarray(samples_ms)
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "mean_ms": float(arr.mean())}


def _median_runs(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def bench_retrieval(n: int, *, n_queries: int, repeats: int, seed: int = 0, index_type: str = "auto") -> dict:
    from lopd_core.memory.retriever import leakage_filter
    from lopd_core.memory.store import ExperienceStore
    from lopd_core.records.experience import RetrievalQuery

    with tempfile.TemporaryDirectory(prefix="lopd-bench-") as tmp:
        store = ExperienceStore(str(Path(tmp) / "lance"), embedder="hash", vector_index_min_rows=5000)
        t0 = time.perf_counter()
        centers = _unit(np.random.default_rng(seed + 7), max(8, n // 200), DIM)
        layout = build_table(store, n, centers=centers, seed=seed)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        index_info = store.ensure_vector_index(index_type=index_type)
        index_s = time.perf_counter() - t0
        retriever = store.retriever()
        rng = np.random.default_rng(seed + 1)
        vectors = _clustered(rng, centers, n_queries)
        queries = [RetrievalQuery(instruction="", task_id=f"task-{rng.integers(0, layout['n_tasks'])}",
                                  episode_id=f"ep{rng.integers(0, n)}", before_step=int(rng.integers(1, 200)))
                   for _ in range(n_queries)]
        filters = [leakage_filter(q) for q in queries]
        for v, f in zip(vectors[:10], filters[:10], strict=True):  # warm caches
            retriever.search_vector(v, k=K, where=f)

        def timed(fn) -> list[float]:
            out = []
            for i in range(n_queries):
                start = time.perf_counter()
                fn(i)
                out.append((time.perf_counter() - start) * 1000)
            return out

        filtered_runs, unfiltered_runs = [], []
        for _ in range(repeats):
            filtered_runs.append(_percentiles(timed(lambda i: retriever.search_vector(vectors[i], k=K, where=filters[i]))))
            unfiltered_runs.append(_percentiles(timed(lambda i: retriever.search_vector(vectors[i], k=K))))
        # exact filtered search as the recall reference (and its latency)
        exact_ms, recalls, violations = [], [], 0
        for i in range(min(n_queries, 100)):
            start = time.perf_counter()
            exact = (retriever.table.search(vectors[i], vector_column_name="vector").distance_type("cosine")
                     .where(filters[i], prefilter=True).bypass_vector_index().select(["experience_id"]).limit(K)
                     .to_list())
            exact_ms.append((time.perf_counter() - start) * 1000)
            ann = retriever.search_vector(vectors[i], k=K, where=filters[i])
            q = queries[i]
            violations += sum(h.task_id == q.task_id or h.episode_id == q.episode_id or h.step >= q.before_step
                              for h in ann)
            want = {r["experience_id"] for r in exact}
            recalls.append(len(want & {h.experience_id for h in ann}) / max(1, len(want)))
        filtered = _median_runs(filtered_runs)
        unfiltered = _median_runs(unfiltered_runs)
        return {
            "rows": n, "k": K, "queries": n_queries, "repeats": repeats, "vector_index": index_info,
            "write_seconds": round(write_s, 2), "index_build_seconds": round(index_s, 2),
            "filtered": filtered, "unfiltered": unfiltered,
            "ratio_vs_unfiltered_p99": filtered["p99_ms"] / unfiltered["p99_ms"],
            "exact_filtered": _percentiles(exact_ms), "recall_at_k_vs_exact": float(np.mean(recalls)),
            "leakage_violations": violations, "meets_goal_p99_le_20ms": filtered["p99_ms"] <= 20.0,
        }


def _texts(n: int) -> list:
    from lopd_core.records.trajectory import Trajectory

    domains = ["shop", "calendar", "weather", "bank"]
    verbs = ["book", "cancel", "find", "move", "check", "buy", "refund", "schedule"]
    out = []
    for i in range(n):
        instruction = (f"{verbs[i % 8]} item {i} for customer {i * 13 % 997} in the {domains[i % 4]} system "
                       f"before day {i % 28 + 1} and confirm with reference {i * 7919 % 100000}")
        messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": instruction},
                    {"role": "assistant", "content": f"calling lookup for {i}"},
                    {"role": "tool", "content": f"record {i}: status open, owner {i % 50}"},
                    {"role": "assistant", "content": f"done: {verbs[i % 8]} {i} confirmed"}]
        out.append(Trajectory(task_id=f"task-{i}", suite="toolworld", family=domains[i % 4], split="train", level=1,
                              instruction=instruction, messages=messages, initial_messages=2, tools=[],
                              token_ids=[1, 2, 3], prompt_len=1, assistant_mask=[0, 1, 1],
                              sampling_logprobs=[0.0, -0.1, -0.2], reward=1.0, success=True,
                              trajectory_id=f"tr-{i}", episode_id=f"ep-{i}", cycle_id="bench"))
    return out


def bench_indexing(n_texts: int, *, repeats: int, embedder_name: str = "minilm") -> dict:
    from data_contracts.convert import trajectories_to_frame
    from lopd_core.memory.curation import curate_frame
    from lopd_core.memory.indexing import index_store
    from lopd_core.memory.store import ExperienceStore

    trajectories = _texts(n_texts)
    curated, _ = curate_frame(trajectories_to_frame(trajectories), success_threshold_tool=0.8,
                              success_threshold_code=1.0, dedupe_threshold=0.999, per_task_cap=2,
                              balance_families=False)
    with tempfile.TemporaryDirectory(prefix="lopd-bench-") as tmp:
        probe = ExperienceStore(str(Path(tmp) / "warm"), embedder=embedder_name)
        embedder = probe.embedder
        texts = curated["instruction"].tolist()
        embedder.encode(texts[:16])  # load + warm up
        encode_rates, index_rates, embed_shares = [], [], []
        for r in range(repeats):
            start = time.perf_counter()
            embedder.encode(texts, batch_size=64)
            encode_rates.append(len(texts) / (time.perf_counter() - start))
            store = ExperienceStore(str(Path(tmp) / f"run{r}"), embedder=embedder_name, embed_batch_size=64)
            store.upsert("curated", curated)
            result = index_store(store)
            assert result.n_embedded == len(texts), result.to_dict()
            index_rates.append(result.experiences_per_second)
            embed_shares.append(result.embed_seconds / result.total_seconds)
    encode, index = statistics.median(encode_rates), statistics.median(index_rates)
    return {"embedder": embedder.name, "texts": len(texts), "repeats": repeats,
            "encode_texts_per_second": encode, "index_experiences_per_second": index, "ratio": index / encode,
            "embedding_share_of_index_time": statistics.median(embed_shares)}


def machine() -> dict:
    import lancedb
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
            "lancedb": lancedb.__version__, "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--sizes", type=int, nargs="*", help="table sizes (default 10000 100000)")
    parser.add_argument("--queries", type=int, help="queries per run")
    parser.add_argument("--repeats", type=int, help="runs per measurement (the median is reported)")
    parser.add_argument("--texts", type=int, help="texts for the indexing benchmark")
    parser.add_argument("--embedder", default="minilm", help="embedder of the indexing benchmark")
    parser.add_argument("--index-type", default="auto", choices=["auto", "ivf_pq", "ivf_flat", "ivf_hnsw_sq"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = args.sizes or ([2_000, 10_000] if args.quick else [10_000, 100_000])
    n_queries = args.queries or (100 if args.quick else 500)
    repeats = args.repeats or (2 if args.quick else 3)
    n_texts = args.texts or (64 if args.quick else 512)

    retrieval = []
    for n in sizes:
        print(f"retrieval: {n} experiences …", file=sys.stderr, flush=True)
        retrieval.append(bench_retrieval(n, n_queries=n_queries, repeats=repeats, index_type=args.index_type))
    from lopd_core.memory.embedder import make_embedder

    start = time.perf_counter()
    query_embedder = make_embedder(args.embedder)
    load_s = time.perf_counter() - start
    query_embedder.encode(["warm up"])
    samples = []
    for i in range(50):
        start = time.perf_counter()
        query_embedder.encode([f"book a flight number {i} to rome tomorrow"])
        samples.append((time.perf_counter() - start) * 1000)
    print(f"indexing: {n_texts} texts with {args.embedder} …", file=sys.stderr, flush=True)
    indexing = bench_indexing(n_texts, repeats=repeats, embedder_name=args.embedder)
    report = {
        "benchmark": "memory_retrieval",
        "command": "python -m benchmarks.memory_retrieval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),  # the load average says how busy the shared machine was at the end
        "goal": "filtered retrieval p99 <= 20 ms at 10k and 100k experiences",
        "retrieval": retrieval,
        "query_embed_ms": {"embedder": query_embedder.name, "load_seconds": round(load_s, 2), **_percentiles(samples)},
        "indexing": indexing,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
