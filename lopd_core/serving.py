"""The deployable student: load a registered student artifact, answer chat completions, export it merged.

A registered student version (``models:/lopd-student/<v>``, see :mod:`lopd_core.registry`) is an MLflow
model whose ``python_function`` flavour names this module as its loader::

    MLmodel             loader_module lopd_core.serving, task llm/v1/chat, the chat signature, an input example
    data/student/       the student artifact as training wrote it: lopd_student.json + a peft adapter
                        (adapter_config.json names the base folder) or a full Hugging Face folder;
                        version 1 holds the base marker (lopd_base.json) instead: the base model as it is
    requirements.txt, python_env.yaml, conda.yaml, input_example.json, serving_input_example.json

So ``mlflow.pyfunc.load_model("models:/lopd-student@champion")`` and ``mlflow models serve -m
models:/lopd-student@champion --env-manager local`` load it (lopd must be installed where it is served: the
model is the adapter and this loader, not a copy of the base weights). The base model is the folder named
in the artifact (``base_model_path``, a real local path written at training time); a model moved to
another machine is pointed at its base with the model config ``{"base_model_path": DIR}``
(``mlflow.pyfunc.load_model(uri, model_config=...)``; ``device`` and ``dtype`` too, e.g. ``cuda`` / ``bfloat16``). :class:`ChatStudent` takes an OpenAI-style chat
request (``messages``, ``temperature``, ``max_tokens``, ``top_p``, ``n``, ``tools``) and returns a
``chat.completion`` dict; generation is the rollout's hf engine with the model's end-of-turn ids.

:func:`export_merged` writes the student as one plain Hugging Face folder (the LoRA deltas merged into the
base weights) that ``AutoModelForCausalLM.from_pretrained`` and ``vllm serve`` load without peft or lopd.

What it is not: a server (MLflow's scoring server and vLLM are), the MLflow calls (:mod:`lopd_core.registry`),
or a tool executor: a tool call the model writes comes back in ``content`` as the model wrote it.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from lopd_core.models.loading import load_causal_lm, load_tokenizer
from lopd_core.models.policy import STUDENT_MANIFEST, read_student_manifest
from lopd_core.records.chat import end_of_turn_ids, render_prompt_ids
from lopd_core.registry import BASE_MARKER
from lopd_core.rollout.engines.base import SamplingParams
from lopd_core.rollout.engines.hf import HFEngine

DEFAULT_MAX_TOKENS = 256
"""``max_tokens`` when a request gives none (and the model config sets none)."""
EXPORT_MANIFEST = "lopd_export.json"


def base_model_path(student_dir: Path, *, override: str | Path | None = None) -> Path:
    """The base model folder a student artifact (or the base marker) stands on.

    ``override`` (the model config's ``base_model_path``) wins; then the artifact's own ``base_model_path``;
    then the adapter's ``base_model_name_or_path`` when it is a folder."""
    student_dir = Path(student_dir)
    candidates: list[tuple[str, str]] = []
    if override:
        candidates.append(("the model config's base_model_path", str(override)))
    for name in (BASE_MARKER, STUDENT_MANIFEST):
        if (student_dir / name).exists():
            recorded = json.loads((student_dir / name).read_text()).get("base_model_path")
            if recorded:
                candidates.append((f"{name}'s base_model_path", recorded))
    if (student_dir / "adapter_config.json").exists():
        recorded = json.loads((student_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if recorded:
            candidates.append(("adapter_config.json's base_model_name_or_path", recorded))
    for _, path in candidates:
        if (Path(path).expanduser() / "config.json").exists():
            return Path(path).expanduser()
    tried = "; ".join(f"{where}: {path}" for where, path in candidates) or "none is recorded"
    raise FileNotFoundError(
        f"the base model folder of the student artifact {student_dir} was not found ({tried}). Load it with the "
        "base folder given: mlflow.pyfunc.load_model(uri, model_config={'base_model_path': '/path/to/base'})")


def load_student(student_dir: Path, *, base_path: str | Path | None = None, dtype: str = "float32",
                 device: str = "cpu"):
    """(model, tokenizer) of a student artifact: the base marker → the base model; a LoRA student → its
    adapter on the base (a peft model); a full student → its own folder."""
    student_dir = Path(student_dir)
    if (student_dir / BASE_MARKER).exists():
        path = base_model_path(student_dir, override=base_path)
        return load_causal_lm(path, dtype=dtype, device=device), load_tokenizer(path)
    info = read_student_manifest(student_dir)
    if info["kind"] == "full":
        return load_causal_lm(student_dir, dtype=dtype, device=device), load_tokenizer(student_dir)
    from peft import PeftModel

    path = base_model_path(student_dir, override=base_path)
    model = PeftModel.from_pretrained(load_causal_lm(path, dtype=dtype, device=device), str(student_dir))
    return model.eval(), load_tokenizer(path)


def export_merged(student_dir: Path, out: Path, *, base_path: str | Path | None = None,
                  provenance: dict[str, Any] | None = None) -> Path:
    """Write the student as one Hugging Face folder (LoRA merged into the base) with its tokenizer."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder for the export")
    model, tokenizer = load_student(student_dir, base_path=base_path)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    (partial / EXPORT_MANIFEST).write_text(json.dumps({"source": str(student_dir), **(provenance or {})}, indent=2))
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return out


# --------------------------------------------------------------------------------------------------
# The chat-completions model
def _plain(value: Any) -> Any:
    """numpy arrays (a request that went through MLflow's schema enforcement as a DataFrame) → lists."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def chat_request(model_input: Any) -> dict[str, Any]:
    """A chat request as a dict, from the dict or one-row DataFrame MLflow's pyfunc hands over."""
    if hasattr(model_input, "to_dict") and hasattr(model_input, "columns"):  # a pandas DataFrame
        rows = model_input.to_dict(orient="records")
        if len(rows) != 1:
            raise ValueError(f"one chat request per call (got {len(rows)} rows)")
        model_input = rows[0]
    if not isinstance(model_input, dict):
        raise ValueError(f"a chat request is a dict with 'messages' (got {type(model_input).__name__})")
    request = {k: _plain(v) for k, v in model_input.items() if v is not None}
    messages = request.get("messages")
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects")
    request["messages"] = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return request


class ChatStudent:
    """A loaded student answering OpenAI-style chat completion requests (what MLflow's pyfunc serves)."""

    def __init__(self, model, tokenizer, *, name: str = "lopd-student", max_tokens: int = DEFAULT_MAX_TOKENS):
        self.engine = HFEngine(model, tokenizer, batch_size=8)
        self.tokenizer = tokenizer
        self.name = name
        self.max_tokens = max_tokens
        self.stop_ids = end_of_turn_ids(tokenizer)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> dict[str, Any]:
        request = chat_request(model_input) | {k: v for k, v in (params or {}).items() if v is not None}
        n = int(request.get("n") or 1)
        temperature = float(request.get("temperature", 1.0))
        sampling = SamplingParams(temperature=temperature, top_p=float(request.get("top_p") or 1.0),
                                  top_k=int(request.get("top_k") or 0),
                                  max_new_tokens=int(request.get("max_tokens") or self.max_tokens),
                                  stop_token_ids=self.stop_ids, seed=request.get("seed"))
        prompt = render_prompt_ids(self.tokenizer, request["messages"], request.get("tools"))
        generations = self.engine.generate([prompt] * n, sampling)
        choices = []
        for i, gen in enumerate(generations):
            ids = [t for t in gen.token_ids if t not in self.stop_ids]
            text, finish = self.tokenizer.decode(ids, skip_special_tokens=True), gen.finish_reason
            for stop in request.get("stop") or []:
                if stop and stop in text:
                    text, finish = text.split(stop, 1)[0], "stop"
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
        completion_tokens = sum(len(g.token_ids) for g in generations)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt) + completion_tokens}}


def _load_pyfunc(data_path: str, model_config: dict[str, Any] | None = None) -> ChatStudent:
    """MLflow's entry point (``loader_module``): ``data_path`` is the model's ``data/student`` folder."""
    config = model_config or {}
    model, tokenizer = load_student(Path(data_path), base_path=config.get("base_model_path"),
                                    dtype=config.get("dtype", "float32"), device=config.get("device", "cpu"))
    return ChatStudent(model, tokenizer, max_tokens=int(config.get("max_tokens") or DEFAULT_MAX_TOKENS))
