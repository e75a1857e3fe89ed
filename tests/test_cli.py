"""The real `lopd` entry point, run as a subprocess."""

import json
import os
import subprocess
import sys

SUBCOMMANDS = ["models", "rollout", "sandbox", "memory", "distill", "cycle", "serve", "backfill", "evaluate",
               "promote", "rollback", "export", "compare", "status", "rescore"]


def lopd(*args, env=None, check=False):
    return subprocess.run([sys.executable, "-m", "lopd_cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=check)


def test_help_lists_every_subcommand():
    res = lopd("--help")
    assert res.returncode == 0
    for name in SUBCOMMANDS:
        assert name in res.stdout, name


def test_bad_config_value_exits_nonzero_naming_the_field():
    res = lopd("config", "show", "--profile", "smoke", "--set", "distill.top_m=0")
    assert res.returncode == 2
    assert "distill.top_m" in res.stderr


def test_status_json_is_the_last_line(tmp_path):
    res = lopd("status", "--profile", "smoke", "--json", env={"LOPD_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["workspace"] == str(tmp_path) and info["profile"] == "smoke"


def test_progress_lines_and_errors_keep_their_brackets(capsys):
    # rich would read "[bank]" as a markup tag and drop it; progress lines and error messages are plain text
    import typer

    from lopd_cli.common import fail, log

    log("[bank] 2/16 successes")
    try:
        fail("bad value in [distill] section")
    except typer.Exit as e:
        assert e.exit_code == 1
    err = capsys.readouterr().err
    assert "[bank] 2/16 successes" in err
    assert "bad value in [distill] section" in err
