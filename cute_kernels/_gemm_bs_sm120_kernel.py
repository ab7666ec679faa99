"""The CuTe DSL kernel of `gemm_bs_sm120` (layouts, tiles and numerics: that module's docstring).
Imports the CuTe DSL: only `gemm_bs_sm120.build` imports this module.

Both kinds share everything but the MMA: the cp.async ring of 128-byte operand rows, the
fragment loads from shared memory and the bf16 epilogue. `nvfp4` feeds the block-scaled
`mma.sync ... kind::mxf4nvf4 ... m16n8k64` its e4m3 scales from shared memory and applies the
fp32 globals once at the end; `fp8` runs `mma.sync ... m16n8k32 .e4m3` into a fresh fragment per
128-column k-tile and adds it into the accumulator times the two fp32 block scales.

`load_stage` is a module-level `@cute.jit` function with every value an argument: the DSL does not
stage a call of a closure inside a runtime loop, and the ring is refilled inside one.
"""

from __future__ import annotations

from typing import Any

import cutlass
from cutlass import cute
from cutlass.cute.nvgpu import cpasync, warp

ROW_WORDS = 32  # an operand row of a k-tile: 128 bytes = 32 words = 8 chunks of 16 bytes


def swizzled(row: Any, chunk: Any, word: Any) -> Any:
    """Word offset of (row, 16-byte chunk, word in chunk) in a [rows, 128 bytes] tile: chunk c of
    row r lies at chunk c ^ (r % 8), so the 8 rows r = 0..7 a fragment load reads at once (lane
    r * 4 + q reads word q of one chunk of row r) hit 32 distinct banks."""
    return row * ROW_WORDS + ((chunk ^ (row % 8)) * 4 + word)


