"""Text configs of the released models' shapes, for runs on synthetic weights
(`--synthetic-weights SEED --synthetic-shape NAME`, the benches): a speed run needs the real
sizes, not the checkpoint. Values from the models' config.json (research/qwen-arch.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN36_27B: dict[str, Any] = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "num_attention_heads": 24,
    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "intermediate_size": 17408, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}

QWEN36_35B_A3B: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}

# Qwen3-Next-80B-A3B: a flat config with RoPE at the top level (no MRoPE: plain 1-D RoPE), every
# layer MoE (`mlp_only_layers` empty; its `intermediate_size` 5120 is then unused) and the top-10
# weights renormalised (`norm_topk_prob`). The checkpoint carries one MTP layer it does not declare.
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "rope_theta": 1e7, "partial_rotary_factor": 0.25,
}

SHAPES: dict[str, dict[str, Any]] = {"qwen3.6-27b": QWEN36_27B, "qwen3.6-35b-a3b": QWEN36_35B_A3B,
                                     "qwen3-next-80b": QWEN3_NEXT_80B_A3B}


def shape_config(name_or_file: str) -> dict[str, Any]:
    """A named shape (`SHAPES`) or a JSON file holding a text config."""
    if name_or_file in SHAPES:
        return dict(SHAPES[name_or_file])
    path = Path(name_or_file)
    if not path.is_file():
        raise ValueError(f"{name_or_file!r} is neither a known shape ({', '.join(SHAPES)}) nor a file")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON text config ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a text config is a JSON object")
    return config
