"""`lopd rollout` and `lopd sandbox run`."""

from __future__ import annotations

from pathlib import Path

import typer

from lopd_core.commands.common import Overrides, Profile, not_built

sandbox_app = typer.Typer(no_args_is_help=True, help="Run model-generated code in the sandbox.")


def rollout(profile: Profile = "demo", set_: Overrides = None):
    """Generate episodes on a task suite and print success rate, reward and tokens/s."""
    not_built("rollout")


@sandbox_app.command("run")
def run(file: Path):
    """Run a Python file in the sandbox and print the verdict."""
    not_built("sandbox run")
