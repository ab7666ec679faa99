"""Decode GEMV for NVFP4 weights (W4A16): `out[M, :] = x[M, K] @ dequant(W)^T`, M = 1..8 (the wide
variants: up to 16 or 32, `WIDE_FORMS` below).

W is stored as the artifact keeps it (`nvfp4`, docs/artifact.md): e2m1 codes two per byte
`w[N, K / 2]` (column 2j in the low nibble), one e4m3 scale per 16 consecutive columns
`scale[N, K / 16]`, and an fp32 global scale, which the runner expands to one per row
(`gscale[N]`: a fused projection's parts have their own globals). `W[n, k] = e2m1(w[n, k]) *
e4m3(scale[n, k // 16]) * gscale[n]`. It keeps the structure of `gemv_fp8.py` (and `gemv.py`):

- the weights are the `mma.sync.m16n8k16` M side ("swap AB"): a CTA owns 16 rows, its 8 warps
  split the K / 128 column steps among themselves (one more or one less when they do not divide
  evenly; the tiny model's K = 128 leaves 7 warps idle);
- per step, lane (r, q) = (lane / 4, lane % 4) loads 32 contiguous columns of rows r and r + 8:
  16 bytes of codes and 2 scale bytes per row (the 32 columns are two 16-column scale blocks),
  and the same 32 columns of token r's activation (64 bytes);
- decode in registers (the `lut` form; `FORMS` below and `dequant.py` give the cheaper `shift`
  forms, whose scaled weights come out times 2^-7, undone exactly after the MMA): per 32-bit
  word of 8 codes, byte permutes (`prmt`) look the 3-bit magnitudes up in two constant tables
  (high and low bytes of the bf16 value), the sign bits are moved to bit 15 of each bf16 and the
  low / high bytes interleaved into bf16 pairs. The eight e2m1 magnitudes are exact in bf16;
- scale: each bf16 pair is multiplied by its block's e4m3 scale as a bf16 pair (`mul.bf16x2`).
  Exact: an e2m1 value has 2 significand bits and an e4m3 value 4, so the product needs at most
  6 of bf16's 8, and its exponent (2^-10 .. 2^11.4) is far inside bf16's range;
- the scaled weights feed eight MMAs per step with the K permutation of `gemv.py` (the same for
  A and B); each product of a bf16 activation and a scaled weight needs at most 14 significand
  bits (exact in fp32), and the MMA accumulates them in fp32 over the warp's whole K range;
- epilogue: the 8 warps' totals meet in shared memory, are added in a fixed order
  (deterministic), multiplied once by the row's fp32 global scale and rounded once to bf16.
  `reference(exact=False)` is this order of roundings (fp32 dot product of x and the exactly
  scaled weights, times the global scale in fp32, bf16).

A variant may carry a BF16 tail (`NT` rows read from `tail[NT, K]`, written after the NVFP4
rows): `tools.convert --recipe nvfp4` (and ModelOpt) keep the GDN `in_proj_b` / `in_proj_a` in
BF16, and the runner reads `[in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]` as one projection.
The tail's CTAs (a CTA-uniform branch) load bf16 rows and skip the global scale. Output rows are
`N + NT` wide. Tokens past M read token M - 1 again (valid memory); their MMA columns are never
stored. Rows past a tail CTA's last row read that row again.

Wide variants (`MB` 16 or 32, key `..._m32_r2u1_shift_u8`) serve verification steps as
`gemv_fp8.py`'s do, with its design and its argument that row t of a wide launch equals row t % 8
of the m8 launch over t's block of 8 bit for bit: one 8-token MMA column group per 8 tokens fed
the same decoded fragments in the same k16 order, R row groups of 16 per CTA, the epilogue adding
one row group's warp partials at a time in warp order and applying the global scale once.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .dequant import E2M1_UNDO
from .gemv_fp8 import MB, ROWS, SHAPES, SILU_SHAPES, WARPS, WIDE, WIDE_SHAPES, e4m3_values, weight_only_variant
from .variant import Variant, tensor

FAMILY = "gemv_nvfp4"
STEP = 128  # columns per warp step (4 lanes x 32 columns)
GROUP = 16  # columns per e4m3 scale
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# The shapes are `gemv_fp8.SHAPES`: `tools.convert --recipe nvfp4` (and NVIDIA's ModelOpt
# checkpoints) quantise the same projections as Qwen's FP8 release (lm_head, in_proj_b /
# in_proj_a stay BF16: gdn_in's tail).

# Forms (see gemv_fp8.FORMS): `lut` decodes with byte-permute tables, `shift` by bit placement
# (`dequant.py`: about half the integer instructions per code byte), `shift_x` by bit placement
# in an interleaved column order that the activations follow (half the byte permutes of `shift`).
# `shift_h`: `shift` with 8 rows per CTA (shapes without a BF16 tail): N = 5120 (o_proj, down)
# then makes 640 CTAs instead of 320, which 132 SMs holding 3 CTAs each take in far more even
# shares (320 CTAs leave some SMs 3 and others 2: the 3-CTA SMs set the time).
# `pfD` (PREFETCH): `shift_u8` (the same instructions, so bit for bit its numbers) plus, at each
# step, an L2 prefetch of the codes and scales D steps ahead (`prefetch.global.L2`: no register
# holds them). ptxas issues the loop's loads only about one step ahead (the PTX's order does not
# change that: it sinks loads issued earlier to save registers), and at 66-75 registers (3 CTAs,
# 24 warps an SM) that leaves ~24 KB of weights in flight per SM where the BF16 GEMV (44
# registers, 40 warps, 64-byte steps) keeps ~80 KB: by Little's law too little for the copy
# bandwidth. The prefetches keep D KB per warp in flight; the loads then wait on L2, not DRAM.
# `pf4_h`: `pf4` with 8 rows per CTA (`shift_h`'s grid) for the shapes without a tail.
FORMS = {"lut": ("lut", 4, ROWS), "shift": ("shift", 4, ROWS), "shift_u8": ("shift", 8, ROWS),
         "shift_x": ("shift_x", 4, ROWS), "shift_h": ("shift", 4, ROWS // 2),
         "pf2": ("shift", 8, ROWS), "pf4": ("shift", 8, ROWS), "pf8": ("shift", 8, ROWS),
         "pf4_h": ("shift", 8, ROWS // 2)}
PREFETCH = {"pf2": 2, "pf4": 4, "pf8": 8, "pf4_h": 4}  # form -> steps prefetched ahead


# Wide variants (MB 16 / 32: gemv_fp8's WIDE row-group forms and WIDE_SHAPES, its design and its
# proof that row t equals row t % 8 of the m8 launch bit for bit) in each of WIDE_FORMS: the
# runner's `shift_u8` and the prefetching `pf4`. Every form but `shift_x` gives the same sums, so
# the wide rows equal the m8 rows of any of them.
WIDE_FORMS = ("shift_u8", "pf4")
# The gate/up + SiLU variants (`gemv_fp8.SILU_SHAPES`, `_gemv_silu.py`) are built in the runner's form.
SILU_FORM = "shift_u8"


def _variant(name: str, n: int, nt: int, k: int, form: str, mb: int = MB, groups: int = 1,
             group_unroll: int = 0, silu: bool = False) -> Variant:
    if n % (ROWS * groups) or k % STEP:
        raise ValueError(f"gemv_nvfp4 shape {name}: N = {n} must be a multiple of {ROWS * groups} (rows per CTA) "
                         f"and K = {k} of {STEP}")
    weights = {"w": tensor("u8", n, k // 2), "scale": tensor("e4m3", n, k // GROUP), "gscale": tensor("f32", n)}
    return weight_only_variant(FAMILY, name, n, nt, k, k // STEP, weights, {"step": STEP},
                               f"nvfp4 W[{n},{k}]^T (e4m3 scale per 16, fp32 per row)", FORMS, form,
                               mb, groups, group_unroll, silu)


def variants() -> list[Variant]:
    out = [_variant(*shape, form) for shape in SHAPES for form in FORMS]
    for shape in SHAPES:
        if shape[0] in WIDE_SHAPES:
            out += [_variant(*shape, form, mb, groups, unroll)
                    for form in WIDE_FORMS for mb, forms in WIDE.items() for groups, unroll in forms]
        if shape[0] in SILU_SHAPES:
            out.append(_variant(*shape, SILU_FORM, silu=True))
    return out


def e2m1_values(packed: np.ndarray) -> np.ndarray:
    """Packed codes [N, K / 2] (column 2j in the low nibble) -> float64 values [N, K]."""
    p = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)
    return np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]


def nvfp4_values(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Packed codes [R, K / 2] and e4m3 scale codes [R, K / 16] -> float64 code x block scale
    [R, K] (exact in float64 and float32: 2 + 4 significand bits), without the global scale."""
    return e2m1_values(packed) * np.repeat(e4m3_values(scales), GROUP, axis=1)


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, gscale: np.ndarray,
              tail: np.ndarray | None = None, *, exact: bool = False) -> np.ndarray:
    """out[M, N + NT] for bf16-valued x [M, K], packed e2m1 codes [N, K / 2], e4m3 scale codes
    [N, K / 16] (uint8), fp32 per-row global scales [N] and an optional bf16-valued tail [NT, K].

    exact: float64 of the dequantised weights. Otherwise the kernel's roundings: code times block
    scale exactly (6 significand bits), the dot product in fp32 (products exact), times the
    row's fp32 global scale in fp32, rounded to bf16; the tail's rows in fp32, rounded to bf16."""
    n = codes.shape[0]
    k = codes.shape[1] * 2
    if scales.shape != (n, k // GROUP) or np.shape(gscale) != (n,):
        raise ValueError(f"nvfp4 reference: codes {codes.shape} need scales {(n, k // GROUP)} and gscale {(n,)}, "
                         f"got {scales.shape} and {np.shape(gscale)}")
    scaled = nvfp4_values(codes, scales)
    g = np.asarray(gscale, np.float32)
    if exact:
        out = x.astype(np.float64) @ (scaled * g.astype(np.float64)[:, None]).T
        if tail is not None:
            out = np.concatenate([out, x.astype(np.float64) @ tail.astype(np.float64).T], axis=1)
        return out
    dot = np.matmul(x.astype(np.float32), scaled.astype(np.float32).T, dtype=np.float32)
    out = dot * g[None, :]
    if tail is not None:
        out = np.concatenate([out, x.astype(np.float32) @ tail.astype(np.float32).T], axis=1)
    return round_bf16(out.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    from . import _dequant, _dsl, _gemv_silu

    n, nt, k = variant.config["N"], variant.config["NT"], variant.config["K"]
    unroll = variant.config["unroll"]
    silu = variant.config["silu"]
    mb, row_groups = variant.config["MB"], variant.config.get("groups", 1)
    groups = mb // 8  # 8-token MMA column groups
    ldo = n + nt
    steps = k // STEP
    per_warp, extra = steps // WARPS, steps % WARPS  # warps < extra take one more step
    rows = variant.config["rows"]  # rows per CTA: row_groups x 16, or 8 (`half`)
    half = rows < ROWS  # lanes load row r only; the MMA's rows r + 8 are zeros
    fp4_ctas = n // rows
    form = variant.config["decode"]
    ahead = PREFETCH.get(variant.config["form"], 0)  # steps prefetched to L2 ahead of the loads

    def mma_step(mma: Any, frag_a: Any, frag_b: Any, a_lo: list, a_hi: list, x_at: list, col: Any,
                 accs: list, decoded: bool) -> None:
        """One step's rows into accumulators [row group][token group] (a plain helper: Python
        loops unroll while tracing): token groups outermost (one activation fragment live at a
        time), each accumulator sees k16 steps 0..7 in order, as in the m8 variant. The
        activations follow the decode's column order for decoded NVFP4 rows
        (`_dequant.activations`), not for the BF16 tail's."""
        for g in range(groups):
            b = cute.make_tensor(x_at[g] + col, cute.make_layout((32,))).load()
            if decoded:
                b = _dequant.activations(form, b)
            for j in range(8):
                for h in range(row_groups):
                    _dsl.fill_k_slots(frag_a, frag_b, a_lo[h], a_hi[h], b, j)
                    cute.gemm(mma, accs[h * groups + g], frag_a, frag_b, accs[h * groups + g])

    def prefetch(w_lo: list, w_hi: list, s_lo: list, s_hi: list, c: Any) -> None:
        """L2 prefetches of step c's codes and scales (this lane's addresses: the lanes of a row
        cover its bytes of the step)."""
        for h in range(row_groups):
            cute.arch.prefetch((w_lo[h] + c * (STEP // 2)).llvm_ptr, cache_level="L2")
            cute.arch.prefetch((s_lo[h] + c * (STEP // GROUP)).llvm_ptr, cache_level="L2")
            if not half:
                cute.arch.prefetch((w_hi[h] + c * (STEP // 2)).llvm_ptr, cache_level="L2")
                cute.arch.prefetch((s_hi[h] + c * (STEP // GROUP)).llvm_ptr, cache_level="L2")

    def fp4_step(mma: Any, frag_a: Any, frag_b: Any, accs: list, w_lo: list, w_hi: list, s_lo: list, s_hi: list,
                 x_at: list, c: Any) -> None:
        a_lo = [_dequant.e2m1_row(form, w_lo[h] + c * (STEP // 2), s_lo[h] + c * (STEP // GROUP))
                for h in range(row_groups)]
        a_hi = [None if half else _dequant.e2m1_row(form, w_hi[h] + c * (STEP // 2), s_hi[h] + c * (STEP // GROUP))
                for h in range(row_groups)]
        mma_step(mma, frag_a, frag_b, a_lo, a_hi, x_at, c * STEP, accs, True)

    def bf16_step(mma: Any, frag_a: Any, frag_b: Any, accs: list, t_lo: list, t_hi: list, x_at: list,
                  c: Any) -> None:
        col = c * STEP
        a_lo = [cute.make_tensor(p + col, cute.make_layout((32,))).load() for p in t_lo]
        a_hi = [cute.make_tensor(p + col, cute.make_layout((32,))).load() for p in t_hi]
        mma_step(mma, frag_a, frag_b, a_lo, a_hi, x_at, col, accs, False)

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, tail: Any,
               out: cute.Pointer, m: cutlass.Int32):
        tid, bid, warp, r, q, mma, frag_a, frag_b = _dsl.gemv_lanes()
        accs = []  # [row group][token group]
        for _ in cutlass.range_constexpr(row_groups * groups):
            acc = mma.make_fragment_C(mma.partition_shape_C((16, 8)))
            acc.fill(0.0)
            accs.append(acc)
        first = warp * per_warp + cutlass.min(warp, extra)  # this warp's first step
        x_at = []
        for g in cutlass.range_constexpr(groups):
            x_at.append(x + cutlass.Int64(cutlass.min(g * 8 + r, m - 1)) * k + q * 32)
        row0 = bid * rows
        count = rows
        if cutlass.const_expr(half):
            for i in (2, 3, 6, 7):
                frag_a[i] = cutlass.BFloat16(0.0)
        if bid < fp4_ctas:
            w_lo, w_hi, s_lo, s_hi = [], [], [], []
            for h in cutlass.range_constexpr(row_groups):
                lo_row, hi_row = row0 + h * ROWS + r, row0 + h * ROWS + r + 8
                if cutlass.const_expr(silu):
                    lo_row, hi_row = _gemv_silu.gate_up_rows(bid, r, n)
                w_lo.append(w + cutlass.Int64(lo_row) * (k // 2) + q * 16)
                w_hi.append(w + cutlass.Int64(hi_row) * (k // 2) + q * 16)
                s_lo.append(scale + cutlass.Int64(lo_row) * (k // GROUP) + q * 2)
                s_hi.append(scale + cutlass.Int64(hi_row) * (k // GROUP) + q * 2)
            last = first + per_warp - 1  # the warp's last step (for the prefetch's clamp)
            if cutlass.const_expr(ahead > 0 and per_warp > 0):
                for c in cutlass.range_constexpr(1, ahead):  # steps first + 1 .. first + ahead - 1
                    prefetch(w_lo, w_hi, s_lo, s_hi, cutlass.min(first + c, last))
            for c in cutlass.range(first, first + per_warp, unroll=unroll):
                if cutlass.const_expr(ahead > 0):
                    # Past the warp's last step: that step again (an L2 hit, no stray addresses).
                    prefetch(w_lo, w_hi, s_lo, s_hi, cutlass.min(c + ahead, last))
                fp4_step(mma, frag_a, frag_b, accs, w_lo, w_hi, s_lo, s_hi, x_at, c)
            if cutlass.const_expr(extra > 0):
                if warp < extra:
                    fp4_step(mma, frag_a, frag_b, accs, w_lo, w_hi, s_lo, s_hi, x_at, first + per_warp)
            if cutlass.const_expr(form != "lut"):
                for acc in accs:
                    for i in cutlass.range_constexpr(4):  # the decode's 2^-7, exactly (dequant.py)
                        acc[i] = acc[i] * E2M1_UNDO
        if cutlass.const_expr(nt > 0):
            if bid >= fp4_ctas:
                t0 = (bid - fp4_ctas) * rows
                count = cutlass.min(nt - t0, rows)
                t_lo, t_hi = [], []
                for h in cutlass.range_constexpr(row_groups):
                    t_lo.append(tail + cutlass.Int64(t0 + cutlass.min(h * ROWS + r, count - 1)) * k + q * 32)
                    t_hi.append(tail + cutlass.Int64(t0 + cutlass.min(h * ROWS + r + 8, count - 1)) * k + q * 32)
                for c in cutlass.range(first, first + per_warp, unroll=unroll):
                    bf16_step(mma, frag_a, frag_b, accs, t_lo, t_hi, x_at, c)
                if cutlass.const_expr(extra > 0):
                    if warp < extra:
                        bf16_step(mma, frag_a, frag_b, accs, t_lo, t_hi, x_at, first + per_warp)
                row0 = n + t0
        if cutlass.const_expr(silu):
            partial = _dsl.acc_partials(accs[0], r, q, warp, ROWS, MB, WARPS)
            _gemv_silu.silu_pairs(partial, tid, out, n // 2, bid * _gemv_silu.PAIRS, m, MB, WARPS, gscale, n // 2)
        elif cutlass.const_expr(mb == MB):
            partial = _dsl.acc_partials(accs[0], r, q, warp, ROWS, MB, WARPS)
            # The global scale once per NVFP4 row after the warps' fixed-order sum, one bf16 rounding.
            _dsl.sum_warp_partials(partial, tid, out, ldo, row0, m, count, ROWS, MB, WARPS, gscale, n)
        else:  # the wide variants (as gemv_fp8's)
            _dsl.sum_row_group_partials(accs, tid, r, q, warp, out, ldo, row0, m, count, ROWS, mb, WARPS, row_groups,
                                        gscale, n)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gemv_nvfp4_{variant.key}")

    if nt:
        @cute.jit
        def launch(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, tail: cute.Pointer,
                   out: cute.Pointer, m: cutlass.Int32, stream: Any):
            kernel(x, w, scale, gscale, tail, out, m).launch(grid=_dsl.grid(variant, {"M": m}),
                                                             block=list(variant.block), stream=stream)
    else:
        @cute.jit
        def launch(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, out: cute.Pointer,
                   m: cutlass.Int32, stream: Any):
            kernel(x, w, scale, gscale, None, out, m).launch(grid=_dsl.grid(variant, {"M": m}),
                                                             block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
