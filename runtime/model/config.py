"""`ModelConfig`: the validated text-decoder configuration of a Qwen3.5/3.6 or Qwen3-Next model.

Built from the flat Hugging Face text config that the artifact's `text` component carries
(`ModelConfig.from_dict`). Every field the forward pass reads is checked here, once, with an
error naming the field, so the runners can trust it. Field meanings follow `config.json`
(research note qwen-arch.md section 1.1); the families are

- `dense`: Qwen3.5/3.6 dense (`qwen3_5_text`, `qwen3_5`), dense SwiGLU MLP in every layer;
- `moe`:   Qwen3.5/3.6 MoE (`qwen3_5_moe_text`, `qwen3_5_moe`), routed experts + shared expert in
  every layer, top-k weights always renormalised;
- `next`:  Qwen3-Next (`qwen3_next`), MoE where `mlp_only_layers` / `decoder_sparse_step` say,
  renormalisation iff `norm_topk_prob`.

`layer_types` is authoritative. When absent, layer i is full attention iff
`(i + 1) % full_attention_interval == 0` (default interval 4), as transformers does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
DENSE_MLP = "dense"
MOE_MLP = "moe"

# HF model_type -> family. Composite (multimodal) types are accepted when the caller already
# passes their text part flattened.
FAMILY_OF_MODEL_TYPE = {
    "qwen3_5_text": "dense",
    "qwen3_5": "dense",
    "qwen3_5_moe_text": "moe",
    "qwen3_5_moe": "moe",
    "qwen3_next": "next",
}
# Older configs name layer types this way; transformers maps them the same.
_LEGACY_LAYER_TYPES = {"mamba": LINEAR_ATTENTION, "attention": FULL_ATTENTION}
# Defaults transformers applies when a field is missing from config.json.
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_PARTIAL_ROTARY = 0.25
_DEFAULT_FULL_ATTENTION_INTERVAL = 4
_MISSING = object()


class ModelConfigError(ValueError):
    """The model configuration is malformed or describes something we do not run."""


@dataclass(frozen=True)
class ModelConfig:
    """Text decoder configuration (all sizes in elements).

    family: "dense" | "moe" | "next" (see module docstring).
    layer_types: per layer "linear_attention" (Gated DeltaNet) or "full_attention".
    mlp_types: per layer "dense" (SwiGLU, `intermediate_size`) or "moe".
    rotary_dim: leading head dims that RoPE rotates (head_dim * partial_rotary_factor).
    mrope_section: Qwen3.5's interleaved MRoPE split of the rotary frequencies over (t, h, w);
        for text tokens all three positions are equal, so it does not change the maths; None for
        Qwen3-Next.
    mtp_num_hidden_layers: layers of the multi-token-prediction head (Qwen3-Next does not declare
        it; its checkpoints carry one, as vLLM assumes); mtp_mlp_type: its FFN kind.
    """

    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rotary_dim: int
    mrope_section: tuple[int, ...] | None
    max_position_embeddings: int
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # FFN
    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int | None
    shared_expert_intermediate_size: int | None
    norm_topk_prob: bool
    # MTP head
    mtp_num_hidden_layers: int
    mtp_mlp_type: str

    # --- derived sizes ------------------------------------------------------------------------

    @property
    def linear_key_dim(self) -> int:
        """Hk * dk: width of the q part (and of the k part) of `in_proj_qkv`."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """Hv * dv: width of v, z and the GDN output."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal depthwise conv: [q | k | v]."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def value_heads_per_key_head(self) -> int:
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """Validate a flat HF text config (a composite config's `text_config` is unwrapped)."""
        if not isinstance(cfg, Mapping):
            raise ModelConfigError(f"model config: expected a mapping, got {type(cfg).__name__}")
        if "text_config" in cfg:
            text = cfg["text_config"]
            if not isinstance(text, Mapping):
                raise ModelConfigError("model config: field 'text_config' must be an object")
            merged = dict(text)
            # Composite configs keep some fields only at the top level.
            for key in ("tie_word_embeddings", "model_type"):
                if key not in merged and key in cfg:
                    merged[key] = cfg[key]
            cfg = merged
        return _build(cfg)


