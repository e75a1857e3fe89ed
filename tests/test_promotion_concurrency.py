"""No mixed champion pair under concurrency, with real processes on one real MLflow sqlite store: two processes
promote and roll back in a loop while a third reads the champion pair; every read must be a registered pair.
(Two cycles promoting at once, in two processes: tests/test_gate.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from test_gate import _pair

from lopd_core.config import load_config
from lopd_core.registry import ModelRegistry

_OPEN = """
import json, sys, time
from pathlib import Path
from lopd_core.config import load_config
from lopd_core.registry import ModelRegistry, PairVersion
home = Path(sys.argv[1])
reg = ModelRegistry(f"sqlite:///{home / 'mlflow.db'}", (home / "art").as_uri(), load_config("smoke").registry)
stop = home / "stop"
"""

_PROMOTER = _OPEN + """
pairs = [PairVersion(s, c) for s, c in json.loads(sys.argv[2])]
print("ready", flush=True)
n = 0
while not stop.exists():
    reg.promote(pairs[n % len(pairs)], force=True)
    n += 1
    (home / "promotions").write_text(str(n))
print(n, flush=True)
"""

_ROLLER = _OPEN + """
print("ready", flush=True)
n = 0
while not stop.exists():
    try:
        reg.rollback()
        n += 1
        (home / "rollbacks").write_text(str(n))
    except RuntimeError:  # the champion was never promoted over another pair
        time.sleep(0.005)
print(n, flush=True)
"""

_READER = _OPEN + """
reads, mirror_disagreed = [], 0
print("ready", flush=True)
def done(name):
    try:
        return int((home / name).read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0
started = time.monotonic()
try:  # at least the asked number of reads, and on until both writers have each done 10 (under load that takes longer)
    while len(reads) < int(sys.argv[2]) or (min(done("promotions"), done("rollbacks")) < 10
                                            and time.monotonic() - started < 240):
        pair = reg.champion()
        reads.append([pair.student, pair.composer])
        s = reg.client.get_model_version_by_alias(reg.cfg.student_model, "champion").version
        c = reg.client.get_model_version_by_alias(reg.cfg.composer_model, "champion").version
        mirror_disagreed += str(s) != str(c)  # what a reader of the two aliases sees (the old design)
finally:
    stop.touch()
print(json.dumps({"reads": reads, "mirror_disagreed": mirror_disagreed}), flush=True)
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline().strip()
    assert line == "ready", (line, proc.stderr.read()[-3000:] if proc.poll() is not None else "")
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


def test_no_mixed_pair_is_readable_while_two_processes_promote_and_roll_back(tmp_path):
    reg = ModelRegistry(f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "art").as_uri(), load_config("smoke").registry)
    reg.bootstrap_base("tiny", config_hash="abc", base_path=tmp_path)
    pairs = [[pair.student, pair.composer] for pair in (_pair(reg, tmp_path, name) for name in ("a", "b", "c"))]
    registered = {(v["version"], v["tags"]["paired_with"]) for v in reg.versions("student")}
    assert len(registered) == 4

    writers = [_start(_PROMOTER, str(tmp_path), json.dumps(pairs)), _start(_ROLLER, str(tmp_path))]
    try:
        started = time.monotonic()
        reader = _start(_READER, str(tmp_path), "400")
        result = json.loads(_finish(reader, timeout=300))
        elapsed = time.monotonic() - started
        promotions, rollbacks = (int(_finish(w)) for w in writers)
    finally:
        (tmp_path / "stop").touch()
        for w in writers:
            if w.poll() is None:
                w.kill()
    reads = [tuple(r) for r in result["reads"]]
    mixed = [r for r in reads if r not in registered]
    print(f"{len(reads)} reads in {elapsed:.0f} s during {promotions} promotions and {rollbacks} rollbacks; "
          f"mixed pairs read: {len(mixed)}; the two aliases disagreed in {result['mirror_disagreed']} reads")
    assert not mixed
    assert len(set(reads)) >= 2 and promotions >= 10 and rollbacks >= 10  # the writers really interleaved
