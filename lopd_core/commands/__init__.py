"""The ``lopd`` subcommands, one module per area; ``lopd_core.cli`` assembles them into one Typer app.

Each module defines plain functions with Typer annotations and keeps heavy imports inside them.
"""
