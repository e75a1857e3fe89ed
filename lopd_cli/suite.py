"""`lopd suite`: the suites there are (``list``) and a suite checked before it is run (``check``).

``lopd suite check PATH`` loads a plug-in suite (or a built-in one by name), validates its files and tool
schemas, replays every oracle solution its tasks declare through the real environment and checker, measures
the episodes in tokens with the profile's model (``--no-tokens`` skips that) and compares them with the
suite's declared needs and the profile's rollout settings. It prints every problem and exits 1 when there is
one (:mod:`lopd_core.suite_check` does the work).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from lopd_cli.common import JsonFlag, Overrides, Profile, emit_json, err, load, out, workspace

suite_app = typer.Typer(no_args_is_help=True, help="Task suites: list them, check a plug-in suite.")


@suite_app.command("list")
def list_(as_json: JsonFlag = False):
    """The built-in suites (any plug-in suite YAML path is accepted wherever a suite is)."""
    from lopd_core.envs import list_suites

    suites = list_suites()
    if as_json:
        emit_json({"suites": suites})
        return
    for s in suites:
        out.print(f"{s['name']:<16} {s['kind']:<5} {s['description']}", highlight=False)


@suite_app.command("check")
def check(
    path: Annotated[str, typer.Argument(help="A plug-in suite YAML path, or a built-in suite name.")],
    limit: Annotated[int | None, typer.Option(help="Replay at most this many tasks per split and level.")] = None,
    tokens: Annotated[bool, typer.Option("--tokens/--no-tokens",
                                         help="Measure in tokens with the profile's model.base tokenizer.")] = True,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Validate a suite, replay its oracle solutions and check it against the profile's rollout settings."""
    from lopd_core.suite_check import check_suite

    cfg = load(profile, set_)
    tokenizer = None
    if tokens:
        from lopd_core.models.loading import ModelNotFoundError, load_tokenizer, resolve_model_path

        try:
            tokenizer = load_tokenizer(resolve_model_path(cfg.model.base, workspace(cfg).models_dir))
        except (ModelNotFoundError, ValueError, OSError) as e:
            err.print(f"[yellow]no token counts:[/yellow] {escape(str(e))} (--no-tokens to skip)", highlight=False)
    report = check_suite(path, rollout=cfg.rollout, tokenizer=tokenizer, limit=limit)
    if as_json:
        emit_json({**report.to_dict(), "profile": cfg.name})
    else:
        _print_report(report, cfg.name)
    if not report.ok:
        raise typer.Exit(1)


def _print_report(report, profile: str) -> None:
    from lopd_core.suite_check import CHECKS

    tasks = ", ".join(f"{k}: {v}" for k, v in report.tasks.items()) or "none"
    out.print(f"suite {report.suite}: {len(report.tools)} tools, tasks ({tasks})", highlight=False)
    for name, what in CHECKS.items():
        problems = report.checks[name]
        if name in report.skipped and not problems:
            mark = "[yellow]skip[/yellow]"
        else:
            mark = "[red]FAIL[/red]" if problems else "[green]pass[/green]"
        extra = f" ({report.oracles['passed']}/{report.oracles['replayed']} score 1)" if name == "oracles" else ""
        out.print(f"  {mark} {name:<9} {escape(what)}{extra}", highlight=False)
        for problem in problems[:10]:
            out.print(f"         - {escape(problem)}", highlight=False, soft_wrap=True)
        if len(problems) > 10:
            out.print(f"         ... and {len(problems) - 10} more (--json lists all)", highlight=False)
    for key, seen in report.measured.items():
        out.print(f"  longest {key.replace('_', ' '):<18} {seen['value']} ({seen['task']})", highlight=False)
    for note in report.notes[:20]:
        out.print(f"  note: {note}", highlight=False, markup=False, soft_wrap=True)
    if len(report.notes) > 20:
        out.print(f"  ... and {len(report.notes) - 20} more notes (--json lists all)", highlight=False)
    verdict = "[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problems[/red]"
    out.print(f"suite {escape(report.suite)} checked against profile {profile}: {verdict}", highlight=False)
