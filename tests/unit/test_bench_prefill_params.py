"""`bench.prefill.linear_params`: the projection weights one token multiplies by, which the
prefill bench turns into FLOPs. Checked against counts written out from the published shapes'
numbers (not from the weight layout the function reads)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.prefill import linear_params
from runtime.model.config import ModelConfig
from runtime.model.gpu.weights import WeightLayout
from runtime.model.shapes import shape_config


def _params(shape: str) -> int:
    config = ModelConfig.from_dict(shape_config(shape))
    return linear_params(SimpleNamespace(config=config, layout=WeightLayout.plan(config)))


def test_the_27b_counts_every_projection_of_every_layer():
    h, inter = 5120, 17408
    gdn = (2 * 16 * 128 + 48 * 128 + 48 * 128 + 2 * 48) * h + 48 * 128 * h   # in (qkv, z, b, a), out
    attn = (24 * 2 * 256 + 2 * 4 * 256) * h + 24 * 256 * h                  # q with gate, k, v; o
    mlp = 3 * h * inter
    assert _params("qwen3.6-27b") == 48 * gdn + 16 * attn + 64 * mlp


def test_an_moe_token_counts_the_router_and_only_its_k_experts_and_the_shared_one():
    h, moe = 2048, 512
    gdn = (2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32) * h + 32 * 128 * h
    attn = (16 * 2 * 256 + 2 * 2 * 256) * h + 16 * 256 * h
    mlp = 256 * h + 1 * h + (8 + 1) * 3 * h * moe                           # router, shared gate, experts
    assert _params("qwen3.6-35b-a3b") == 30 * gdn + 10 * attn + 40 * mlp


def test_a_next_80b_token_counts_its_ten_experts_and_the_shared_one():
    h, moe = 2048, 512
    gdn = (2 * 16 * 128 + 32 * 128 + 32 * 128 + 2 * 32) * h + 32 * 128 * h
    attn = (16 * 2 * 256 + 2 * 2 * 256) * h + 16 * 256 * h
    mlp = 512 * h + 1 * h + (10 + 1) * 3 * h * moe                          # router, shared gate, experts
    assert _params("qwen3-next-80b") == 36 * gdn + 12 * attn + 48 * mlp
