"""Activation quantisation for the FP8 prefill GEMM: bf16 `x[M, K]` -> e4m3 `q[M, K]` + fp32 `scale[M, KB]`.

One scale per (row, group of 128 columns), KB = cdiv(K, 128) groups: `scale = amax / 448` (448 is
e4m3's largest finite value, so the group's largest magnitude maps onto it) and `q = e4m3(x /
scale)`, so `x ~ q * scale`. A group of zeros gets scale 0 and codes 0 (no division by zero). The
groups are the k-tiles of `gemm_fp8_sm90` (BK = 128), which multiplies each k-tile's partial
product by the row's scale there.

Two forms (`FORMS`, key tag `_{form}` but for `v4`; `runtime/model/gpu/kernels.py:
QUANTIZE_ACT_FORM` picks one), the same numbers bit for bit:

- `v4` (untagged keys): one warp per (row, group): each lane loads 4 bf16 (8 bytes), the group's
  amax is a butterfly max over the warp, and each lane stores its 4 codes (4 bytes). One 8-byte
  load in flight per thread: it ran at 41-43 % of the H200's copy bandwidth (latency-bound);
- `v8`: half a warp per (row, group), each lane 8 bf16 (16-byte loads, 8-byte code stores), and
  each warp takes UNROLL pairs of groups with all their loads issued before the first is used
  (64 bytes in flight per thread), the amax a butterfly over the half warp. Consecutive items may
  belong to different rows, so loads and stores are predicated and the shuffles run on the whole
  warp. K must be a multiple of 8. Compiled, not yet run on a GPU.

Lane 0 of a group stores its scale. The scale and the quotient are IEEE fp32 divisions (`div.rn`,
no fast-math) and the code is `cvt.rn.satfinite` (round to nearest even, saturating at +-448), so
`reference` reproduces every code and scale bit for bit. K must be a multiple of the lane's
vector (each lane's vector is wholly inside K or wholly past it); a last partial group (K % 128 !=
0) has scale amax/448 of its columns and no codes past K.
"""

from typing import Any

import numpy as np

from .gemv_fp8 import e4m3_values
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "quantize_act"
GROUP = 128  # columns per activation scale (one k-tile of gemm_fp8_sm90)
WARPS = 8  # warps per CTA
E4M3_MAX = 448.0
# form -> (bf16 values per lane, group pairs per warp in flight): v4, one group per warp; v8, two
# groups per warp (16 lanes each), UNROLL pairs of them per warp.
FORMS = {"v4": (4, 1), "v8": (8, 4)}
DEFAULT_FORM = "v4"

# (name, K): the K of every FP8 linear of the 27B (gemv_fp8 / gemm_fp8_sm90 shapes: 5120 for
# gdn_in / attn_qkv / gate_up, 6144 for o_proj and the GDN out_proj, 17408 for down) and of the
# tiny fp8 model (256, 128 for its GDN out_proj, 512 for down), of the A3B models (2048; 4096 for
# o_proj), and 320 for tests (a partial group).
SHAPES = [("k5120", 5120), ("k6144", 6144), ("k17408", 17408), ("k2048", 2048), ("k4096", 4096), ("k128", 128),
          ("k256", 256), ("k512", 512), ("k320", 320)]


