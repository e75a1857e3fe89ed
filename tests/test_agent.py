"""The agent loop on the tiny model with the real hf engine and a small scripted environment.

``ScriptedSuite`` below is a test double for a task suite (the real suites have their own tests): its
environment ends after a per-task number of turns, echoes what it received, and can be told to raise,
to return long observations or no observation at all. Everything else — the model, the engine, the chat
template, the tokenizer — is real.
"""

from __future__ import annotations

import json

import pytest
import torch

from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.records.chat import end_of_turn_ids, render_prompt_ids, render_text
from lopd_core.records.experience import observation_lite_messages, shorten_observation
from lopd_core.rollout.agent import run_episodes, summarize_trajectories
from lopd_core.rollout.engines.base import SamplingParams
from lopd_core.rollout.engines.hf import HFEngine

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]


class ScriptedEnv:
    def __init__(self, task: Task):
        self.task, self.turns, self.received = task, 0, []

    def reset(self, task):
        if task.payload.get("raise_on_reset"):
            raise RuntimeError("reset exploded")
        return [{"role": "system", "content": "You are a careful agent."},
                {"role": "user", "content": task.instruction}]

    def step(self, text):
        self.turns += 1
        self.received.append(text)
        p = self.task.payload
        if p.get("raise_on_step") == self.turns:
            raise ValueError("step exploded")
        if self.turns >= p.get("turns_needed", 1):
            return StepResult(observation=None, done=True, tool_calls=1)
        if p.get("no_observation"):
            return StepResult(observation=None, done=False)
        body = json.dumps({"turn": self.turns, "chars": len(text)}) + "x" * p.get("obs_pad", 0)
        return StepResult(observation=f"<tool_response>{body}</tool_response>", done=False, tool_calls=1,
                          invalid_tool_calls=int(self.turns % 2 == 0))

    def result(self):
        needed = self.task.payload.get("turns_needed", 1)
        reward = min(self.turns, needed) / needed
        return EpisodeResult(reward=reward, success=reward == 1.0, feedback=f"{self.turns} turns",
                             checklist={"turns": self.turns})


class ScriptedSuite:
    name, kind = "scripted", "tool"

    def __init__(self):
        self.envs: dict[str, ScriptedEnv] = {}

    def tasks(self, specs: list[dict]) -> list[Task]:
        return [Task(task_id=f"scripted-{i}", suite=self.name, family="echo", split="train", level=1,
                     instruction=f"Task number {i}: look up key k{i} and report it.", tools=TOOLS, payload=spec)
                for i, spec in enumerate(specs)]

    def make_env(self, task):
        env = self.envs[task.task_id] = ScriptedEnv(task)
        return env


class RecordingEngine:
    """Wraps the real engine and keeps every call's prompts and generations (for alignment checks)."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, []

    def generate(self, prompts, params):
        gens = self.inner.generate(prompts, params)
        self.calls.append(([list(p) for p in prompts], gens, params))
        return gens

    def update_policy(self, model, version):
        self.inner.update_policy(model, version)


SAMPLING = SamplingParams(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=12, seed=7)


def _run(tiny_model, tok, specs, *, max_turns=4, cap=1024, sampling=SAMPLING, batch_size=8, **kw):
    suite = ScriptedSuite()
    engine = RecordingEngine(HFEngine(tiny_model, tok, batch_size=batch_size))
    trajs = run_episodes(engine, tok, suite, suite.tasks(specs), max_turns=max_turns, max_trajectory_tokens=cap,
                         sampling=sampling, **kw)
    return trajs, engine, suite


def _expected_mask(traj, calls, cap):
    """Rebuild the assistant mask from the engine's recorded calls: 1 exactly on generated positions."""
    mask = [0] * traj.n_tokens
    for prompts, gens, _ in calls:
        for prompt, gen in zip(prompts, gens, strict=True):
            if traj.token_ids[: len(prompt)] != prompt or len(prompt) < traj.prompt_len:
                continue
            kept = traj.token_ids[len(prompt): len(prompt) + len(gen.token_ids)]
            n = 0
            while n < len(kept) and n < len(gen.token_ids) and kept[n] == gen.token_ids[n] \
                    and traj.assistant_mask[len(prompt) + n]:
                n += 1
            # verbatim, and cut short only by the trajectory cap (room left for the 2 closing tokens)
            assert n == len(gen.token_ids) or len(prompt) + n + 2 == cap, (n, len(gen.token_ids))
            assert traj.sampling_logprobs[len(prompt): len(prompt) + n] == gen.logprobs[:n]
            for i in range(len(prompt), len(prompt) + n):
                mask[i] = 1
    return mask


