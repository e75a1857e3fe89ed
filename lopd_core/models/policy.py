"""Student, teacher and composer-encoder on one shared frozen base model.

What this module is: :class:`PolicySet`, the models of one training run, and the forward passes the
algorithms need (hidden states, then the LM head only at supervised positions).

One frozen copy of the configured base model is wrapped once by peft and carries named LoRA adapters:

- ``encoder``: the composer's encoder ψ (rank 8, α 16 on all linear projections);
- ``encoder_phi0``: a frozen copy of ψ at the end of the cold start (for anchor latents of new pairs);
- ``student``: the LoRA student θ (``model.student = 'lora'``);
- ``student_ema``: SDPO's EMA teacher (only when that baseline runs with a LoRA student).

The teacher is the same module with every adapter disabled (= the initial base weights), so teacher,
encoder backbone and LoRA student are views of one set of weights, never copies. A full fine-tune student
(``model.student = 'full'``) is a separate trainable model; the teacher keeps the frozen original.

Switching adapters goes through :meth:`PolicySet.adapter`, which sets the active adapter on peft's tuner
layers directly. peft's own ``set_adapter`` / ``disable_adapter`` also flip ``requires_grad`` of the
adapters, which would silently stop gradients to an adapter that is inactive for one forward of a step but
trained by another; here ``requires_grad`` is set once at construction and never touched again.
Outside :meth:`PolicySet.adapter` the shared model serves the student (rollout engines generate with it).

What it is not: no losses, no optimizers, no prompt construction.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lopd_core.config import LOPDConfig, ModelConfig
from lopd_core.models.loading import load_causal_lm, load_tokenizer, resolve_model_path
from lopd_core.models.precision import install_bf16_backward, native_bf16

log = logging.getLogger(__name__)

STUDENT = "student"
ENCODER = "encoder"
ENCODER_PHI0 = "encoder_phi0"
STUDENT_EMA = "student_ema"
STUDENT_MANIFEST = "lopd_student.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _lora_config(*, rank: int, alpha: int, targets: list[str], dropout: float = 0.0):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                      bias="none", task_type="CAUSAL_LM")


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack returning final-norm hidden states, LM head) of a HF causal LM, peft-wrapped or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(inner, inner.base_model_prefix, None)
    head = inner.get_output_embeddings()
    if decoder is None or head is None:
        raise TypeError(f"{type(inner).__name__} is not a decoder-only causal LM with an output embedding "
                        "(expected e.g. LlamaForCausalLM: `.model` + `.lm_head`)")
    return decoder, head


def hidden_states(model: nn.Module, *, attention_mask: Tensor, input_ids: Tensor | None = None,
                  inputs_embeds: Tensor | None = None) -> Tensor:
    """Last-layer hidden states ``[B, T, d]`` (after the final norm), without computing any logits."""
    decoder, _ = causal_lm_parts(model)
    out = decoder(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


def logprobs_at(model: nn.Module, hidden: Tensor, predict_index: Tensor, mask: Tensor) -> Tensor:
    """Temperature-1 log-probs ``[N, V]`` at the positions ``predict_index[mask]`` only (the LM head runs on N rows).

    ``predict_index`` ``[B, S]`` holds, for each supervised token, the position whose hidden state
    predicts it (the token's index − 1); rows are flattened in ``mask`` order, which every caller shares.
    """
    _, head = causal_lm_parts(model)
    rows = torch.arange(hidden.shape[0], device=hidden.device)[:, None].expand_as(predict_index)
    picked = hidden[rows[mask.bool()], predict_index[mask.bool()]]
    with torch.autocast(device_type=picked.device.type, enabled=False):  # the LM head and log-softmax in fp32
        return torch.log_softmax(head(picked.float()).float(), dim=-1)


def embedding_rms(model: nn.Module) -> float:
    """Root-mean-square of the input embedding matrix (SmolLM2-135M: ≈ 0.14), the latent gain's initial value."""
    weight = model.get_input_embeddings().weight
    return float(weight.detach().float().pow(2).mean().sqrt())


@dataclass
class PolicySet:
    """The shared frozen base (peft-wrapped, with named adapters), the tokenizer and the student."""

    base: nn.Module
    """PeftModel over the frozen base weights; see the module docstring for its adapters."""
    tokenizer: Any
    student_kind: str
    """'lora' (adapter ``student`` on ``base``) or 'full' (``full_student``)."""
    base_model: str
    """The configured base model name (the lineage's teacher and encoder backbone), recorded in artifacts."""
    base_path: Path
    full_student: nn.Module | None = None
    gradient_checkpointing: bool = False
    autocast: bool = False
    """bf16 autocast in every scope (model.autocast): matmuls in bf16, weights and log-softmax in fp32."""
    _active: str | None = field(default=None, repr=False)

    # --- adapters ---------------------------------------------------------------------------------
    def _set_active(self, name: str | None) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.base.modules():
            if isinstance(module, BaseTunerLayer):
                if name is None:
                    module._disable_adapters = True
                else:
                    module._disable_adapters = False
                    module._active_adapter = [name]
        self._active = name

    def default_adapter(self) -> str | None:
        return STUDENT if self.student_kind == "lora" else None

    @contextlib.contextmanager
    def adapter(self, name: str | None):
        """Run the shared model with one adapter live (None = the base weights, i.e. the teacher)."""
        if name is not None and name not in self.adapter_names():
            raise KeyError(f"adapter '{name}' is not loaded (have: {sorted(self.adapter_names())})")
        previous = self._active
        self._set_active(name)
        try:
            with self._precision():
                yield self.base
        finally:
            self._set_active(previous)

    def _precision(self):
        """bf16 autocast when ``model.autocast`` asks for it, else nothing."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    @contextlib.contextmanager
    def composer_backward(self, latents: Tensor):
        """Wrap ``loss.backward()`` of a loss that flows teacher → latents → encoder under activation checkpointing.

        A checkpointed layer recomputes its forward during backward with whatever adapter is live *then*.
        Backward runs through the teacher first (every adapter off) and reaches the encoder (``encoder``
        adapter) only once the latents' gradient is complete, so the live adapter is switched by a hook on
        ``latents``. Without checkpointing this does nothing.
        """
        if not (self.gradient_checkpointing and latents.requires_grad):
            yield
            return
        previous = self._active
        self._set_active(None)
        handle = latents.register_hook(lambda grad: self._set_active(ENCODER))
        try:
            yield
        finally:
            handle.remove()
            self._set_active(previous)

    def adapter_names(self) -> set[str]:
        return set(self.base.peft_config)

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        marker = f".{name}."
        return [p for n, p in self.base.named_parameters() if marker in n and "lora_" in n]

    def add_adapter(self, name: str, *, rank: int, alpha: int, targets: list[str], trainable: bool,
                    copy_from: str | None = None) -> None:
        self.base.add_adapter(name, _lora_config(rank=rank, alpha=alpha, targets=targets))
        if copy_from is not None:
            copy_adapter(self, copy_from, name)
        for p in self.adapter_parameters(name):
            p.requires_grad_(trainable)
        self._set_active(self._active)  # add_adapter may re-activate peft's notion of the active adapter

    # --- the student --------------------------------------------------------------------------------
    def student_module(self) -> nn.Module:
        """The module that generates as the student (the engines hold this one)."""
        return self.full_student if self.student_kind == "full" else self.base

    def student_parameters(self) -> list[nn.Parameter]:
        if self.student_kind == "full":
            return [p for p in self.full_student.parameters() if p.requires_grad]
        return self.adapter_parameters(STUDENT)

    @contextlib.contextmanager
    def student(self):
        """The student model with its weights live (LoRA: the ``student`` adapter on the shared base)."""
        if self.student_kind == "full":
            with self._precision():
                yield self.full_student
        else:
            with self.adapter(STUDENT) as model:
                yield model

    @contextlib.contextmanager
    def teacher(self):
        """The frozen initial base model (every adapter off)."""
        with self.adapter(None) as model:
            yield model

    def train_mode(self, enabled: bool) -> None:
        """Train mode only matters for gradient checkpointing (no dropout anywhere: LoRA dropout 0, attention 0)."""
        for model in (self.base, self.full_student):
            if model is not None:
                model.train(enabled and self.gradient_checkpointing)

    @property
    def device(self) -> torch.device:
        return next(self.base.parameters()).device

    # --- artifacts ---------------------------------------------------------------------------------
    def save_student(self, directory: Path) -> Path:
        """Write the student as a plain directory (layout in :mod:`lopd_core.training`)."""
        directory.mkdir(parents=True, exist_ok=True)
        info = {"kind": self.student_kind, "base_model": self.base_model,
                "base_model_path": str(Path(self.base_path).resolve()),
                "format": "peft-lora" if self.student_kind == "lora" else "hf-causal-lm"}
        if self.student_kind == "full":
            self.full_student.save_pretrained(directory, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
        else:
            save_adapter(self, STUDENT, directory)
        (directory / STUDENT_MANIFEST).write_text(json.dumps(info, indent=2))
        return directory

    def load_student(self, directory: Path) -> None:
        info = read_student_manifest(directory)
        if info["kind"] != self.student_kind:
            raise ValueError(f"{directory} holds a '{info['kind']}' student but model.student is '{self.student_kind}'; "
                             "set model.student to match or start from the base model")
        if self.student_kind == "full":
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(str(directory), dtype=next(self.full_student.parameters()).dtype)
            self.full_student.load_state_dict(loaded.state_dict())
        else:
            load_adapter(self, STUDENT, directory)


def read_student_manifest(directory: Path) -> dict[str, Any]:
    path = directory / STUDENT_MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a student artifact (no {STUDENT_MANIFEST}); pass a directory "
                                "written by lopd_core.training.save_student, or none to start from the base model")
    return json.loads(path.read_text())


def save_adapter(policies: PolicySet, name: str, directory: Path) -> None:
    """A standard peft adapter folder (adapter_config.json + adapter_model.safetensors) for one named adapter."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    # save_embedding_layers=False: no embedding is adapted, and "auto" would look the base model up on the hub
    state = get_peft_model_state_dict(policies.base, adapter_name=name, save_embedding_layers=False)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS))
    config = policies.base.peft_config[name]
    # a real folder, so that peft's AutoPeftModelForCausalLM, vLLM and the served model find the base
    config.base_model_name_or_path = str(Path(policies.base_path).resolve())
    config.save_pretrained(str(directory))


