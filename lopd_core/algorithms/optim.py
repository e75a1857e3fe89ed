"""The optimizer pieces every method uses: AdamW over the trainable parameters, and clip-then-step."""

from __future__ import annotations

import torch


def make_adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    if not params:
        raise ValueError("no trainable parameters for the optimizer (is the model frozen?)")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def clip_and_step(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, *, max_norm: float) -> float:
    """Clip the gradient norm, step, zero the gradients; returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
