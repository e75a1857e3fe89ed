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


def test_ingest_quarantines_every_malformed_line_and_loses_no_good_row(tmp_path, monkeypatch):
    """400 good lines with every adversarial record and line of tests/adversarial_rows.py between them (and
    one bad line twice): the real `lopd memory ingest` stores the 400 and quarantines each bad line with its
    line number and reason. A second ingest changes nothing."""
    from adversarial_rows import BAD_LINES, BAD_RECORDS, good_record, jsonl_line

    from lopd_core.memory.store import ExperienceStore

    home = tmp_path / "ws"
    lines: list[bytes] = [jsonl_line(good_record(i)) for i in range(400)]
    expected: dict[int, str] = {}
    bad = [(name, jsonl_line(record), reason) for name, record, reason in BAD_RECORDS] + BAD_LINES
    bad.append(("the first bad line again, identical", bad[0][1], bad[0][2]))
    bad.append(("a good row's trajectory_id again, on the last line", jsonl_line(good_record(5) | {"reward": 0.5}),
                "duplicate_key: trajectory_id repeats an earlier row"))
    for k, (_, raw, reason) in enumerate(bad):
        at = (k * 7) % len(lines) if k < len(bad) - 1 else len(lines)
        lines.insert(at, raw)
        expected = {n + 1 if n >= at + 1 else n: r for n, r in expected.items()}
        expected[at + 1] = reason
    jsonl = tmp_path / "rollouts.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n\n")
    env = {**os.environ, "LOPD_HOME": str(home)}
    run = subprocess.run([sys.executable, "-m", "lopd_cli", "memory", "ingest", str(jsonl), "--profile", "smoke",
                          "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = last_json(run.stdout)
    assert (result["n_input"], result["n_inserted"], result["n_quarantined"]) == (400 + len(bad), 400, len(bad))

    store = ExperienceStore(str(home / "lance"))
    assert store.count("trajectories") == 400
    stored = set(store.read("trajectories", columns=["trajectory_id"])["trajectory_id"])
    assert stored == {good_record(i)["trajectory_id"] for i in range(400)}
    quarantine = store.read("quarantine")
    assert len(quarantine) == len(bad) and quarantine["quarantine_id"].is_unique
    by_line = {}
    for reason in quarantine["reason"]:
        number, _, rest = reason.removeprefix("line ").partition(": ")
        by_line[int(number)] = rest
    missed = {n: (want, by_line.get(n)) for n, want in expected.items() if want not in (by_line.get(n) or "")}
    assert not missed, missed
    assert (quarantine["stage"] == "ingest").all()

    monkeypatch.setenv("LOPD_HOME", str(home))
    versions = (store.version("trajectories"), store.version("quarantine"))
    res = CliRunner().invoke(app, ["memory", "ingest", str(jsonl), "--profile", "smoke", "--json"])
    assert res.exit_code == 0, res.output
    again = last_json(res.stdout)
    assert (again["n_unchanged"], again["n_quarantined"]) == (400, len(bad))
    assert (store.version("trajectories"), store.version("quarantine")) == versions


def test_ingest_refuses_a_cycle_id_that_is_not_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LOPD_HOME", str(tmp_path / "ws"))
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text("")
    res = CliRunner().invoke(app, ["memory", "ingest", str(jsonl), "--profile", "smoke", "--cycle-id", "../c1"])
    assert res.exit_code == 2 and "cycle id '../c1' is not allowed" in res.output
