"""`lopd probe-passk` and `lopd probe-teacher`: measure before training (see :mod:`lopd_core.probe`).

``probe-passk`` samples the base model k times on a few training tasks of every family and reports per
family how often it succeeds; ``--out DIR`` keeps the episodes (JSONL), which ``probe-teacher`` and bank
seeding can reuse. ``probe-teacher`` scores the base model's own successes and failures under each teacher
(the text context in every placement asked for, the latent composer when one is given or cold-started
here, the framing-only control and, with ``--sdpo``, SDPO's teacher with its feedback in full and
redacted) and says whether the teacher is privileged.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from lopd_cli.common import JsonFlag, Overrides, Profile, emit_json, err, fail, load, out, workspace


def _policies(cfg):
    from lopd_core.models.loading import ModelNotFoundError
    from lopd_core.training import build_policies

    try:
        return build_policies(cfg, models_dir=workspace(cfg).models_dir)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))


def probe_passk(
    suite: Annotated[str | None, typer.Option(help="Task suite (overrides rollout.suite).")] = None,
    per_family: Annotated[int, typer.Option(help="Training tasks per family.")] = 4,
    k: Annotated[int, typer.Option("--k", help="Samples per task.")] = 16,
    temperature: Annotated[list[float] | None, typer.Option(help="Sampling temperature (repeatable).")] = None,
    seed: Annotated[int, typer.Option(help="Task and sampling seed.")] = 0,
    out_dir: Annotated[Path | None, typer.Option("--out", help="Write the episodes (JSONL) and the summary here.")] = None,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """pass@k per task family of the base model on training tasks, at one or more temperatures."""
    from lopd_core.envs import get_suite
    from lopd_core.probe import pass_at_k

    cfg = load(profile, set_)
    if suite:
        cfg = cfg.with_overrides({"rollout.suite": suite})
    suite_obj = get_suite(cfg.rollout.suite)
    policies = _policies(cfg)
    results = []
    for t in temperature or [0.7, 1.0]:
        started = time.perf_counter()
        err.print(f"pass@{k}: {per_family} tasks per family × {k} samples at T={t}", highlight=False)
        summary, episodes = pass_at_k(cfg, policies, suite_obj, per_family=per_family, k=k, temperature=t, seed=seed,
                                      success_reward=cfg.curation.success_threshold(suite_obj.kind))
        summary["seconds"] = round(time.perf_counter() - started, 1)
        results.append(summary)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            stem = f"passk-{suite_obj.name}-T{t}-k{k}-s{seed}"
            (out_dir / f"{stem}.jsonl").write_text("".join(e.to_json() + "\n" for e in episodes))
            (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not as_json:
            out.print(f"T={t}: {summary['episodes']} episodes, success {summary['success_rate']:.3f}; "
                      f"families with pass@{k} > 0: {', '.join(summary['learnable_families']) or 'none'}",
                      highlight=False)
            for family, row in summary["families"].items():
                out.print(f"  {family:28s} success {row['success_rate']:.3f}  pass@1 {row['pass_at_1']:.3f}  "
                          f"pass@{k} {row[f'pass_at_{k}']:.3f}", highlight=False)
    if as_json:
        emit_json({"suite": suite_obj.name, "k": k, "results": results})


def probe_teacher(
    episodes: Annotated[list[Path], typer.Option("--episodes", help="JSONL of the base model's sampled episodes (repeatable).")],
    composer: Annotated[Path | None, typer.Option(help="A cold-started composer directory (probes the latent teacher).")] = None,
    cold_start: Annotated[bool, typer.Option("--cold-start", help="Cold-start a composer on the episodes' successes first.")] = False,
    store: Annotated[Path | None, typer.Option("--store", help="Retrieve from this LanceDB store's latest experiences (e.g. a comparison root's lance/, the bank its runs train with) instead of an in-memory bank of every success in the episodes.")] = None,
    placements: Annotated[str, typer.Option(help="Comma-separated placements to probe (default: the config's).")] = "",
    max_successes: Annotated[int, typer.Option(help="At most this many successes scored.")] = 64,
    max_failures: Annotated[int, typer.Option(help="At most this many failures scored.")] = 64,
    text: Annotated[bool, typer.Option("--text/--no-text", help="Probe the text-context teacher and its framing-only control.")] = True,
    sdpo: Annotated[bool, typer.Option("--sdpo/--no-sdpo", help="Also probe SDPO's teacher (a successful sibling + the feedback), with the feedback in full and redacted.")] = False,
    agent_tasks: Annotated[int, typer.Option(help="Also play this many training tasks with the text context (0: skip).")] = 0,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write the JSON result here too.")] = None,
    profile: Profile = "demo",
    set_: Overrides = None,
    as_json: JsonFlag = False,
):
    """Is the self-teacher privileged? δ on the base model's own successes and failures, per teacher."""
    from lopd_core.envs import get_suite, suite_kind
    from lopd_core.models.latent import PLACEMENTS
    from lopd_core.privilege import probe_teacher as probe
    from lopd_core.probe import tasks_per_family, text_teacher_as_agent
    from lopd_core.recipe import cold_start_composer, memory_bank
    from lopd_core.training import load_composer_init

    cfg = load(profile, set_)
    from lopd_core.compare import read_episodes

    try:
        rows = read_episodes(episodes)
    except FileNotFoundError as e:
        fail(str(e))
    suites = {r.suite for r in rows}
    if len(suites) != 1:
        fail(f"the episodes come from {len(suites)} suites ({', '.join(sorted(suites))}); probe one suite at a time")
    suite_name = suites.pop()
    cfg = cfg.with_overrides({"rollout.suite": suite_name})
    suite_obj = get_suite(suite_name)
    wanted = [p.strip() for p in placements.split(",") if p.strip()] or [cfg.distill.lopd.context_placement]
    for p in wanted:
        if p not in PLACEMENTS:
            fail(f"placement {p!r} is not one of {', '.join(PLACEMENTS)}", code=2)
    if store is not None:
        from lopd_core.memory.store import ExperienceStore
        from lopd_core.recipe import bank_from_store

        lance = ExperienceStore.from_config(cfg, uri=str(store))
        if not (lance.has_table("experiences") and lance.count("experiences") > 0):
            fail(f"{store} holds no experiences (a LanceDB store such as a comparison root's lance/)", code=2)
        bank = bank_from_store(lance)
    else:
        bank = memory_bank(rows, cfg, kind=suite_kind(suite_name))
    policies = _policies(cfg)
    report = {"suite": suite_name, "episodes": len(rows), "bank": bank.source, "bank_version": bank.version,
              "bank_successes": len(bank.successes),
              "bank_families": sorted({t.family for t in bank.successes}), "teachers": {}}
    started = time.perf_counter()
    base_cache: dict = {}  # the base model's log-probs, shared by every teacher

    def save() -> None:  # after every teacher, so a long probe's finished part is never lost
        if out_file is not None:
            out_file.parent.mkdir(parents=True, exist_ok=True)
            out_file.write_text(json.dumps(report, indent=2) + "\n")

    def record(name: str, row: dict) -> None:
        report["teachers"][name] = row
        err.print(f"  {_teacher_line(name, row)}", highlight=False)
        save()

    for placement in wanted:
        pcfg = cfg.with_overrides({"distill.lopd.context_placement": placement})
        if text:
            err.print(f"text teacher, {placement}…", highlight=False)
            record(f"text/{placement}", probe(pcfg, policies, suite_obj, rows, bank, composer=None,
                                              max_successes=max_successes, max_failures=max_failures, base_cache=base_cache))
            record(f"framing_only/{placement}", probe(pcfg, policies, suite_obj, rows, bank, composer=None,
                                                      max_successes=max_successes, max_failures=max_failures,
                                                      framing_only=True, base_cache=base_cache))
            if agent_tasks:
                tasks = tasks_per_family(suite_obj, split="train", level=cfg.rollout.level,
                                         per_family=max(agent_tasks // 11, 1), seed=4242)[:agent_tasks]
                report["teachers"][f"text/{placement}"]["as_agent"] = text_teacher_as_agent(pcfg, policies, suite_obj,
                                                                                            tasks, bank)
                save()
        composer_dir = composer
        if cold_start and composer_dir is None:
            composer_dir = workspace(cfg).home / "probe" / f"cold_start-{placement}"
            err.print(f"cold-starting a composer ({placement})…", highlight=False)
            result = cold_start_composer(pcfg, bank, suite_name=suite_name, out_dir=composer_dir, policies=policies)
            report.setdefault("cold_start", {})[placement] = result.to_dict()
            save()
        if composer_dir is not None:
            state = load_composer_init(policies, pcfg, composer_dir)
            if state is None:
                fail(f"{composer_dir} is not a trained composer")
            err.print(f"latent teacher, {placement}…", highlight=False)
            record(f"latent/{placement}", probe(pcfg, policies, suite_obj, rows, bank, composer=state,
                                                max_successes=max_successes, max_failures=max_failures,
                                                base_cache=base_cache))
    if sdpo:  # does naming the expected answer make SDPO's teacher skip the tool call?
        for feedback in ("full", "redacted"):
            err.print(f"SDPO teacher, feedback {feedback}…", highlight=False)
            row = probe(cfg, policies, suite_obj, rows, bank, composer=None, sdpo_feedback=feedback,
                        max_successes=max_successes, max_failures=max_failures, base_cache=base_cache)
            record(f"sdpo/{cfg.distill.sdpo.context_placement}/{feedback}", row)
    report["seconds"] = round(time.perf_counter() - started, 1)
    save()
    if as_json:
        emit_json(report)
        return
    out.print(f"{report['episodes']} episodes, {report['bank_successes']} successes in the bank "
              f"({', '.join(report['bank_families'])})", highlight=False)
    for name, row in report["teachers"].items():
        out.print(f"  {_teacher_line(name, row)}", highlight=False)


def _teacher_line(name: str, row: dict) -> str:
    return (f"{name:26s} δ successes {row['privilege_success']:+.3f}  failures {row['privilege_failure']:+.3f}  "
            f"first token {row['privilege_first_token']:+.3f} [{row['first_token_ci95_low']:+.3f}, "
            f"{row['first_token_ci95_high']:+.3f}]  opener {row['privilege_opener']:+.3f} "
            f"[{row['opener_ci95_low']:+.3f}, {row['opener_ci95_high']:+.3f}]  "
            f"({row['successes']} / {row['failures']}, {row['failures_opening_tool_response']} inventing a tool reply: "
            f"opener {row['privilege_opener_tool_response']:+.3f})")
