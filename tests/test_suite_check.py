"""`lopd suite check`: the shipped example passes every check; a suite broken on purpose fails each check it
breaks, with the task, tool or setting named, and the command exits non-zero."""

from __future__ import annotations

import json
import textwrap

import pytest
from typer.testing import CliRunner

from lopd_core.config import load_config
from lopd_core.envs.plugin import EXAMPLE_SUITE, PluginError, load_plugin_suite
from lopd_core.suite_check import CHECKS, check_suite

TOOLS = '''
from lopd_core.envs.tools import ToolError


class Counters:
    def __init__(self, state):
        self.state = state

    def read(self, key: str) -> int:
        """Read a counter.

        Args:
            key: The counter's name.
        """
        if key == "missing":
            raise ToolError("no counter named missing")
        return self.state["counters"][key]  # KeyError for any other unknown name: a bug of this tool

    def bump(self, key: str, by: int = 1) -> int:
        """Add to a counter.

        Args:
            key: The counter's name.
            by: How much to add.
        """
        self.state["counters"][key] += by
        return self.state["counters"][key]


def make_state(task):
    if task.get("data", {}).get("broken"):
        raise RuntimeError("no such fixture")
    return {"counters": {"a": 1, "b": 5}}
'''


def _call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _row(task_id, instruction, turns, **fields):
    return json.dumps({"id": task_id, "instruction": instruction, "oracle_turns": turns, **fields})


