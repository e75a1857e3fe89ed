"""`lopd memory curate|index|search`: the LanceDB experience store by hand."""

from __future__ import annotations

import typer

from lopd_core.commands.common import Overrides, Profile, not_built

memory_app = typer.Typer(no_args_is_help=True, help="The LanceDB experience store: curate, index, search.")


@memory_app.command("curate")
def curate(profile: Profile = "demo", set_: Overrides = None):
    """Curate stored trajectories into experiences."""
    not_built("memory curate")


@memory_app.command("index")
def index(profile: Profile = "demo", set_: Overrides = None):
    """Embed curated experiences into the LanceDB experiences table."""
    not_built("memory index")


@memory_app.command("search")
def search(query: str, profile: Profile = "demo", set_: Overrides = None):
    """Search the experiences table with the leakage rules applied."""
    not_built("memory search")
