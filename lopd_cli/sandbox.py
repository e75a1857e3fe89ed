"""`lopd sandbox run`: run a Python file in the code sandbox and print the verdict.

The exit code is 0 when the program's status is ``ok``, 1 for any other verdict (error, timeout, memory,
killed, or refused: this machine cannot contain it and LOPD_SANDBOX_ALLOW_UNCONTAINED is not set) and 2
when the file cannot be run at all. With ``--json`` the verdict is the last line of stdout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lopd_cli.common import JsonFlag, emit_json, err, fail, out

sandbox_app = typer.Typer(no_args_is_help=True, help="Run model-generated code in the sandbox.")


@sandbox_app.command("run")
def run(
    file: Annotated[Path, typer.Argument(help="Python file to run (copied into a fresh sandbox directory).")],
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit in seconds.")] = 10.0,
    memory_mb: Annotated[int, typer.Option("--memory-mb", help="Address-space limit in MiB.")] = 512,
    max_output: Annotated[int, typer.Option("--max-output", help="Bytes of stdout/stderr kept.")] = 16_384,
    json_out: JsonFlag = False,
):
    """Run a Python file in the sandbox and print the verdict."""
    from lopd_core.envs.sandbox import SandboxError, SandboxLimits, run_file

    if not file.is_file():
        fail(f"no such file {file}; pass the path of a Python file to run", code=2)
    try:
        limits = SandboxLimits(timeout_s=timeout, memory_mb=memory_mb, max_output_bytes=max_output)
        verdict = run_file(file, limits=limits)
    except (ValueError, SandboxError) as exc:
        fail(str(exc), code=2)
    if json_out:
        emit_json(verdict.to_dict())
    else:
        colour = "green" if verdict.ok else "red"
        out.print(f"[{colour}]{verdict.status}[/{colour}] exit={verdict.exit_code} signal={verdict.signal} "
                  f"seconds={verdict.seconds:.3f}" + (f" — {verdict.reason}" if verdict.reason else ""), highlight=False)
        if verdict.stdout:
            out.print("[bold]stdout[/bold]" + (" (truncated)" if verdict.stdout_truncated else ""))
            out.print(verdict.stdout, markup=False, highlight=False, end="")
        if verdict.stderr:
            out.print("[bold]stderr[/bold]" + (" (truncated)" if verdict.stderr_truncated else ""))
            out.print(verdict.stderr, markup=False, highlight=False, end="")
        if verdict.uncontained:
            err.print(f"[yellow]not contained on this machine:[/yellow] {', '.join(verdict.uncontained)}")
    raise typer.Exit(0 if verdict.ok else 1)
