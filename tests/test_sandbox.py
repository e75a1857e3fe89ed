"""Adversarial tests of the code sandbox: real subprocesses, each attack contained with the right verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lopd_core.envs.sandbox import SandboxLimits, isolation_available, run_batch, run_file, run_python

FAST = SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=16)
ISOLATED = bool(isolation_available()) and os.geteuid() == 0
needs_isolation = pytest.mark.skipif(not ISOLATED, reason="needs root and `unshare` (namespaces + privilege drop)")


def _sandbox_user_processes() -> list[int]:
    """Pids of processes that belong to the sandbox's unprivileged user on the host."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == FAST.uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids


def test_ok_program_reports_output_and_protections():
    verdict = run_python("import os\nprint('hello', os.getcwd() == os.environ['HOME'])", limits=FAST)
    assert verdict.status == "ok" and verdict.exit_code == 0
    assert verdict.stdout == "hello True\n"
    assert verdict.seconds > 0
    if ISOLATED:
        assert verdict.uncontained == [], verdict.protections


def test_error_exit_code_and_exception_reason():
    verdict = run_python("raise SystemExit(3)", limits=FAST)
    assert (verdict.status, verdict.exit_code) == ("error", 3)
    verdict = run_python("1/0", limits=FAST)
    assert verdict.status == "error" and "ZeroDivisionError" in verdict.reason


def test_infinite_loop_times_out_and_is_killed():
    start = time.monotonic()
    verdict = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=1.5, memory_mb=256))
    assert verdict.status == "timeout"
    assert time.monotonic() - start < 6
    assert "1.5 s" in verdict.reason


def test_cpu_limit_is_a_timeout():
    # Wall-clock limit well above the CPU limit: RLIMIT_CPU must fire first.
    verdict = run_python("while True:\n    pass", limits=SandboxLimits(timeout_s=8, cpu_s=1, memory_mb=256))
    assert verdict.status == "timeout"
    assert verdict.seconds < 7.5


@needs_isolation
def test_fork_bomb_is_contained_and_leaves_no_process():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    verdict = run_python(bomb, limits=SandboxLimits(timeout_s=2, memory_mb=256, max_processes=16))
    assert verdict.status in ("timeout", "error", "killed")
    assert verdict.protections["rlimit_nproc"] and verdict.protections["pid_namespace"]
    time.sleep(0.2)
    assert _sandbox_user_processes() == []
    # The host can still start processes.
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True).returncode == 0


@needs_isolation
def test_detached_child_dies_with_the_sandbox():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    raise SystemExit\n"
            "print('parent done')\n")
    verdict = run_python(code, limits=FAST)
    assert verdict.status == "ok" and "parent done" in verdict.stdout
    time.sleep(0.2)
    assert _sandbox_user_processes() == []


def test_memory_bomb_gets_memory_verdict():
    verdict = run_python("x = bytearray(2 * 1024 ** 3)", limits=FAST)
    assert verdict.status == "memory"
    verdict = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))", limits=FAST)
    assert verdict.status == "memory"


@needs_isolation
def test_writing_outside_its_directory_is_denied(tmp_path):
    # A root-owned directory (this tests folder): permission denied for the unprivileged user — or, when
    # the checkout itself lives under /tmp, not even visible (the sandbox's /tmp is a private tmpfs).
    target = Path(__file__).parent / f"escaped-{os.getpid()}.txt"
    verdict = run_python(f"open({str(target)!r}, 'w').write('x')", limits=FAST)
    expected = "FileNotFoundError" if str(target.resolve()).startswith("/tmp/") else "PermissionError"
    assert verdict.status == "error" and expected in verdict.reason
    assert not target.exists()
    # A path under the host's /tmp (the private tmpfs hides it: not found, and nothing is created).
    target = tmp_path / "escaped.txt"
    verdict = run_python(f"open({str(target)!r}, 'w').write('x')", limits=FAST)
    assert verdict.status == "error"
    assert not target.exists()
    # /tmp is world-writable on the host: inside the sandbox it is a private tmpfs, so nothing lands on the host.
    marker = f"/tmp/lopd-sandbox-escape-{os.getpid()}"
    verdict = run_python(f"open({marker!r}, 'w').write('x')\nprint('written')", limits=FAST)
    assert verdict.status == "ok" and verdict.protections["private_tmp"]
    assert not Path(marker).exists()
    # Its own directory is writable.
    verdict = run_python("open('out.txt', 'w').write('fine')\nprint(open('out.txt').read())", limits=FAST)
    assert verdict.stdout.strip() == "fine"