@pytest.fixture
def eager_model(tiny_model, tiny_tokenizer):
    """The tiny model with +1 on the end-of-turn logit (an lm_head bias, as a forward hook): its turns end
    with ``<|im_end|>`` most of the time, so stopped and length-cut turns both occur."""
    eot = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")

    def add_bias(module, inputs, output):
        output = output.clone()
        output[..., eot] += 1.0
        return output

    tiny_model.lm_head.register_forward_hook(add_bias)
    return tiny_model


def _check_token_exact(trajs, engine, suite, tok):
    for traj in trajs:
        traj.validate_alignment()
        # the whole conversation decodes to the chat-template rendering of the final messages
        assert tok.decode(traj.token_ids) == render_text(tok, traj.messages, traj.tools, add_generation_prompt=False)
        # the prompt is the template's rendering of the initial messages, with the assistant header
        assert traj.token_ids[: traj.prompt_len] == render_prompt_ids(tok, traj.messages[: traj.initial_messages], TOOLS)
        # the mask covers exactly the generated tokens, which are the engine's ids verbatim
        assert traj.assistant_mask == _expected_mask(traj, engine.calls, 1024)
        assert all(lp == 0.0 for lp, m in zip(traj.sampling_logprobs, traj.assistant_mask, strict=True) if not m)
        assert all(lp <= 0.0 for lp, m in zip(traj.sampling_logprobs, traj.assistant_mask, strict=True) if m)
        assert traj.n_generated == sum(traj.assistant_mask) > 0
        # the environment saw each turn's text (no end-of-turn token)
        assistant = [m["content"] for m in traj.messages if m["role"] == "assistant"]
        assert len(assistant) == traj.n_turns
        env = suite.envs[traj.task_id]
        assert env.received == [a.removesuffix("<|im_end|>") for a in assistant]
        assert traj.sampling["stop_token_ids"] == end_of_turn_ids(tok)
        assert set(traj.timings) == {"generate_s", "env_s", "total_s"} and traj.timings["generate_s"] > 0


