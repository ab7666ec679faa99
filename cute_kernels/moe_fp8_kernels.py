"""The CuTe DSL code of the `moe` family's FP8 expert kernels, `up_fp8` and `down_fp8`: `up` and
`down` (moe_kernels.py) with the expert stacks stored as block-scaled e4m3 codes
(`weights.Slot`: codes [rows, K], then fp32 scales [rows / BR, cdiv(K, 128)], BR = the slot's
`block_rows`). The routing (`logits`, `route`) and its buffers are the BF16 path's, unchanged.

Each lane reads its 8-column vectors of a weight row as in the BF16 kernels (vector c at column
(c * lanes + j) * 8, so the act / x vectors are the same), here as 8 code bytes. The codes become
fp32 exactly (e4m3 has 4 significant bits and exponents inside fp32's), the vector's 8 products
are summed in fp32 unscaled, and that partial times its 128-column block's scale is added to the
lane's fp32 total: a vector never spans two blocks (8 divides 128), so this is the dequantised
weights' dot product with the scale applied per partial sum and no weight rounded to bf16 (the
FP8 GEMV's rule, cute_kernels/gemv_fp8.py). The lanes' totals meet through the same butterfly,
and everything after the dot products (bf16 roundings of g and u, SwiGLU, the routing weights,
the fixed slot order of `down`) is `up`'s and `down`'s.
"""

from typing import Any

from .moe import UP_FEATURES, WARPS, lanes_per_row
from .moe_kernels import _at, _expert, _load_vecs
from .variant import Variant

BLOCK = 128  # scale block columns


def build(variant: Variant) -> tuple[Any, list[Any]]:
    return {"up_fp8": _up_fp8, "down_fp8": _down_fp8}[variant.config["kind"]](variant)


def _dot_fp8(x_vecs: list, codes_row: Any, scale_row: Any, lanes: int, j: Any) -> Any:
    """x . dequant(w_row) over the row's `lanes` lanes (butterfly order): lane j's vectors c at
    column (c * lanes + j) * 8, each one's fp32 partial times its block's scale."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    f32 = cutlass.Float32
    acc = f32(0.0)
    for c in range(len(x_vecs)):  # a plain helper: unrolled while tracing
        col = (c * lanes + j) * 8
        w = cute.make_tensor(codes_row + col, cute.make_layout((8,))).load().to(cutlass.BFloat16).to(f32)
        partial = (x_vecs[c] * w).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
        acc = acc + partial * _at(scale_row, col // BLOCK)[0]
    return _dsl.warp_sum(acc, lanes)


def _up_fp8(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, h, inter, p, br = cfg["E"], cfg["H"], cfg["I"], cfg["P"], cfg["block_rows"]
    kb = -(-h // BLOCK)
    vecs = h // 256
    per_warp = UP_FEATURES // WARPS
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, ids: cute.Pointer, act: cute.Pointer,
               m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        slot, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        row = slot // p
        expert = _expert(ids, slot, e)
        xs = _load_vecs(x + cutlass.Int64(row) * h, vecs, 32, lane)
        first = cutlass.Int64(expert) * (2 * inter)  # the expert's first row in the stack
        for t in cutlass.range_constexpr(per_warp):
            f = tile * UP_FEATURES + warp * per_warp + t
            g = _dot_fp8(xs, w + (first + f) * h, scale + ((first + f) // br) * kb, 32, lane).to(bf16).to(f32)
            u = _dot_fp8(xs, w + (first + inter + f) * h, scale + ((first + inter + f) // br) * kb, 32,
                         lane).to(bf16).to(f32)
            s = _dsl.silu_f32(g).to(bf16).to(f32)
            if lane == 0:
                _at(act, slot * inter + f)[0] = (s * u).to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, ids: cute.Pointer, act: cute.Pointer,
               m: cutlass.Int32, stream: Any):
        kernel(x, w, scale, ids, act, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                stream=stream)

    return launch, _dsl.example_args(variant)


def _down_fp8(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, h, inter, p, rows, br = cfg["E"], cfg["H"], cfg["I"], cfg["P"], cfg["rows_per_warp"], cfg["block_rows"]
    kb = -(-inter // BLOCK)
    lanes = lanes_per_row(inter)
    groups = 32 // lanes  # rows a warp works on at once
    vecs = inter // (8 * lanes)
    iters = rows // groups
    features = WARPS * rows  # per CTA
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(act: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer,
               out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        group, j = lane // lanes, lane % lanes
        first = tile * features + warp * rows + group  # this lane group's feature in iteration 0
        accs = [f32(0.0) for _ in range(iters)]
        for s in cutlass.range_constexpr(p):
            slot = row * p + s
            expert = _expert(ids, slot, e)
            weight = _at(wts, slot)[0]
            xs = _load_vecs(act + cutlass.Int64(slot) * inter, vecs, lanes, j)
            for it in cutlass.range_constexpr(iters):
                r = cutlass.Int64(expert) * h + first + it * groups  # the weight row in the stack
                accs[it] = accs[it] + weight * _dot_fp8(xs, w + r * inter, scale + (r // br) * kb, lanes, j)
        for it in cutlass.range_constexpr(iters):
            if j == 0:
                _at(out, row * h + first + it * groups)[0] = accs[it].to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(act: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer,
               out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(act, w, scale, ids, wts, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                       stream=stream)

    return launch, _dsl.example_args(variant)
