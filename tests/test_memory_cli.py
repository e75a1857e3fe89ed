"""`lopd memory ingest|curate|index|search|status` on a fresh workspace.

The first command runs as a real subprocess of the ``lopd`` entry point; the rest run the same Typer app
in-process (``CliRunner``) to keep the test fast — same code path from argument parsing to output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_memory_support import make_trajectory
from typer.testing import CliRunner

from lopd_cli.main import app


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_memory_commands_end_to_end(tmp_path, monkeypatch):
    home = tmp_path / "ws"
    trajs = [make_trajectory(i, task_id=f"t{i}", family=["shop", "bank"][i % 2], step=i,
                             instruction=f"please book flight {i} to city{i} for passenger{i}") for i in range(10)]
    jsonl = tmp_path / "rollouts.jsonl"
    jsonl.write_text("".join(t.to_json() + "\n" for t in trajs) + "{broken\n" + json.dumps({"task_id": "x"}) + "\n")

    strict = subprocess.run(
        [sys.executable, "-m", "lopd_cli", "memory", "ingest", str(jsonl), "--profile", "smoke",
         "--set", "curation.max_bad_row_fraction=0.1"],
        capture_output=True, text=True, env={**os.environ, "LOPD_HOME": str(home)}, timeout=300)
    assert strict.returncode == 1 and "curation.max_bad_row_fraction" in strict.stderr  # 2 of 12 bad > 10%

    monkeypatch.setenv("LOPD_HOME", str(home))
    runner = CliRunner()

    def lopd(*args):
        res = runner.invoke(app, ["memory", *args, "--profile", "smoke"])
        assert res.exit_code == 0, (res.output, res.exception)
        return res

    ingested = last_json(lopd("ingest", str(jsonl), "--json").stdout)  # the default limit (0.2) passes
    assert ingested["n_quarantined"] == 2 and ingested["n_inserted"] == 0 and ingested["n_unchanged"] == 10

    curated = last_json(lopd("curate", "--json").stdout)
    assert curated["n_kept"] == 10 and curated["n_quarantined_upstream"] == 2  # the broken line + the bare record
    assert "Curation report" in open(curated["report_path"]).read()

    indexed = last_json(lopd("index", "--json").stdout)
    assert indexed["n_inserted"] == 10 and indexed["embedder"] == "hash-384"

    found = last_json(lopd("search", "please book flight 3 to city3", "--k", "3", "--task-id", "t3",
                           "--before-step", "5", "--json").stdout)
    assert found["version"] == indexed["experiences_version"]
    assert len(found["hits"]) == 3 and all(h["task_id"] != "t3" and h["step"] < 5 for h in found["hits"])
    assert found["hits"][0]["score"] >= found["hits"][-1]["score"]
    assert "score" in lopd("search", "please book flight 3", "--k", "2").stdout

    status = last_json(lopd("status", "--json").stdout)
    assert status["tables"]["experiences"]["rows"] == 10 and status["tables"]["quarantine"]["rows"] == 2
