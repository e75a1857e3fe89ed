"""bf16 autocast (model.autocast=bfloat16) against fp32 on replayed trajectories: δ and Δ within 0.002.

The trainer's decoder matmuls run in bf16 while weights, the LM head, the log-softmax, δ, the KL and the
margin stay fp32. :mod:`benchmarks.precision_parity` replays the same episodes through a text teacher and the
base model in both precisions: per-token δ = log p_teacher − log p_base may move by at most 0.002 nats, and
so may the balanced margin Δ. Here on the tiny model (embeddings sharpened so that its distributions are
peaked like a trained model's). On SmolLM2-135M (30 layers) bf16 autocast does NOT meet this bar (the
benchmark's figures are in benchmarks/results/precision_parity.json), which is why ``model.autocast`` is
off in every profile.
"""

from __future__ import annotations

from benchmarks.precision_parity import TOLERANCE, compare_precisions
from lopd_core.config import load_config


def test_bf16_autocast_keeps_delta_and_margin_within_tolerance_on_the_tiny_model(models_dir):
    result = compare_precisions(load_config("smoke"), models_dir, sharpen=10.0)
    assert result["delta_max_abs_change"] <= TOLERANCE and result["margin_abs_change"] <= TOLERANCE
    assert result["within_tolerance"] and result["delta_fp32_max_abs"] > 0.01  # the δ compared are not all zero