def groups(k: int) -> int:
    return -(-k // GROUP)


def e4m3_codes(values: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn codes as `cvt.rn.satfinite.e4m3x2.f32` gives them: the nearest finite
    value, ties to the even code (its mantissa's last bit 0), magnitudes past 448 saturated, the
    sign kept (-0 and negatives that round to 0 are 0x80)."""
    v = np.asarray(values, dtype=np.float32)
    table = e4m3_values(np.arange(0x7F, dtype=np.uint8))  # codes 0x00 .. 0x7E: increasing magnitudes
    mag = np.minimum(np.abs(v).astype(np.float64), E4M3_MAX)
    upper = np.minimum(np.searchsorted(table, mag, side="left"), 0x7E)
    lower = np.maximum(upper - 1, 0)
    below, above = mag - table[lower], table[upper] - mag
    code = np.where((below < above) | ((below == above) & (lower % 2 == 0)), lower, upper)
    return (code.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 7)).astype(np.uint8)


def items_per_cta(form: str) -> int:
    """(row, group) items one CTA quantises."""
    vec, unroll = FORMS[form]
    return WARPS * (32 * vec // GROUP) * unroll


def _variant(key: str, k: int, form: str) -> Variant:
    vec, unroll = FORMS[form]
    if k % vec:
        raise ValueError(f"quantize_act shape {key}: K = {k} must be a multiple of {vec} (one lane's vector)")
    kb = groups(k)
    config = {"K": k, "group": GROUP, "warps": WARPS, "form": form, "vec": vec, "unroll": unroll}
    return Variant(
        family=FAMILY,
        key=key if form == DEFAULT_FORM else f"{key}_{form}",
        config=config,
        params=[ptr("x"), ptr("q"), ptr("scale"), i32("M")],
        tensors={"x": tensor("bf16", "M", k), "q": tensor("e4m3", "M", k, role="out"),
                 "scale": tensor("f32", "M", kb, role="out")},
        sizes=("M",),
        block=(32 * WARPS, 1, 1),
        grid=(f"cdiv(M * {kb}, {items_per_cta(form)})", 1, 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // kb}"),  # item = row * KB + group stays an int32
        arches=ALL_ARCHES,
        note=f"bf16 x[M,{k}] -> e4m3 codes + fp32 scale per (row, 128 columns), form {form}",
        example_sizes={"M": 8192},
    )


def variants() -> list[Variant]:
    return [_variant(*s, form) for form in FORMS for s in SHAPES]


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] (bf16 values) -> (e4m3 codes uint8 [M, K], fp32 scales [M, cdiv(K, 128)]),
    with the kernel's fp32 operations and roundings."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    kb = groups(k)
    padded = np.zeros((m, kb * GROUP), dtype=np.float32)
    padded[:, :k] = x
    blocks = padded.reshape(m, kb, GROUP)
    scale = (np.abs(blocks).max(axis=2) / np.float32(E4M3_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))[:, :, None]
    quotient = np.where(scale[:, :, None] > 0, blocks / safe, np.float32(0.0)).astype(np.float32)
    codes = e4m3_codes(quotient).reshape(m, kb * GROUP)[:, :k]
    return np.ascontiguousarray(codes), scale


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    k = variant.config["K"]
    kb = groups(k)
    f32 = cutlass.Float32
    form = variant.config["form"]
    vec, unroll = FORMS[form]
    lanes = GROUP // vec  # lanes per group: 32 (v4) or 16 (v8)

    @cute.kernel
    def kernel(x: cute.Pointer, q: cute.Pointer, scale: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * WARPS + tid // 32
        lane = tid % 32
        row = item // kb
        group = item % kb
        col = group * GROUP + lane * 4
        if row < m:  # warp-uniform: the shuffles below see the whole warp
            vec4 = cute.make_layout((4,))
            values = cute.make_rmem_tensor((4,), f32)
            values.fill(0.0)
            if col < k:
                values.store(cute.make_tensor(x + cutlass.Int64(row) * k + col, vec4).load().to(f32))
            amax = f32(0.0)
            for i in cutlass.range_constexpr(4):
                amax = cute.arch.fmax(amax, cute.arch.fmax(values[i], -values[i]))
            for offset in (16, 8, 4, 2, 1):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
            s = amax / f32(E4M3_MAX)
            if lane == 0:
                cute.make_tensor(scale + cutlass.Int64(row) * kb + group, cute.make_layout(1))[0] = s
            if col < k:
                quotient = cute.make_rmem_tensor((4,), f32)
                for i in cutlass.range_constexpr(4):
                    quotient[i] = f32(0.0)
                    if s > f32(0.0):
                        quotient[i] = values[i] / s
                dst = cute.make_tensor(q + cutlass.Int64(row) * k + col, vec4)
                dst.store(quotient.load().to(cutlass.Float8E4M3FN))

    @cute.kernel
    def kernel_v8(x: cute.Pointer, q: cute.Pointer, scale: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % 32
        sub = lane % lanes  # the lane's place in its group
        total = m * kb
        # Warp w of CTA b takes items (b * WARPS + w) * 2 * unroll + 2 u + (lane // 16), u < unroll.
        first = (bid * WARPS + tid // 32) * (2 * unroll) + lane // lanes
        layout = cute.make_layout((vec,))
        rows, groups_, cols, values = [], [], [], []
        # Every load first (unroll 16-byte loads in flight per lane), then the groups one by one.
        for u in cutlass.range_constexpr(unroll):
            item = first + 2 * u
            row, group = item // kb, item % kb
            col = group * GROUP + sub * vec
            v = cute.make_rmem_tensor((vec,), f32)
            v.fill(0.0)
            if item < total and col < k:
                v.store(cute.make_tensor(x + cutlass.Int64(row) * k + col, layout).load().to(f32))
            rows.append(row)
            groups_.append(group)
            cols.append(col)
            values.append(v)
        for u in cutlass.range_constexpr(unroll):
            v = values[u]
            amax = f32(0.0)
            for i in cutlass.range_constexpr(vec):
                amax = cute.arch.fmax(amax, cute.arch.fmax(v[i], -v[i]))
            # Within each half warp (its group); every lane takes part, valid or not.
            for offset in (8, 4, 2, 1):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset))
            s = amax / f32(E4M3_MAX)
            if first + 2 * u < total:
                if sub == 0:
                    cute.make_tensor(scale + cutlass.Int64(rows[u]) * kb + groups_[u], cute.make_layout(1))[0] = s
                if cols[u] < k:
                    quotient = cute.make_rmem_tensor((vec,), f32)
                    for i in cutlass.range_constexpr(vec):
                        quotient[i] = f32(0.0)
                        if s > f32(0.0):
                            quotient[i] = v[i] / s
                    dst = cute.make_tensor(q + cutlass.Int64(rows[u]) * k + cols[u], layout)
                    dst.store(quotient.load().to(cutlass.Float8E4M3FN))

    chosen = kernel if form == "v4" else kernel_v8  # v4 keeps its entry name
    chosen.set_name_prefix(f"{_dsl.NAME_PREFIX}_quantize_act_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, q: cute.Pointer, scale: cute.Pointer, m: cutlass.Int32, stream: Any):
        chosen(x, q, scale, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    # q rows are K bytes: each lane's codes are aligned to their count (K % vec == 0), not 16.
    return launch, _dsl.example_args(variant, aligns={"q": vec, "x": 2 * vec})
