"""`lopd memory ingest|curate|index|search|status` run as real subprocesses on a fresh workspace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_memory_support import make_trajectory


def lopd(home, *args):
    env = {**os.environ, "LOPD_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "lopd_core.cli", "memory", *args, "--profile", "smoke"],
                          capture_output=True, text=True, env=env, timeout=300)


def last_json(res):
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_memory_commands_end_to_end(tmp_path):
    home = tmp_path / "ws"
    trajs = [make_trajectory(i, task_id=f"t{i}", family=["shop", "bank"][i % 2], step=i,
                             instruction=f"please book flight {i} to city{i} for passenger{i}") for i in range(10)]
    jsonl = tmp_path / "rollouts.jsonl"
    jsonl.write_text("".join(t.to_json() + "\n" for t in trajs) + "{broken\n" + json.dumps({"task_id": "x"}) + "\n")

    strict = lopd(home, "ingest", str(jsonl), "--set", "curation.max_bad_row_fraction=0.1")
    assert strict.returncode == 1 and "curation.max_bad_row_fraction" in strict.stderr  # 2 of 12 bad > 10%
    ingested = last_json(lopd(home, "ingest", str(jsonl), "--json"))  # the default limit (0.2) passes
    assert ingested["n_quarantined"] == 2 and ingested["n_inserted"] == 0 and ingested["n_unchanged"] == 10

    curated = last_json(lopd(home, "curate", "--json"))
    assert curated["n_kept"] == 10 and curated["n_quarantined_upstream"] == 2  # the broken line + the bare record
    assert "Curation report" in open(curated["report_path"]).read()

    indexed = last_json(lopd(home, "index", "--json"))
    assert indexed["n_inserted"] == 10 and indexed["embedder"] == "hash-384"

    found = last_json(lopd(home, "search", "please book flight 3 to city3", "--k", "3", "--task-id", "t3",
                           "--before-step", "5", "--json"))
    assert found["version"] == indexed["experiences_version"]
    assert len(found["hits"]) == 3 and all(h["task_id"] != "t3" and h["step"] < 5 for h in found["hits"])
    assert found["hits"][0]["score"] >= found["hits"][-1]["score"]

    table = lopd(home, "search", "please book flight 3", "--k", "2")
    assert table.returncode == 0 and "score" in table.stdout

    status = last_json(lopd(home, "status", "--json"))
    assert status["tables"]["experiences"]["rows"] == 10 and status["tables"]["quarantine"]["rows"] == 2
