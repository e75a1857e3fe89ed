"""The hf engine on the tiny model: batching with left padding, stops, log-probs, policy updates, embeddings."""

from __future__ import annotations

import pytest
import torch

from lopd_core.models.tiny import build_tiny_model
from lopd_core.records.chat import render_prompt_ids
from lopd_core.rollout.engines import make_engine
from lopd_core.rollout.engines.base import Engine, SamplingParams
from lopd_core.rollout.engines.hf import HFEngine

QUESTIONS = ["hi", "what is the weather in Oslo today, in celsius please?", "2+2?",
             "list three colours and explain why the sky is blue", "ok"]


@pytest.fixture
def peaked_model(tiny_tokenizer):
    """The tiny architecture with a 30x final norm: sharp logits, so greedy decoding does not flip on the
    ~1e-6 numerical differences between padded and unpadded batches."""
    model = build_tiny_model(tiny_tokenizer, seed=1)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return model


def _prompts(tok):
    return [render_prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[2])


def test_engine_protocol_and_factory(tiny_model, tiny_tokenizer, tiny_model_path):
    engine = make_engine("hf", tiny_model, tiny_tokenizer, batch_size=3)
    assert isinstance(engine, Engine) and engine.name == "hf" and engine.model is tiny_model
    loaded = make_engine("hf", model_path=tiny_model_path, device="cpu")
    assert loaded.generate([[1, 2, 3]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        make_engine("sglang", tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError, match="model_path"):
        make_engine("vllm", None, tiny_tokenizer)
    try:
        import vllm  # noqa: F401
    except ImportError:  # the main environment: the error says where vLLM lives
        with pytest.raises(ImportError, match="make test-vllm"):
            make_engine("vllm", tiny_model, tiny_tokenizer)  # model_path defaults to the folder it came from
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], GREEDY)


def test_left_padded_chunks_equal_one_prompt_at_a_time(peaked_model, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)
    batched = HFEngine(peaked_model, tiny_tokenizer, batch_size=2).generate(prompts, GREEDY)
    alone = [HFEngine(peaked_model, tiny_tokenizer, batch_size=1).generate([p], GREEDY)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    for b, a in zip(batched, alone, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    # a different order gives the same per-prompt results (outputs come back in the caller's order)
    reordered = HFEngine(peaked_model, tiny_tokenizer, batch_size=2).generate(prompts[::-1], GREEDY)
    assert [g.token_ids for g in reordered] == [g.token_ids for g in batched][::-1]


def test_greedy_logprobs_are_the_unscaled_model_logprobs(peaked_model, tiny_tokenizer):
    prompt = _prompts(tiny_tokenizer)[1]
    gen = HFEngine(peaked_model, tiny_tokenizer).generate([prompt], GREEDY)[0]
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(peaked_model(ids).logits[0].float(), -1)
    for i, tok in enumerate(gen.token_ids):
        row = logp[len(prompt) + i - 1]
        assert tok == int(row.argmax())
        assert gen.logprobs[i] == pytest.approx(row[tok].item(), abs=1e-4)


def test_generation_stops_on_a_stop_id_and_keeps_it(peaked_model, tiny_tokenizer):
    prompts = _prompts(tiny_tokenizer)[:2]
    free = HFEngine(peaked_model, tiny_tokenizer).generate(prompts, GREEDY)
    stop_at = free[0].token_ids[3]
    stopped = HFEngine(peaked_model, tiny_tokenizer).generate(prompts, SamplingParams(
        temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_at]))
    first = free[0].token_ids.index(stop_at)
    assert stopped[0].token_ids == free[0].token_ids[: first + 1] and stopped[0].finish_reason == "stop"
    if stop_at not in free[1].token_ids:
        assert stopped[1].token_ids == free[1].token_ids and stopped[1].finish_reason == "length"
    assert len(stopped[0].logprobs) == len(stopped[0].token_ids)


def test_seeded_sampling_is_reproducible_and_leaves_the_global_rng_alone(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, batch_size=4)
    prompts = _prompts(tiny_tokenizer)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=[2], seed=11)
    state = torch.random.get_rng_state()
    a = engine.generate(prompts, params)
    assert torch.equal(state, torch.random.get_rng_state())
    b = engine.generate(prompts, params)
    c = engine.generate(prompts, SamplingParams(max_new_tokens=8, stop_token_ids=[2], seed=12))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    # top-k 20: every token is drawn from the 20 most likely, so its processed probability is at least 1/20
    # of the mass only on average; the recorded log-prob is finite and at most 0
    assert all(-30 < lp <= 0 for g in a for lp in g.logprobs)


def test_peft_student_is_used_in_place_and_train_mode_is_restored(peaked_model, tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    student = get_peft_model(peaked_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    engine = HFEngine(student, tiny_tokenizer)
    engine.update_policy(student, "v1")
    assert engine.model is student and engine.policy_version == "v1"
    prompts = _prompts(tiny_tokenizer)[:3]
    before = engine.generate(prompts, GREEDY)
    student.train()
    with torch.no_grad():  # an "optimizer step" on the live adapter: no copy, no reload
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2.0)
    after = engine.generate(prompts, GREEDY)
    assert student.training  # restored after generation
    assert [g.token_ids for g in before] != [g.token_ids for g in after]
    assert not any(p.requires_grad and p.grad is not None for p in student.parameters())


def test_generate_from_embeds_matches_token_prompts(peaked_model, tiny_tokenizer):
    engine = HFEngine(peaked_model, tiny_tokenizer, batch_size=2)
    prompts = _prompts(tiny_tokenizer)[:3]
    table = peaked_model.get_input_embeddings().weight.detach()
    from_ids = engine.generate(prompts, GREEDY)
    from_embeds = engine.generate_from_embeds([table[p] for p in prompts], GREEDY)
    assert [g.token_ids for g in from_embeds] == [g.token_ids for g in from_ids]
    with pytest.raises(ValueError, match=r"prompt_embeds\[0\] must have shape"):
        engine.generate_from_embeds([torch.zeros(3, 5)], GREEDY)


def test_only_the_given_stop_ids_stop_generation(tiny_model, tiny_tokenizer):
    """The model's own EOS (<|im_end|> here, made very likely by an lm_head bias hook) stops nothing unless it is
    a stop id — as in the vllm engine, which ignores EOS too."""
    def favour_eos(module, inputs, output):
        output = output.clone()
        output[..., 2] += 8.0
        return output

    tiny_model.lm_head.register_forward_hook(favour_eos)
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = _prompts(tiny_tokenizer)[:1]
    free = engine.generate(prompt, SamplingParams(max_new_tokens=6, stop_token_ids=[], seed=0))[0]
    assert len(free.token_ids) == 6 and free.finish_reason == "length" and free.token_ids[0] == 2
    stopped = engine.generate(prompt, SamplingParams(max_new_tokens=6, stop_token_ids=[2], seed=0))[0]
    assert stopped.token_ids == [2] and stopped.finish_reason == "stop"
