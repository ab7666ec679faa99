"""Paged K/V tiles into shared memory with cp.async, for the attention kernels' `build()` (imports
the CuTe DSL; only `build()` functions import this module).

A `@cute.jit` function at module level with every value an argument: the DSL does not stage a
call of a closure inside a runtime loop or `if`, and a K/V stream is loaded in one."""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

PAGE = 64  # keys per KV page (attention.PAGE)


@cute.jit
def load_kv_tile(tid: Any, s_kv: Any, k_pages: Any, v_pages: Any, trow: Any, start: Any, end: Any, kvh: Any,
                 it: Any, stage: Any, threads: cutlass.Constexpr, hkv: cutlass.Constexpr, d: cutlass.Constexpr,
                 bn: cutlass.Constexpr, stages: cutlass.Constexpr) -> None:
    """Keys start + it * bn .. + bn - 1 of KV head kvh (pools [NP * 64, hkv, d], page j of the
    sequence at trow[j]; bn divides the page) into `stage` of s_kv [bn, d, 2 * stages] (K at slot
    stage, V at stages + stage), 16 bytes per cp.async, 8 threads per 64 columns. Rows at or past
    `end` are written as zeros: the page may hold anything there, and 0 * NaN is not 0. A tile
    wholly past `end` is all zeros (its page looked up at the last key, so the table is never
    read past the sequence), which lets a pipeline issue its loads without a runtime `if`."""
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16,
                              num_bits_per_copy=128)
    gcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((threads // 8, 8), stride=(8, 1)),
                                    cute.make_layout((1, 8)))
    thr_g = gcopy.get_slice(tid)
    tile_rows = thr_g.partition_S(cute.make_identity_tensor((bn, d)))
    n0 = start + it * bn
    page = trow[cutlass.min(n0, end - 1) // PAGE]
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
