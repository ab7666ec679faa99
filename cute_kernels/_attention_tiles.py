"""Building blocks of the mma.sync attention kernels (`attention_prefill`, `attention_decode_mma`):
views of an m16n8 accumulator for a row-wise softmax, the quad reduction over a row's lanes, and
paged K/V tiles into shared memory with cp.async. Imports the CuTe DSL: only `build()` functions
import this module.

`load_kv_tile` is a `@cute.jit` function at module level with every value an argument: the DSL
does not stage a call of a closure inside a runtime loop or `if`, and a K/V stream is loaded in
one."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

PAGE = 64  # keys per KV page (attention.PAGE)


def acc_rows_cols(t: Any) -> Any:
    """An mma.sync m16n8 accumulator ((2, 2), MMA_M, MMA_N) seen as (rows, cols) of this thread
    (the row-wise softmax walks it so)."""
    lay = cute.make_layout(t.layout.shape)
    mn = cute.make_layout(((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[2])),
                          stride=((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


def acc_as_a_operand(t: Any) -> Any:
    """Accumulator-shaped bf16 P ((2, 2), MMA_M, MMA_N) as the A operand ((2, 2, 2), MMA_M, MMA_N / 2)
    of the next k16 product (two n8 accumulator tiles form one k16 A tile)."""
    div = cute.logical_divide(t.layout, (None, None, 2))
    lay = cute.make_layout(((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
                           stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]))
    return cute.make_tensor(t.iterator, lay)


def quad_reduce(v: Any, op: Any) -> Any:
    """op over the 4 lanes of an mma.sync accumulator row (lanes 4r..4r+3)."""
    v = op(v, cute.arch.shuffle_sync_bfly(v, offset=2))
    return op(v, cute.arch.shuffle_sync_bfly(v, offset=1))


def tile_page(trow: Any, start: Any, end: Any, it: Any, bn: int) -> Any:
    """The page (the sequence's page table row `trow`) holding keys start + it * bn .. + bn - 1
    (bn divides the page); a tile wholly past `end` takes the page of the last key, so the table
    is never read past the sequence. A pipeline reads it an iteration ahead of the tile's copies:
    read after the barrier before them, its latency held the copies back (ncu on the H200: the
    FP8-KV decode kernel's second stall, after the wait for the tile itself)."""
    return trow[cutlass.min(start + it * bn, end - 1) // PAGE]


@cute.jit
def load_kv_tile(tid: Any, s_kv: Any, k_pages: Any, v_pages: Any, page: Any, start: Any, end: Any, kvh: Any,
                 it: Any, stage: Any, threads: cutlass.Constexpr, hkv: cutlass.Constexpr, d: cutlass.Constexpr,
                 bn: cutlass.Constexpr, stages: cutlass.Constexpr) -> None:
    """Keys start + it * bn .. + bn - 1 of KV head kvh (pools [NP * 64, hkv, d]; `page` the tile's
    page, `tile_page`) into `stage` of s_kv [bn, d, 2 * stages] (K at slot stage, V at stages +
    stage), 16 bytes per cp.async, 8 threads per 64 columns. Rows at or past `end` are written as
    zeros: the page may hold anything there, and 0 * NaN is not 0. A tile wholly past `end` is all
    zeros, which lets a pipeline issue its loads without a runtime `if`."""
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16,
                              num_bits_per_copy=128)
    gcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((threads // 8, 8), stride=(8, 1)),
                                    cute.make_layout((1, 8)))
    thr_g = gcopy.get_slice(tid)
    tile_rows = thr_g.partition_S(cute.make_identity_tensor((bn, d)))
    n0 = start + it * bn
    row0 = (cutlass.Int64(page) * PAGE + n0 % PAGE) * hkv + kvh
    for pool_index in cutlass.range_constexpr(2):
        pool = k_pages if pool_index == 0 else v_pages
        src = cute.make_tensor(pool + cute.assume(row0 * d, divby=8), cute.make_layout((bn, d), stride=(hkv * d, 1)))
        tsrc = thr_g.partition_S(src)
        tdst = thr_g.partition_D(s_kv[None, None, pool_index * stages + stage])
        for i in cutlass.range_constexpr(cute.size(tdst.shape[1])):
            if n0 + tile_rows[0, i, 0][0] < end:
                cute.copy(gcopy, tsrc[None, i, None], tdst[None, i, None])
            else:
                tdst[None, i, None].fill(0)


def wgmma_row_of(i: int) -> int:
    """Which of its two rows (r, r + 8) value i of a thread's WGMMA accumulator belongs to (per
    thread: 2 adjacent columns of 2 rows 8 apart per 8-column group)."""
    return (i // 2) % 2


def wgmma_o_to_smem(acc_o: Any, row_sum: Any, o_coords: Any, s_o: Any, o_vals: int) -> None:
    """The WGMMA kernels' O / row sum, rounded to bf16 into the shared tile s_o [bm, d] (the Q
    buffer), then a CTA barrier so `store_gated_rows` may read any row. row_sum holds the thread's
    two rows' sums (`wgmma_row_of`)."""
    for h in range(2):
        row_sum[h] = cutlass.Float32(1.0) / row_sum[h]
    for i in range(o_vals):
        r, c = o_coords[i]
        s_o[r, c] = (acc_o[i] * row_sum[wgmma_row_of(i)]).to(cutlass.BFloat16)
    cute.arch.sync_threads()


@cute.jit
def store_gated_rows(tid: Any, s_o: Any, x: Any, out: Any, m0: Any, m: Any, head: Any, threads: cutlass.Constexpr,
                     hq: cutlass.Constexpr, d: cutlass.Constexpr, stride: cutlass.Constexpr,
                     bm: cutlass.Constexpr) -> None:
    """The prefill attention epilogue of query rows m0 .. m0 + bm - 1 (those below m) of one head:
    out[row, head] = O[row] * bf16(sigmoid(gate[row])), O the bf16 tile s_o [bm, d] in shared
    memory, the gate the second half of the head's 2 d columns of x (rows `stride` apart); 16
    bytes a thread per copy, 8 threads per 64 columns, so the stores coalesce."""
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), bf16, num_bits_per_copy=128)
    thr_g = cute.make_tiled_copy_tv(g2s, cute.make_layout((threads // 8, 8), stride=(8, 1)),
                                    cute.make_layout((1, 8))).get_slice(tid)
    rows = thr_g.partition_S(cute.make_identity_tensor((bm, d)))
    g_gate = cute.make_tensor(x + cute.assume(cutlass.Int64(m0) * stride + head * 2 * d + d, divby=8),
                              cute.make_layout((bm, d), stride=(stride, 1)))
    g_out = cute.make_tensor(out + cute.assume((cutlass.Int64(m0) * hq + head) * d, divby=8),
                             cute.make_layout((bm, d), stride=(hq * d, 1)))
    t_o, t_gate, t_out = thr_g.partition_S(s_o), thr_g.partition_S(g_gate), thr_g.partition_S(g_out)
    for i in cutlass.range_constexpr(cute.size(t_o.shape[1])):
        if m0 + rows[0, i, 0][0] < m:
            o = t_o[None, i, None].load().to(f32)
            g = t_gate[None, i, None].load().to(f32)
            sig = (f32(1.0) / (f32(1.0) + cute.math.exp(-g, fastmath=True))).to(bf16).to(f32)
            t_out[None, i, None].store((o * sig).to(bf16))
