"""The CuTe DSL code of the `moe` family's NVFP4 expert kernels, `up_nvfp4` and `down_nvfp4`: `up`
and `down` (moe_kernels.py) with the expert stacks stored as NVFP4 (`weights.Slot` of format
`nvfp4`: packed e2m1 codes [rows, K / 2] (column 2j in the low nibble), e4m3 block scales
[rows, K / 16], fp32 global scales [rows], one per row: each expert's gate, up and down tensors
keep their own global, repeated over their rows). The routing (`logits`, `route`) and its buffers
are the BF16 path's, unchanged.

A dot product over K columns is split over L = min(32, K / 32) lanes (cute_kernels/moe.py
`nvfp4_lanes`): lane j reads chunks c of 32 columns at column (c * L + j) * 32, i.e. 16 code bytes
and the chunk's two scale bytes, and the same 32 columns of x (or act). A warp so works on 32 / L
rows at once (the tiny model's H = 256 gives L = 8, its I = 64 L = 2).

Decode and rounding model: the chunk is decoded by the NVFP4 GEMV's `lut` decoder
(`_dequant.e2m1_row`): each e2m1 code becomes its exact bf16 value and is multiplied by its
16-column block's e4m3 scale as a bf16 pair, exact (2 + 4 significand bits, exponent far inside
bf16's). Each product of a bf16 activation and such a weight is exact in fp32 (at most 14
significand bits); a chunk's 32 products are summed in fp32, the chunks added to the lane's fp32
total, the lanes' totals meet through the butterfly, and the total is multiplied once by the
row's fp32 global scale (rounded to fp32). That is `gemv_nvfp4.reference(exact=False)`'s order of
roundings: the fp32 dot product of x and the exactly scaled weights, times the global in fp32.
No weight is rounded to bf16 (prefill's dequantised copy is, once: `dequant_nvfp4`). Everything
after the dot products (bf16 roundings of g and u, SwiGLU, the routing weights, the fixed slot
order of `down`) is `up`'s and `down`'s.
"""

from typing import Any

from .moe import WARPS, nvfp4_lanes
from .moe_kernels import _at, _expert
from .variant import Variant

CHUNK = 32  # columns per lane read: one `e2m1_row` (16 code bytes, 2 scale bytes)
GROUP = 16  # columns per e4m3 block scale


def build(variant: Variant) -> tuple[Any, list[Any]]:
    return {"up_nvfp4": _up_nvfp4, "down_nvfp4": _down_nvfp4}[variant.config["kind"]](variant)


def _load_chunks(row: Any, count: int, lanes: int, j: Any) -> list:
    """This lane's `count` fp32 chunks of a bf16 row (chunk c at column (c * lanes + j) * 32)."""
    import cutlass
    import cutlass.cute as cute

    return [cute.make_tensor(row + (c * lanes + j) * CHUNK, cute.make_layout((CHUNK,))).load().to(cutlass.Float32)
            for c in range(count)]


def _dot_nvfp4(x_chunks: list, codes_row: Any, scale_row: Any, gscale: Any, lanes: int, j: Any) -> Any:
    """x . dequant(w_row) over the row's `lanes` lanes (butterfly order), times the row's global
    scale: lane j's chunks c at column (c * lanes + j) * 32, each decoded exactly to bf16."""
    import cutlass
    import cutlass.cute as cute

    from . import _dequant, _dsl

    f32 = cutlass.Float32
    acc = f32(0.0)
    for c in range(len(x_chunks)):  # a plain helper: unrolled while tracing
        chunk = c * lanes + j
        w = _dequant.e2m1_row("lut", codes_row + chunk * (CHUNK // 2), scale_row + chunk * (CHUNK // GROUP))
        acc = acc + (x_chunks[c] * w.load().to(f32)).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
    return _dsl.warp_sum(acc, lanes) * gscale


def _row(w: Any, scale: Any, gscale: Any, r: Any, k: int) -> tuple[Any, Any, Any]:
    """Row r of a stack: its code bytes, its block scales and its global scale."""
    import cutlass

    r = cutlass.Int64(r)
    return w + r * (k // 2), scale + r * (k // GROUP), _at(gscale, r)[0]


def _up_nvfp4(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, h, inter, p, features = cfg["E"], cfg["H"], cfg["I"], cfg["P"], cfg["features"]
    lanes = nvfp4_lanes(h)
    groups = 32 // lanes  # features a warp works on at once
    chunks = h // (CHUNK * lanes)
    per_warp = features // WARPS
    iters = per_warp // groups
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, ids: cute.Pointer,
               act: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        slot, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        group, j = lane // lanes, lane % lanes
        row = slot // p
        expert = _expert(ids, slot, e)
        xs = _load_chunks(x + cutlass.Int64(row) * h, chunks, lanes, j)
        first = cutlass.Int64(expert) * (2 * inter)  # the expert's first row in the stack
        for t in cutlass.range_constexpr(iters):
            f = tile * features + warp * per_warp + t * groups + group
            g = _dot_nvfp4(xs, *_row(w, scale, gscale, first + f, h), lanes, j).to(bf16).to(f32)
            u = _dot_nvfp4(xs, *_row(w, scale, gscale, first + inter + f, h), lanes, j).to(bf16).to(f32)
            s = _dsl.silu_f32(g).to(bf16).to(f32)
            if j == 0:
                _at(act, slot * inter + f)[0] = (s * u).to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, ids: cute.Pointer,
               act: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(x, w, scale, gscale, ids, act, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                        stream=stream)

    return launch, _dsl.example_args(variant)


def _down_nvfp4(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, h, inter, p, rows = cfg["E"], cfg["H"], cfg["I"], cfg["P"], cfg["rows_per_warp"]
    lanes = nvfp4_lanes(inter)
    groups = 32 // lanes  # rows a warp works on at once
    chunks = inter // (CHUNK * lanes)
    iters = rows // groups
    features = WARPS * rows  # per CTA
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(act: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, ids: cute.Pointer,
               wts: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
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
            xs = _load_chunks(act + cutlass.Int64(slot) * inter, chunks, lanes, j)
            for it in cutlass.range_constexpr(iters):
                r = cutlass.Int64(expert) * h + first + it * groups  # the weight row in the stack
                accs[it] = accs[it] + weight * _dot_nvfp4(xs, *_row(w, scale, gscale, r, inter), lanes, j)
        for it in cutlass.range_constexpr(iters):
            if j == 0:
                _at(out, row * h + first + it * groups)[0] = accs[it].to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(act: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, ids: cute.Pointer,
               wts: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(act, w, scale, gscale, ids, wts, out, m).launch(grid=_dsl.grid(variant, {"M": m}),
                                                               block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