# --------------------------------------------------------------------------------------------------
def test_trajectories_are_token_exact(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    specs = [{"turns_needed": 1}, {"turns_needed": 3}, {"turns_needed": 2, "obs_pad": 50}, {"turns_needed": 9}]
    trajs, engine, suite = _run(tiny_model, tok, specs, max_turns=4)
    assert [t.task_id for t in trajs] == [f"scripted-{i}" for i in range(4)]
    assert [t.status for t in trajs] == ["ok", "ok", "ok", "truncated"]
    assert [t.n_turns for t in trajs] == [1, 3, 2, 4]
    _check_token_exact(trajs, engine, suite, tok)
    assert all(t.engine == "hf" and t.sampling["seed"] == 7 for t in trajs)
    assert all(lp < 0.0 for t in trajs for lp, m in zip(t.sampling_logprobs, t.assistant_mask, strict=True) if m)
    assert trajs[1].reward == 1.0 and trajs[1].success and trajs[1].checklist == {"turns": 3}
    assert trajs[3].reward == pytest.approx(4 / 9) and not trajs[3].success
    assert trajs[1].n_tool_calls == 3 and trajs[1].n_invalid_tool_calls == 1
    # all live episodes generate together: turn 1 has 4 prompts, then 3, 2, 1
    assert [len(c[0]) for c in engine.calls] == [4, 3, 2, 1]


def test_turns_that_end_with_the_end_of_turn_token_are_token_exact(eager_model, tiny_tokenizer):
    tok = tiny_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    specs = [{"turns_needed": n, "obs_pad": 7 * n} for n in (2, 3, 4, 4, 5, 6)]
    trajs, engine, suite = _run(eager_model, tok, specs, max_turns=6)
    _check_token_exact(trajs, engine, suite, tok)
    finishes = [g.finish_reason for _, gens, _ in engine.calls for g in gens]
    assert "stop" in finishes and "length" in finishes
    for _, gens, _ in engine.calls:
        for g in gens:
            assert (g.finish_reason == "stop") == (g.token_ids[-1] == eot) and eot not in g.token_ids[:-1]
    # a generated end-of-turn token is in the mask; the one the template adds after a length cut is not
    for t in trajs:
        eot_positions = [i for i, x in enumerate(t.token_ids) if x == eot and i >= t.prompt_len]
        generated_eots = [i for i in eot_positions if t.assistant_mask[i]]
        assert len(eot_positions) == t.n_turns + sum(m["role"] != "assistant" for m in t.messages[t.initial_messages:])
        assert all(t.sampling_logprobs[i] < 0 for i in generated_eots)
    assert any(t.assistant_mask[i] for t in trajs for i, x in enumerate(t.token_ids) if x == eot)


@pytest.mark.parametrize("model_fixture", ["tiny_model", "eager_model"])
def test_sampling_logprobs_match_a_fresh_forward_under_the_processed_distribution(model_fixture, request,
                                                                                  tiny_tokenizer):
    """Recompute each generated token's probability under temperature/top-k/top-p with one unpadded forward."""
    tiny_model = request.getfixturevalue(model_fixture)
    trajs, _, _ = _run(tiny_model, tiny_tokenizer, [{"turns_needed": 2}, {"turns_needed": 1}, {"turns_needed": 3}])
    T, K, P = SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p
    for traj in trajs:
        ids = torch.tensor([traj.token_ids])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0].float() / T
        for pos in (i for i, m in enumerate(traj.assistant_mask) if m):
            row = logits[pos - 1]
            top = torch.topk(row, K)
            probs = torch.softmax(top.values, -1)
            before = torch.cumsum(probs, -1) - probs  # mass strictly above each candidate
            keep = top.indices[before < P]
            kept = row[keep]
            expected = (row[traj.token_ids[pos]] - torch.logsumexp(kept, -1)).item()
            assert traj.token_ids[pos] in keep.tolist()
            assert traj.sampling_logprobs[pos] == pytest.approx(expected, abs=1e-3)


def test_an_env_that_raises_only_fails_its_own_episode(tiny_model, tiny_tokenizer):
    specs = [{"turns_needed": 2}, {"raise_on_reset": True}, {"turns_needed": 3, "raise_on_step": 2}, {"turns_needed": 2}]
    trajs, _, _ = _run(tiny_model, tiny_tokenizer, specs)
    assert [t.status for t in trajs] == ["ok", "error", "error", "ok"]
    assert "env.reset" in trajs[1].error and "reset exploded" in trajs[1].error and trajs[1].token_ids == []
    assert "env.step (turn 2)" in trajs[2].error and "step exploded" in trajs[2].error
    for t in trajs[1:3]:
        assert t.reward == 0.0 and not t.success
    # the failed episode is still token-exact up to where it stopped
    t = trajs[2]
    assert t.n_turns == 2
    assert tiny_tokenizer.decode(t.token_ids) == render_text(tiny_tokenizer, t.messages, t.tools, add_generation_prompt=False)
    assert trajs[0].success and trajs[3].success