def broken_suite(tmp_path, *, needs="needs: {turns: 1}"):
    """A suite with one sound task and one of each problem the check must find."""
    (tmp_path / "tools.py").write_text(TOOLS)
    rows = [
        _row("good", "Bump a by 2.", [_call("bump", key="a", by=2), "a is now 3."],
             expected_calls=[{"name": "bump", "arguments": {"key": "a", "by": 2}}], expected_answer=[3]),
        _row("wrong-answer", "What is b?", [_call("read", key="b"), "b is 4."],
             expected_calls=[{"name": "read", "arguments": {"key": "b"}}], expected_answer=[5]),
        _row("tool-crash", "What is zz?", [_call("read", key="zz"), "There is no zz."], expected_answer=["no zz"]),
        _row("domain-error", "What is missing?", [_call("read", key="missing"), "There is no counter named missing."],
             expected_answer=["no counter"]),
        _row("bad-state", "What is a?", [_call("read", key="a"), "a is 1."], expected_answer=[1], data={"broken": True}),
        _row("early-end", "Read a, then b.", ["a is 1.", _call("read", key="b")], expected_answer=[1]),
    ]
    (tmp_path / "tasks.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "suite.yaml").write_text(textwrap.dedent(f"""\
        name: counters
        tools: {{module: tools.py, class: Counters}}
        make_state: tools.py:make_state
        tasks: tasks.jsonl
        {needs}
        """))
    return tmp_path / "suite.yaml"


def test_example_suite_passes_every_check_measured_in_tokens(tiny_tokenizer):
    rollout = load_config("demo").rollout
    report = check_suite(str(EXAMPLE_SUITE), rollout=rollout, tokenizer=tiny_tokenizer)
    assert report.ok, report.problems
    assert all(not report.checks[c] for c in CHECKS) and report.skipped == []
    assert report.oracles == {"replayed": 24, "passed": 24}
    assert report.tasks == {"train/1": 8, "train/2": 8, "test/1": 4, "test/2": 4}
    needs = load_plugin_suite(EXAMPLE_SUITE).needs
    assert 0 < report.measured["episode_tokens"]["value"] <= needs.context_tokens
    assert report.measured["turns"]["value"] == needs.turns == 3
    assert 0 < report.measured["turn_tokens"]["value"] <= needs.new_tokens


def test_example_suite_against_settings_too_small_for_it(tiny_tokenizer):
    rollout = load_config("demo", {"rollout.max_trajectory_tokens": 512, "rollout.max_turns": 2,
                                   "rollout.max_new_tokens": 32}).rollout
    report = check_suite(str(EXAMPLE_SUITE), rollout=rollout, tokenizer=tiny_tokenizer)
    assert not report.ok and report.checks["oracles"] == [] and report.checks["needs"] == []
    settings = " | ".join(report.checks["settings"])
    for fix in ("--set rollout.max_trajectory_tokens=1024", "--set rollout.max_turns=3", "--set rollout.max_new_tokens=64"):
        assert fix in settings
    assert "its episodes would error at the first turn" in settings  # the prompt alone is over 512 tokens


def test_broken_suite_fails_each_check_it_breaks_and_names_the_task(tmp_path):
    report = check_suite(str(broken_suite(tmp_path)), rollout=load_config("demo").rollout)
    assert not report.ok
    assert report.checks["load"] == [] and report.checks["schemas"] == [] and report.checks["tasks"] == []
    oracles = report.checks["oracles"]
    assert any("counters/wrong-answer" in p and "scores 0.5" in p and "unmet answer" in p for p in oracles), oracles
    assert any("counters/tool-crash" in p and "KeyError" in p and "ToolError" in p for p in oracles), oracles
    assert any("counters/early-end" in p and "ended at turn 1" in p for p in oracles), oracles
    assert not any("domain-error" in p for p in oracles)  # a ToolError is the tool working as designed
    assert not any("counters/good" in p for c in CHECKS if c != "needs" for p in report.checks[c])
    [episode] = report.checks["episodes"]
    assert "counters/bad-state" in episode and "make_state" in episode and "no such fixture" in episode
    [needs] = report.checks["needs"]
    assert "needs.turns=1" in needs and "(2)" in needs
    assert report.oracles == {"replayed": 5, "passed": 2}  # good and domain-error


def test_suite_that_fails_to_load_is_one_clear_problem(tmp_path):
    path = broken_suite(tmp_path)
    text = path.read_text()
    (tmp_path / "hooks.py").write_text("def load():\n    raise OSError('data.bin is missing')\n")
    path.write_text(text + "shared: hooks.py:load\n")
    with pytest.raises(PluginError, match=r"shared: hooks.py:load raised OSError: data.bin is missing"):
        load_plugin_suite(path)
    report = check_suite(str(path))
    assert report.checks["load"] and "data.bin is missing" in report.checks["load"][0]
    assert set(report.skipped) == set(CHECKS) - {"load"} and report.oracles["replayed"] == 0


def test_lopd_suite_check_cli_exit_codes_and_report(tmp_path):
    from lopd_cli.main import app

    good = CliRunner().invoke(app, ["suite", "check", str(EXAMPLE_SUITE), "--no-tokens"])
    assert good.exit_code == 0, good.output
    assert "pass oracles" in good.output and "24/24 score 1" in good.output and ": ok" in good.output
    path = broken_suite(tmp_path)
    bad = CliRunner().invoke(app, ["suite", "check", str(path), "--no-tokens"])
    assert bad.exit_code == 1
    text = " ".join(bad.output.split())
    assert "FAIL oracles" in text and "FAIL episodes" in text and "FAIL needs" in text and "pass schemas" in text
    assert "counters/tool-crash" in text and "counters/bad-state" in text
    as_json = CliRunner().invoke(app, ["suite", "check", str(path), "--no-tokens", "--json"])
    assert as_json.exit_code == 1
    summary = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert summary["ok"] is False and summary["checks"]["load"]["ok"] and not summary["checks"]["oracles"]["ok"]
    assert summary["oracles"] == {"replayed": 5, "passed": 2}
    missing = CliRunner().invoke(app, ["suite", "check", str(tmp_path / "nope.yaml"), "--no-tokens"])
    assert missing.exit_code == 1 and "FAIL load" in missing.output


def test_the_plugin_doc_documents_every_field_hook_argument_and_check():
    from pathlib import Path

    from lopd_core.envs import plugin

    doc = (Path(__file__).resolve().parents[1] / "docs" / "plugin-suites.md").read_text()
    documented = {
        *plugin._YAML_KEYS, *plugin._TOOLS_KEYS, *plugin._TASK_KEYS, *plugin._NEEDS_KEYS, *plugin.CHECKER_ARGUMENTS,
        *CHECKS, *plugin.HELPER_NAMES,
    }
    missing = sorted(k for k in documented if f"`{k}`" not in doc and f"{k}:" not in doc)
    assert not missing, f"docs/plugin-suites.md does not mention {missing}"