def test_parent_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("LOPD_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "print(os.environ.get('LOPD_TEST_SECRET'))\n"
        "leaked = False\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n"
        "            leaked |= b'hunter2' in open(f'/proc/{pid}/environ', 'rb').read()\n"
        "        except OSError:\n"
        "            pass\n"
        "print(leaked)\n"
    )
    verdict = run_python(code, limits=FAST)
    assert verdict.status == "ok"
    assert verdict.stdout.split() == ["None", "False"]
    assert verdict.protections["scrubbed_env"]


@needs_isolation
def test_socket_cannot_reach_the_network():
    code = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
            "s.connect(('1.1.1.1', 80))\nprint('connected')\n")
    verdict = run_python(code, limits=FAST)
    assert verdict.status == "error" and "connected" not in verdict.stdout
    assert verdict.protections["network_namespace"]
    assert "unreachable" in verdict.reason.lower() or "OSError" in verdict.reason


def test_huge_output_is_capped_and_flood_killed():
    limits = SandboxLimits(timeout_s=5, memory_mb=256, max_output_bytes=1000, hard_output_bytes=200_000)
    verdict = run_python("print('y' * 100_000)", limits=limits)
    assert verdict.status == "ok" and verdict.stdout_truncated and len(verdict.stdout) == 1000
    verdict = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 10000)", limits=limits)
    assert verdict.status == "killed" and "output" in verdict.reason
    assert len(verdict.stdout) == 1000


def test_segfault_is_reported_as_killed_by_sigsegv():
    verdict = run_python("import ctypes\nctypes.string_at(0)", limits=FAST)
    assert verdict.status == "killed" and verdict.signal == "SIGSEGV"
    assert verdict.exit_code is None


@needs_isolation
def test_program_runs_as_unprivileged_user():
    verdict = run_python("import os\nprint(os.getuid(), os.getgid(), os.getgroups())", limits=FAST)
    assert verdict.stdout.split() == ["65534", "65534", "[]"]


def test_batch_runs_in_order_and_extra_files(tmp_path):
    programs = [f"print({i} * {i})" for i in range(6)]
    verdicts = run_batch(programs, limits=FAST, workers=2)
    assert [v.stdout.strip() for v in verdicts] == [str(i * i) for i in range(6)]
    verdict = run_batch([{"main.py": "import helper\nprint(helper.VALUE)", "helper.py": "VALUE = 42"}],
                        limits=FAST)[0]
    assert verdict.stdout.strip() == "42"


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        run_file(tmp_path / "missing.py")
    with pytest.raises(ValueError, match="relative path"):
        run_batch([{"main.py": "", "../evil.py": ""}])
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)


def test_cli_sandbox_run_prints_the_verdict(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import time\nwhile True:\n    time.sleep(0.1)\n")
    done = subprocess.run([sys.executable, "-m", "lopd_cli", "sandbox", "run", str(script), "--timeout", "1",
                           "--memory-mb", "128", "--json"], capture_output=True, text=True, timeout=60)
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["status"] == "timeout" and done.returncode == 1
    script.write_text("print('fine')\n")
    done = subprocess.run([sys.executable, "-m", "lopd_cli", "sandbox", "run", str(script), "--json"],
                          capture_output=True, text=True, timeout=60)
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert (verdict["status"], verdict["stdout"], done.returncode) == ("ok", "fine\n", 0)
    done = subprocess.run([sys.executable, "-m", "lopd_cli", "sandbox", "run", str(tmp_path / "nope.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such file" in done.stderr