def test_trajectory_cap_truncates_and_keeps_alignment(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    cap = 420
    trajs, engine, _ = _run(tiny_model, tok, [{"turns_needed": 50, "obs_pad": 60}, {"turns_needed": 1}],
                            max_turns=50, cap=cap)
    long, short = trajs
    assert long.status == "truncated" and long.n_tokens <= cap and 1 < long.n_turns < 50
    assert tok.decode(long.token_ids) == render_text(tok, long.messages, long.tools, add_generation_prompt=False)
    assert long.messages[-1]["role"] == "assistant"  # a cut-off observation is left out entirely
    assert long.assistant_mask == _expected_mask(long, engine.calls, cap)
    assert short.status == "ok"


def test_a_prompt_longer_than_the_cap_is_an_actionable_error(tiny_model, tiny_tokenizer):
    trajs, engine, _ = _run(tiny_model, tiny_tokenizer, [{"turns_needed": 1}], cap=64)
    assert trajs[0].status == "error" and "rollout.max_trajectory_tokens=64" in trajs[0].error
    assert engine.calls == []


def test_a_context_with_an_allowance_runs_past_the_cap_by_its_own_length_and_no_further(tiny_model, tiny_tokenizer):
    """Hinted rollouts: a worked example before the task may take none of the room the episode has without it,
    so the episode behind the plain prompt still fits the cap; without the allowance it crowds the episode out."""
    from lopd_core.rollout.context import ContextSuite

    tok = tiny_tokenizer
    worked = [[{"role": "user", "content": "Task number 9: look up key k9 and report it."},
               {"role": "assistant", "content": '<tool_call>{"name": "lookup", "arguments": {"key": "k9"}}</tool_call>'},
               {"role": "tool", "content": "<tool_response>v9</tool_response>"},
               {"role": "assistant", "content": "k9 is v9."}]]
    task = ScriptedSuite().tasks([{"turns_needed": 50, "obs_pad": 60}])[0]
    plain_prompt = len(render_prompt_ids(tok, ScriptedEnv(task).reset(task), TOOLS))
    cap = plain_prompt + 200

    def play(suite):
        return run_episodes(HFEngine(tiny_model, tok, batch_size=8), tok, suite, [task], max_turns=50,
                            max_trajectory_tokens=cap, sampling=SAMPLING)[0]

    def hinted(allowance):
        return play(ContextSuite(ScriptedSuite(), lambda t: worked, placement="chat_turn", allowance_tokens=allowance))

    plain, crowded, roomy, part = play(ScriptedSuite()), hinted(0), hinted(10_000), hinted(16)
    context = roomy.prompt_len - plain_prompt
    assert plain.prompt_len == plain_prompt and context > 16
    for t in (plain, crowded, roomy, part):
        assert t.status == "truncated" and tok.decode(t.token_ids) == render_text(tok, t.messages, t.tools,
                                                                                  add_generation_prompt=False)
    assert crowded.n_tokens <= cap and crowded.n_generated < plain.n_generated  # the context took the room
    assert cap < roomy.n_tokens <= cap + context  # past the cap by at most the context's length ...
    assert roomy.n_tokens - roomy.prompt_len <= cap - plain_prompt  # ... so the plain-prompt twin fits the cap
    assert roomy.n_tokens - roomy.prompt_len > cap - plain_prompt - 40  # and the episode had its room (one turn's slack)
    assert cap < part.n_tokens <= cap + 16  # the allowance is at most allowance_tokens
    # a prompt too long even with the allowance names both
    tight = run_episodes(HFEngine(tiny_model, tok, batch_size=8), tok,
                         ContextSuite(ScriptedSuite(), lambda t: worked, placement="chat_turn", allowance_tokens=4),
                         [task], max_turns=2, max_trajectory_tokens=plain_prompt + 8, sampling=SAMPLING)[0]
    assert tight.status == "error" and "plus its context's allowance of 4" in tight.error


def test_consecutive_assistant_turns_without_observation(tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    trajs, _, _ = _run(tiny_model, tok, [{"turns_needed": 3, "no_observation": True}])
    t = trajs[0]
    assert [m["role"] for m in t.messages[t.initial_messages:]] == ["assistant"] * 3
    assert tok.decode(t.token_ids) == render_text(tok, t.messages, t.tools, add_generation_prompt=False)


def test_seeded_rollouts_are_reproducible(tiny_model, tiny_tokenizer):
    specs = [{"turns_needed": 2}, {"turns_needed": 3}]
    a, _, _ = _run(tiny_model, tiny_tokenizer, specs)
    b, _, _ = _run(tiny_model, tiny_tokenizer, specs)
    c, _, _ = _run(tiny_model, tiny_tokenizer, specs, sampling=SamplingParams(max_new_tokens=12, seed=8))
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.sampling_logprobs for t in a] == [t.sampling_logprobs for t in b]
    assert [t.token_ids for t in a] != [t.token_ids for t in c]


def test_observation_lite_shortens_only_observations(tiny_model, tiny_tokenizer):
    trajs, _, _ = _run(tiny_model, tiny_tokenizer, [{"turns_needed": 2, "obs_pad": 900}], observation_max_chars=100,
                       policy_version="v3", composer_version="c2", step=5, cycle_id="cycle-1")
    t = trajs[0]
    tool_full = [m for m in t.messages if m["role"] == "tool"]
    tool_lite = [m for m in t.messages_lite if m["role"] == "tool"]
    assert len(tool_full) == len(tool_lite) == 1
    assert len(tool_full[0]["content"]) > 900 and len(tool_lite[0]["content"]) <= 100
    assert tool_lite[0]["content"].startswith("<tool_response>{") and "shortened" in tool_lite[0]["content"]
    assert [m for m in t.messages_lite if m["role"] != "tool"] == [m for m in t.messages if m["role"] != "tool"]
    assert "shortened" in t.observation_lite and "careful agent" not in t.observation_lite
    assert t.instruction in t.observation_lite
    assert (t.policy_version, t.composer_version, t.step, t.cycle_id) == ("v3", "c2", 5, "cycle-1")


def test_shorten_observation_is_bounded():
    text = "a" * 50 + "b" * 1000 + "c" * 50
    short = shorten_observation(text, max_chars=120)
    assert len(short) <= 120 and short.startswith("aaa") and short.endswith("ccc")
    assert shorten_observation("tiny", max_chars=120) == "tiny"
    with pytest.raises(ValueError, match="max_chars"):
        shorten_observation(text, max_chars=3)
    msgs = [{"role": "user", "content": "u" * 500}, {"role": "assistant", "content": "a" * 500},
            {"role": "tool", "content": "t" * 500}]
    lite = observation_lite_messages(msgs, 1, max_chars=50)
    assert lite[0] == msgs[0] and lite[1] == msgs[1] and len(lite[2]["content"]) <= 50


def test_summary_metrics(tiny_model, tiny_tokenizer):
    trajs, _, _ = _run(tiny_model, tiny_tokenizer, [{"turns_needed": 1}, {"turns_needed": 9}], max_turns=2)
    m = summarize_trajectories(trajs, wall_s=2.0)
    assert m["rollout/n_episodes"] == 2 and m["rollout/success_rate"] == 0.5
    assert m["rollout/mean_reward"] == pytest.approx((1.0 + 2 / 9) / 2)
    assert m["rollout/status_ok"] == 1 and m["rollout/status_truncated"] == 1
    assert m["rollout/generated_tokens"] == sum(t.n_generated for t in trajs)
    assert m["rollout/generated_tokens_per_s"] > 0 and m["rollout/wall_s"] == 2.0


def test_rejects_nonsense_limits(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="max_turns"):
        _run(tiny_model, tiny_tokenizer, [{}], max_turns=0)
