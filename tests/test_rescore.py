"""Stored episodes scored again under the current checker by replaying them (`lopd rescore`)."""

import json

from lopd_core.envs import get_suite
from lopd_core.envs.base import tasks_by_id
from lopd_core.envs.plugin import EXAMPLE_SUITE
from lopd_core.records.trajectory import Trajectory
from lopd_core.rescore import rescore_episodes
from lopd_core.rollout.oracle import oracle_replies
from tests.test_cli import lopd


def _episode(suite, task, replies, *, reward, success):
    """An episode as a rollout stores it (messages only, no token ids), played through the real environment,
    with the score an older checker gave it."""
    env = suite.make_env(task)
    messages = env.reset(task)
    initial = len(messages)
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        result = env.step(reply)
        if result.done:
            break
        if result.observation is not None:
            messages.append({"role": result.role or "tool", "content": result.observation})
    if callable(getattr(env, "close", None)):
        env.close()
    return Trajectory(task_id=task.task_id, suite=task.suite, family=task.family, split=task.split,
                      level=task.level, instruction=task.instruction, messages=messages, initial_messages=initial,
                      tools=list(task.tools), token_ids=[], prompt_len=0, assistant_mask=[], sampling_logprobs=[],
                      reward=reward, success=success)


def _convert_task():
    suite = get_suite("toolworld")
    task = next(t for t in suite.tasks("train", 40, level=1, seed=0) if t.family == "weather/convert_only")
    return suite, task


def test_a_contradicting_answer_credited_by_the_old_checker_loses_its_success_and_a_right_one_keeps_it():
    suite, task = _convert_task()
    call, answer = oracle_replies(task)  # '<tool_call>… "to_unit": "F" …', '9 °C is 48.2 °F.'
    celsius = answer.split(" °C")[0]
    contradiction = f"{answer.split(' is ')[1].split(' °F')[0]} °C is {celsius} °F."  # "48.2 °C is 9 °F."
    right = _episode(suite, task, [call, answer], reward=1.0, success=True)
    wrong = _episode(suite, task, [call, contradiction], reward=1.0, success=True)
    result = rescore_episodes(suite, [right, wrong], progress=False)
    assert result.replayed == 2 and not result.kept
    assert result.episodes[0].success and result.episodes[0].reward == 1.0
    assert not result.episodes[1].success and result.episodes[1].reward == 0.5  # the call's half of the checklist
    assert "no temperature that contradicts it" in result.episodes[1].feedback  # the unmet item, named
    assert "contradicts" not in result.episodes[0].feedback
    assert [c["episode_id"] for c in result.changed] == [wrong.episode_id]
    assert result.changed[0]["success"] == [True, False]
    summary = result.summary([right, wrong])
    assert summary["success_flips"] == {"lost": 1, "gained": 0}
    assert summary["families"]["weather/convert_only"]["before"]["successes"] == 2
    assert summary["families"]["weather/convert_only"]["after"]["successes"] == 1


def test_an_episode_the_environment_does_not_reproduce_keeps_its_score_with_the_reason():
    suite, task = _convert_task()
    call, answer = oracle_replies(task)
    tampered = _episode(suite, task, [call, answer], reward=0.25, success=False)
    tool_turn = next(i for i, m in enumerate(tampered.messages) if m["role"] == "tool" and i >= tampered.initial_messages)
    tampered.messages[tool_turn] = {"role": "tool", "content": "<tool_response>\n{\"value\": 99.9}\n</tool_response>"}
    other_prompt = _episode(suite, task, [call, answer], reward=0.25, success=False)
    other_prompt.messages[0] = {**other_prompt.messages[0], "content": "You are a pirate."}
    unknown = _episode(suite, task, [call, answer], reward=0.25, success=False)
    unknown.task_id = "toolworld/an-id-of-an-older-version"
    errored = _episode(suite, task, [call, answer], reward=0.0, success=False)
    errored.status, errored.error = "error", "engine died"
    episodes = [tampered, other_prompt, unknown, errored]
    result = rescore_episodes(suite, episodes, progress=False)
    assert result.replayed == 0 and [e.reward for e in result.episodes] == [0.25, 0.25, 0.25, 0.0]
    reasons = [k["reason"] for k in result.kept]
    assert reasons[0].startswith("diverged: the observation after turn")
    assert reasons[1].startswith("diverged: the prompt differs")
    assert reasons[2].startswith("task not found")
    assert reasons[3].startswith("error")
    assert result.summary(episodes)["kept_reasons"] == {"diverged": 2, "task not found": 1, "error": 1}


def test_a_plug_in_suite_finds_its_tasks_by_id_and_rescores_them():
    suite = get_suite(str(EXAMPLE_SUITE))
    task = suite.tasks("train", 1, level=1)[0]
    assert tasks_by_id(suite, [task.task_id, f"{suite.name}/no-such-row"]) == {task.task_id: task}
    episode = _episode(suite, task, oracle_replies(task), reward=0.0, success=False)
    result = rescore_episodes(suite, [episode], progress=False)
    assert result.replayed == 1 and result.episodes[0].success and result.changed[0]["success"] == [False, True]


def test_the_command_writes_every_episode_and_refuses_to_overwrite_its_input(tmp_path):
    suite, task = _convert_task()
    call, answer = oracle_replies(task)
    stale = _episode(suite, task, [call, answer], reward=0.0, success=False)
    src = tmp_path / "episodes.jsonl"
    src.write_text(stale.to_json() + "\n")
    res = lopd("rescore", str(src), "--out", str(tmp_path / "new.jsonl"), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["replayed"] == 1 and summary["success_flips"] == {"lost": 0, "gained": 1}
    rows = [json.loads(line) for line in (tmp_path / "new.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["success"] is True and rows[0]["episode_id"] == stale.episode_id
    res = lopd("rescore", str(src), "--out", str(src))
    assert res.returncode == 2 and "is one of the inputs" in " ".join(res.stderr.split())
    assert src.read_text() == stale.to_json() + "\n"


def test_an_episode_that_goes_on_after_the_environment_ends_it_or_whose_replay_raises_keeps_its_score(monkeypatch):
    suite, task = _convert_task()
    call, answer = oracle_replies(task)
    longer = _episode(suite, task, [call, answer], reward=0.5, success=False)
    longer.messages += [{"role": "user", "content": "and in kelvin?"}, {"role": "assistant", "content": "282 K."}]
    assert rescore_episodes(suite, [longer], progress=False).kept[0]["reason"].startswith(
        "diverged: the episode now ends at turn")

    class Raising:  # stands in for an environment whose checker now raises
        def __init__(self, env):
            self.env = env

        def reset(self, t):
            return self.env.reset(t)

        def step(self, text):
            return self.env.step(text)

        def result(self):
            raise KeyError("temperature")

    make_env = suite.make_env
    monkeypatch.setattr(suite, "make_env", lambda t: Raising(make_env(t)))
    right = _episode(suite, task, [call, answer], reward=0.5, success=False)
    result = rescore_episodes(suite, [right], progress=False)
    assert result.episodes[0].reward == 0.5 and result.kept[0]["reason"] == "replay failed: KeyError: 'temperature'"
