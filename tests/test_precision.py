"""bf16 on replayed trajectories against fp32: per-token δ and the margin Δ within 0.002 nats.

Two precisions are compared with fp32 by :mod:`benchmarks.precision_parity`, which replays the same episodes
through a text teacher and the base model:
- ``model.autocast=bfloat16``: decoder matmuls in bf16, forward and backward (the LM head, log-softmax, δ,
  KL and margin in fp32). It passes on the tiny model (embeddings sharpened so that its distributions are
  peaked like a trained model's) but NOT on SmolLM2-135M's 30 layers (δ moves by up to 0.25 nats;
  ``benchmarks/results/precision_parity.json``), which is why it is off in every profile.
- ``model.bf16_backward=true``: every forward in fp32, the input gradients through frozen weights in bf16.
  δ and Δ are the fp32 ones exactly; what changes is the gradient, whose cosine to fp32 is checked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from benchmarks.precision_parity import TOLERANCE, compare_precisions
from lopd_core.config import load_config
from lopd_core.models.precision import Bf16BackwardLinear, install_bf16_backward


def test_both_bf16_modes_keep_delta_and_margin_within_tolerance_on_the_tiny_model(models_dir):
    result = compare_precisions(load_config("smoke"), models_dir, sharpen=10.0)
    assert result["delta_fp32_max_abs"] > 0.01  # the δ compared are not all zero
    autocast, backward = result["precisions"]["autocast"], result["precisions"]["bf16_backward"]
    assert autocast["delta_max_abs_change"] <= TOLERANCE and autocast["margin_abs_change"] <= TOLERANCE
    assert autocast["delta_max_abs_change"] > 0  # autocast does round the forward
    assert backward["delta_max_abs_change"] == 0.0 and backward["margin_abs_change"] == 0.0  # forward untouched
    assert backward["within_tolerance"] and autocast["within_tolerance"]
    assert backward["grad_cosine"] > 0.999 and 0 < backward["grad_relative_error"] < 0.05


def test_bf16_backward_rounds_only_the_input_gradient_of_frozen_linears():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32))
    model[0].requires_grad_(False)  # frozen: gets the bf16 backward
    reference = copy.deepcopy(model)
    assert install_bf16_backward(model) == 1
    assert type(model[0]) is Bf16BackwardLinear and type(model[1]) is nn.Linear
    assert model.state_dict().keys() == reference.state_dict().keys()

    x = torch.randn(8, 64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = model(x), reference(x_ref)
    assert torch.equal(out, out_ref)  # the forward is fp32, bit for bit
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert torch.equal(model[1].weight.grad, reference[1].weight.grad)  # trainable layer: fp32 as before
    assert not torch.equal(x.grad, x_ref.grad)  # the gradient through the frozen layer was rounded …
    assert torch.allclose(x.grad, x_ref.grad, rtol=0.02, atol=1e-3)  # … to bf16's precision
    assert model[0].weight.grad is None


def test_bf16_backward_falls_back_to_fp32_when_the_weight_trains_or_changes():
    torch.manual_seed(0)
    layer = nn.Linear(16, 16).requires_grad_(False)
    install_bf16_backward(layer)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()  # makes the bf16 copy
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place change refreshes it
    x.grad = None
    layer(x).sum().backward()
    expected = layer.weight.detach().sum(0).expand(4, 16)
    assert torch.allclose(x.grad, expected, rtol=0.02, atol=0.02)  # the doubled weight, in bf16
    layer.weight.requires_grad_(True)  # unfrozen: the plain nn.Linear, weight gradient included
    layer(x).sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("flag", [False, True])
def test_the_config_installs_it_on_the_shared_base_only_when_asked(flag, models_dir):
    from lopd_core.models.policy import build_policy_set

    cfg = load_config("smoke", {"model.bf16_backward": str(flag).lower()})
    policies = build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    installed = [m for m in policies.base.modules() if isinstance(m, Bf16BackwardLinear)]
    assert bool(installed) is flag
    assert all(not m.weight.requires_grad for m in installed)  # never on a LoRA matrix


AVX2_FLAGS = "fpu vme sse sse2 avx avx2 fma bmi2"


@pytest.mark.parametrize(("extra", "native"), [("", False), (" avx512f avx512_vnni", False),
                                               (" avx512f avx512_bf16", True), (" amx_tile amx_bf16", True)])
def test_cpu_bf16_is_native_only_with_avx512_bf16_or_amx(tmp_path, extra, native):
    from lopd_core.models.precision import cpu_has_native_bf16

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {AVX2_FLAGS}{extra}\n\n")
    assert cpu_has_native_bf16(str(info)) is native
    assert cpu_has_native_bf16(str(tmp_path / "absent")) is False  # unreadable: fp32, never the slow choice


@pytest.mark.parametrize("native", [False, True])
def test_engine_dtype_auto_is_bf16_only_where_it_is_native_and_bf16_backward_warns_elsewhere(
        monkeypatch, caplog, models_dir, native):
    from lopd_core.models import policy, precision
    from lopd_core.rollout.engines import engine_dtype

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    cfg = load_config("smoke", {"model.device": "cpu", "rollout.engine_dtype": "auto"})
    assert engine_dtype(cfg) == ("bfloat16" if native else "float32")
    assert engine_dtype(cfg.with_overrides({"rollout.engine_dtype": "model"})) == "float32"  # model.dtype
    assert engine_dtype(cfg.with_overrides({"rollout.engine_dtype": "bfloat16"})) == "bfloat16"  # asked for

    cfg = load_config("smoke", {"model.device": "cpu", "model.bf16_backward": "true"})
    with caplog.at_level("WARNING", logger=policy.log.name):
        policy.build_policy_set(cfg.model, cfg.distill.lopd, models_dir, device="cpu")
    warned = [r for r in caplog.records if "bf16_backward" in r.getMessage()]
    assert bool(warned) is not native
