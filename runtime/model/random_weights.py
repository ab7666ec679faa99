"""Tiny random models for tests and demos: HF-style config dicts and canonical weight dicts.

Weights are drawn so that every part of the forward pass matters numerically: projections scaled
by 1/sqrt(fan_in), zero-centred norm weights clearly off 0 and gated-norm weights clearly off 1
(a `w` vs `1 + w` mix-up changes the output), `dt_bias` and `A_log` spread out. With
`bf16_exact=True` every value is representable in bfloat16, so a bf16 artifact holds it exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.model.config import DENSE_MLP, LINEAR_ATTENTION, ModelConfig


def tiny_config_dict(family: str, *, vocab_size: int = 512, hidden_size: int = 64,
                     layer_types: tuple[str, ...] = ("linear_attention", "linear_attention",
                                                     "full_attention", "linear_attention",
                                                     "full_attention"),
                     tie_word_embeddings: bool = False, **overrides: Any) -> dict[str, Any]:
    """A flat HF text config of a tiny model of `family` ("dense", "moe" or "next").

    Head counts keep GQA (Hq/Hkv = 2) and grouped value heads (Hv/Hk = 2) in play; `overrides`
    replace any top-level field.
    """
    model_type = {"dense": "qwen3_5_text", "moe": "qwen3_5_moe_text", "next": "qwen3_next"}
    if family not in model_type:
        raise ValueError(f"unknown family {family!r}")
    cfg: dict[str, Any] = {
        "model_type": model_type[family],
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "num_hidden_layers": len(layer_types), "layer_types": list(layer_types),
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 4096,
        "tie_word_embeddings": tie_word_embeddings, "attention_bias": False,
    }
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25}
    if family != "next":
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)   # sums to 32*0.25/2
    cfg["rope_parameters"] = rope
    if family != "dense":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)
    if family == "next":
        cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    cfg.update(overrides)
    return cfg


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


class _Draw:
    def __init__(self, seed: int, bf16_exact: bool):
        self.rng = np.random.default_rng(seed)
        self.bf16_exact = bf16_exact

    def _out(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32, copy=False)
        return round_to_bf16(x) if self.bf16_exact else x

    def linear(self, out_dim: int, in_dim: int, *lead: int) -> np.ndarray:
        draw = self.rng.standard_normal((*lead, out_dim, in_dim), dtype=np.float32)
        return self._out(draw * np.float32(1 / np.sqrt(in_dim)))

    def centred_norm(self, dim: int) -> np.ndarray:
        return self._out(0.3 * self.rng.standard_normal(dim))

    def plain_norm(self, dim: int) -> np.ndarray:
        return self._out(1.0 + 0.3 * self.rng.standard_normal(dim))

    def normal(self, shape: tuple[int, ...], scale: float, mean: float = 0.0) -> np.ndarray:
        draw = self.rng.standard_normal(shape, dtype=np.float32)
        return self._out(np.float32(mean) + np.float32(scale) * draw)


def _layer(draw: _Draw, cfg: ModelConfig, p: str, layer_type: str, mlp_type: str,
           out: dict[str, np.ndarray]) -> None:
    h = cfg.hidden_size
    out[p + "input_layernorm.weight"] = draw.centred_norm(h)
    out[p + "post_attention_layernorm.weight"] = draw.centred_norm(h)
    if layer_type == LINEAR_ATTENTION:
        a = p + "linear_attn."
        hv = cfg.linear_num_value_heads
        out[a + "in_proj_qkv.weight"] = draw.linear(cfg.conv_dim, h)
        out[a + "in_proj_z.weight"] = draw.linear(cfg.linear_value_dim, h)
        out[a + "in_proj_b.weight"] = draw.linear(hv, h)
        out[a + "in_proj_a.weight"] = draw.linear(hv, h)
        out[a + "conv1d.weight"] = draw.normal((cfg.conv_dim, cfg.linear_conv_kernel_dim), 0.5)
        out[a + "A_log"] = draw._out(np.log(draw.rng.uniform(0.5, 8.0, hv)))
        out[a + "dt_bias"] = draw.normal((hv,), 0.5, mean=0.5)
        out[a + "norm.weight"] = draw.plain_norm(cfg.linear_value_head_dim)
        out[a + "out_proj.weight"] = draw.linear(h, cfg.linear_value_dim)
    else:
        a = p + "self_attn."
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out[a + "q_proj.weight"] = draw.linear(2 * hq * d, h)
        out[a + "k_proj.weight"] = draw.linear(hkv * d, h)
        out[a + "v_proj.weight"] = draw.linear(hkv * d, h)
        out[a + "o_proj.weight"] = draw.linear(h, hq * d)
        out[a + "q_norm.weight"] = draw.centred_norm(d)
        out[a + "k_norm.weight"] = draw.centred_norm(d)
    m = p + "mlp."
    if mlp_type == DENSE_MLP:
        i = cfg.intermediate_size
        out[m + "gate_proj.weight"] = draw.linear(i, h)
        out[m + "up_proj.weight"] = draw.linear(i, h)
        out[m + "down_proj.weight"] = draw.linear(h, i)
    else:
        e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        out[m + "gate.weight"] = draw.linear(e, h)
        out[m + "experts.gate_up_proj"] = draw.linear(2 * i, h, e)
        out[m + "experts.down_proj"] = draw.linear(h, i, e)
        out[m + "shared_expert.gate_proj.weight"] = draw.linear(s, h)
        out[m + "shared_expert.up_proj.weight"] = draw.linear(s, h)
        out[m + "shared_expert.down_proj.weight"] = draw.linear(h, s)
        out[m + "shared_expert_gate.weight"] = draw.linear(1, h)


def random_weights(cfg: ModelConfig, *, seed: int = 0, bf16_exact: bool = False
                   ) -> dict[str, np.ndarray]:
    """Canonical text weights (float32) for `cfg`; `lm_head.weight` only when untied."""
    draw = _Draw(seed, bf16_exact)
    h, v = cfg.hidden_size, cfg.vocab_size
    out = {"embed_tokens.weight": draw.normal((v, h), 1.0)}
    for i in range(cfg.num_hidden_layers):
        _layer(draw, cfg, f"layers.{i}.", cfg.layer_types[i], cfg.mlp_types[i], out)
    out["norm.weight"] = draw.centred_norm(h)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = draw.linear(v, h)
    return out


def random_mtp_weights(cfg: ModelConfig, *, seed: int = 1, bf16_exact: bool = False
                       ) -> dict[str, np.ndarray]:
    """Canonical MTP component weights for `cfg` (`fc.weight`, norms, `layers.{j}.*`)."""
    draw = _Draw(seed, bf16_exact)
    h = cfg.hidden_size
    out = {"fc.weight": draw.linear(h, 2 * h),
           "pre_fc_norm_embedding.weight": draw.centred_norm(h),
           "pre_fc_norm_hidden.weight": draw.centred_norm(h),
           "norm.weight": draw.centred_norm(h)}
    for j in range(cfg.mtp_num_hidden_layers):
        _layer(draw, cfg, f"layers.{j}.", "full_attention", cfg.mtp_mlp_type, out)
    return out
