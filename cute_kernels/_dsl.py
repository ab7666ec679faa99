"""Helpers shared by the kernel families' `build()` functions (imports the CuTe DSL).

Only `build()` functions import this module, so the DSL is needed at build time only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import cuda.bindings.driver as cuda_driver
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

from runtime.cuda.expr import evaluate

from .variant import Variant

__all__ = ["dtype", "fake_ptr", "example_args", "grid", "stream", "warp_sum", "silu_f32", "sum_warp_partials",
           "gemv_lanes", "fill_k_slots", "NAME_PREFIX"]

NAME_PREFIX = "infx"


def dtype(name: str) -> type:
    """The DSL numeric type of a manifest dtype name."""
    return {
        "bf16": cutlass.BFloat16,
        "f16": cutlass.Float16,
        "f32": cutlass.Float32,
        "i32": cutlass.Int32,
        "i64": cutlass.Int64,
        "u8": cutlass.Uint8,
        "e4m3": cutlass.Float8E4M3FN,
    }[name]


def fake_ptr(dtype_name: str, align: int = 16) -> Any:
    """A global-memory pointer argument for compiling (its value is never used)."""
    return make_ptr(dtype(dtype_name), 0, cute.AddressSpace.gmem, assumed_align=align)


def stream() -> Any:
    return cuda_driver.CUstream(0)


def example_args(variant: Variant, aligns: Mapping[str, int] | None = None) -> list[Any]:
    """Compile-time arguments for a kernel whose launch function takes exactly its params.

    Pointers get 16-byte alignment (every buffer the runtime hands out is 256-byte aligned;
    a family may lower a buffer's promise with `aligns`), int32 params an Int32, f32 a Float32,
    and the CUDA stream comes last.
    """
    args: list[Any] = []
    for p in variant.params:
        if p.kind == "ptr":
            assert p.buffer is not None
            args.append(fake_ptr(variant.tensors[p.buffer].dtype, (aligns or {}).get(p.buffer, 16)))
        elif p.kind == "i32":
            args.append(cutlass.Int32(1))
        elif p.kind == "f32":
            args.append(cutlass.Float32(0.0))
        else:
            raise ValueError(f"{variant.name}: example_args cannot make a {p.kind} parameter")
    args.append(stream())
    return args


def grid(variant: Variant, env: Mapping[str, Any]) -> list[Any]:
    """The launch grid from the variant's formulas, evaluated on DSL values while tracing."""
    return [evaluate(g, env) for g in variant.grid]


def warp_sum(value: Any, width: int) -> Any:
    """Butterfly sum over groups of `width` consecutive lanes (width a power of two <= 32)."""
    offset = width // 2
    while offset >= 1:
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
        offset //= 2
    return value


def silu_f32(x: Any) -> Any:
    """x * sigmoid(x) in fp32."""
    return x / (cutlass.Float32(1.0) + cute.math.exp(-x, fastmath=True))


def gemv_lanes() -> tuple:
    """The GEMV kernels' thread layout and bf16 m16n8k16 MMA: (tid, bid, warp, r, q, mma, frag_a,
    frag_b), lane (r, q) = (lane / 4, lane % 4) as the MMA fragments place it."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    warp = tid // 32
    lane = tid % 32
    mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16)))
    frag_a = mma.make_fragment_A(mma.partition_shape_A((16, 16)))
    frag_b = mma.make_fragment_B(mma.partition_shape_B((8, 16)))
    return tid, bid, warp, lane // 4, lane % 4, mma, frag_a, frag_b


def fill_k_slots(frag_a: Any, frag_b: Any, a_lo: Any, a_hi: Any, b: Any, j: int) -> None:
    """One 16-deep MMA step of the GEMVs: the lane's physical columns 4j..4j+3 fill the
    fragments' K slots (2q, 2q+1, 2q+8, 2q+9) in A and B alike; rows r + 8 of A from `a_hi`
    (None: left as they are, for a half-height tile)."""
    frag_a[0] = a_lo[4 * j]
    frag_a[1] = a_lo[4 * j + 1]
    frag_a[4] = a_lo[4 * j + 2]
    frag_a[5] = a_lo[4 * j + 3]
    if a_hi is not None:
        frag_a[2] = a_hi[4 * j]
        frag_a[3] = a_hi[4 * j + 1]
        frag_a[6] = a_hi[4 * j + 2]
        frag_a[7] = a_hi[4 * j + 3]
    frag_b[0] = b[4 * j]
    frag_b[1] = b[4 * j + 1]
    frag_b[2] = b[4 * j + 2]
    frag_b[3] = b[4 * j + 3]


def acc_partials(acc: Any, r: Any, q: Any, warp: Any, rows: int, mb: int, warps: int) -> Any:
    """Shared memory [rows, mb, warps] holding this warp's m16n8 accumulator (one 16 x 8 tile:
    slots (row r, token 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1)), for
    `sum_warp_partials`."""
    smem = cutlass.memory.SmemAllocator()
    partial = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout((rows, mb, warps), stride=(1, rows, rows * mb)), byte_alignment=16
    )
    partial[r, 2 * q, warp] = acc[0]
    partial[r, 2 * q + 1, warp] = acc[1]
    partial[r + 8, 2 * q, warp] = acc[2]
    partial[r + 8, 2 * q + 1, warp] = acc[3]
    return partial


def sum_row_group_partials(accs: list, tid: Any, r: Any, q: Any, warp: Any, out: Any, ld: Any, row0: Any, m: Any,
                           count: Any, rows: int, mb: int, warps: int, row_groups: int,
                           row_scale: Any = None, scaled_rows: Any = None) -> None:
    """The epilogue of a GEMV whose warps hold `row_groups` x (mb / 8) m16n8 accumulators
    (`accs`, [row group][8-token group]; the wide decode variants of the quantised GEMVs): each
    row group's partials go through one shared [rows, mb, warps] buffer into `sum_warp_partials`,
    one (row, token) per thread, so mb = 32 takes two passes of 16 tokens and the groups follow
    one another (row group h at output row row0 + h * rows)."""
    groups = mb // 8
    smem = cutlass.memory.SmemAllocator()
    partial = smem.allocate_tensor(cutlass.Float32, cute.make_layout((rows, mb, warps), stride=(1, rows, rows * mb)),
                                   byte_alignment=16)
    per = min(mb, 32 * warps // rows)
    for h in range(row_groups):  # a plain helper: Python loops unroll while tracing
        if h > 0:
            cute.arch.sync_threads()  # every thread has added the previous group's partials
        for g in range(groups):
            # Accumulator slots: (row r, token 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1).
            acc = accs[h * groups + g]
            partial[r, g * 8 + 2 * q, warp] = acc[0]
            partial[r, g * 8 + 2 * q + 1, warp] = acc[1]
            partial[r + 8, g * 8 + 2 * q, warp] = acc[2]
            partial[r + 8, g * 8 + 2 * q + 1, warp] = acc[3]
        for p in range(mb // per):
            part = cute.make_tensor(partial.iterator + p * per * rows,
                                    cute.make_layout((rows, per, warps), stride=(1, rows, rows * mb)))
            sum_warp_partials(part, tid, out + cutlass.Int64(p * per) * ld, ld, row0 + h * rows, m - p * per,
                              count - h * rows, rows, per, warps, row_scale, scaled_rows)


@cute.jit
def sum_warp_partials(partial: Any, tid: Any, out: Any, ld: Any, row0: Any, m: Any, count: Any,
                      rows: cutlass.Constexpr, mb: cutlass.Constexpr, warps: cutlass.Constexpr,
                      row_scale: Any = None, scaled_rows: Any = None) -> None:
    """The GEMV epilogue: once every warp wrote its partial dot products to `partial` (shared
    memory, [rows, mb, warps]), thread tid < rows * mb adds row tid % rows of token tid // rows
    over the warps in warp order (a fixed order: a token's result does not depend on the others)
    and stores it as bf16 at out[token * ld + row0 + row], for tokens < m and rows < count.
    row_scale (fp32 per output row, NVFP4's global scale): the sum of an output row below
    `scaled_rows` is multiplied by it once before the rounding (rows past it: a BF16 tail)."""
    cute.arch.sync_threads()
    if tid < rows * mb:
        row = tid % rows
        token = tid // rows
        if token < m and row < count:
            total = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(warps):
                total = total + partial[row, token, i]
            if cutlass.const_expr(row_scale is not None):
                if row0 < scaled_rows:
                    total = total * cute.make_tensor(row_scale + row0 + row, cute.make_layout(1))[0]
            dst = cute.make_tensor(out + cutlass.Int64(token) * ld + row0 + row, cute.make_layout(1))
            dst[0] = total.to(cutlass.BFloat16)
