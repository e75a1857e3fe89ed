"""The agent loop on the real suites (toolworld, codegen) and the real `lopd rollout` command.

Two policies: the tiny random model through the real hf engine (noise: episodes must still be exact and
scored), and ``OraclePolicyEngine`` — a test double for the *policy* only, which answers each turn with the
task's scripted oracle turn — so the success path (tool calls executed, checklist satisfied, sandboxed tests
passing) runs through the same loop, environments, template and token bookkeeping.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lopd_core.envs import get_suite
from lopd_core.records.chat import encode, render_text
from lopd_core.rollout.agent import run_episodes, summarize_trajectories
from lopd_core.rollout.engines.base import Generation, SamplingParams
from lopd_core.rollout.engines.hf import HFEngine

SAMPLING = SamplingParams(max_new_tokens=24, seed=0)


class OraclePolicyEngine:
    """Answers turn k of a task with its k-th oracle turn (found from the prompt's text), then end-of-turn."""

    name = "oracle-test-double"

    def __init__(self, tokenizer, tasks):
        self.tok, self.tasks, self.first_seen = tokenizer, tasks, {}

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            task = next(t for t in self.tasks if t.instruction in text)
            headers = text.count("<|im_start|>assistant")  # few-shot examples may hold assistant turns too
            turn = headers - self.first_seen.setdefault(task.task_id, headers)
            turns = task.oracle_turns or [task.oracle]
            ids = (encode(self.tok, turns[min(turn, len(turns) - 1)]) + [params.stop_token_ids[0]])
            finish = "stop" if len(ids) <= params.max_new_tokens else "length"
            ids = ids[: params.max_new_tokens]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish))
        return out

    def update_policy(self, model, version):
        pass


def _assert_exact(tok, trajs):
    for t in trajs:
        t.validate_alignment()
        assert tok.decode(t.token_ids) == render_text(tok, t.messages, t.tools, add_generation_prompt=False)
        assert 0.0 <= t.reward <= 1.0 and t.n_tokens <= 3000


@pytest.mark.parametrize("suite_name,level", [("toolworld", 1), ("toolworld", 3), ("codegen", 1)])
def test_oracle_policy_succeeds_through_the_loop(tiny_tokenizer, suite_name, level):
    suite = get_suite(suite_name)
    tasks = suite.tasks("train", 4, level=level, seed=0)
    trajs = run_episodes(OraclePolicyEngine(tiny_tokenizer, tasks), tiny_tokenizer, suite, tasks, max_turns=6,
                         max_trajectory_tokens=3000, sampling=SamplingParams(max_new_tokens=160))
    _assert_exact(tiny_tokenizer, trajs)
    assert [t.status for t in trajs] == ["ok"] * 4, [t.error for t in trajs]
    assert all(t.success and t.reward == 1.0 for t in trajs), [t.feedback for t in trajs]
    if suite_name == "toolworld":
        assert all(t.n_tool_calls >= 1 and t.n_invalid_tool_calls == 0 for t in trajs)
        assert all(any(m["role"] == "tool" for m in t.messages) for t in trajs)
        assert all(t.n_turns == len(task.oracle_turns) for t, task in zip(trajs, tasks, strict=True))


@pytest.mark.parametrize("suite_name", ["toolworld", "codegen"])
def test_tiny_model_episodes_are_exact_and_scored(tiny_model, tiny_tokenizer, suite_name):
    suite = get_suite(suite_name)
    tasks = suite.tasks("test", 3, level=1, seed=1)
    trajs = run_episodes(HFEngine(tiny_model, tiny_tokenizer, batch_size=3), tiny_tokenizer, suite, tasks,
                         max_turns=2, max_trajectory_tokens=2048, sampling=SAMPLING)
    _assert_exact(tiny_tokenizer, trajs)
    assert all(t.status in ("ok", "truncated") for t in trajs), [t.error for t in trajs]
    assert all(t.split == "test" and t.suite == suite_name and t.feedback for t in trajs)
    assert summarize_trajectories(trajs)["rollout/n_episodes"] == 3


def test_lopd_rollout_cli(tmp_path, models_dir):
    from lopd_cli.main import app

    args = ["rollout", "--profile", "smoke", "--set", f"workspace.home={tmp_path / 'ws'}",
            "--set", f"workspace.models_dir={models_dir}", "--suite", "toolworld", "--n", "2", "--split", "test",
            "--out", str(tmp_path / "out"), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["rollout/n_episodes"] == 2 and summary["split"] == "test" and summary["engine"] == "hf"
    assert {"rollout/success_rate", "rollout/mean_reward", "rollout/generated_tokens_per_s"} <= set(summary)
    rows = [json.loads(line) for line in open(summary["out"])]
    assert len(rows) == 2 and all(r["split"] == "test" and r["token_ids"] for r in rows)
    # a second run writes a new file instead of overwriting the first
    again = json.loads(CliRunner().invoke(app, args).stdout.strip().splitlines()[-1])
    assert again["out"] != summary["out"] and len(list((tmp_path / "out").glob("*.jsonl"))) == 2


def test_lopd_rollout_cli_errors_name_the_fix(tmp_path, models_dir):
    from lopd_cli.main import app

    base = ["rollout", "--profile", "smoke", "--set", f"workspace.home={tmp_path / 'ws'}",
            "--set", f"workspace.models_dir={models_dir}"]
    bad_suite = CliRunner().invoke(app, [*base, "--suite", "nosuch"])
    assert bad_suite.exit_code != 0 and "unknown suite" in bad_suite.output
    bad_split = CliRunner().invoke(app, [*base, "--split", "dev"])
    assert bad_split.exit_code == 2 and "--split" in bad_split.output
    bad_engine = CliRunner().invoke(app, [*base, "--engine", "sglang"])
    assert bad_engine.exit_code == 2 and "rollout.engine" in bad_engine.output
    bad_model = CliRunner().invoke(app, [*base, "--model", str(tmp_path / "missing")])
    assert bad_model.exit_code != 0 and "not found locally" in " ".join(bad_model.output.split())


@pytest.mark.slow
def test_smollm2_plays_toolworld_exactly(prepared_default_dir):
    """The real default model on real tasks: exact trajectories, and it does emit parseable tool calls."""
    from lopd_core.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(prepared_default_dir)
    model = load_causal_lm(prepared_default_dir, device="cpu")
    suite = get_suite("toolworld")
    tasks = suite.tasks("train", 6, level=1, seed=0)
    trajs = run_episodes(HFEngine(model, tok, batch_size=6), tok, suite, tasks, max_turns=3,
                         max_trajectory_tokens=2048, sampling=SamplingParams(max_new_tokens=96, seed=0))
    _assert_exact(tok, trajs)
    assert all(t.status in ("ok", "truncated") for t in trajs), [t.error for t in trajs]
    assert sum(t.n_tool_calls for t in trajs) > 0
    m = summarize_trajectories(trajs)
    assert 0.0 <= m["rollout/success_rate"] <= 1.0 and m["rollout/generated_tokens"] > 0
