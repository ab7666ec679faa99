"""The `wg2p` form of `attention_wgmma`: the `wg2` kernel with intra-warpgroup overlap.

Same launch contract, tiles, shared memory (Q 64 KB + 2 x (K 32 KB + V 32 KB) = 192 KB) and
arithmetic as `wg2`; only the schedule differs. Per 64-key tile j, each consumer warpgroup

1. waits for its copies of V_j and K_{j+1}, then one CTA barrier (every thread's rows landed, and
   every warpgroup is past S_j and P_{j-1} V_{j-1}, so their stages are free);
2. cp.asyncs K_{j+2} into K_j's stage and V_{j+1} into V_{j-1}'s (they land under this tile's
   work, a whole iteration ahead);
3. issues S_{j+1} = Q K_{j+1}ᵀ and O += P_j V_j back to back as two WGMMA groups;
4. once S_{j+1} is done (wait for all but the newest group), runs its mask, row max, exp2 and
   row sum while the tensor cores work on P_j V_j;
5. after P_j V_j, rescales O by the new correction factor and converts S_{j+1} to P_{j+1}.

So the softmax of one tile runs under the PV product of the previous one (FlashAttention-3's
intra-warpgroup overlap), and one CTA barrier per tile replaces `wg2`'s two. The operations on
every value are those of `wg2` in the same order (O * corr_j + P_j V_j, then * corr_{j+1}, ...),
so the outputs are expected to be bit-identical to `wg2`'s (tests/gpu/test_attention_wgmma.py
asserts it).

Registers: O 128 fp32 per thread + one S tile 32 + P 16 (bf16 pairs) = 176 live across the
overlapped section, below the 255 a 256-thread CTA allows; a second S accumulator (issuing
S_{j+2} under the softmax of S_{j+1}) would not be needed for this order.

Not done here: ping-pong between the two warpgroups (named barriers ordering one warpgroup's
GEMMs under the other's softmax; FA3 turns it off with intra-warpgroup overlap at d > 128), a
producer warp with TMA and mbarrier rings, quantised KV pages (bf16 pages only; `wg2` keeps the
FP8 / INT8 forms).
"""

from typing import Any

