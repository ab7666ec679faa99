"""Device weights of `CudaRunner`: where every tensor lives in the weights arena, and filling it.

Linear weights that one GEMM reads together are placed back to back, so the fused matrix exists
without repacking anything: the GDN input projection `[in_proj_qkv | in_proj_z | in_proj_b |
in_proj_a]` (rows), the attention projection `[q_proj | k_proj | v_proj]` and the MLP's
`[gate_proj | up_proj]`. Every other tensor is uploaded as stored. Each slot names the format the
kernels read (`Slot.format`); only BF16 exists so far (FP8 / NVFP4 kernels are separate work), so
an artifact tensor in any other format is refused by name.

Two sources fill the same layout: an artifact component (`upload_artifact`, one host-to-device
copy per tensor straight from the memory-mapped file) or a seed (`fill_synthetic`: random bf16
values of the configured shapes generated once on the host in a block and tiled on the device,
for speed runs of real model sizes without a 50 GB file). `rope_tables` are the constant RoPE
cos/sin rows the attention prep kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from runtime.model.config import LINEAR_ATTENTION, ModelConfig


@dataclass(frozen=True)
class Slot:
    """One place in the arena: byte offset, shape, and which stored tensors fill it (rows)."""

    offset: int
    shape: tuple[int, ...]
    parts: tuple[tuple[str, int], ...]  # (tensor name, rows) in order; rows = 0 for 1-D tensors
    kind: str = "linear"  # "linear" | "norm" (zero-centred) | "plain" (centred on 1) | "vector"
    format: str = "bf16"  # how the kernels read it (`layers.Forward.linear` picks by it)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * 2


@dataclass
class WeightLayout:
    """Byte offsets of every device weight; `layers[i]` maps a role name to its Slot."""

    config: ModelConfig
    total: int = 0
    globals: dict[str, Slot] = field(default_factory=dict)
    layers: list[dict[str, Slot]] = field(default_factory=list)

    def _take(self, shape: tuple[int, ...], parts: tuple[tuple[str, int], ...], kind: str = "linear") -> Slot:
        start = (self.total + 255) // 256 * 256
        slot = Slot(start, tuple(shape), parts, kind)
        self.total = start + slot.nbytes
        return slot

    @classmethod
    def plan(cls, config: ModelConfig) -> "WeightLayout":
        c = config
        if c.family != "dense":
            raise NotImplementedError(f"CudaRunner runs dense models only so far (this is {c.family!r})")
        lay = cls(config)
        h = c.hidden_size
        lay.globals["embed"] = lay._take((c.vocab_size, h), (("embed_tokens.weight", c.vocab_size),))
        lay.globals["norm"] = lay._take((h,), (("norm.weight", 0),), "norm")
        if not c.tie_word_embeddings:
            lay.globals["lm_head"] = lay._take((c.vocab_size, h), (("lm_head.weight", c.vocab_size),))
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            s: dict[str, Slot] = {
                "input_norm": lay._take((h,), ((p + "input_layernorm.weight", 0),), "norm"),
                "post_norm": lay._take((h,), ((p + "post_attention_layernorm.weight", 0),), "norm"),
            }
            if kind == LINEAR_ATTENTION:
                q = p + "linear_attn."
                hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
                parts = ((q + "in_proj_qkv.weight", c.conv_dim), (q + "in_proj_z.weight", hv * dv),
                         (q + "in_proj_b.weight", hv), (q + "in_proj_a.weight", hv))
                s["w_in"] = lay._take((sum(r for _, r in parts), h), parts)
                s["conv"] = lay._take((c.conv_dim, c.linear_conv_kernel_dim), ((q + "conv1d.weight", c.conv_dim),),
                                      "vector")
                s["a_log"] = lay._take((hv,), ((q + "A_log", 0),), "vector")
                s["dt_bias"] = lay._take((hv,), ((q + "dt_bias", 0),), "vector")
                s["gdn_norm"] = lay._take((dv,), ((q + "norm.weight", 0),), "plain")
                s["out_proj"] = lay._take((h, hv * dv), ((q + "out_proj.weight", h),))
            else:
                q = p + "self_attn."
                hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
                parts = ((q + "q_proj.weight", hq * 2 * d), (q + "k_proj.weight", hkv * d),
                         (q + "v_proj.weight", hkv * d))
                s["w_qkv"] = lay._take((sum(r for _, r in parts), h), parts)
                s["o_proj"] = lay._take((h, hq * d), ((q + "o_proj.weight", h),))
                s["q_norm"] = lay._take((d,), ((q + "q_norm.weight", 0),), "norm")
                s["k_norm"] = lay._take((d,), ((q + "k_norm.weight", 0),), "norm")
            m = p + "mlp."
            inter = c.intermediate_size
            assert inter is not None
            parts = ((m + "gate_proj.weight", inter), (m + "up_proj.weight", inter))
            s["w_gate_up"] = lay._take((2 * inter, h), parts)
            s["down"] = lay._take((h, inter), ((m + "down_proj.weight", h),))
            lay.layers.append(s)
        return lay

    def all_slots(self) -> list[Slot]:
        return list(self.globals.values()) + [s for layer in self.layers for s in layer.values()]


def upload_artifact(layout: WeightLayout, component: Any, device: Any, base: int, stream: Any,
                    progress: Callable[[int, int], None] | None = None) -> None:
    """Copy every tensor of an artifact component to its place (bf16 as stored, no repacking)."""
    slots = layout.all_slots()
    done = 0
    for slot in slots:
        offset = base + slot.offset
        for name, rows in slot.parts:
            entry = component.entry(name)
            if entry.format != slot.format:
                raise NotImplementedError(f"tensor {name} is {entry.format}; CudaRunner reads {slot.format} "
                                          "weights only so far")
            raw = component.raw(name)
            expect = int(np.prod(slot.shape[1:])) * rows if rows else int(np.prod(slot.shape))
            if raw.size != expect:
                raise ValueError(f"tensor {name} has {raw.size} values, the {slot.shape} slot needs {expect}")
            device.memcpy_htod(offset, raw, stream)
            offset += raw.nbytes
        done += slot.nbytes
        if progress is not None:
            progress(done, layout.total)


def fill_synthetic(layout: WeightLayout, seed: int, device: Any, base: int, stream: Any) -> None:
    """Random bf16 weights of the right shapes, without a file.

    Linear weights get uniform values of std ~ 1/sqrt(fan_in) (a 16 MiB block drawn once and
    tiled across the arena: speed does not depend on the values), zero-centred norm weights small
    values around 0, the gated norm's weight values around 1, A_log / dt_bias / conv taps small.
    """
    from runtime.artifact.formats import f32_to_bf16

    rng = np.random.default_rng(seed)
    block_elems = 8 << 20
    block = rng.uniform(-1.0, 1.0, block_elems).astype(np.float32)
    scratch = device.mem_alloc(block_elems * 2, "synthetic weight block")
    try:
        block_fan_in = 0
        for slot in layout.all_slots():
            count = int(np.prod(slot.shape))
            if slot.kind == "linear":
                fan_in = slot.shape[-1]
                if fan_in != block_fan_in:  # uniform on [-a, a] has std a / sqrt(3)
                    device.memcpy_htod(scratch, f32_to_bf16(block * np.float32(np.sqrt(3.0 / fan_in))), stream)
                    stream.synchronize()
                    block_fan_in = fan_in
                remaining, dst = count * 2, base + slot.offset
                while remaining > 0:
                    n = min(remaining, block_elems * 2)
                    device.memcpy_dtod(dst, scratch, n, stream)
                    dst += n
                    remaining -= n
            else:
                if slot.kind == "norm":
                    values = rng.normal(0.0, 0.05, count)
                elif slot.kind == "plain":
                    values = 1.0 + rng.normal(0.0, 0.05, count)
                else:
                    values = rng.normal(0.0, 0.3, count)
                device.memcpy_htod(base + slot.offset, f32_to_bf16(values.astype(np.float32)), stream)
                stream.synchronize()
        stream.synchronize()
    finally:
        device.mem_free(scratch)


def rope_tables(config: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bits of cos and sin [positions, rotary_dim / 2] (the attention prep kernel's tables)."""
    from runtime.artifact.formats import f32_to_bf16

    rd = config.rotary_dim
    inv_freq = config.rope_theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return f32_to_bf16(np.cos(angles).astype(np.float32)), f32_to_bf16(np.sin(angles).astype(np.float32))