# --- field readers ------------------------------------------------------------------------------

def _fail(field: str, message: str) -> ModelConfigError:
    return ModelConfigError(f"model config: field '{field}' {message}")


def _int(cfg: Mapping[str, Any], field: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
    value = cfg.get(field, default)
    if value is _MISSING:
        raise _fail(field, "is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, f"must be an integer, got {value!r}")
    if value < minimum:
        raise _fail(field, f"must be >= {minimum}, got {value}")
    return value


def _float(cfg: Mapping[str, Any], field: str, default: Any = _MISSING, *,
           positive: bool = True) -> float:
    value = cfg.get(field, default)
    if value is _MISSING:
        raise _fail(field, "is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(field, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise _fail(field, f"must be a finite {'positive ' if positive else ''}number, "
                           f"got {value!r}")
    return value


def _bool(cfg: Mapping[str, Any], field: str, default: Any = _MISSING) -> bool:
    value = cfg.get(field, default)
    if value is _MISSING:
        raise _fail(field, "is required")
    if not isinstance(value, bool):
        raise _fail(field, f"must be true or false, got {value!r}")
    return value


def _expect(cfg: Mapping[str, Any], field: str, allowed: tuple, default: Any) -> None:
    """Fields we do not implement alternatives for: accept only the supported values."""
    value = cfg.get(field, default)
    if value not in allowed:
        raise _fail(field, f"is {value!r}; only {', '.join(map(repr, allowed))} is supported")


def _rope(cfg: Mapping[str, Any], head_dim: int
          ) -> tuple[float, float, int, tuple[int, ...] | None]:
    """(theta, partial factor, rotary_dim, mrope_section) from `rope_parameters` (or the older
    top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` fields)."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = cfg.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise _fail("rope_parameters", f"must be an object, got {params!r}")
    merged = dict(params)
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in merged and key in cfg:
            merged[key] = cfg[key]
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type != "default":
        raise _fail("rope_parameters.rope_type", f"is {rope_type!r}; only 'default' is supported")
    theta = _float(merged, "rope_theta", _DEFAULT_ROPE_THETA)
    partial = _float(merged, "partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY)
    if partial > 1.0:
        raise _fail("partial_rotary_factor", f"must be in (0, 1], got {partial}")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise _fail("partial_rotary_factor",
                    f"gives rotary dim {rotary_dim} for head_dim {head_dim}; it must be even >= 2")
    section = merged.get("mrope_section")
    if section is not None:
        if (not isinstance(section, (list, tuple)) or len(section) != 3
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                           for s in section)):
            raise _fail("rope_parameters.mrope_section",
                        f"must be three non-negative integers, got {section!r}")
        if sum(section) != rotary_dim // 2:
            raise _fail("rope_parameters.mrope_section",
                        f"sums to {sum(section)}; it must equal rotary_dim/2 = {rotary_dim // 2}")
        if not merged.get("mrope_interleaved", True):
            raise _fail("rope_parameters.mrope_interleaved", "is false; only the interleaved "
                        "layout of Qwen3.5/3.6 is supported")
        section = tuple(section)
    return theta, partial, rotary_dim, section


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    raw = cfg.get("layer_types")
    if raw is None:
        interval = _int(cfg, "full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL)
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                     for i in range(num_layers))
    if not isinstance(raw, (list, tuple)):
        raise _fail("layer_types", f"must be a list, got {raw!r}")
    if len(raw) != num_layers:
        raise _fail("layer_types", f"has {len(raw)} entries; num_hidden_layers is {num_layers}")
    types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in raw)
    for i, t in enumerate(types):
        if t not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise _fail("layer_types", f"entry {i} is {raw[i]!r}; expected "
                                       f"'{LINEAR_ATTENTION}' or '{FULL_ATTENTION}'")
    return types


def _build(cfg: Mapping[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise _fail("model_type", f"is {model_type!r}; supported: "
                                  f"{', '.join(sorted(FAMILY_OF_MODEL_TYPE))}")
    family = FAMILY_OF_MODEL_TYPE[model_type]

    hidden = _int(cfg, "hidden_size")
    num_layers = _int(cfg, "num_hidden_layers")
    vocab = _int(cfg, "vocab_size")
    eps = _float(cfg, "rms_norm_eps", 1e-6)
    _expect(cfg, "hidden_act", ("silu",), "silu")
    _expect(cfg, "attention_bias", (False,), False)
    _expect(cfg, "output_gate_type", ("swish", "silu"), "swish")
    _expect(cfg, "mtp_use_dedicated_embeddings", (False,), False)
    tie = _bool(cfg, "tie_word_embeddings", False)
    layer_types = _layer_types(cfg, num_layers)

    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads")
    if heads % kv_heads:
        raise _fail("num_key_value_heads",
                    f"({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = _int(cfg, "head_dim", hidden // heads if hidden % heads == 0 else _MISSING)
    theta, partial, rotary_dim, mrope_section = _rope(cfg, head_dim)
    max_pos = _int(cfg, "max_position_embeddings", 262144)

    k_heads = _int(cfg, "linear_num_key_heads")
    v_heads = _int(cfg, "linear_num_value_heads")
    if v_heads % k_heads:
        raise _fail("linear_num_value_heads",
                    f"({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})")
    dk = _int(cfg, "linear_key_head_dim")
    dv = _int(cfg, "linear_value_head_dim")
    kernel = _int(cfg, "linear_conv_kernel_dim", 4, minimum=2)

    intermediate = None
    num_experts = experts_per_tok = 0
    moe_inter = shared_inter = None
    norm_topk = True
    if family == "dense":
        intermediate = _int(cfg, "intermediate_size")
        mlp_types = (DENSE_MLP,) * num_layers
    else:
        num_experts = _int(cfg, "num_experts")
        experts_per_tok = _int(cfg, "num_experts_per_tok")
        if experts_per_tok > num_experts:
            raise _fail("num_experts_per_tok",
                        f"({experts_per_tok}) exceeds num_experts ({num_experts})")
        moe_inter = _int(cfg, "moe_intermediate_size")
        shared_inter = _int(cfg, "shared_expert_intermediate_size")
        if family == "moe":
            mlp_types = (MOE_MLP,) * num_layers
        else:
            norm_topk = _bool(cfg, "norm_topk_prob", True)
            step = _int(cfg, "decoder_sparse_step", 1)
            dense_layers = cfg.get("mlp_only_layers") or []
            if (not isinstance(dense_layers, (list, tuple))
                    or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense_layers)):
                raise _fail("mlp_only_layers",
                            f"must list layer indices below {num_layers}, got {dense_layers!r}")
            mlp_types = tuple(MOE_MLP if i not in dense_layers and (i + 1) % step == 0
                              else DENSE_MLP for i in range(num_layers))
            if DENSE_MLP in mlp_types:
                intermediate = _int(cfg, "intermediate_size")

    mtp_layers = _int(cfg, "mtp_num_hidden_layers", 1, minimum=0)
    return ModelConfig(
        family=family, model_type=model_type, vocab_size=vocab, hidden_size=hidden,
        num_hidden_layers=num_layers, rms_norm_eps=eps, layer_types=layer_types,
        mlp_types=mlp_types, tie_word_embeddings=tie,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=theta, partial_rotary_factor=partial, rotary_dim=rotary_dim,
        mrope_section=mrope_section, max_position_embeddings=max_pos,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel,
        intermediate_size=intermediate, num_experts=num_experts,
        num_experts_per_tok=experts_per_tok, moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=shared_inter, norm_topk_prob=norm_topk,
        mtp_num_hidden_layers=mtp_layers,
        mtp_mlp_type=DENSE_MLP if family == "dense" else MOE_MLP,
    )