def load_adapter(policies: PolicySet, name: str, directory: Path) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = directory / ADAPTER_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {directory} is not an adapter folder")
    result = set_peft_model_state_dict(policies.base, load_file(str(path), device=str(policies.device)), adapter_name=name)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise ValueError(f"adapter at {directory} does not fit adapter '{name}' of {policies.base_model} "
                         f"(unexpected keys such as {unexpected[:2]}); was it trained on another base model?")
    policies._set_active(policies._active)


def copy_adapter(policies: PolicySet, source: str, target: str) -> None:
    """Copy adapter weights ``source`` → ``target`` (same rank and targets), in place, without autograd."""
    src = dict((n.replace(f".{source}.", "."), p) for n, p in policies.base.named_parameters() if f".{source}." in n)
    with torch.no_grad():
        for n, p in policies.base.named_parameters():
            if f".{target}." in n:
                p.copy_(src[n.replace(f".{target}.", ".")])


def _enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing (transformers 5.24 renamed the method; older releases have the old name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_policy_set(model_cfg: ModelConfig, lopd_cfg: LOPDConfig, models_dir: Path, *, device: str | None = None) -> PolicySet:
    """Load the configured base once, wrap it with the encoder adapter (and the student adapter or a full student)."""
    import copy

    from peft import get_peft_model


    path = resolve_model_path(model_cfg.base, models_dir)
    tokenizer = load_tokenizer(path)
    base = load_causal_lm(path, dtype=model_cfg.dtype, device=device or model_cfg.device)
    base.requires_grad_(False)
    full_student = None
    if model_cfg.student == "full":
        full_student = copy.deepcopy(base)
        full_student.requires_grad_(True)
    if model_cfg.gradient_checkpointing:
        for model in (base, full_student):
            if model is not None:
                _enable_checkpointing(model)
    peft_model = get_peft_model(base, _lora_config(rank=lopd_cfg.encoder_lora_rank, alpha=lopd_cfg.encoder_lora_alpha,
                                                   targets=model_cfg.lora_targets), adapter_name=ENCODER)
    policies = PolicySet(base=peft_model, tokenizer=tokenizer, student_kind=model_cfg.student, base_model=model_cfg.base,
                         base_path=path, full_student=full_student,
                         gradient_checkpointing=model_cfg.gradient_checkpointing,
                         autocast=model_cfg.autocast == "bfloat16")
    for p in policies.adapter_parameters(ENCODER):
        p.requires_grad_(True)
    if model_cfg.student == "lora":
        policies.add_adapter(STUDENT, rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                             targets=model_cfg.lora_targets, trainable=True)
    if model_cfg.bf16_backward:
        if not native_bf16(model_cfg.device):
            log.warning("model.bf16_backward: this device has no native bf16 (a CPU without AVX-512 BF16 or AMX "
                        "emulates it), so the bf16 backward is slower than fp32 here; set model.bf16_backward=false")
        install_bf16_backward(peft_model)  # a full student's weights train, so its gradients stay fp32
    policies._set_active(policies.default_adapter())
    peft_model.eval()
    return policies
