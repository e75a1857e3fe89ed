"""Builders shared by the contract, store and curation tests (plus a check that they build valid rows).

Trajectories here are hand-made records with consistent token alignment (prompt tokens unmasked, sampling
log-probs 0 outside the assistant mask); the tests that need a real rollout use the tiny model.
"""

from __future__ import annotations

from lopd_core.records.trajectory import Trajectory


def make_trajectory(i: int, *, task_id: str | None = None, family: str = "shop", suite: str = "toolworld",
                    reward: float = 1.0, step: int = -1, instruction: str | None = None, answer: str | None = None,
                    status: str = "ok", split: str = "train", cycle_id: str = "c1", n_generated: int = 3,
                    observation: str = "ok", **overrides) -> Trajectory:
    instruction = instruction or f"task number {i}: please handle request {i} in the {family} domain"
    answer = answer or f"I handled request {i} with tool call {i} and confirmed order {i * 7}"
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": instruction},
        {"role": "assistant", "content": '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'},
        {"role": "tool", "content": observation},
        {"role": "assistant", "content": answer},
    ]
    prompt = [11, 12, 13, 14]
    generated = [100 + i % 50 + j for j in range(n_generated)]
    fields = dict(
        task_id=task_id or f"task-{i}", suite=suite, family=family, split=split, level=1, instruction=instruction,
        messages=messages, initial_messages=2, tools=[{"type": "function", "function": {"name": "lookup"}}],
        token_ids=prompt + generated + [7], prompt_len=len(prompt),
        assistant_mask=[0] * len(prompt) + [1] * n_generated + [0],
        sampling_logprobs=[0.0] * len(prompt) + [-0.25] * n_generated + [0.0],
        reward=reward, success=reward >= 0.8, status=status, error="engine crashed" if status == "error" else "",
        policy_version="base", cycle_id=cycle_id, step=step, n_turns=2, n_tool_calls=1,
        trajectory_id=f"{cycle_id}-traj-{i}", episode_id=f"{cycle_id}-ep-{i}",
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_factory_builds_contract_valid_trajectories():
    from data_contracts import TrajectorySchema, trajectories_to_frame, validate_frame

    trajs = [make_trajectory(i, status=s) for i, s in enumerate(["ok", "error", "truncated"])]
    for t in trajs:
        t.validate_alignment()
    valid, quarantine = validate_frame(trajectories_to_frame(trajs), TrajectorySchema)
    assert len(valid) == 3 and quarantine.empty
