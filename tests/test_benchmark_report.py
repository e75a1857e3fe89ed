"""benchmarks/run_all renders the generated section of benchmarks/results/README.md from the result files (no benchmark runs)."""

import json

from benchmarks import run_all


def test_generated_section_is_rebuilt_in_place_and_keeps_the_hand_written_part(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    (results / "toy.json").write_text(json.dumps({
        "command": "python -m benchmarks.toy", "machine": {"cpus": 2}, "ratio": 1.5,
        "timing": {"median": 2.0, "runs": [1.0, 2.0, 3.0]},
        "results": [{"suite": "codegen", "level": 1, "success_rate": 0.25}]}))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nhand-written\n")
    monkeypatch.setattr(run_all, "RESULTS", results)
    monkeypatch.setattr(run_all, "DOC", doc)

    run_all.write_doc()
    first = doc.read_text()
    assert "hand-written" in first and "`python -m benchmarks.toy`" in first
    assert "| `ratio` | 1.5 |" in first and "| `timing` | 2 |" in first  # medians, not the per-run list
    assert "| `results[codegen,1].success_rate` | 0.25 |" in first

    (results / "toy.json").write_text(json.dumps({"command": "c", "ratio": 3.0}))
    run_all.write_doc()
    second = doc.read_text()
    assert second.count(run_all.BEGIN) == 1 and "| `ratio` | 3 |" in second and "1.5" not in second
