"""`lopd sandbox run`: run a file in the code sandbox and print the verdict."""

from __future__ import annotations

from pathlib import Path

import typer

from lopd_core.commands.common import not_built

sandbox_app = typer.Typer(no_args_is_help=True, help="Run model-generated code in the sandbox.")


@sandbox_app.command("run")
def run(file: Path):
    """Run a Python file in the sandbox and print the verdict."""
    not_built("sandbox run")