from .variant import Variant


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils.layout import LayoutEnum

    from . import _attention_tiles, _dsl

    row_of = _attention_tiles.wgmma_row_of  # accumulator value -> its row of two
    from .attention import LOG2E, PAGE

    cfg = variant.config
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    bm, bn, stages, threads = cfg["BM"], cfg["BN"], cfg["stages"], cfg["threads"]
    if cfg["kv"] != "bf16" or bn != PAGE or stages != 2 or cfg.get("kv_split"):
        raise ValueError(f"{variant.name}: the overlapped form reads bf16 pages, one page a tile, 2 stages, "
                         f"all keys (not over key splits: attention_wgmma.KV_SPLIT_FORMS)")
    wgs = threads // 128
    group = hq // hkv
    scale_log2 = d ** -0.5 * LOG2E
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    ninf = -float("inf")
    k_major, mn_major = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
    s_vals = bn // 2  # S accumulator values per thread: 2 rows x BN / 4 columns
    o_vals = d // 2

    def smem_layouts() -> tuple[Any, Any, Any]:
        q_lay = sm90.make_smem_layout_a(k_major, (bm, bn, d), bf16, 1)  # (BM, D, 1)
        k_lay = sm90.make_smem_layout_b(k_major, (bm, bn, d), bf16, stages)  # (BN, D, stages)
        v_lay = sm90.make_smem_layout_b(mn_major, (bm, d, bn), bf16, stages)  # (D, BN, stages), d contiguous
        for what, lay in (("q", q_lay), ("k", k_lay), ("v", v_lay)):
            if "S<3,4,3>" not in str(lay.inner):
                raise ValueError(f"{variant.name}: {what} smem layout is {lay.inner}, expected 128-byte swizzle")
        return q_lay, k_lay, v_lay

    @cute.jit
    def load_tile(gcopy: Any, thr_g: Any, src_base: Any, dst: Any, tile_rows: Any, row0: Any, end: Any) -> None:
        """cp.async a (rows, D) tile (row r at src_base + r * row_stride) into dst, a (rows, D)
        view of shared memory; rows at or past `end` (row0 + r counted) are zero-filled: pages may
        hold anything there and 0 * NaN is NaN."""
        tsrc = thr_g.partition_S(src_base)
        tdst = thr_g.partition_D(dst)
        for i in cutlass.range_constexpr(cute.size(tdst.shape[1])):
            if row0 + tile_rows[0, i, 0][0] < end:
                cute.copy(gcopy, tsrc[None, i, None], tdst[None, i, None])
            else:
                tdst[None, i, None].fill(0)

    def load_page(gcopy: Any, thr_g: Any, kv_rows: Any, pool: Any, page: Any, kvh: Any, dst: Any, row0: Any,
                  end: Any) -> None:
        """KV head kvh of one page (K or V) into a (BN, D) view of its stage."""
        src = cute.make_tensor(pool + cute.assume((cutlass.Int64(page) * bn * hkv + kvh) * d, divby=8),
                               cute.make_layout((bn, d), stride=(hkv * d, 1)))
        load_tile(gcopy, thr_g, src, dst, kv_rows, row0, end)

    @cute.jit
    def softmax(acc_s: Any, s_coords: Any, row_pos: Any, row_max: Any, row_sum: Any, corr: Any, n0: Any) -> None:
        """Online softmax of the S tile at key n0 (exp2 domain, `wg2`'s arithmetic), the causal
        mask where the tile reaches past the thread's first row: P into acc_s, the row statistics
        updated, corr set (the caller rescales O once the previous PV product is done). Every
        value is an argument: the kernel calls it inside its runtime loop."""
        if n0 + bn - 1 > row_pos[0]:
            for i in cutlass.range_constexpr(s_vals):
                if n0 + s_coords[i][1] > row_pos[row_of(i)]:
                    acc_s[i] = f32(ninf)
        for h in cutlass.range_constexpr(2):
            cur = f32(ninf)
            for i in cutlass.range_constexpr(s_vals):
                if row_of(i) == h:
                    cur = cute.arch.fmax(cur, acc_s[i])
            cur = cute.arch.fmax(cur, cute.arch.shuffle_sync_bfly(cur, offset=2))
            cur = cute.arch.fmax(cur, cute.arch.shuffle_sync_bfly(cur, offset=1))
            new_max = cute.arch.fmax(row_max[h], cur)
            corr[h] = cute.math.exp2((row_max[h] - new_max) * f32(scale_log2), fastmath=True)
            shift = new_max * f32(scale_log2)
            total = f32(0.0)
            for i in cutlass.range_constexpr(s_vals):
                if row_of(i) == h:
                    p = cute.math.exp2(acc_s[i] * f32(scale_log2) - shift, fastmath=True)
                    acc_s[i] = p
                    total = total + p
            row_sum[h] = row_sum[h] * corr[h] + total
            row_max[h] = new_max

    # Plain Python (traced inline, Python loops unrolled): no runtime control flow inside, and
    # every DSL value an argument, as the kernel's runtime loop requires of what it calls.
    def issue_qk(qk_mma: Any, acc_s: Any, tSrQ: Any, tSrK: Any, stage: Any) -> None:
        """S = Q K_stageᵀ, issued and committed as one WGMMA group (not waited)."""
        qk_mma.set(warpgroup.Field.ACCUMULATE, False)
        for kk in range(d // 16):
            cute.gemm(qk_mma, acc_s, tSrQ[None, None, kk, 0], tSrK[None, None, kk, stage], acc_s)
            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    def issue_pv(pv_mma: Any, acc_o: Any, t_p: Any, tOrV: Any, stage: Any) -> None:
        """O += P V_stage, issued and committed as one WGMMA group (not waited)."""
        for kk in range(bn // 16):
            cute.gemm(pv_mma, acc_o, t_p[None, None, kk], tOrV[None, None, kk, stage], acc_o)
        warpgroup.commit_group()

    def rescale_and_pack(acc_o: Any, acc_s: Any, r_p: Any, corr: Any) -> None:
        """O *= corr (per row), then P -> bf16 as the next PV product's A operand."""
        for i in range(o_vals):
            acc_o[i] = acc_o[i] * corr[row_of(i)]
        r_p.store(acc_s.load().to(bf16))

    def landed() -> None:
        """Every thread's outstanding copies landed and are visible to WGMMA (cp.async and the
        zero fills write through the generic proxy, WGMMA reads through the async one)."""
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

    @cute.jit
    def attend(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               maxp: cutlass.Int32) -> None:
        """The kernel body: x (the gate) and out (the bf16 output)."""
        q_lay, k_lay, v_lay = smem_layouts()
        tid, _, _ = cute.arch.thread_idx()
        head, by, _ = cute.arch.block_idx()
        tiles = (m + bm - 1) // bm
        m0 = (tiles - 1 - by) * bm  # longest tiles first
        kvh = head // group
        gpos = cute.make_tensor(pos, cute.make_layout(m))
        end = gpos[cutlass.min(m0 + bm - 1, m - 1)] + 1  # keys this tile reads: 0..end-1
        k_lo = cutlass.Int32(0)  # keys 0..end-1: tiles kb0..nkb-1
        k_hi = end
        kb0 = k_lo // bn
        nkb = (k_hi + bn - 1) // bn
        ntiles = cutlass.max(nkb - kb0, 1)
        seq = cute.make_tensor(qseq, cute.make_layout(m))[m0]
        trow = cute.make_tensor(table + cutlass.Int64(seq) * maxp, cute.make_layout(maxp))

        @cute.struct
        class Storage:
            sq: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_lay)], 1024]
            sk: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(k_lay)], 1024]
            sv: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(v_lay)], 1024]

        storage = cutlass.utils.SmemAllocator().allocate(Storage)
        sQ = storage.sq.get_tensor(q_lay.outer, swizzle=q_lay.inner)
        sK = storage.sk.get_tensor(k_lay.outer, swizzle=k_lay.inner)
        sV = storage.sv.get_tensor(v_lay.outer, swizzle=v_lay.inner)

        # ---- global -> shared: 16 bytes per thread per copy, 8 threads per 64 columns. V's
        # stages are (D, BN) with d contiguous; seen as (BN, D) they take the same copy as K.
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), bf16,
                                  num_bits_per_copy=128)
        gcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((threads // 8, 8), stride=(8, 1)),
                                        cute.make_layout((1, 8)))
        thr_g = gcopy.get_slice(tid)
        q_rows = thr_g.partition_S(cute.make_identity_tensor((bm, d)))
        kv_rows = thr_g.partition_S(cute.make_identity_tensor((bn, d)))
        key_by_d = cute.make_layout((bn, d), stride=(d, 1))

        # Two copy groups ahead: {Q, K_kb0}, then {K_kb0+1, V_kb0} (the loop's invariant: at the
        # top of tile j the outstanding group holds V_j and K_j+1).
        gQ = cute.make_tensor(q + cute.assume((cutlass.Int64(m0) * hq + head) * d, divby=8),
                              cute.make_layout((bm, d), stride=(hq * d, 1)))
        load_tile(gcopy, thr_g, gQ, sQ[None, None, 0], q_rows, m0, m)
        load_page(gcopy, thr_g, kv_rows, k_pages, trow[kb0], kvh, sK[None, None, 0], k_lo, k_hi)
        cute.arch.cp_async_commit_group()
        if kb0 + 1 < nkb:
            load_page(gcopy, thr_g, kv_rows, k_pages, trow[kb0 + 1], kvh, sK[None, None, 1], k_lo + bn, k_hi)
        load_page(gcopy, thr_g, kv_rows, v_pages, trow[kb0], kvh, cute.composition(sV[None, None, 0], key_by_d),
                  k_lo, k_hi)
        cute.arch.cp_async_commit_group()

        # ---- WGMMA partitions: warpgroup w owns query rows 64w..64w+63 of the tile.
        qk_mma = sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                             k_major.sm90_mma_major_mode(), f32, (wgs, 1, 1), tiler_mn=(64, bn))
        pv_mma = sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                             mn_major.sm90_mma_major_mode(), f32, (wgs, 1, 1),
                                             tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)  # O accumulates over all tiles (an atom starts at False)
        wg_first = (tid // 128) * 128
        qk_wg, pv_wg = qk_mma.get_slice(wg_first), pv_mma.get_slice(wg_first)
        qk_thr, pv_thr = qk_mma.get_slice(tid), pv_mma.get_slice(tid)
        tSrQ = qk_mma.make_fragment_A(qk_wg.partition_A(sQ))  # (MMA, 1, D / 16, 1)
        tSrK = qk_mma.make_fragment_B(qk_wg.partition_B(sK))  # (MMA, 1, D / 16, stages)
        tOrV = pv_mma.make_fragment_B(pv_wg.partition_B(sV))  # (MMA, 1, BN / 16, stages)
        s_coords = qk_thr.partition_C(cute.make_identity_tensor((bm, bn)))
        o_coords = pv_thr.partition_C(cute.make_identity_tensor((bm, d)))
        acc_s = cute.make_rmem_tensor(s_coords.shape, f32)
        acc_o = cute.make_rmem_tensor(o_coords.shape, f32)
        acc_o.fill(0.0)
        r_p = cute.make_rmem_tensor(s_coords.shape, bf16)
        # P as the A operand of the k16 products: accumulator column groups 2j, 2j + 1 (columns
        # 16j..16j+15) are the RS-WGMMA A fragment of k-block j (the same thread/value placement).
        t_p = cute.make_tensor(r_p.iterator, cute.make_layout(((2, 2, 2), 1, bn // 16), stride=((1, 2, 4), 0, 8)))

        # This thread's two rows and their positions (rows past M repeat the last row's).
        row_pos = cute.make_rmem_tensor((2,), cutlass.Int32)
        row_max = cute.make_rmem_tensor((2,), f32)
        row_sum = cute.make_rmem_tensor((2,), f32)
        corr = cute.make_rmem_tensor((2,), f32)
        for h in range(2):
            row_pos[h] = gpos[cutlass.min(m0 + s_coords[2 * h][0], m - 1)]
            row_max[h] = f32(ninf)
            row_sum[h] = f32(0.0)

        # ---- the first tile's S and P (Q and K_kb0 landed; K_kb0+1 and V_kb0 may be in flight)
        cute.arch.cp_async_wait_group(1)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        warpgroup.fence()
        issue_qk(qk_mma, acc_s, tSrQ, tSrK, 0)
        warpgroup.wait_group(0)
        softmax(acc_s, s_coords, row_pos, row_max, row_sum, corr, kb0 * bn)
        rescale_and_pack(acc_o, acc_s, r_p, corr)

        for kb in cutlass.range(kb0, nkb - 1, unroll=1):
            it = kb - kb0
            landed()  # V_kb and K_kb+1; every warpgroup is past S_kb and P_kb-1 V_kb-1
            if kb + 2 < nkb:
                load_page(gcopy, thr_g, kv_rows, k_pages, trow[kb + 2], kvh, sK[None, None, it % 2],
                          (kb + 2) * bn, k_hi)
            load_page(gcopy, thr_g, kv_rows, v_pages, trow[kb + 1], kvh,
                      cute.composition(sV[None, None, (it + 1) % 2], key_by_d), (kb + 1) * bn, k_hi)
            cute.arch.cp_async_commit_group()
            # S_kb+1 and P_kb V_kb (O and P were last written by this thread's registers: the
            # WGMMA fence orders those writes before both products read them).
            warpgroup.fence()
            issue_qk(qk_mma, acc_s, tSrQ, tSrK, (it + 1) % 2)
            issue_pv(pv_mma, acc_o, t_p, tOrV, it % 2)
            warpgroup.wait_group(1)  # S_kb+1 done; P_kb V_kb may still run
            softmax(acc_s, s_coords, row_pos, row_max, row_sum, corr, (kb + 1) * bn)
            warpgroup.wait_group(0)
            rescale_and_pack(acc_o, acc_s, r_p, corr)

        # ---- the last tile's PV product
        landed()
        warpgroup.fence()
        issue_pv(pv_mma, acc_o, t_p, tOrV, (ntiles - 1) % 2)
        warpgroup.wait_group(0)

        # ---- epilogue (as `wg2`'s). A warpgroup's S products read only its own Q rows, which
        # are the rows it overwrites with O below.
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            row_sum[h] = total
        # O / sum -> bf16 into Q's buffer, then out = O * sigmoid(gate), coalesced
        sO = sQ[None, None, 0]
        _attention_tiles.wgmma_o_to_smem(acc_o, row_sum, o_coords, sO, o_vals)
        _attention_tiles.store_gated_rows(tid, sO, x, out, m0, m, head, threads, hq, d, stride, bm)

    @cute.kernel
    def kernel(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               maxp: cutlass.Int32):
        attend(q, k_pages, v_pages, table, qseq, pos, x, out, m, maxp)

    @cute.jit
    def launch(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               maxp: cutlass.Int32, stream: Any):
        kernel(q, k_pages, v_pages, table, qseq, pos, x, out, m, maxp).launch(
            grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    aligns = {"table": 4, "qseq": 4, "pos": 4}
    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_wgmma_{variant.key}")
    return launch, _dsl.example_args(variant, aligns=aligns)