@cute.jit
def load_stage(tid: Any, m: Any, m0: Any, n0: Any, kt: Any, stage: Any, x: Any, w: Any, xs: Any, ws: Any,
               s_x: Any, s_w: Any, s_xs: Any, s_ws: Any, bm: cutlass.Constexpr, bn: cutlass.Constexpr,
               row_words: cutlass.Constexpr, scale_words: cutlass.Constexpr, threads: cutlass.Constexpr,
               scaled: cutlass.Constexpr) -> None:
    """cp.async k-tile kt of the CTA's x rows m0.. (rows past M read row M - 1 again: valid memory,
    and their results are never stored) and w rows n0.. into ring slot `stage`, 16 bytes per copy;
    with `scaled` also the k-tile's 16 bytes of e4m3 block scales per row (NVFP4). Operand and
    scale pointers are int32 views; row_words / scale_words: a global row's length in words."""
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.Int32,
                              num_bits_per_copy=128)
    chunk_layout = cute.make_layout(4)
    for i in cutlass.range_constexpr(bm * 8 // threads):
        c = tid + i * threads
        row, chunk = c // 8, c % 8
        src_row = cutlass.Int64(cutlass.min(m0 + row, m - 1))
        src = cute.make_tensor(x + cute.assume(src_row * row_words + kt * ROW_WORDS + chunk * 4, divby=4),
                               chunk_layout)
        dst = cute.make_tensor(s_x.iterator + cute.assume(stage * bm * ROW_WORDS + swizzled(row, chunk, 0), divby=4),
                               chunk_layout)
        cute.copy(g2s, src, dst)
    for i in cutlass.range_constexpr(bn * 8 // threads):
        c = tid + i * threads
        row, chunk = c // 8, c % 8
        src = cute.make_tensor(w + cute.assume(cutlass.Int64(n0 + row) * row_words + kt * ROW_WORDS + chunk * 4,
                                               divby=4), chunk_layout)
        dst = cute.make_tensor(s_w.iterator + cute.assume(stage * bn * ROW_WORDS + swizzled(row, chunk, 0), divby=4),
                               chunk_layout)
        cute.copy(g2s, src, dst)
    if cutlass.const_expr(scaled):
        # One 16-byte chunk (16 e4m3 scales = one k-tile of 256 columns) per row and thread.
        if tid < bm:
            src_row = cutlass.Int64(cutlass.min(m0 + tid, m - 1))
            src = cute.make_tensor(xs + cute.assume(src_row * scale_words + kt * 4, divby=4), chunk_layout)
            dst = cute.make_tensor(s_xs.iterator + cute.assume((stage * bm + tid) * 4, divby=4), chunk_layout)
            cute.copy(g2s, src, dst)
        for i in cutlass.range_constexpr(bn // threads):
            row = tid + i * threads
            src = cute.make_tensor(ws + cute.assume(cutlass.Int64(n0 + row) * scale_words + kt * 4, divby=4),
                                   chunk_layout)
            dst = cute.make_tensor(s_ws.iterator + cute.assume((stage * bn + row) * 4, divby=4), chunk_layout)
            cute.copy(g2s, src, dst)


def build(cfg: dict, name_prefix: str, grid: Any) -> Any:
    """The launch function of one variant's config (`gemm_bs_sm120._variant`); grid: the launch
    grid from {"M": m} while tracing."""
    kind, n, k = cfg["kind"], cfg["N"], cfg["K"]
    bm, bn, stages, threads = cfg["BM"], cfg["BN"], cfg["stages"], cfg["threads"]
    scaled = kind == "nvfp4"
    f32, bf16, i32 = cutlass.Float32, cutlass.BFloat16, cutlass.Int32
    k_bytes = k // 2 if scaled else k  # an operand row in global memory
    k_tiles = k_bytes // 128
    row_words, scale_words = k_bytes // 4, k // 16 // 4
    warp_m, warp_n = bm // 2, bn // 2  # 2 x 2 warps
    atoms_m, atoms_n = warp_m // 16, warp_n // 8
    k_steps = 4  # MMAs per k-tile along K: 32 bytes each (k32 e4m3 or k64 e2m1)
    if scaled:
        op = warp.MmaMXF4NVF4Op(cutlass.Float4E2M1FN, f32, cutlass.Float8E4M3FN)
        ab, ab_k = cutlass.Float4E2M1FN, 64
    else:
        op = warp.MmaFP8Op(cutlass.Float8E4M3FN, f32, (16, 8, 32))
        ab, ab_k = cutlass.Float8E4M3FN, 32

    @cute.jit
    def body(x: cute.Pointer, x_scale: cute.Pointer, x_gscale: cute.Pointer, w: cute.Pointer,
             w_scale: cute.Pointer, w_gscale: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        n0, m0 = bx * bn, by * bm
        wid, lane = tid // 32, tid % 32
        r, q = lane // 4, lane % 4
        wr0 = (wid % 2) * warp_m  # the warp's first row and column in the tile
        wc0 = (wid // 2) * warp_n

        smem = cutlass.utils.SmemAllocator()
        s_x = smem.allocate_tensor(i32, cute.make_layout(stages * bm * ROW_WORDS), byte_alignment=128)
        s_w = smem.allocate_tensor(i32, cute.make_layout(stages * bn * ROW_WORDS), byte_alignment=128)
        s_xs, s_ws = s_x, s_w  # the FP8 kind has no scale tiles (its scales are per k-tile: registers)
        if cutlass.const_expr(scaled):
            s_xs = smem.allocate_tensor(i32, cute.make_layout(stages * bm * 4), byte_alignment=16)
            s_ws = smem.allocate_tensor(i32, cute.make_layout(stages * bn * 4), byte_alignment=16)
        gx, gw = cute.recast_ptr(x, dtype=i32), cute.recast_ptr(w, dtype=i32)
        gxs, gws = gx, gw
        if cutlass.const_expr(scaled):
            gxs, gws = cute.recast_ptr(x_scale, dtype=i32), cute.recast_ptr(w_scale, dtype=i32)

        mma = cute.make_tiled_mma(op)
        frag_a = [cute.make_rmem_tensor(mma.partition_shape_A((16, ab_k)), ab) for _ in range(atoms_m)]
        frag_b = [cute.make_rmem_tensor(mma.partition_shape_B((8, ab_k)), ab) for _ in range(atoms_n)]
        words_a = [cute.recast_tensor(t, i32) for t in frag_a]
        words_b = [cute.recast_tensor(t, i32) for t in frag_b]
        acc = [[cute.make_rmem_tensor(mma.partition_shape_C((16, 8)), f32) for _ in range(atoms_n)]
               for _ in range(atoms_m)]
        for i in cutlass.range_constexpr(atoms_m):
            for j in cutlass.range_constexpr(atoms_n):
                acc[i][j].fill(0.0)
        # The block-scaled MMA's scale operands: one word of 4 e4m3 scales (the 4 16-column blocks
        # of the k64 step) of row r + 8 * (lane % 2) of the A atom and of column r of the B atom.
        sf_layout = cute.make_layout(((16, 4), 1, 1), stride=((0, 1), 0, 0))
        sf_a = [cute.make_rmem_tensor(sf_layout, cutlass.Float8E4M3FN) for _ in range(atoms_m)]
        sf_b = [cute.make_rmem_tensor(sf_layout, cutlass.Float8E4M3FN) for _ in range(atoms_n)]
        part = acc  # the FP8 kind's per-k-tile fragments
        if cutlass.const_expr(not scaled):
            part = [[cute.make_rmem_tensor(mma.partition_shape_C((16, 8)), f32) for _ in range(atoms_n)]
                    for _ in range(atoms_m)]
            g_xs = cute.make_tensor(x_scale, cute.make_layout((m, k_tiles), stride=(k_tiles, 1)))
            g_ws = cute.make_tensor(w_scale, cute.make_layout((n // 128, k_tiles), stride=(k_tiles, 1)))

        for s in cutlass.range_constexpr(stages - 1):
            load_stage(tid, m, m0, n0, s, s, gx, gw, gxs, gws, s_x, s_w, s_xs, s_ws, bm, bn, row_words,
                       scale_words, threads, scaled)
            cute.arch.cp_async_commit_group()

        for kt in cutlass.range(k_tiles, unroll=1):
            if cutlass.const_expr(not scaled):
                # This k-tile's scales, read before the wait so their latency hides behind it. A
                # thread's accumulator rows are wr0 + 16 i + r (+ 8); rows past M read row M - 1.
                w_s = g_ws[bx * bn // 128, kt]
                row_s = [[g_xs[cutlass.min(m0 + wr0 + 16 * i + 8 * h + r, m - 1), kt] * w_s for h in range(2)]
                         for i in range(atoms_m)]
            cute.arch.cp_async_wait_group(stages - 2)
            cute.arch.sync_threads()  # slot kt % stages is complete, and every warp is done with kt - 1's
            # Refill the slot k-tile kt - 1 used with k-tile kt + stages - 1. Past the last k-tile
            # the last one is loaded again into a slot no later step reads (no runtime branch; a
            # group is committed every step, so the wait count above stays right).
            nxt = cutlass.min(kt + stages - 1, k_tiles - 1)
            load_stage(tid, m, m0, n0, nxt, (kt + stages - 1) % stages, gx, gw, gxs, gws, s_x, s_w, s_xs, s_ws,
                       bm, bn, row_words, scale_words, threads, scaled)
            cute.arch.cp_async_commit_group()

            stage = kt % stages
            base_x, base_w = stage * bm * ROW_WORDS, stage * bn * ROW_WORDS
            if cutlass.const_expr(not scaled):
                for i in cutlass.range_constexpr(atoms_m):
                    for j in cutlass.range_constexpr(atoms_n):
                        part[i][j].fill(0.0)
            for ks in cutlass.range_constexpr(k_steps):
                # mma.sync fragments of a 32-byte K step: A word (row, k-half) and B word (k-half)
                # of lane (r, q) are word q of chunk 2 ks + k-half of their row.
                for i in cutlass.range_constexpr(atoms_m):
                    row = wr0 + 16 * i + r
                    for half in cutlass.range_constexpr(2):
                        words_a[i][2 * half] = s_x[base_x + swizzled(row, 2 * ks + half, q)]
                        words_a[i][2 * half + 1] = s_x[base_x + swizzled(row + 8, 2 * ks + half, q)]
                    if cutlass.const_expr(scaled):
                        cute.recast_tensor(sf_a[i], i32)[0] = s_xs[(stage * bm + row + 8 * (lane % 2)) * 4 + ks]
                for j in cutlass.range_constexpr(atoms_n):
                    col = wc0 + 8 * j + r
                    for half in cutlass.range_constexpr(2):
                        words_b[j][half] = s_w[base_w + swizzled(col, 2 * ks + half, q)]
                    if cutlass.const_expr(scaled):
                        cute.recast_tensor(sf_b[j], i32)[0] = s_ws[(stage * bn + col) * 4 + ks]
                for i in cutlass.range_constexpr(atoms_m):
                    for j in cutlass.range_constexpr(atoms_n):
                        if cutlass.const_expr(scaled):
                            cute.gemm(mma, acc[i][j], [frag_a[i], sf_a[i]], [frag_b[j], sf_b[j]], acc[i][j])
                        else:
                            cute.gemm(mma, part[i][j], frag_a[i], frag_b[j], part[i][j])
            if cutlass.const_expr(not scaled):
                # Promotion: slots 0, 1 of an m16n8 fragment are row r, slots 2, 3 row r + 8.
                for i in cutlass.range_constexpr(atoms_m):
                    for j in cutlass.range_constexpr(atoms_n):
                        for c in cutlass.range_constexpr(4):
                            acc[i][j][c] = acc[i][j][c] + part[i][j][c] * row_s[i][c // 2]
        cute.arch.cp_async_wait_group(0)

        g_out = cute.make_tensor(cute.recast_ptr(out, dtype=i32), cute.make_layout((m, n // 2), stride=(n // 2, 1)))
        if cutlass.const_expr(scaled):
            x_g = cute.make_tensor(x_gscale, cute.make_layout(1))[0]
            g_wg = cute.make_tensor(w_gscale, cute.make_layout(n))
        pair = cute.make_rmem_tensor(cute.make_layout(2), bf16)
        for i in cutlass.range_constexpr(atoms_m):
            for j in cutlass.range_constexpr(atoms_n):
                col = n0 + wc0 + 8 * j + 2 * q
                for h in cutlass.range_constexpr(2):
                    row = m0 + wr0 + 16 * i + 8 * h + r
                    v0, v1 = acc[i][j][2 * h], acc[i][j][2 * h + 1]
                    if cutlass.const_expr(scaled):
                        v0, v1 = v0 * (x_g * g_wg[col]), v1 * (x_g * g_wg[col + 1])
                    pair[0] = v0.to(bf16)
                    pair[1] = v1.to(bf16)
                    if row < m:
                        g_out[row, col // 2] = cute.recast_tensor(pair, i32)[0]

    # The kinds' entry parameters differ (FP8 has no global scales); the body is shared, and the
    # FP8 kind hands it its operand pointers in the unused global-scale slots.
    if scaled:
        @cute.kernel
        def kernel(x: cute.Pointer, x_scale: cute.Pointer, x_gscale: cute.Pointer, w: cute.Pointer,
                   w_scale: cute.Pointer, w_gscale: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
            body(x, x_scale, x_gscale, w, w_scale, w_gscale, out, m)

        @cute.jit
        def launch(x: cute.Pointer, x_scale: cute.Pointer, x_gscale: cute.Pointer, w: cute.Pointer,
                   w_scale: cute.Pointer, w_gscale: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
                   stream: Any):
            kernel(x, x_scale, x_gscale, w, w_scale, w_gscale, out, m).launch(
                grid=grid({"M": m}), block=[threads, 1, 1], stream=stream)
    else:
        @cute.kernel
        def kernel(x: cute.Pointer, x_scale: cute.Pointer, w: cute.Pointer, w_scale: cute.Pointer,
                   out: cute.Pointer, m: cutlass.Int32):
            body(x, x_scale, x, w, w_scale, w, out, m)

        @cute.jit
        def launch(x: cute.Pointer, x_scale: cute.Pointer, w: cute.Pointer, w_scale: cute.Pointer,
                   out: cute.Pointer, m: cutlass.Int32, stream: Any):
            kernel(x, x_scale, w, w_scale, out, m).launch(grid=grid({"M": m}), block=[threads, 1, 1], stream=stream)

    kernel.set_name_prefix(name_prefix)
    return launch
