"""The CuTe DSL code of the `gdn_chunked` family: the chunked (WY) Gated DeltaNet prefill kernel
and its launcher, for the variants cute_kernels/gdn_chunked.py declares (its `build` calls this).

The maths, the kernel's plan per chunk, the forms (config `vsplit`, `prefetch`, `tinv`) and the
precision model are in that module's docstring; `gdn_chunked.reference_core` models what this
computes.
"""

from typing import Any

from . import gdn
from .gdn_chunked import C, L2_EPS, THREADS
from .variant import Variant


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync, warp

    from . import _dsl

    cfg = variant.config
    hk, hv, dk, dv = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"]
    vsplit, prefetch, blocked = cfg["vsplit"], cfg["prefetch"], cfg["tinv"] == "blocked"
    dvc = dv // vsplit  # value columns (and state rows) of one CTA
    conv_dim, stride = cfg["conv_dim"], cfg["x_stride"]
    b_off, a_off = cfg["b_off"], cfg["a_off"]
    key_dim = hk * dk
    rep = hv // hk
    q_scale = dk ** -0.5
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    warps = THREADS // 32
    qk_lanes = dk // 8  # threads of one q/k row in the cp.async tiling (16 bytes each)
    v_lanes = dvc // 8

    def tview(t: Any, rows: int, cols: int) -> Any:
        """(cols, rows) view of a (rows, cols) shared-memory tile: the MN-major operand."""
        return cute.composition(t, cute.make_layout((cols, rows), stride=(rows, 1)))

    def gemm(mma: Any, thr: Any, tid: Any, acc: Any, sa: Any, sb: Any, lda: Any, ldb: Any) -> None:
        """acc += sa @ sb^T, sa (M, K) and sb (N, K) in shared memory, through ldmatrix and mma.sync."""
        ra = thr.make_fragment_A(thr.partition_A(sa))
        rb = thr.make_fragment_B(thr.partition_B(sb))
        ta, tb = lda.get_slice(tid), ldb.get_slice(tid)
        tsa, rav = ta.partition_S(sa), ta.retile(ra)
        tsb, rbv = tb.partition_S(sb), tb.retile(rb)
        for kk in range(cute.size(tsa.shape[2])):
            cute.copy(lda, tsa[None, None, kk], rav[None, None, kk])
            cute.copy(ldb, tsb[None, None, kk], rbv[None, None, kk])
            cute.gemm(mma, acc, ra[None, None, kk], rb[None, None, kk], acc)

    def gate_values(araw: Any, braw: Any, neg_a: Any, dtb: Any) -> tuple[Any, Any]:
        """(g, beta) of one token from its raw a and b."""
        av = araw + dtb
        sp = cute.math.log1p(cute.math.exp(-cute.math.absf(av))) + cute.arch.fmax(av, f32(0.0))
        return neg_a * sp, f32(1.0) / (f32(1.0) + cute.math.exp(-braw))

    @cute.jit
    def load_qk(qkv: Any, rbase: Any, n: Any, kh: Any, gcopy: Any, thr_g: Any, rows: Any, tq: Any, tk: Any) -> None:
        """cp.async of a chunk's raw q, k rows (from element rbase of qkv; zeros from row n on)."""
        gq = cute.make_tensor(qkv + cute.assume(rbase + kh * dk, divby=8),
                              cute.make_layout((C, dk), stride=(conv_dim, 1)))
        gk = cute.make_tensor(qkv + cute.assume(rbase + key_dim + kh * dk, divby=8),
                              cute.make_layout((C, dk), stride=(conv_dim, 1)))
        tgq, tgk = thr_g.partition_S(gq), thr_g.partition_S(gk)
        for i in cutlass.range_constexpr(cute.size(tq.shape[1])):
            if rows[0, i, 0][0] < n:
                cute.copy(gcopy, tgq[None, i, None], tq[None, i, None])
                cute.copy(gcopy, tgk[None, i, None], tk[None, i, None])
            else:
                tq[None, i, None].fill(0)
                tk[None, i, None].fill(0)

    @cute.jit
    def load_v(qkv: Any, vbase: Any, n: Any, vcopy: Any, thr_v: Any, rows: Any, tv: Any) -> None:
        """cp.async of a chunk's v columns of this CTA (from element vbase of qkv; zeros from row n on)."""
        gv = cute.make_tensor(qkv + cute.assume(vbase, divby=8), cute.make_layout((C, dvc), stride=(conv_dim, 1)))
        tgv = thr_v.partition_S(gv)
        for i in cutlass.range_constexpr(cute.size(tv.shape[1])):
            if rows[0, i, 0][0] < n:
                cute.copy(vcopy, tgv[None, i, None], tv[None, i, None])
            else:
                tv[None, i, None].fill(0)

    @cute.kernel
    def kernel(qkv: cute.Pointer, x: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
               state: cute.Pointer, slots: cute.Pointer, out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, b, _ = cute.arch.block_idx()
        h = bid // vsplit
        part = bid % vsplit  # this CTA's value columns: [part * dvc, (part + 1) * dvc)
        lane = tid % 32
        wid = tid // 32
        kh = h // rep
        one = cute.make_layout(1)
        slot = cute.make_tensor(slots, cute.make_layout(nb))[b]
        row0 = cutlass.Int64(b) * nt
        s_base = state + ((cutlass.Int64(slot) * hv + h) * dv + part * dvc) * dk
        v_col = 2 * key_dim + h * dv + part * dvc
        o_col = h * dv + part * dvc
        neg_a = -cute.math.exp(cute.make_tensor(a_log + h, one)[0].to(f32))
        dtb = cute.make_tensor(dt_bias + h, one)[0].to(f32)
        nchunks = (nt + C - 1) // C

        # ---- shared memory: 128-byte rows swizzled for ldmatrix
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
        l_ck = cute.tile_to_shape(atom, (C, dk), (0, 1))
        l_cv = cute.tile_to_shape(atom, (C, dvc), (0, 1))
        l_cc = cute.tile_to_shape(atom, (C, C), (0, 1))
        l_s = cute.tile_to_shape(atom, (dvc, dk), (0, 1))
        l_f = cute.make_layout((C, C), stride=(C + 1, 1))
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(bf16, l_ck, byte_alignment=1024)
        sK = smem.allocate_tensor(bf16, l_ck, byte_alignment=1024)
        sV = smem.allocate_tensor(bf16, l_cv, byte_alignment=1024)
        sR = smem.allocate_tensor(bf16, l_cv, byte_alignment=1024)
        sD = smem.allocate_tensor(bf16, l_cv, byte_alignment=1024)
        sDd = smem.allocate_tensor(bf16, l_cv, byte_alignment=1024)
        sS = smem.allocate_tensor(bf16, l_s, byte_alignment=1024)
        sT = smem.allocate_tensor(bf16, l_cc, byte_alignment=1024)
        sP = smem.allocate_tensor(bf16, l_cc, byte_alignment=1024)
        # prefetch: the raw q, k rows of the next chunk land here (each thread reads back only
        # what it copied itself, normalised into sQ, sK); otherwise they load into sQ, sK.
        sQr = smem.allocate_tensor(bf16, l_ck, byte_alignment=1024) if prefetch else sQ
        sKr = smem.allocate_tensor(bf16, l_ck, byte_alignment=1024) if prefetch else sK
        sA = smem.allocate_tensor(f32, l_f, byte_alignment=16)
        sTf = smem.allocate_tensor(f32, l_f, byte_alignment=16) if blocked else sA  # T in fp32
        sG = smem.allocate_tensor(f32, cute.make_layout(C), byte_alignment=16)
        sB = smem.allocate_tensor(f32, cute.make_layout(C), byte_alignment=16)
        sRt = tview(sR, C, dvc)
        sDt = tview(sD, C, dvc)
        sDdt = tview(sDd, C, dvc)
        sKt = tview(sK, C, dk)

        # ---- global -> shared: 16 bytes per thread per copy, a row over dk / 8 (dvc / 8) threads
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), bf16,
                                  num_bits_per_copy=128)
        gcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((THREADS // qk_lanes, qk_lanes), stride=(qk_lanes, 1)),
                                        cute.make_layout((1, 8)))
        vcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((THREADS // v_lanes, v_lanes), stride=(v_lanes, 1)),
                                        cute.make_layout((1, 8)))
        thr_g = gcopy.get_slice(tid)
        thr_v = vcopy.get_slice(tid)
        tile_rows = thr_g.partition_S(cute.make_identity_tensor((C, dk)))
        vtile_rows = thr_v.partition_S(cute.make_identity_tensor((C, dvc)))
        tQs, tKs, tVs = thr_g.partition_D(sQr), thr_g.partition_D(sKr), thr_v.partition_D(sV)
        tQw, tKw = thr_g.partition_D(sQ), thr_g.partition_D(sK)

        # ---- tensor cores: 8 warps, 4 along M and 2 along N, 64 x 32 per tile
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(bf16, f32, (16, 8, 16)), (4, 2, 1),
                                  permutation_mnk=(64, 32, 16))
        thr = mma.get_slice(tid)
        ld_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), bf16), mma)
        ld_at = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), bf16), mma)
        ld_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), bf16), mma)
        ld_bt = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), bf16), mma)

        c_cc = thr.partition_C(cute.make_identity_tensor((C, C)))
        c_cv = thr.partition_C(cute.make_identity_tensor((C, dvc)))
        c_s = thr.partition_C(cute.make_identity_tensor((dvc, dk)))

        # ---- the state rows of this CTA: fp32 in registers (accumulator of the update), bf16 copy in smem
        acc_s = cute.make_rmem_tensor(thr.partition_shape_C((dvc, dk)), f32)
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r, c = c_s[i][0], c_s[i][1]
            val = cute.make_tensor(s_base + r * dk + c, one)[0]
            acc_s[i] = val
            sS[r, c] = val.to(bf16)
        if cutlass.const_expr(blocked):
            # T's blocks above the diagonal stay zero; nothing else writes them.
            for i in cutlass.range_constexpr(cute.size(c_cc)):
                sT[c_cc[i][0], c_cc[i][1]] = f32(0.0).to(bf16)

        # Raw a, b of tokens 2 lane, 2 lane + 1 of a chunk (warp 0); prefetch: of the next chunk,
        # and chunk 0's loads are issued here.
        nab = cute.make_rmem_tensor((4,), f32)
        if cutlass.const_expr(prefetch):
            n0 = cutlass.min(nt, C)
            load_qk(qkv, row0 * conv_dim, n0, kh, gcopy, thr_g, tile_rows, tQs, tKs)
            load_v(qkv, row0 * conv_dim + v_col, n0, vcopy, thr_v, vtile_rows, tVs)
            cute.arch.cp_async_commit_group()
            if wid == 0:
                for e in cutlass.range_constexpr(2):
                    tt = 2 * lane + e
                    nab[e] = f32(0.0)
                    nab[2 + e] = f32(0.0)
                    if tt < nt:
                        xrow = x + (row0 + tt) * stride
                        nab[e] = cute.make_tensor(xrow + a_off + h, one)[0].to(f32)
                        nab[2 + e] = cute.make_tensor(xrow + b_off + h, one)[0].to(f32)

        for ci in cutlass.range(nchunks, unroll=1):
            t0 = ci * C
            n = cutlass.min(nt - t0, C)
            if cutlass.const_expr(not prefetch):
                load_qk(qkv, (row0 + t0) * conv_dim, n, kh, gcopy, thr_g, tile_rows, tQs, tKs)
                load_v(qkv, (row0 + t0) * conv_dim + v_col, n, vcopy, thr_v, vtile_rows, tVs)
                cute.arch.cp_async_commit_group()
            # Gates of the chunk (warp 0, two tokens a lane): g, beta, and the inclusive prefix sum of g.
            # (prefetch: from the raw a, b loaded during the previous chunk).
            if wid == 0:
                if cutlass.const_expr(not prefetch):
                    for e in cutlass.range_constexpr(2):
                        tt = 2 * lane + e
                        if tt < n:
                            xrow = x + (row0 + t0 + tt) * stride
                            nab[e] = cute.make_tensor(xrow + a_off + h, one)[0].to(f32)
                            nab[2 + e] = cute.make_tensor(xrow + b_off + h, one)[0].to(f32)
                gg = cute.make_rmem_tensor((2,), f32)
                bb = cute.make_rmem_tensor((2,), f32)
                for e in cutlass.range_constexpr(2):
                    gg[e] = f32(0.0)
                    bb[e] = f32(0.0)
                    if 2 * lane + e < n:
                        gv_, bv_ = gate_values(nab[e], nab[2 + e], neg_a, dtb)
                        gg[e] = gv_
                        bb[e] = bv_
                pair = gg[0] + gg[1]
                run = pair
                for off in (1, 2, 4, 8, 16):
                    up = cute.arch.shuffle_sync_up(run, offset=off)
                    if lane >= off:
                        run = run + up
                sG[2 * lane] = run - pair + gg[0]
                sG[2 * lane + 1] = run
                sB[2 * lane] = bb[0]
                sB[2 * lane + 1] = bb[1]
                if cutlass.const_expr(prefetch):
                    # Raw gate inputs of the next chunk, in flight while this one computes.
                    for e in cutlass.range_constexpr(2):
                        tt = t0 + C + 2 * lane + e
                        if tt < nt:
                            xrow = x + (row0 + tt) * stride
                            nab[e] = cute.make_tensor(xrow + a_off + h, one)[0].to(f32)
                            nab[2 + e] = cute.make_tensor(xrow + b_off + h, one)[0].to(f32)
            cute.arch.cp_async_wait_group(0)

            if cutlass.const_expr(prefetch):
                # L2 norms of the rows this thread copied (dk / 8 lanes a row): sQr, sKr -> sQ, sK.
                for i in cutlass.range_constexpr(cute.size(tQs.shape[1])):
                    xq = tQs[None, i, None].load().to(f32)
                    sq = _dsl.warp_sum((xq * xq).reduce(cute.ReductionOp.ADD, f32(0.0), 0), qk_lanes)
                    tQw[None, i, None].store((xq * (cute.math.rsqrt(sq + f32(L2_EPS)) * f32(q_scale))).to(bf16))
                    xk = tKs[None, i, None].load().to(f32)
                    sk = _dsl.warp_sum((xk * xk).reduce(cute.ReductionOp.ADD, f32(0.0), 0), qk_lanes)
                    tKw[None, i, None].store((xk * cute.math.rsqrt(sk + f32(L2_EPS))).to(bf16))
                cute.arch.sync_threads()
                # The next chunk's q, k into the staging tiles (every thread is past reading them).
                if ci + 1 < nchunks:
                    load_qk(qkv, (row0 + t0 + C) * conv_dim, cutlass.min(nt - t0 - C, C), kh, gcopy, thr_g,
                            tile_rows, tQs, tKs)
                cute.arch.cp_async_commit_group()
            else:
                cute.arch.sync_threads()
                # L2 norms of q (scaled) and k rows, in place: each warp 16 of the 128 rows, 4 columns a lane.
                for j in cutlass.range_constexpr(2 * C // warps):
                    rr = wid * (2 * C // warps) + j
                    vals = cute.make_rmem_tensor((4,), f32)
                    if rr < C:
                        for e in cutlass.range_constexpr(4):
                            vals[e] = sQ[rr, 4 * lane + e].to(f32)
                    else:
                        for e in cutlass.range_constexpr(4):
                            vals[e] = sK[rr - C, 4 * lane + e].to(f32)
                    v4 = vals.load()
                    ss = _dsl.warp_sum((v4 * v4).reduce(cute.ReductionOp.ADD, f32(0.0), 0), 32)
                    if rr < C:
                        vals.store(v4 * (cute.math.rsqrt(ss + f32(L2_EPS)) * f32(q_scale)))
                        for e in cutlass.range_constexpr(4):
                            sQ[rr, 4 * lane + e] = vals[e].to(bf16)
                    else:
                        vals.store(v4 * cute.math.rsqrt(ss + f32(L2_EPS)))
                        for e in cutlass.range_constexpr(4):
                            sK[rr - C, 4 * lane + e] = vals[e].to(bf16)
                cute.arch.sync_threads()

            # A = beta_t e^{G_t - G_s} K K^T (s < t), fp32; P = Q K^T e^{G_t - G_s} (s <= t), bf16.
            acc_kk = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), f32)
            acc_kk.fill(0.0)
            gemm(mma, thr, tid, acc_kk, sK, sK, ld_a, ld_b)
            acc_qk = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), f32)
            acc_qk.fill(0.0)
            gemm(mma, thr, tid, acc_qk, sQ, sK, ld_a, ld_b)
            for i in cutlass.range_constexpr(cute.size(acc_kk)):
                r, c = c_cc[i][0], c_cc[i][1]
                diff = f32(0.0)
                if c <= r:
                    diff = sG[r] - sG[c]
                dec = cute.math.exp(diff)
                av = f32(0.0)
                pv = f32(0.0)
                if c < r:
                    av = sB[r] * dec * acc_kk[i]
                if c <= r:
                    pv = acc_qk[i] * dec
                sA[r, c] = av
                sP[r, c] = pv.to(bf16)
            # R = beta (V - e^G K S^T), bf16.
            acc_x = cute.make_rmem_tensor(thr.partition_shape_C((C, dvc)), f32)
            acc_x.fill(0.0)
            gemm(mma, thr, tid, acc_x, sK, sS, ld_a, ld_b)
            for i in cutlass.range_constexpr(cute.size(acc_x)):
                r, c = c_cv[i][0], c_cv[i][1]
                rv = sB[r] * (sV[r, c].to(f32) - cute.math.exp(sG[r]) * acc_x[i])
                sR[r, c] = rv.to(bf16)
            cute.arch.sync_threads()
            if cutlass.const_expr(prefetch):
                # The next chunk's v (every thread is past reading sV).
                if ci + 1 < nchunks:
                    load_v(qkv, (row0 + t0 + C) * conv_dim + v_col, cutlass.min(nt - t0 - C, C), vcopy, thr_v,
                           vtile_rows, tVs)
                cute.arch.cp_async_commit_group()

            if cutlass.const_expr(blocked):
                # T = (I + A)^-1 by blocks of 16: the diagonal blocks T_ii = (I + A_ii)^-1 by forward
                # substitution (one thread per (block, column)), then, by distance d = i - j,
                # T_ij = -T_ii sum_{j<=k<i} A_ik T_kj: warp w owns columns 2w, 2w + 1 of block (i, j),
                # a lane one entry of X = sum A_ik T_kj, and T_ii X gathers X's column by shuffles.
                if tid < C:
                    base = (tid // 16) * 16
                    col = tid % 16
                    xs = cute.make_rmem_tensor((16,), f32)
                    for t in cutlass.range_constexpr(16):
                        xs[t] = f32(0.0)
                        if col == t:
                            xs[t] = f32(1.0)
                    for s in cutlass.range_constexpr(15):
                        xv = xs[s]
                        for t in cutlass.range_constexpr(s + 1, 16):
                            xs[t] = xs[t] - sA[base + t, base + s] * xv
                    for t in cutlass.range_constexpr(16):
                        sTf[base + t, base + col] = xs[t]
                        sT[base + t, base + col] = xs[t].to(bf16)
                cute.arch.sync_threads()
                r16 = lane % 16
                src0 = lane - r16
                for d in cutlass.range_constexpr(1, 4):
                    for u in cutlass.range_constexpr(4 - d):
                        bi, bj = d + u, u
                        r = 16 * bi + r16
                        c = 16 * bj + 2 * wid + lane // 16
                        xacc = f32(0.0)
                        for kb in cutlass.range_constexpr(bj, bi):
                            for m in cutlass.range_constexpr(16):
                                xacc = xacc + sA[r, 16 * kb + m] * sTf[16 * kb + m, c]
                        tv = f32(0.0)
                        for m in cutlass.range_constexpr(16):
                            tv = tv + sTf[r, 16 * bi + m] * cute.arch.shuffle_sync(xacc, src0 + m)
                        sTf[r, c] = -tv
                        sT[r, c] = (-tv).to(bf16)
                    if cutlass.const_expr(d < 3):
                        cute.arch.sync_threads()
            else:
                # T = (I + A)^-1 by forward substitution, one thread per column, fp32.
                if tid < C:
                    xs = cute.make_rmem_tensor((C,), f32)
                    for t in cutlass.range_constexpr(C):
                        xs[t] = f32(0.0)
                        if tid == t:
                            xs[t] = f32(1.0)
                    for s in cutlass.range_constexpr(C - 1):
                        xv = xs[s]
                        for t in cutlass.range_constexpr(s + 1, C):
                            xs[t] = xs[t] - sA[t, s] * xv
                    for t in cutlass.range_constexpr(C):
                        sT[t, tid] = xs[t].to(bf16)
            cute.arch.sync_threads()

            # D = T R; D and its decayed copy (for the state update) in bf16.
            g_last = sG[C - 1]
            acc_d = cute.make_rmem_tensor(thr.partition_shape_C((C, dvc)), f32)
            acc_d.fill(0.0)
            gemm(mma, thr, tid, acc_d, sT, sRt, ld_a, ld_bt)
            for i in cutlass.range_constexpr(cute.size(acc_d)):
                r, c = c_cv[i][0], c_cv[i][1]
                sD[r, c] = acc_d[i].to(bf16)
                sDd[r, c] = (acc_d[i] * cute.math.exp(g_last - sG[r])).to(bf16)
            # O = e^G Q S^T + P D.
            acc_o = cute.make_rmem_tensor(thr.partition_shape_C((C, dvc)), f32)
            acc_o.fill(0.0)
            gemm(mma, thr, tid, acc_o, sQ, sS, ld_a, ld_b)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[i] = acc_o[i] * cute.math.exp(sG[c_cv[i][0]])
            cute.arch.sync_threads()
            gemm(mma, thr, tid, acc_o, sP, sDt, ld_a, ld_bt)
            obase = out + (row0 + t0) * (hv * dv) + o_col
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                r, c = c_cv[i][0], c_cv[i][1]
                if r < n:
                    cute.make_tensor(obase + r * (hv * dv) + c, one)[0] = acc_o[i].to(bf16)
            # S = e^{G_C} S + Dd^T K, then the bf16 copy for the next chunk.
            dec_c = cute.math.exp(g_last)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * dec_c
            gemm(mma, thr, tid, acc_s, sDdt, sKt, ld_at, ld_bt)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                sS[c_s[i][0], c_s[i][1]] = acc_s[i].to(bf16)
            cute.arch.sync_threads()

        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r, c = c_s[i][0], c_s[i][1]
            cute.make_tensor(s_base + r * dk + c, one)[0] = acc_s[i]

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gdn_chunked_{variant.key}")
    return gdn.prefill_launcher(kernel, variant)
