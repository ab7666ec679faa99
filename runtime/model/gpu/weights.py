"""Device weights of `CudaRunner`: where every tensor lives in the weights arena, and filling it.

Linear weights that one GEMM reads together are placed back to back, so the fused matrix exists
without repacking anything: the GDN input projection `[in_proj_qkv | in_proj_z | in_proj_b |
in_proj_a]` (rows), the attention projection `[q_proj | k_proj | v_proj]` and the MLP's
`[gate_proj | up_proj]`; a MoE layer's experts are stacked with its shared expert as one more
expert (`WeightLayout._moe`). Every other tensor is uploaded as stored. Each slot names the format the
kernels read (`Slot.format`): BF16, or for the projections FP8 (`fp8_e4m3`: e4m3 codes, then the
fp32 128 x 128 block scales of all its parts stacked, read by `cute_kernels/gemv_fp8.py`) or NVFP4
(`nvfp4`: packed e2m1 codes, the e4m3 scale per 16 columns, then one fp32 global scale per row,
each part's global repeated over its rows, read by `cute_kernels/gemv_nvfp4.py`); an artifact
tensor in any other format is refused by name. MoE expert stacks are BF16, FP8 or NVFP4 (every
expert of every layer, the shared one included; FP8 scale rows cover `Slot.block_rows` rows, 128
or an expert half narrower than that; NVFP4 stacks are plain `nvfp4` slots, each expert tensor's
global scale repeated over its rows), read by the `moe` family's `up_fp8` / `down_fp8` or
`up_nvfp4` / `down_nvfp4` and, for prefill, dequantised by `dequant_weights` / `dequant_nvfp4`;
the router and shared-expert gate are BF16. A fused
projection whose parts differ in format is a quantised slot followed by a BF16 `tail` slot
(Qwen's FP8 releases and the nvfp4 recipe keep the GDN `in_proj_b` / `in_proj_a` in BF16 after
`in_proj_qkv` / `in_proj_z`; the quantised GEMVs read both).

With an MTP head (`plan(..., mtp=True)`) the head's tensors follow, named with the
`mtp.` prefix of their artifact component (`mtp.fc.weight` is the component `mtp`'s `fc.weight`):
`WeightLayout.mtp` (fc, the two pre-fc norms, the final norm) and `mtp_layers` (each a full-attention
layer with the model's MLP kind, dense or MoE, the same roles as a main attention layer of that kind).
They are BF16 (the upload refuses another format by name).

Two sources fill the same layout: an artifact component (`upload_artifact`, one host-to-device
copy per tensor straight from the memory-mapped file) or a seed (`fill_synthetic`: random bf16
values of the configured shapes generated once on the host in a block and tiled on the device,
for speed runs of real model sizes without a 50 GB file; FP8 slots get random e4m3 codes and block
scales, NVFP4 slots random e2m1 codes, block scales and per-row globals). `rope_tables` are the
constant RoPE cos/sin rows the attention prep kernel reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from runtime.model.config import LINEAR_ATTENTION, MOE_MLP, ModelConfig

FP8 = "fp8_e4m3"
NVFP4 = "nvfp4"
QUANTIZED = (FP8, NVFP4)
MTP_PREFIX = "mtp."  # layout names of the MTP component's tensors
FP8_BLOCK = 128  # rows and columns per fp8 scale
NVFP4_GROUP = 16  # columns per nvfp4 block scale


def fp8_recipe_format(name: str) -> str:
    """The format Qwen's FP8 releases and `tools.convert --recipe fp8` give a projection weight
    (for `--synthetic-weights` without an FP8 artifact): FP8 except the GDN `in_proj_a` / `in_proj_b`,
    the lm_head and a MoE layer's router and shared-expert gate (its experts, the shared one
    included, are FP8)."""
    keep = ("in_proj_a.weight", "in_proj_b.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")
    return "bf16" if name.endswith(keep) else FP8


def nvfp4_recipe_format(name: str) -> str:
    """The format `tools.convert --recipe nvfp4` gives a projection weight, as ModelOpt's NVFP4
    recipes do (for `--synthetic-weights` without an NVFP4 artifact): NVFP4 except the GDN
    `in_proj_a` / `in_proj_b`, the lm_head and a MoE layer's router and shared-expert gate (its
    experts, the shared one included, are NVFP4)."""
    keep = ("in_proj_a.weight", "in_proj_b.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")
    return "bf16" if name.endswith(keep) else NVFP4


@dataclass(frozen=True)
class Slot:
    """One place in the arena: byte offset, shape, and which stored tensors fill it (rows)."""

    offset: int
    shape: tuple[int, ...]
    parts: tuple[tuple[str, int], ...]  # (tensor name, rows) in order; rows = 0 for 1-D tensors
    kind: str = "linear"  # "linear" | "norm" (zero-centred) | "plain" (centred on 1) | "vector"
    format: str = "bf16"  # how the kernels read it (`layers.Forward.linear` picks by it)
    scale_offset: int = 0  # fp8: byte offset of the fp32 block scales [cdiv(N, 128), cdiv(K, 128)];
    # nvfp4: of the e4m3 block scales [N, K / 16]
    gscale_offset: int = 0  # nvfp4: byte offset of the fp32 global scale of every row [N]
    block_rows: int = FP8_BLOCK  # fp8: rows per scale row (an expert stack with I < 128: I, see `_moe`)

    @property
    def data_bytes(self) -> int:
        count = int(np.prod(self.shape))
        return {FP8: count, NVFP4: count // 2}.get(self.format, count * 2)

    @property
    def scale_shape(self) -> tuple[int, int]:
        n, k = self.shape
        if self.format == NVFP4:
            return n, k // NVFP4_GROUP
        return -(-n // self.block_rows), -(-k // FP8_BLOCK)

    @property
    def scale_bytes(self) -> int:
        return int(np.prod(self.scale_shape)) * (1 if self.format == NVFP4 else 4)

    @property
    def nbytes(self) -> int:
        """Bytes from `offset` to the slot's end (codes, then the scales for fp8; codes, block
        scales, then the per-row globals for nvfp4)."""
        if self.format == NVFP4:
            return self.gscale_offset - self.offset + self.shape[0] * 4
        if self.format != FP8:
            return self.data_bytes
        return self.scale_offset - self.offset + self.scale_bytes


@dataclass
class WeightLayout:
    """Byte offsets of every device weight; `layers[i]` maps a role name to its Slot."""

    config: ModelConfig
    total: int = 0
    globals: dict[str, Slot] = field(default_factory=dict)
    layers: list[dict[str, Slot]] = field(default_factory=list)
    mtp: dict[str, Slot] = field(default_factory=dict)  # the MTP head's fc and norms (empty: no head)
    mtp_layers: list[dict[str, Slot]] = field(default_factory=list)
    format_of: Callable[[str], str] = field(default=lambda name: "bf16", repr=False)  # see `plan`

    def _take(self, shape: tuple[int, ...], parts: tuple[tuple[str, int], ...], kind: str = "linear",
              fmt: str = "bf16", block_rows: int = FP8_BLOCK) -> Slot:
        start = (self.total + 255) // 256 * 256
        slot = Slot(start, tuple(shape), parts, kind, fmt, block_rows=block_rows)
        if fmt in QUANTIZED:
            scale_offset = (start + slot.data_bytes + 255) // 256 * 256
            gscale_offset = (scale_offset + slot.scale_bytes + 255) // 256 * 256 if fmt == NVFP4 else 0
            slot = Slot(start, tuple(shape), parts, kind, fmt, scale_offset, gscale_offset, block_rows)
        self.total = start + slot.nbytes
        return slot

    def _projection(self, into: dict[str, Slot], role: str, k: int, parts: tuple[tuple[str, int], ...]) -> None:
        """into[role] = the fused projection of `parts` ([rows, k] each) in its format; a BF16 run of
        parts after an FP8 or NVFP4 run becomes `into[role + "_tail"]`, placed right after it. The
        MTP head's parts are BF16."""
        formats = ["bf16" if name.startswith(MTP_PREFIX) else self.format_of(name) for name, _ in parts]
        for name, fmt in zip([name for name, _ in parts], formats):
            if fmt not in ("bf16", *QUANTIZED):
                raise NotImplementedError(f"tensor {name} is {fmt}; CudaRunner reads bf16, {FP8} and {NVFP4} "
                                          "projections only")
        split = next((i for i, f in enumerate(formats) if f != formats[0]), len(parts))
        if split < len(parts) and (formats[0] not in QUANTIZED or any(f != "bf16" for f in formats[split:])):
            raise NotImplementedError(
                f"fused projection {[name for name, _ in parts]} has formats {formats}; CudaRunner reads one format, "
                "or FP8 / NVFP4 parts followed by BF16 ones")
        head, tail = parts[:split], parts[split:]
        if formats[0] == FP8:
            # Each part's scale rows are stacked: every part but the last must fill whole 128-row blocks.
            for name, rows in head[:-1]:
                if rows % FP8_BLOCK:
                    raise NotImplementedError(f"fp8 tensor {name} has {rows} rows, not a multiple of {FP8_BLOCK}: its "
                                              "scale blocks cannot be stacked with the next part's")
        into[role] = self._take((sum(r for _, r in head), k), head, fmt=formats[0])
        if tail:
            into[role + "_tail"] = self._take((sum(r for _, r in tail), k), tail)

    @classmethod
    def plan(cls, config: ModelConfig, format_of: Callable[[str], str] | None = None, mtp: bool = False
             ) -> "WeightLayout":
        """format_of(tensor name): the stored format of a projection weight (default all bf16); the
        embedding and every non-projection tensor are bf16 (the upload checks). mtp: place the MTP
        head too (refused for a config without one); its layer's MLP is the config's `mtp_mlp_type`
        (dense, or MoE with the main layers' slots and shapes)."""
        c = config
        if c.family not in ("dense", "moe", "next"):
            raise NotImplementedError(f"CudaRunner runs Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next models only "
                                      f"(this is {c.family!r})")
        lay = cls(config, **({"format_of": format_of} if format_of else {}))
        h = c.hidden_size
        lay.globals["embed"] = lay._take((c.vocab_size, h), (("embed_tokens.weight", c.vocab_size),))
        lay.globals["norm"] = lay._take((h,), (("norm.weight", 0),), "norm")
        if not c.tie_word_embeddings:
            lay._projection(lay.globals, "lm_head", h, (("lm_head.weight", c.vocab_size),))
        for i, kind in enumerate(c.layer_types):
            lay.layers.append(lay._layer(f"layers.{i}.", kind, c.mlp_types[i]))
        expert_formats = {layer["experts_gate_up"].format for layer in lay.layers if "experts_gate_up" in layer}
        if len(expert_formats) > 1:
            raise NotImplementedError(f"MoE layers with experts in {sorted(expert_formats)}: CudaRunner runs one "
                                      "expert format for every layer")
        if mtp:
            if c.mtp_num_hidden_layers < 1:
                raise ValueError("an MTP head was asked for, but the config has mtp_num_hidden_layers = 0")
            p = MTP_PREFIX
            lay.mtp["fc"] = lay._take((h, 2 * h), ((p + "fc.weight", h),))
            for role in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                lay.mtp[role] = lay._take((h,), ((f"{p}{role}.weight", 0),), "norm")
            for j in range(c.mtp_num_hidden_layers):
                lay.mtp_layers.append(lay._layer(f"{p}layers.{j}.", "full_attention", c.mtp_mlp_type))
        return lay

    def _layer(self, p: str, kind: str, mlp: str) -> dict[str, Slot]:
        """The slots of one decoder layer named with prefix p: its norms, its mixer (GDN for
        linear attention, else gated attention) and its MLP (dense, or MoE: `_moe`)."""
        c, h = self.config, self.config.hidden_size
        s: dict[str, Slot] = {
            "input_norm": self._take((h,), ((p + "input_layernorm.weight", 0),), "norm"),
            "post_norm": self._take((h,), ((p + "post_attention_layernorm.weight", 0),), "norm"),
        }
        if kind == LINEAR_ATTENTION:
            q = p + "linear_attn."
            hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
            parts = ((q + "in_proj_qkv.weight", c.conv_dim), (q + "in_proj_z.weight", hv * dv),
                     (q + "in_proj_b.weight", hv), (q + "in_proj_a.weight", hv))
            self._projection(s, "w_in", h, parts)
            s["conv"] = self._take((c.conv_dim, c.linear_conv_kernel_dim), ((q + "conv1d.weight", c.conv_dim),),
                                   "vector")
            s["a_log"] = self._take((hv,), ((q + "A_log", 0),), "vector")
            s["dt_bias"] = self._take((hv,), ((q + "dt_bias", 0),), "vector")
            s["gdn_norm"] = self._take((dv,), ((q + "norm.weight", 0),), "plain")
            self._projection(s, "out_proj", hv * dv, ((q + "out_proj.weight", h),))
        else:
            q = p + "self_attn."
            hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            parts = ((q + "q_proj.weight", hq * 2 * d), (q + "k_proj.weight", hkv * d),
                     (q + "v_proj.weight", hkv * d))
            self._projection(s, "w_qkv", h, parts)
            self._projection(s, "o_proj", hq * d, ((q + "o_proj.weight", h),))
            s["q_norm"] = self._take((d,), ((q + "q_norm.weight", 0),), "norm")
            s["k_norm"] = self._take((d,), ((q + "k_norm.weight", 0),), "norm")
        m = p + "mlp."
        if mlp == MOE_MLP:
            self._moe(s, m)
            return s
        inter = c.intermediate_size
        assert inter is not None
        parts = ((m + "gate_proj.weight", inter), (m + "up_proj.weight", inter))
        self._projection(s, "w_gate_up", h, parts)
        self._projection(s, "down", inter, ((m + "down_proj.weight", h),))
        return s

    def _moe(self, into: dict[str, Slot], m: str) -> None:
        """The MoE MLP's slots (`cute_kernels/moe.py` reads them): the router [E, H], the shared
        expert's gate row [1, H], and the experts stacked with the shared expert as expert E (so one
        launch covers the k routed slots and the shared one): `experts_gate_up` [(E + 1) * 2I, H]
        (per expert gate rows, then up rows) and `experts_down` [(E + 1) * H, I]."""
        c = self.config
        h, e, inter, shared = (c.hidden_size, c.num_experts, c.moe_intermediate_size,
                               c.shared_expert_intermediate_size)
        if shared != inter:
            raise NotImplementedError(f"the shared expert's width ({shared}) differs from the routed experts' "
                                      f"({inter}); CudaRunner stacks it as one more expert")
        parts = {"router": ((m + "gate.weight", e),), "shared_gate": ((m + "shared_expert_gate.weight", 1),),
                 "experts_gate_up": ((m + "experts.gate_up_proj", e * 2 * inter),
                                     (m + "shared_expert.gate_proj.weight", inter),
                                     (m + "shared_expert.up_proj.weight", inter)),
                 "experts_down": ((m + "experts.down_proj", e * h), (m + "shared_expert.down_proj.weight", h))}
        for role, named in parts.items():
            # The MTP head's tensors are BF16 (as `_projection` reads them).
            formats = {"bf16" if name.startswith(MTP_PREFIX) else self.format_of(name) for name, _ in named}
            allowed = ("bf16", *QUANTIZED) if role.startswith("experts") else ("bf16",)
            if len(formats) > 1 or not formats <= set(allowed):
                raise NotImplementedError(
                    f"MoE tensors {[name for name, _ in named]} are {[self.format_of(name) for name, _ in named]}; "
                    f"CudaRunner reads the router and shared-expert gate in bf16 and the experts (the shared one "
                    f"included) all in bf16, all in {FP8} or all in {NVFP4}")
            k = inter if role == "experts_down" else h
            fmt = formats.pop()
            # An fp8 scale row covers 128 rows of one row group (an expert's gate or up half, or
            # its down rows): 128, or the whole group when it is narrower (the tiny model's I = 64).
            group = inter if role == "experts_gate_up" else h
            block_rows = min(FP8_BLOCK, group)
            if fmt == FP8 and group % block_rows:
                raise NotImplementedError(f"fp8 experts of {group} rows per half: neither below nor a multiple of "
                                          f"{FP8_BLOCK}, so their scale rows do not stack")
            into[role] = self._take((sum(rows for _, rows in named), k), named, fmt=fmt, block_rows=block_rows)

    @property
    def expert_format(self) -> str:
        """The MoE expert stacks' format ("bf16" without MoE layers); one for every layer (`plan`
        refuses a mix)."""
        return next((layer["experts_gate_up"].format for layer in self.layers if "experts_gate_up" in layer), "bf16")

    def all_slots(self) -> list[Slot]:
        return [*self.globals.values(), *(s for layer in self.layers for s in layer.values()), *self.mtp.values(),
                *(s for layer in self.mtp_layers for s in layer.values())]

    def fp8_shapes(self) -> set[tuple[int, int, int]]:
        """(N, NT, K) of every FP8 projection: its rows, its BF16 tail's rows (0 without) and K."""
        return self.quantized_shapes(FP8)

    def nvfp4_shapes(self) -> set[tuple[int, int, int]]:
        """(N, NT, K) of every NVFP4 projection, as `fp8_shapes`."""
        return self.quantized_shapes(NVFP4)

    def quantized_shapes(self, fmt: str) -> set[tuple[int, int, int]]:
        """(N, NT, K) of every projection in `fmt` that a quantised GEMV reads (not the experts)."""
        shapes = set()
        for slots in [self.globals, *self.layers]:
            for role, slot in slots.items():
                if slot.format == fmt and not role.startswith("experts"):  # the MoE kernels read those
                    tail = slots.get(role + "_tail")
                    shapes.add((slot.shape[0], tail.shape[0] if tail else 0, slot.shape[1]))
        return shapes


