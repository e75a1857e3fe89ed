"""What plug-in suites rely on at run time: argument validation that follows the schema (explicit null for
optional parameters, numeric strings where the suite asks for coercion), ToolError as an error call, episodes
isolated from each other when interleaved, BFCL v4 multi-turn's ground truth through our environment, and
rollouts that fail loudly, naming the suite and task."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
from typer.testing import CliRunner

from lopd_core.envs import get_suite
from lopd_core.envs.plugin import load_plugin_suite
from lopd_core.envs.tools import Toolbox, ToolCall, ToolError, schema_of
from lopd_core.rollout.agent import EpisodesFailed, episode_problems, play, run_episodes
from lopd_core.rollout.engines.base import SamplingParams


# --------------------------------------------------------------------------------------------------
def search(query: str, limit: int = 3, region: str | None = None) -> dict:
    """Search the catalogue.

    Args:
        query: What to look for.
        limit: How many results.
        region: Only this region.
    """
    return {"query": query, "limit": limit, "region": region}


def lookup(item_id: str) -> dict:
    """Look an item up.

    Args:
        item_id: The item's id.
    """
    if item_id == "gone":
        raise ToolError(f"no item {item_id}")
    if item_id == "bug":
        return {}["missing"]
    return {"item_id": item_id}


def test_schema_keeps_defaults_and_explicit_null_is_accepted_for_optional_parameters():
    params = schema_of(search)["function"]["parameters"]
    assert params["required"] == ["query"]
    assert params["properties"]["limit"]["default"] == 3 and params["properties"]["region"].get("nullable") is True
    box = Toolbox.from_functions([search])
    # null for a parameter that is not nullable: dropped, so the function's default applies
    record = box.run(ToolCall("search", {"query": "maps", "limit": None}))
    assert record.status == "ok" and record.result == {"query": "maps", "limit": 3, "region": None}
    # null for a nullable parameter: passed as None
    record = box.run(ToolCall("search", {"query": "maps", "region": None}))
    assert record.status == "ok" and record.result["region"] is None
    # null for a required parameter is still an invalid call
    record = box.run(ToolCall("search", {"query": None}))
    assert record.status == "rejected" and "query must be of type string" in record.error


def test_numeric_strings_are_coerced_only_where_the_suite_declares_it():
    schemas = [schema_of(search)]
    strict = Toolbox({"search": search}, schemas)
    record = strict.run(ToolCall("search", {"query": "maps", "limit": "5"}))
    assert record.status == "rejected" and "limit must be of type integer" in record.error
    coercing = Toolbox({"search": search}, schemas, coerce_numbers=True)
    record = coercing.run(ToolCall("search", {"query": "12", "limit": "5"}))
    assert record.status == "ok" and record.result["limit"] == 5 and record.result["query"] == "12"  # strings stay
    assert coercing.run(ToolCall("search", {"query": "maps", "limit": "5.5"})).status == "rejected"
    assert coercing.run(ToolCall("search", {"query": "maps", "limit": "five"})).status == "rejected"


def test_tool_error_is_an_error_call_and_other_exceptions_are_reported():
    box = Toolbox.from_functions([lookup])
    ok = box.run(ToolCall("lookup", {"item_id": "A1"}))
    domain = box.run(ToolCall("lookup", {"item_id": "gone"}))
    crash = box.run(ToolCall("lookup", {"item_id": "bug"}))
    assert ok.status == "ok" and ok.exception == ""
    assert domain.status == "error" and domain.error == "no item gone" and domain.exception == ""
    assert domain.observation == "<tool_response>\nerror: no item gone\n</tool_response>"
    assert crash.status == "error" and crash.exception == "KeyError" and "lookup failed: KeyError" in crash.error
    assert domain.to_dict()["status"] == "error" and crash.to_dict()["exception"] == "KeyError"


# --------------------------------------------------------------------------------------------------
COUNTER_TOOLS = '''
from lopd_core.envs.tools import ToolError

CLOSED = []


class Counter:
    def __init__(self, state):
        self.state = state

    def add(self, amount: int) -> int:
        """Add to the counter.

        Args:
            amount: How much to add.
        """
        self.state["value"] += amount
        return self.state["value"]

    def read(self) -> int:
        """Read the counter."""
        return self.state["value"]

    def lookup(self, item_id: str) -> dict:
        """Look an item up.

        Args:
            item_id: The item's id.
        """
        if item_id == "gone":
            raise ToolError("no item gone")
        return {}[item_id]

    def release(self) -> None:
        CLOSED.append(self.state["value"])


def make_state(task):
    if task["data"].get("broken"):
        raise RuntimeError("fixture for " + task["id"] + " is missing")
    return {"value": task["data"]["start"]}


def check(task, calls, trace, final_state):
    want = task["data"]["start"] + sum(c["arguments"]["amount"] for c in calls if c["name"] == "add")
    errors = [r for r in trace if r["status"] == "error"]
    ok = final_state["value"] == task["data"]["want"] == want and not errors
    return {"reward": 1.0 if ok else 0.0, "feedback": f"value {final_state['value']}, {len(errors)} error calls"}
'''


def _call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def counter_suite(tmp_path, rows):
    (tmp_path / "counter.py").write_text(COUNTER_TOOLS)
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "suite.yaml").write_text(textwrap.dedent("""\
        name: counter
        tools: {module: counter.py, class: Counter, functions: [add, read, lookup], teardown: release}
        make_state: counter.py:make_state
        checker: counter.py:check
        tasks: tasks.jsonl
        """))
    return load_plugin_suite(tmp_path / "suite.yaml")


def _task(task_id, start, adds, **data):
    turns = [_call("add", amount=a) for a in adds] + [f"The counter is {start + sum(adds)}."]
    return {"id": task_id, "instruction": f"Task {task_id}: add {adds} to the counter.", "oracle_turns": turns,
            "data": {"start": start, "want": start + sum(adds), **data}}


def test_interleaved_episodes_of_a_stateful_suite_score_as_when_run_alone(tmp_path):
    suite = counter_suite(tmp_path, [_task("a", 10, [1, 2, 3]), _task("b", 100, [50, 5])])
    closed = suite.spec.module.CLOSED
    a, b = (suite.tasks("train", 5)[i] for i in (0, 1))
    alone = []
    for task in (a, b, a):
        env = suite.make_env(task)
        env.reset(task)
        for turn in task.oracle_turns:
            env.step(turn)
        alone.append(env.result().reward)
        env.close()
    assert alone == [1.0, 1.0, 1.0] and closed == [16, 155, 16]
    # two episodes of the same task and one of another, stepped in turn: each has its own state and instance
    envs = [(task, suite.make_env(task)) for task in (a, a, b)]
    for task, env in envs:
        env.reset(task)
    for k in range(4):
        for task, env in envs:
            if k < len(task.oracle_turns):
                env.step(task.oracle_turns[k])
    assert [env.result().reward for _, env in envs] == [1.0, 1.0, 1.0]
    for _, env in envs:
        env.close()
        env.close()  # a second close does not tear down again
    assert closed[3:] == [16, 16, 155]


def test_interleaved_episodes_through_the_batched_agent_loop(tmp_path, tiny_tokenizer):
    from test_agent_suites import OraclePolicyEngine

    suite = counter_suite(tmp_path, [_task("a", 10, [1, 2, 3]), _task("b", 100, [50, 5]), _task("c", 0, [7])])
    tasks = suite.tasks("train", 5)
    trajs = run_episodes(OraclePolicyEngine(tiny_tokenizer, tasks), tiny_tokenizer, suite, tasks, max_turns=6,
                         max_trajectory_tokens=2048, sampling=SamplingParams(max_new_tokens=64))
    assert [t.status for t in trajs] == ["ok"] * 3, [t.error for t in trajs]
    assert [t.reward for t in trajs] == [1.0, 1.0, 1.0], [t.feedback for t in trajs]
    assert sorted(suite.spec.module.CLOSED) == [7, 16, 155]


def test_tool_error_call_is_in_the_trace_and_a_crash_is_reported_naming_the_task(tmp_path, tiny_tokenizer):
    from test_agent_suites import OraclePolicyEngine

    domain = {**_task("domain", 1, [1]), "oracle_turns": [_call("lookup", item_id="gone"), _call("add", amount=1),
                                                            "The counter is 2."]}
    crash = {**_task("crash", 1, [1]), "oracle_turns": [_call("lookup", item_id="x"), _call("add", amount=1),
                                                         "The counter is 2."]}
    suite = counter_suite(tmp_path, [domain, crash])
    tasks = suite.tasks("train", 5)
    trajs = run_episodes(OraclePolicyEngine(tiny_tokenizer, tasks), tiny_tokenizer, suite, tasks, max_turns=6,
                         max_trajectory_tokens=2048, sampling=SamplingParams(max_new_tokens=64))
    assert [t.status for t in trajs] == ["ok", "ok"]
    # the checker saw the ToolError call as an error in the trace (reward 0), and it is counted as invalid
    assert trajs[0].reward == 0.0 and "1 error calls" in trajs[0].feedback and trajs[0].n_invalid_tool_calls == 1
    assert "error: no item gone" in trajs[0].messages[-4]["content"]
    assert "tool_exceptions" not in trajs[0].checklist
    assert trajs[1].checklist["tool_exceptions"] and "KeyError" in trajs[1].checklist["tool_exceptions"][0]
    [problem] = episode_problems(trajs)
    assert problem.startswith("suite counter, task counter/crash: tool raised an unexpected exception: lookup")


# --------------------------------------------------------------------------------------------------
def test_a_run_whose_every_episode_errors_fails_loudly_naming_suite_and_task(tmp_path, tiny_tokenizer):
    from test_agent_suites import OraclePolicyEngine

    from lopd_core.config import load_config

    suite = counter_suite(tmp_path, [_task("x", 0, [1], broken=True), _task("y", 0, [2], broken=True)])
    tasks = suite.tasks("train", 5)
    rollout = load_config("smoke").rollout
    with pytest.raises(EpisodesFailed) as caught:
        play(rollout, OraclePolicyEngine(tiny_tokenizer, tasks), tiny_tokenizer, suite, tasks, seed=0)
    message = str(caught.value)
    assert message.startswith("all 2 episodes errored")
    assert "suite counter, task counter/x: env.reset" in message and "make_state hook counter.py:make_state" in message
    assert "fixture for x is missing" in message and "fixture for y is missing" in message
    assert all(t.reward == 0.0 and t.token_ids == [] for t in caught.value.trajectories)


def test_lopd_rollout_exits_nonzero_when_every_episode_errors(tmp_path, models_dir):
    from lopd_cli.main import app

    counter_suite(tmp_path, [_task("x", 0, [1], broken=True)])
    args = ["rollout", "--profile", "smoke", "--set", f"workspace.home={tmp_path / 'ws'}",
            "--set", f"workspace.models_dir={models_dir}", "--suite", str(tmp_path / "suite.yaml"), "--n", "1",
            "--out", str(tmp_path / "out"), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "all 1 episodes errored" in text and "task counter/x" in text and "fixture for x is missing" in text
    rows = [json.loads(line) for f in (tmp_path / "out").glob("*.jsonl") for line in f.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["status"] == "error"  # the records are written before the exit
    broken = CliRunner().invoke(app, [*args[:-5], "--suite", str(tmp_path / "missing.yaml")])
    assert broken.exit_code == 1 and "missing.yaml not found" in " ".join(broken.output.split())


# --------------------------------------------------------------------------------------------------
needs_bfcl = pytest.mark.skipif(importlib.util.find_spec("bfcl_eval") is None,
                                reason="bfcl-eval is not installed (pip install --no-deps bfcl-eval)")


@needs_bfcl
@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_bfcl_multi_turn_ground_truth_scores_one_through_our_env(level):
    suite = get_suite("bfcl_multi_turn")
    tasks = suite.tasks("test", 4, level=level, seed=level)  # a seeded sample of each category
    assert len(tasks) == 4
    for task in tasks:
        env = suite.make_env(task)
        try:
            env.reset(task)
            for turn in task.oracle_turns:
                if env.step(turn).done:
                    break
            result = env.result()
        finally:
            env.close()
        assert result.reward == 1.0 and result.success, (task.task_id, result.feedback)
        assert "tool_exceptions" not in result.checklist
    # the same entry answered without its last user turn's calls is not accepted
    task = tasks[0]
    env = suite.make_env(task)
    env.reset(task)
    env.step(task.oracle_turns[-1])  # the final answer of the last turn only: nothing done
    for _ in range(len(task.oracle_turns)):
        if env.step("Done.").done:
            break
    assert env.result().reward == 0.0
    env.close()
