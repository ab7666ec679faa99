"""Binding canonical weight names to per-layer records, with shape checks.

Canonical names are the HF names with the `model.language_model.` / `model.` prefix stripped
(`embed_tokens.weight`, `layers.{i}.linear_attn.in_proj_qkv.weight`, ...); the MTP component
uses `fc.weight`, `pre_fc_norm_embedding.weight`, `pre_fc_norm_hidden.weight`, `norm.weight`,
`layers.{j}.*`. A missing tensor or a wrong shape raises `WeightError` naming the tensor.

Accepted alternatives (so hand-built dicts and other converters work too):
- conv1d weight [C, Kc] or HF's [C, 1, Kc];
- MoE experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I])
  or per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`);
- Qwen3-Next's fused `in_proj_qkvz` / `in_proj_ba`, regrouped here to the split form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

import numpy as np

from runtime.model.config import DENSE_MLP, LINEAR_ATTENTION, ModelConfig


class WeightError(ValueError):
    """A weight is missing or has the wrong shape."""


@dataclass(frozen=True)
class GdnWeights:
    in_proj_qkv: np.ndarray      # [conv_dim, H], rows [q | k | v]
    in_proj_z: np.ndarray        # [Hv*dv, H]
    in_proj_b: np.ndarray        # [Hv, H]
    in_proj_a: np.ndarray        # [Hv, H]
    conv: np.ndarray             # [conv_dim, Kc]
    a_log: np.ndarray            # [Hv]
    dt_bias: np.ndarray          # [Hv]
    norm: np.ndarray             # [dv], plain (gated norm)
    out_proj: np.ndarray         # [H, Hv*dv]


@dataclass(frozen=True)
class AttentionWeights:
    q_proj: np.ndarray           # [Hq*2D, H], per head [q | gate]
    k_proj: np.ndarray           # [Hkv*D, H]
    v_proj: np.ndarray           # [Hkv*D, H]
    o_proj: np.ndarray           # [H, Hq*D]
    q_norm: np.ndarray           # [D], zero-centred
    k_norm: np.ndarray           # [D], zero-centred


@dataclass(frozen=True)
class DenseMlpWeights:
    gate_proj: np.ndarray        # [I, H]
    up_proj: np.ndarray          # [I, H]
    down_proj: np.ndarray        # [H, I]


@dataclass(frozen=True)
class MoeWeights:
    router: np.ndarray           # [E, H]
    gate_up: np.ndarray          # [E, 2I, H], gate rows first
    down: np.ndarray             # [E, H, I]
    shared_gate_proj: np.ndarray  # [Is, H]
    shared_up_proj: np.ndarray   # [Is, H]
    shared_down_proj: np.ndarray  # [H, Is]
    shared_expert_gate: np.ndarray  # [1, H]


MixerWeights = Union[GdnWeights, AttentionWeights]
MlpWeights = Union[DenseMlpWeights, MoeWeights]


@dataclass(frozen=True)
class LayerWeights:
    input_norm: np.ndarray       # [H], zero-centred
    post_norm: np.ndarray        # [H], zero-centred
    mixer: MixerWeights
    mlp: MlpWeights


@dataclass(frozen=True)
class MtpWeights:
    fc: np.ndarray               # [H, 2H], input [normed embedding | normed hidden]
    pre_fc_norm_embedding: np.ndarray
    pre_fc_norm_hidden: np.ndarray
    norm: np.ndarray
    layers: tuple[LayerWeights, ...]   # full-attention layers


class _Source:
    """Reads named tensors from a mapping, converting to the compute dtype and checking shape."""

    def __init__(self, tensors: Mapping[str, np.ndarray], dtype: np.dtype, where: str):
        self.tensors = tensors
        self.dtype = dtype
        self.where = where

    def has(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> np.ndarray:
        try:
            return np.asarray(self.tensors[name])
        except KeyError:
            raise WeightError(f"{self.where}: missing tensor '{name}'") from None

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = self.raw(name)
        if array.shape != tuple(shape):
            raise WeightError(f"{self.where}: tensor '{name}' has shape {list(array.shape)}, "
                              f"expected {list(shape)}")
        return np.ascontiguousarray(array, dtype=self.dtype)


def _gdn(src: _Source, p: str, cfg: ModelConfig) -> GdnWeights:
    h, hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    kc = cfg.linear_conv_kernel_dim
    if src.has(p + "in_proj_qkvz.weight"):
        qkv, z, b, a = _regroup_next(src, p, cfg)
    else:
        qkv = src.get(p + "in_proj_qkv.weight", (cfg.conv_dim, h))
        z = src.get(p + "in_proj_z.weight", (cfg.linear_value_dim, h))
        b = src.get(p + "in_proj_b.weight", (hv, h))
        a = src.get(p + "in_proj_a.weight", (hv, h))
    conv = src.raw(p + "conv1d.weight")
    if conv.ndim == 3 and conv.shape[1] == 1:
        conv = conv[:, 0, :]
    if conv.shape != (cfg.conv_dim, kc):
        raise WeightError(f"{src.where}: tensor '{p}conv1d.weight' has shape "
                          f"{list(conv.shape)}, expected {[cfg.conv_dim, kc]}")
    return GdnWeights(
        in_proj_qkv=qkv, in_proj_z=z, in_proj_b=b, in_proj_a=a,
        conv=np.ascontiguousarray(conv, dtype=src.dtype),
        a_log=src.get(p + "A_log", (hv,)), dt_bias=src.get(p + "dt_bias", (hv,)),
        norm=src.get(p + "norm.weight", (dv,)),
        out_proj=src.get(p + "out_proj.weight", (h, cfg.linear_value_dim)))


def _regroup_next(src: _Source, p: str, cfg: ModelConfig) -> tuple[np.ndarray, ...]:
    """Qwen3-Next groups projections by key head: qkvz rows [Hk, q dk | k dk | v r*dv | z r*dv],
    ba rows [Hk, b r | a r]. Value head g*r + j belongs to key head g."""
    h, hk, dk, dv = (cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
    r = cfg.value_heads_per_key_head
    qkvz = src.get(p + "in_proj_qkvz.weight",
                   (2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, h))
    ba = src.get(p + "in_proj_ba.weight", (2 * cfg.linear_num_value_heads, h))
    groups = qkvz.reshape(hk, 2 * dk + 2 * r * dv, h)
    q = groups[:, :dk].reshape(-1, h)
    k = groups[:, dk:2 * dk].reshape(-1, h)
    v = groups[:, 2 * dk:2 * dk + r * dv].reshape(-1, h)
    z = groups[:, 2 * dk + r * dv:].reshape(-1, h)
    ba_groups = ba.reshape(hk, 2 * r, h)
    b = ba_groups[:, :r].reshape(-1, h)
    a = ba_groups[:, r:].reshape(-1, h)
    contiguous = np.ascontiguousarray
    return contiguous(np.concatenate([q, k, v])), contiguous(z), contiguous(b), contiguous(a)


def _attention(src: _Source, p: str, cfg: ModelConfig) -> AttentionWeights:
    h, hq, hkv, d = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim)
    return AttentionWeights(
        q_proj=src.get(p + "q_proj.weight", (hq * 2 * d, h)),
        k_proj=src.get(p + "k_proj.weight", (hkv * d, h)),
        v_proj=src.get(p + "v_proj.weight", (hkv * d, h)),
        o_proj=src.get(p + "o_proj.weight", (h, hq * d)),
        q_norm=src.get(p + "q_norm.weight", (d,)),
        k_norm=src.get(p + "k_norm.weight", (d,)))


def _dense_mlp(src: _Source, p: str, cfg: ModelConfig) -> DenseMlpWeights:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return DenseMlpWeights(gate_proj=src.get(p + "gate_proj.weight", (i, h)),
                           up_proj=src.get(p + "up_proj.weight", (i, h)),
                           down_proj=src.get(p + "down_proj.weight", (h, i)))


def _moe(src: _Source, p: str, cfg: ModelConfig) -> MoeWeights:
    h, e, i, s = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                  cfg.shared_expert_intermediate_size)
    if src.has(p + "experts.gate_up_proj"):
        gate_up = src.get(p + "experts.gate_up_proj", (e, 2 * i, h))
        down = src.get(p + "experts.down_proj", (e, h, i))
    else:
        gate_up = np.stack([np.concatenate([src.get(f"{p}experts.{x}.gate_proj.weight", (i, h)),
                                            src.get(f"{p}experts.{x}.up_proj.weight", (i, h))])
                            for x in range(e)])
        down = np.stack([src.get(f"{p}experts.{x}.down_proj.weight", (h, i)) for x in range(e)])
    return MoeWeights(
        router=src.get(p + "gate.weight", (e, h)), gate_up=gate_up, down=down,
        shared_gate_proj=src.get(p + "shared_expert.gate_proj.weight", (s, h)),
        shared_up_proj=src.get(p + "shared_expert.up_proj.weight", (s, h)),
        shared_down_proj=src.get(p + "shared_expert.down_proj.weight", (h, s)),
        shared_expert_gate=src.get(p + "shared_expert_gate.weight", (1, h)))


def _layer(src: _Source, p: str, cfg: ModelConfig, layer_type: str, mlp_type: str
           ) -> LayerWeights:
    h = cfg.hidden_size
    if layer_type == LINEAR_ATTENTION:
        mixer: MixerWeights = _gdn(src, p + "linear_attn.", cfg)
    else:
        mixer = _attention(src, p + "self_attn.", cfg)
    build: Callable = _dense_mlp if mlp_type == DENSE_MLP else _moe
    return LayerWeights(input_norm=src.get(p + "input_layernorm.weight", (h,)),
                        post_norm=src.get(p + "post_attention_layernorm.weight", (h,)),
                        mixer=mixer, mlp=build(src, p + "mlp.", cfg))


@dataclass(frozen=True)
class TextWeights:
    embed: np.ndarray            # [V, H] (a view of lm_head_t.T when tied)
    lm_head_t: np.ndarray        # [H, V] contiguous: the logits GEMM streams it row by row
    norm: np.ndarray             # [H]
    layers: tuple[LayerWeights, ...]


def bind_text(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: np.dtype,
              vocab_rows: tuple[int, int] | None = None) -> TextWeights:
    """vocab_rows: the lm_head rows [start, stop) a tensor-parallel rank holds (`sharding`):
    `lm_head.weight` is then only those rows, and `lm_head_t` holds their columns; for tied
    embeddings they are read from the (replicated) embedding. None: the whole vocabulary."""
    src = _Source(tensors, dtype, "text weights")
    h, v = cfg.hidden_size, cfg.vocab_size
    start, stop = (0, v) if vocab_rows is None else vocab_rows
    layers = tuple(_layer(src, f"layers.{i}.", cfg, cfg.layer_types[i], cfg.mlp_types[i])
                   for i in range(cfg.num_hidden_layers))
    if cfg.tie_word_embeddings:
        table = _checked(src, "embed_tokens.weight", (v, h))
        lm_head_t = _transposed(table[start:stop], dtype)
        # The whole vocabulary: the embedding is a view of the head (no second copy).
        embed = lm_head_t.T if vocab_rows is None else src.get("embed_tokens.weight", (v, h))
    else:
        lm_head_t = _transposed(_checked(src, "lm_head.weight", (stop - start, h)), dtype)
        embed = src.get("embed_tokens.weight", (v, h))
    return TextWeights(embed=embed, lm_head_t=lm_head_t,
                       norm=src.get("norm.weight", (h,)), layers=layers)


def bind_mtp(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: np.dtype
             ) -> MtpWeights:
    src = _Source(tensors, dtype, "mtp weights")
    h = cfg.hidden_size
    layers = tuple(_layer(src, f"layers.{j}.", cfg, "full_attention", cfg.mtp_mlp_type)
                   for j in range(cfg.mtp_num_hidden_layers))
    return MtpWeights(fc=src.get("fc.weight", (h, 2 * h)),
                      pre_fc_norm_embedding=src.get("pre_fc_norm_embedding.weight", (h,)),
                      pre_fc_norm_hidden=src.get("pre_fc_norm_hidden.weight", (h,)),
                      norm=src.get("norm.weight", (h,)), layers=layers)


def _checked(src: _Source, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Shape-checked tensor in whatever dtype it came in (avoids a second full-size copy)."""
    array = src.raw(name)
    if array.shape != shape:
        raise WeightError(f"{src.where}: tensor '{name}' has shape {list(array.shape)}, "
                          f"expected {list(shape)}")
    return array


def _transposed(array: np.ndarray, dtype: np.dtype, block: int = 2048) -> np.ndarray:
    """Contiguous `array.T` in `dtype`, copied in row blocks (about twice as fast as one
    strided copy for the 248k-row embedding, which stays cache-friendly this way)."""
    out = np.empty(array.shape[::-1], dtype)
    for start in range(0, array.shape[0], block):
        out[:, start:start + block] = array[start:start + block].T
    return out


class ComponentTensors(Mapping[str, np.ndarray]):
    """A read-only mapping over an artifact component, for `bind_text` / `bind_mtp`: tensors
    dequantized to float32 on access (`component.f32(name)`)."""

    def __init__(self, component: Any):
        self._component = component
        self._names = tuple(component.tensor_names())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._component.f32(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