def upload_artifact(layout: WeightLayout, component: Any, device: Any, base: int, stream: Any,
                    progress: Callable[[int, int], None] | None = None, mtp_component: Any = None) -> None:
    """Copy every tensor of the artifact's text component (and of its `mtp` component for the
    `mtp.` slots) to its place as stored (no repacking): bf16 values, fp8 codes with their block
    scales after the slot's codes, or nvfp4 codes, block scales and each part's global scale (per
    row group) repeated over its rows."""
    if layout.mtp and mtp_component is None:
        raise ValueError("the layout has an MTP head: give the artifact's mtp component")
    slots = layout.all_slots()
    done = 0
    for slot in slots:
        offset = base + slot.offset
        scale_offset = base + slot.scale_offset
        gscale_offset = base + slot.gscale_offset
        for layout_name, rows in slot.parts:
            source, name = ((mtp_component, layout_name[len(MTP_PREFIX):]) if layout_name.startswith(MTP_PREFIX)
                            else (component, layout_name))
            entry = source.entry(name)
            if entry.format != slot.format:
                raise NotImplementedError(f"tensor {layout_name} is {entry.format}; CudaRunner reads "
                                          f"{slot.format} there")
            if slot.format == FP8:
                # Scale rows of `block_rows` rows each, stacked: a stored grid matches when every
                # row group of the tensor (per expert, gate and up apart) fills whole scale rows,
                # or is one scale row (block_rows = the group).
                group = entry.shape[-2] // entry.row_groups
                if (entry.row_groups != 1 or len(entry.shape) > 2 or slot.block_rows != FP8_BLOCK) \
                        and group % slot.block_rows:
                    raise NotImplementedError(f"fp8 tensor {name} has row groups of {group} rows; CudaRunner reads "
                                              f"its scales in rows of {slot.block_rows}")
                scales = np.ascontiguousarray(source.raw(name, "scale"), dtype=np.float32)
                scales = scales.reshape(-1, scales.shape[-1])
                want = (-(-rows // slot.block_rows), slot.scale_shape[1])
                if scales.shape != want:
                    raise ValueError(f"tensor {name} has scales {scales.shape}, {rows} x {slot.shape[1]} needs {want}")
                device.memcpy_htod(scale_offset, scales, stream)
                scale_offset += scales.nbytes
            if slot.format == NVFP4:
                    # A part's row groups: the tensor's (one per expert and half for a fused gate|up stack).
                groups = rows // (entry.shape[-2] // entry.row_groups)
                scale_offset, gscale_offset = _upload_nvfp4_scales(source, name, groups, rows, slot,
                                                                   device, scale_offset, gscale_offset, stream)
            raw = source.raw(name)
            expect = int(np.prod(slot.shape[1:])) * rows if rows else int(np.prod(slot.shape))
            if slot.format == NVFP4:
                expect //= 2  # two codes a byte
            if raw.size != expect:
                raise ValueError(f"tensor {name} has {raw.size} values, the {slot.shape} slot needs {expect}")
            device.memcpy_htod(offset, raw, stream)
            offset += raw.nbytes
        done += slot.nbytes
        if progress is not None:
            progress(done, layout.total)


def _upload_nvfp4_scales(source: Any, name: str, row_groups: int, rows: int, slot: Slot, device: Any,
                         scale_offset: int, gscale_offset: int, stream: Any) -> tuple[int, int]:
    """Copy one nvfp4 part's e4m3 block scales [rows, K / 16] as stored (an expert stack's
    [E, rows / E, K / 16] as its rows) and its global scales (one per row group) repeated over the
    group's rows; returns the next part's two offsets."""
    scales = np.ascontiguousarray(source.raw(name, "scale"), dtype=np.uint8)
    scales = scales.reshape(-1, scales.shape[-1])
    if scales.shape != (rows, slot.scale_shape[1]):
        raise ValueError(f"tensor {name} has block scales {scales.shape}, {rows} x {slot.shape[1]} needs "
                         f"{(rows, slot.scale_shape[1])}")
    globals_ = np.asarray(source.raw(name, "global_scale"), dtype=np.float32).reshape(-1)
    if globals_.size != row_groups or rows % row_groups:
        raise ValueError(f"tensor {name} has {globals_.size} global scales for {row_groups} row groups of "
                         f"{rows} rows")
    per_row = np.repeat(globals_, rows // row_groups)
    device.memcpy_htod(scale_offset, scales, stream)
    device.memcpy_htod(gscale_offset, per_row, stream)
    return scale_offset + scales.nbytes, gscale_offset + per_row.nbytes


def _tile(device: Any, dst: int, src: int, src_bytes: int, nbytes: int, stream: Any) -> None:
    """Fill nbytes at dst with copies of the src block."""
    while nbytes > 0:
        n = min(nbytes, src_bytes)
        device.memcpy_dtod(dst, src, n, stream)
        dst += n
        nbytes -= n


SYNTHETIC_ROUTERS = ("balanced", "skewed")
HOT_EXPERTS = 8  # experts the skewed synthetic router favours
HOT_SCALE = 4.0  # their router rows' scale: a logit ~ N(0, 16) is in the top k about half the time


def fill_synthetic(layout: WeightLayout, seed: int, device: Any, base: int, stream: Any,
                   router: str = "balanced") -> None:
    """Random weights of the right shapes and formats, without a file.

    MoE routers (`router`): "balanced" leaves them random like every projection, which routes each
    token to k experts close to uniformly at random (the load of a router trained to balance it);
    "skewed" scales the router rows of the first `HOT_EXPERTS` experts by `HOT_SCALE`, so a few
    experts are hot (each picked by about half the tokens), as in real traffic.

    BF16 linear weights get uniform values of std ~ 1/sqrt(fan_in) (a 16 MiB block drawn once and
    tiled across the arena: speed does not depend on the values); FP8 ones e4m3 codes of values
    uniform in [-448, 448] (a 16 MiB block, tiled) and block scales of sqrt(3 / fan_in) / 448 times
    a factor in [0.5, 1.5] (the same std); NVFP4 ones random bytes as codes (every byte is two
    valid e2m1 codes; a 16 MiB block, tiled), e4m3 block scales of values uniform in [0.5, 1.5] (a
    block, tiled) and per-row globals making the std ~1/sqrt(fan_in) again; zero-centred norm
    weights small values around 0, the gated norm's weight values around 1, A_log / dt_bias / conv
    taps small.
    """
    from runtime.artifact.formats import E2M1_VALUES, FP8_MAX, f32_to_bf16, f32_to_e4m3

    if router not in SYNTHETIC_ROUTERS:
        raise ValueError(f"synthetic router {router!r}: one of {', '.join(SYNTHETIC_ROUTERS)}")
    rng = np.random.default_rng(seed)
    block_elems = 8 << 20
    block = rng.uniform(-1.0, 1.0, block_elems).astype(np.float32)
    scratch = device.mem_alloc(block_elems * 2, "synthetic weight block")
    codes = None  # the device block of fp8 codes, made at the first fp8 slot
    fp4 = None  # the device blocks of nvfp4 codes, then of e4m3 block scales, made at the first nvfp4 slot
    try:
        block_fan_in = 0
        for slot in layout.all_slots():
            count = int(np.prod(slot.shape))
            if slot.format == FP8:
                if codes is None:
                    codes = device.mem_alloc(block_elems * 2, "synthetic fp8 code block")
                    device.memcpy_htod(codes, f32_to_e4m3(np.concatenate([block, block[::-1]]) * np.float32(FP8_MAX)),
                                       stream)
                    stream.synchronize()
                _tile(device, base + slot.offset, codes, block_elems * 2, count, stream)
                scales = np.sqrt(3.0 / slot.shape[-1]) / FP8_MAX * rng.uniform(0.5, 1.5, slot.scale_shape)
                device.memcpy_htod(base + slot.scale_offset, scales.astype(np.float32), stream)
                stream.synchronize()
            elif slot.format == NVFP4:
                if fp4 is None:
                    fp4 = device.mem_alloc(block_elems * 4, "synthetic nvfp4 code and scale blocks")
                    device.memcpy_htod(fp4, rng.integers(0, 256, block_elems * 2, dtype=np.uint8), stream)
                    device.memcpy_htod(fp4 + block_elems * 2,
                                       f32_to_e4m3(rng.uniform(0.5, 1.5, block_elems * 2).astype(np.float32)), stream)
                    stream.synchronize()
                _tile(device, base + slot.offset, fp4, block_elems * 2, slot.data_bytes, stream)
                _tile(device, base + slot.scale_offset, fp4 + block_elems * 2, block_elems * 2, slot.scale_bytes,
                      stream)
                # A weight's mean square: the codes' (uniform over E2M1_VALUES) times the scales' (13 / 12).
                unit = np.sqrt(np.mean(E2M1_VALUES ** 2) * 13.0 / 12.0 * slot.shape[-1])
                gscale = rng.uniform(0.5, 1.5, slot.shape[0]) / unit
                device.memcpy_htod(base + slot.gscale_offset, gscale.astype(np.float32), stream)
                stream.synchronize()
            elif slot.kind == "linear":
                fan_in = slot.shape[-1]
                if fan_in != block_fan_in:  # uniform on [-a, a] has std a / sqrt(3)
                    device.memcpy_htod(scratch, f32_to_bf16(block * np.float32(np.sqrt(3.0 / fan_in))), stream)
                    stream.synchronize()
                    block_fan_in = fan_in
                _tile(device, base + slot.offset, scratch, block_elems * 2, count * 2, stream)
            else:
                if slot.kind == "norm":
                    values = rng.normal(0.0, 0.05, count)
                elif slot.kind == "plain":
                    values = 1.0 + rng.normal(0.0, 0.05, count)
                else:
                    values = rng.normal(0.0, 0.3, count)
                device.memcpy_htod(base + slot.offset, f32_to_bf16(values.astype(np.float32)), stream)
                stream.synchronize()
        if router == "skewed":
            for slots in layout.layers:
                if "router" in slots:
                    e, h = slots["router"].shape
                    hot = min(HOT_EXPERTS, e) * h  # the rows the tiling put there, scaled up
                    rows = block[:hot] * np.float32(np.sqrt(3.0 / h) * HOT_SCALE)
                    device.memcpy_htod(base + slots["router"].offset, f32_to_bf16(rows), stream)
                    stream.synchronize()
        stream.synchronize()
    finally:
        device.mem_free(scratch)
        if codes is not None:
            device.mem_free(codes)
        if fp4 is not None:
            device.mem_free(fp4)


def rope_tables(config: ModelConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bits of cos and sin [positions, rotary_dim / 2] (the attention prep kernel's tables)."""
    from runtime.artifact.formats import f32_to_bf16

    rd = config.rotary_dim
    inv_freq = config.rope_theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    angles = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return f32_to_bf16(np.cos(angles).astype(np.float32)), f32_to_bf16(np.sin(angles).astype(np.float32))
