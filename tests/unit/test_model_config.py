"""ModelConfig.from_dict: families, the layer schedule rule, derived sizes, and field errors."""

from __future__ import annotations

import copy

import pytest

from runtime.model.config import ModelConfig, ModelConfigError
from runtime.model.random_weights import tiny_config_dict

# Text configs of real checkpoints (values from qwen-arch.md section 1.2).
QWEN36_27B = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
    "num_hidden_layers": 64, "intermediate_size": 17408, "num_attention_heads": 24,
    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
}
QWEN36_35B_A3B = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
}
QWEN3_NEXT_80B = {   # flat, older style: rope fields at the top level, no layer_types
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "intermediate_size": 5120, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def test_real_dense_config():
    cfg = ModelConfig.from_dict(QWEN36_27B)
    assert cfg.family == "dense"
    assert cfg.layer_types.count("full_attention") == 16
    assert cfg.attention_layers[:3] == (3, 7, 11)
    assert cfg.linear_key_dim == 2048 and cfg.linear_value_dim == 6144
    assert cfg.conv_dim == 10240 and cfg.value_heads_per_key_head == 3
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert cfg.mrope_section == (11, 11, 10)
    assert set(cfg.mlp_types) == {"dense"} and cfg.mtp_mlp_type == "dense"


def test_real_moe_config_wrapped_in_composite():
    composite = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                 "text_config": QWEN36_35B_A3B}
    cfg = ModelConfig.from_dict(composite)
    assert cfg.family == "moe" and cfg.model_type == "qwen3_5_moe_text"
    assert cfg.num_experts == 256 and cfg.num_experts_per_tok == 8
    assert cfg.norm_topk_prob is True          # Qwen3.5-MoE always renormalises
    assert cfg.conv_dim == 8192 and len(cfg.linear_layers) == 30
    assert set(cfg.mlp_types) == {"moe"} and cfg.mtp_mlp_type == "moe"


def test_real_next_config_top_level_rope_and_interval_rule():
    cfg = ModelConfig.from_dict(QWEN3_NEXT_80B)
    assert cfg.family == "next"
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == 64 and cfg.mrope_section is None
    assert cfg.attention_layers == tuple(range(3, 48, 4))
    assert cfg.mtp_num_hidden_layers == 1       # undeclared in Next configs: one layer
    assert set(cfg.mlp_types) == {"moe"}


def test_layer_types_are_authoritative_over_the_interval():
    raw = dict(QWEN36_27B, num_hidden_layers=4, full_attention_interval=2,
               layer_types=["full_attention", "linear_attention", "linear_attention",
                            "linear_attention"])
    assert ModelConfig.from_dict(raw).attention_layers == (0,)


def test_interval_fallback_with_other_interval():
    raw = dict(QWEN36_27B, num_hidden_layers=6, full_attention_interval=3)
    assert ModelConfig.from_dict(raw).attention_layers == (2, 5)


def test_legacy_layer_type_names():
    raw = dict(QWEN36_27B, num_hidden_layers=2, layer_types=["mamba", "attention"])
    assert ModelConfig.from_dict(raw).layer_types == ("linear_attention", "full_attention")


def test_next_mlp_only_layers_and_sparse_step():
    raw = dict(QWEN3_NEXT_80B, num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.mlp_types == ("dense", "moe", "dense", "moe")
    assert cfg.intermediate_size == 5120
    raw = dict(QWEN3_NEXT_80B, norm_topk_prob=False)
    assert ModelConfig.from_dict(raw).norm_topk_prob is False


@pytest.mark.parametrize("family", ["dense", "moe", "next"])
def test_tiny_configs(family):
    cfg = ModelConfig.from_dict(tiny_config_dict(family))
    assert cfg.family == family
    assert cfg.value_heads_per_key_head == 2
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 2


def test_config_is_frozen():
    cfg = ModelConfig.from_dict(QWEN36_27B)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1


def _mutated(base: dict, path: str, value) -> dict:
    raw = copy.deepcopy(base)
    *parents, key = path.split(".")
    target = raw
    for parent in parents:
        target = target[parent]
    if value is KeyError:
        del target[key]
    else:
        target[key] = value
    return raw


@pytest.mark.parametrize("base,path,value,message", [
    (QWEN36_27B, "hidden_size", KeyError, "'hidden_size' is required"),
    (QWEN36_27B, "hidden_size", "5120", "'hidden_size' must be an integer"),
    (QWEN36_27B, "num_hidden_layers", 0, "'num_hidden_layers' must be >= 1"),
    (QWEN36_27B, "vocab_size", True, "'vocab_size' must be an integer"),
    (QWEN36_27B, "rms_norm_eps", -1.0, "'rms_norm_eps' must be a finite positive"),
    (QWEN36_27B, "model_type", "llama", "'model_type' is 'llama'"),
    (QWEN36_27B, "hidden_act", "gelu", "'hidden_act' is 'gelu'"),
    (QWEN36_27B, "layer_types", ["full_attention"], "'layer_types' has 1 entries"),
    (QWEN36_27B, "layer_types", ["sliding"] * 64, "'layer_types' entry 0 is 'sliding'"),
    (QWEN36_27B, "num_key_value_heads", 5, "'num_key_value_heads' (5) must divide"),
    (QWEN36_27B, "linear_num_value_heads", 20, "'linear_num_value_heads' (20) must be a"),
    (QWEN36_27B, "rope_parameters.mrope_section", [11, 11, 11], "sums to 33"),
    (QWEN36_27B, "rope_parameters.rope_type", "yarn", "'rope_parameters.rope_type' is 'yarn'"),
    (QWEN36_27B, "rope_parameters.partial_rotary_factor", 1.5, "must be in (0, 1]"),
    (QWEN36_27B, "intermediate_size", KeyError, "'intermediate_size' is required"),
    (QWEN36_27B, "tie_word_embeddings", "no", "'tie_word_embeddings' must be true or false"),
    (QWEN36_27B, "attention_bias", True, "'attention_bias' is True"),
    (QWEN36_27B, "mtp_use_dedicated_embeddings", True, "'mtp_use_dedicated_embeddings'"),
    (QWEN36_35B_A3B, "num_experts_per_tok", 300, "'num_experts_per_tok' (300) exceeds"),
    (QWEN36_35B_A3B, "moe_intermediate_size", KeyError, "'moe_intermediate_size' is required"),
    (QWEN3_NEXT_80B, "mlp_only_layers", [99], "'mlp_only_layers' must list layer indices"),
    (QWEN3_NEXT_80B, "norm_topk_prob", 1, "'norm_topk_prob' must be true or false"),
])
def test_errors_name_the_field(base, path, value, message):
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_dict(_mutated(base, path, value))
    assert message in str(info.value)
    assert str(info.value).startswith("model config: field ")


def test_not_a_mapping():
    with pytest.raises(ModelConfigError, match="expected a mapping"):
        ModelConfig.from_dict(["hidden_size"])
