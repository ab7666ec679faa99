"""Prefill attention on Hopper warpgroup MMA (WGMMA): causal, GQA, paged K/V, sigmoid gate fused.

The same launch contract as `attention_prefill` (q `[M, Hq, D]` from `attention.prep`, the K/V
page pools `[NP * 64, Hkv, D]` through the page table row `qseq[0]`, `pos[m]`, the gate read from
the fused projection `x`, bf16 `out [M, Hq * D]`), so the runner launches either; see
`attention_prefill` for the contract's details. Differences from that kernel:

- the products are WGMMAs: S = Q Kᵀ with both operands in shared memory (SS, both K-major) and
  O += P V with P from registers (RS; V is the MN-major B operand: a key page stores d
  contiguous), fp32 accumulators, 128-byte swizzled shared-memory tiles as WGMMA reads them;
- each consumer warpgroup owns 64 query rows; the form `wg2` runs two (128-row tiles, 256
  threads, the tile FA3 uses at d = 256), the form `wg1` one (64-row tiles, 128 threads: half the
  shared memory and the simplest schedule, the fallback if `wg2` misbehaves); the form `wg2p` is
  `wg2` with the softmax of one tile under the previous tile's PV product (its own module,
  `_attention_wgmma_overlap.py`, which says how; bf16 pages only);
- K and V tiles (one 64-key page each) are double-buffered: all threads issue the cp.async of
  tile j + 1 before computing on tile j (the copy overlaps both products and the softmax); a
  page id comes from the table per tile, so the copies follow the paging with no descriptor.

Shared memory at D = 256: Q 64 KB (`wg2`; 32 KB `wg1`) + 2 stages x (K 32 KB + V 32 KB).
Registers: O is 64 x 256 fp32 per warpgroup, 128 per thread, S 32 and P 16 more; without a
producer warp no register split is needed (255 per thread at 256 threads).

Softmax: exp2 with the log2 scale folded in, the causal mask only on tiles that reach past the
thread's first row; key 0 is in every row's range, so each row max is finite after the first tile
and a fully masked row in a later tile adds exp2(-inf) = 0 with a rescale factor of 1 (a row's
value does not depend on its tile-mates).

Not yet: a producer warp with TMA over the page pool and mbarrier rings (kernel-playbook 6.1),
ping-pong between the two warpgroups, and skipping a warpgroup's fully masked tile (`wg2p`
overlaps a tile's softmax with the previous PV product within each warpgroup).
"""

from typing import Any

import numpy as np

from . import attention
from .bf16 import round_bf16
from .variant import HOPPER, Variant, i32, ptr, tensor

FAMILY = "attention_wgmma"
PAGE = attention.PAGE
BN = PAGE  # keys per tile: one KV page
STAGES = 2  # K/V tiles in flight: the one computed on and the next
WG_ROWS = 64  # query rows per consumer warpgroup (the WGMMA M)
LOG2E = attention.LOG2E
FORMS = {"wg2": 2, "wg1": 1, "wg2p": 2}  # form -> consumer warpgroups
# Forms whose schedule overlaps a tile's softmax with the previous tile's PV product (kernel in
# _attention_wgmma_overlap.py; `wg2`'s tiles and arithmetic, bf16 pages only).
OVERLAP_FORMS = ("wg2p",)

# The d = 256 shapes of cute_kernels/attention.py (Qwen3.6-27B, Qwen3.6-35B-A3B); the tiny model
# keeps the mma.sync kernel.
_SHAPES = [(name, hq, hkv, d) for name, hq, hkv, d, _ in attention._SHAPES if d == 256]


def _fwd(name: str, hq: int, hkv: int, d: int, form: str, kv: str) -> Variant:
    stride = attention.x_stride(hq, hkv, d)
    wgs = FORMS[form]
    bm, threads = wgs * WG_ROWS, wgs * 128
    return Variant(
        family=FAMILY,
        key=f"fwd_{name}_{form}" + ("" if kv == "bf16" else f"_{kv}"),
        config={"kind": "fwd", "form": form, "Hq": hq, "Hkv": hkv, "D": d, "x_stride": stride, "BM": bm, "BN": BN,
                "stages": STAGES, "threads": threads, "kv": kv},
        params=[ptr("q"), ptr("k_pages"), ptr("v_pages"), ptr("table"), ptr("qseq"), ptr("pos"), ptr("x"),
                ptr("out"), i32("M"), i32("maxp")],
        tensors={
            **attention.paged_query_tensors(hq, hkv, d, kv),
            "x": tensor("bf16", "M", stride),
            "out": tensor("bf16", "M", hq * d, role="out"),
        },
        sizes=("M", "maxp", "R", "NP"),
        block=(threads, 1, 1),
        grid=(hq, f"cdiv(M, {bm})", 1),
        requires=("M >= 1", "maxp >= 1", "R >= 1", "NP >= 1", f"cdiv(M, {bm}) <= 65535"),
        arches=HOPPER,
        note=f"WGMMA causal prefill attention ({wgs} warpgroups, {bm}-row tiles, double-buffered K/V"
             f"{', softmax under the previous PV' if form in OVERLAP_FORMS else ''}), "
             f"paged {kv} K/V, gate fused, GQA {hq}/{hkv}, D={d}",
        example_sizes={"M": 8192, "maxp": 128, "R": 1, "NP": 128},
    )


def _fwd_kv_split(name: str, hq: int, hkv: int, d: int, form: str) -> Variant:
    """The same kernel over absolute key splits: CTA (head, tile, s) attends to keys
    [s * split, (s + 1) * split) only and writes the split's normalised output and log2-sum-exp
    in the layout of `attention.split_*`, which `attention.combine_*` merges (gate applied there).
    `split` is a multiple of the page; rows that end before a split skip it (the combine reads
    the first cdiv(pos + 1, split) splits of a row). For prefill chunks over a long context:
    few query tiles would otherwise leave SMs idle while each tile walks every key."""
    wgs = FORMS[form]
    bm, threads = wgs * WG_ROWS, wgs * 128
    return Variant(
        family=FAMILY,
        key=f"fwd_{name}_{form}_kvsplit",
        config={"kind": "fwd", "form": form, "Hq": hq, "Hkv": hkv, "D": d, "x_stride": attention.x_stride(hq, hkv, d),
                "BM": bm, "BN": BN, "stages": STAGES, "threads": threads, "kv": "bf16", "kv_split": True},
        params=[ptr("q"), ptr("k_pages"), ptr("v_pages"), ptr("table"), ptr("qseq"), ptr("pos"), ptr("o_part"),
                ptr("lse"), i32("M"), i32("maxp"), i32("S"), i32("split")],
        tensors={
            **attention.paged_query_tensors(hq, hkv, d, "bf16"),
            "o_part": tensor("f32", "M", hq, "S", d, role="out"),
            "lse": tensor("f32", "M", hq, "S", role="out"),
        },
        sizes=("M", "maxp", "R", "NP", "S", "split"),
        block=(threads, 1, 1),
        grid=(hq, f"cdiv(M, {bm})", "S"),
        requires=("M >= 1", "maxp >= 1", "R >= 1", "NP >= 1", f"cdiv(M, {bm}) <= 65535", "S >= 1", "S <= 65535",
                  f"split >= {BN}", f"split % {BN} == 0"),
        arches=HOPPER,
        note=f"WGMMA causal prefill attention over key splits ({wgs} warpgroups, {bm}-row tiles"
             f"{', softmax under the previous PV' if form in OVERLAP_FORMS else ''}), split "
             f"partials for attention.combine, paged K/V, GQA {hq}/{hkv}, D={d}",
        example_sizes={"M": 1024, "maxp": 4096, "R": 1, "NP": 4096, "S": 8, "split": 32768},
    )


# Forms compiled over key splits: wg2 only. wg2p's partial outputs there equalled wg2's bit for bit
# but its log2-sum-exp differed by 1 ulp in places (30 of 30 cases on the H200), and it was barely
# faster (330 TFLOP/s against 323 over 2,048-key splits at 8K), so it is not built over splits.
KV_SPLIT_FORMS = ("wg2",)


def variants() -> list[Variant]:
    out = []
    for name, hq, hkv, d in _SHAPES:
        if d % 64 or hq % hkv:
            raise ValueError(f"attention_wgmma {name}: head dim must be a multiple of 64")
        out += [_fwd(name, hq, hkv, d, form, "bf16") for form in FORMS]
        # Quantised KV pages, dequantised into the bf16 tiles: the 128-row form only.
        out += [_fwd(name, hq, hkv, d, "wg2", kv) for kv in attention.KV_FORMATS[1:]]
        out += [_fwd_kv_split(name, hq, hkv, d, form) for form in KV_SPLIT_FORMS]
    return out


def reference(q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray, table_row: np.ndarray, pos: np.ndarray,
              x: np.ndarray, *, exact: bool = False, block: int = 64) -> np.ndarray:
    """`attention_prefill.reference` (same arguments and result) computed a block of query rows
    and a KV head at a time as matrix products, so the GPU tests can check 1000-row chunks over
    6000 keys in seconds. exact: float64 throughout; else the bf16 baseline (fp32 attention, the
    output and the gate's sigmoid rounded to bf16 as the kernels do). Agrees with the row-by-row
    reference (tests/unit/test_attention_wgmma_reference.py)."""
    ft = np.float64 if exact else np.float32
    m, hq, d = q.shape
    hkv = k_pages.shape[1]
    r = hq // hkv
    n = int(pos.max()) + 1
    rows = np.asarray(table_row)[np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
    k, v = k_pages[rows].astype(ft), v_pages[rows].astype(ft)
    out = np.empty((m, hq, d), ft)
    for m0 in range(0, m, block):
        qb, pb = q[m0:m0 + block].astype(ft), np.asarray(pos[m0:m0 + block])
        keys = int(pb.max()) + 1
        rb = len(pb)
        # [rows, 1, keys]: -inf past the row's position, 0 elsewhere
        mask = np.where(np.arange(keys)[None, :] > pb[:, None], -np.inf, 0.0).astype(ft)[:, None, :]
        for g in range(hkv):
            s = (qb[:, g * r:(g + 1) * r].reshape(rb * r, d) @ k[:keys, g].T).reshape(rb, r, keys)
            s = s * ft(d ** -0.5) + mask
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            o = (p.reshape(rb * r, keys) @ v[:keys, g]).reshape(rb, r, d)
            out[m0:m0 + block, g * r:(g + 1) * r] = o / p.sum(axis=-1, keepdims=True)
    gate = x[:, :hq * 2 * d].reshape(m, hq, 2 * d)[..., d:]
    sig = 1.0 / (1.0 + np.exp(-gate.astype(ft)))
    if exact:
        return (out * sig).reshape(m, hq * d)
    y = round_bf16(out.astype(np.float32)) * round_bf16(sig.astype(np.float32))
    return round_bf16(y).reshape(m, hq * d)


# --------------------------------------------------------------------------- kernel


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["form"] in OVERLAP_FORMS:
        from . import _attention_wgmma_overlap
        return _attention_wgmma_overlap.build(variant)
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.tensor_utils.layout import LayoutEnum

    from . import _attention_tiles, _dsl, _kv_quant

    row_of = _attention_tiles.wgmma_row_of  # accumulator value -> its row of two

    cfg = variant.config
    hq, hkv, d, stride, kv = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"], cfg["kv"]
    bm, threads = cfg["BM"], cfg["threads"]
    kv_split = bool(cfg.get("kv_split"))
    wgs = threads // 128
    group = hq // hkv
    scale_log2 = d ** -0.5 * LOG2E
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    ninf = -float("inf")
    k_major, mn_major = LayoutEnum.ROW_MAJOR, LayoutEnum.COL_MAJOR
    s_vals = BN // 2  # S accumulator values per thread: 2 rows x BN / 4 columns
    o_vals = d // 2

    def smem_layouts() -> tuple[Any, Any, Any]:
        q_lay = sm90.make_smem_layout_a(k_major, (bm, BN, d), bf16, 1)  # (BM, D, 1)
        k_lay = sm90.make_smem_layout_b(k_major, (bm, BN, d), bf16, STAGES)  # (BN, D, stages)
        v_lay = sm90.make_smem_layout_b(mn_major, (bm, d, BN), bf16, STAGES)  # (D, BN, stages), d contiguous
        for what, lay in (("q", q_lay), ("k", k_lay), ("v", v_lay)):
            if "S<3,4,3>" not in str(lay.inner):
                raise ValueError(f"{variant.name}: {what} smem layout is {lay.inner}, expected 128-byte swizzle")
        return q_lay, k_lay, v_lay

    @cute.jit
    def load_tile(gcopy: Any, thr_g: Any, src_base: Any, dst: Any, tile_rows: Any, row0: Any, end: Any) -> None:
        """cp.async a (rows, D) tile whose row r is at src_base + r * row_stride into dst (a
        (rows, D) view of shared memory); rows at or past `end` (row0 + r counted) are zero-filled:
        pages may hold anything there and 0 * NaN is NaN."""
        tsrc = thr_g.partition_S(src_base)
        tdst = thr_g.partition_D(dst)
        for i in cutlass.range_constexpr(cute.size(tdst.shape[1])):
            if row0 + tile_rows[0, i, 0][0] < end:
                cute.copy(gcopy, tsrc[None, i, None], tdst[None, i, None])
            else:
                tdst[None, i, None].fill(0)

    @cute.jit
    def load_quant_tile(thr_g: Any, pages: Any, page: Any, kvh: Any, dst: Any, tile_rows: Any, row0: Any,
                        end: Any) -> None:
        """`load_tile` for a quantised page: each thread's 8-column chunks are loaded as codes,
        times the token-head's scale, rounded to bf16 into dst (plain loads and shared stores, no
        cp.async); rows at or past `end` are zero-filled."""
        tdst = thr_g.partition_D(dst)
        for i in cutlass.range_constexpr(cute.size(tdst.shape[1])):
            row = tile_rows[0, i, 0][0]
            if row0 + row < end:
                codes, scale_byte = _kv_quant.page_offsets(page * BN + row, kvh, hkv, d)
                scale = _kv_quant.scale_at(pages, scale_byte)
                for j in cutlass.range_constexpr(cute.size(tdst.shape[2])):
                    vals = _kv_quant.codes_f32(_kv_quant.load8(pages, codes + tile_rows[0, i, j][1]), kv) * scale
                    tdst[None, i, j].store(vals.to(bf16))
            else:
                tdst[None, i, None].fill(0)

    def load_kv(gcopy: Any, thr_g: Any, kv_rows: Any, page: Any, kvh: Any, k_pages: Any, v_pages: Any,
                k_dst: Any, v_dst: Any, row0: Any, end: Any) -> None:
        """One K and one V tile (a page) into shared memory: cp.async of bf16 pages, or the
        dequantised codes of quantised ones."""
        if kv == "bf16":
            kv_stride = hkv * d
            for pool, dst in ((k_pages, k_dst), (v_pages, v_dst)):
                src = cute.make_tensor(pool + cute.assume((cutlass.Int64(page) * BN * hkv + kvh) * d, divby=8),
                                       cute.make_layout((BN, d), stride=(kv_stride, 1)))
                load_tile(gcopy, thr_g, src, dst, kv_rows, row0, end)
        else:
            load_quant_tile(thr_g, k_pages, page, kvh, k_dst, kv_rows, row0, end)
            load_quant_tile(thr_g, v_pages, page, kvh, v_dst, kv_rows, row0, end)

    @cute.jit
    def attend(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, o_part: cute.Pointer,
               lse: cute.Pointer, m: cutlass.Int32, maxp: cutlass.Int32, ns: cutlass.Int32,
               split: cutlass.Int32) -> None:
        """The kernel body: x / out (gate, bf16 output) or, over key splits, o_part / lse, ns, split."""
        q_lay, k_lay, v_lay = smem_layouts()
        tid, _, _ = cute.arch.thread_idx()
        head, by, sidx = cute.arch.block_idx()
        tiles = (m + bm - 1) // bm
        m0 = (tiles - 1 - by) * bm  # longest tiles first
        kvh = head // group
        gpos = cute.make_tensor(pos, cute.make_layout(m))
        end = gpos[cutlass.min(m0 + bm - 1, m - 1)] + 1  # keys this tile reads: 0..end-1
        # Keys k_lo..k_hi-1 (tiles kb0..nkb-1): all of them, or this CTA's split of them (none
        # when the split starts past the tile's last row: zero-filled loads, no iteration).
        k_lo = cutlass.Int32(0)
        k_hi = end
        if cutlass.const_expr(kv_split):
            k_lo = sidx * split
            k_hi = cutlass.min(k_lo + split, end)
        kb0 = k_lo // BN
        nkb = (k_hi + BN - 1) // BN
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
        kv_rows = thr_g.partition_S(cute.make_identity_tensor((BN, d)))
        key_by_d = cute.make_layout((BN, d), stride=(d, 1))

        gQ = cute.make_tensor(q + cute.assume((cutlass.Int64(m0) * hq + head) * d, divby=8),
                              cute.make_layout((bm, d), stride=(hq * d, 1)))
        load_tile(gcopy, thr_g, gQ, sQ[None, None, 0], q_rows, m0, m)
        load_kv(gcopy, thr_g, kv_rows, trow[kb0], kvh, k_pages, v_pages, sK[None, None, 0],
                cute.composition(sV[None, None, 0], key_by_d), k_lo, k_hi)
        cute.arch.cp_async_commit_group()

        # ---- WGMMA partitions: warpgroup w owns query rows 64w..64w+63 of the tile.
        qk_mma = sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                             k_major.sm90_mma_major_mode(), f32, (wgs, 1, 1), tiler_mn=(WG_ROWS, BN))
        pv_mma = sm90.make_trivial_tiled_mma(bf16, bf16, k_major.sm90_mma_major_mode(),
                                             mn_major.sm90_mma_major_mode(), f32, (wgs, 1, 1),
                                             tiler_mn=(WG_ROWS, d), a_source=warpgroup.OperandSource.RMEM)
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)  # O accumulates over all tiles (an atom starts at False)
        wg_first = (tid // 128) * 128
        qk_wg, pv_wg = qk_mma.get_slice(wg_first), pv_mma.get_slice(wg_first)
        qk_thr, pv_thr = qk_mma.get_slice(tid), pv_mma.get_slice(tid)
        tSrQ = qk_mma.make_fragment_A(qk_wg.partition_A(sQ))  # (MMA, 1, D / 16, 1)
        tSrK = qk_mma.make_fragment_B(qk_wg.partition_B(sK))  # (MMA, 1, D / 16, stages)
        tOrV = pv_mma.make_fragment_B(pv_wg.partition_B(sV))  # (MMA, 1, BN / 16, stages)
        s_coords = qk_thr.partition_C(cute.make_identity_tensor((bm, BN)))
        o_coords = pv_thr.partition_C(cute.make_identity_tensor((bm, d)))
        acc_s = cute.make_rmem_tensor(s_coords.shape, f32)
        acc_o = cute.make_rmem_tensor(o_coords.shape, f32)
        acc_o.fill(0.0)
        r_p = cute.make_rmem_tensor(s_coords.shape, bf16)
        # P as the A operand of the k16 products: accumulator column groups 2j, 2j + 1 (columns
        # 16j..16j+15) are the RS-WGMMA A fragment of k-block j (the same thread/value placement).
        t_p = cute.make_tensor(r_p.iterator, cute.make_layout(((2, 2, 2), 1, BN // 16), stride=((1, 2, 4), 0, 8)))
        k_blocks_qk = cute.size(tSrQ, mode=[2])

        # This thread's two rows and their positions (rows past M repeat the last row's).
        row_pos = cute.make_rmem_tensor((2,), cutlass.Int32)
        row_max = cute.make_rmem_tensor((2,), f32)
        row_sum = cute.make_rmem_tensor((2,), f32)
        for h in range(2):
            row_pos[h] = gpos[cutlass.min(m0 + s_coords[2 * h][0], m - 1)]
            row_max[h] = f32(ninf)
            row_sum[h] = f32(0.0)

        for kb in cutlass.range(kb0, nkb, unroll=1):
            n0 = kb * BN
            stage = (kb - kb0) % STAGES
            # The next tile's copies go out first (its stage was released by the barrier that
            # ended the previous iteration).
            if kb + 1 < nkb:
                nxt = (kb - kb0 + 1) % STAGES
                load_kv(gcopy, thr_g, kv_rows, trow[kb + 1], kvh, k_pages, v_pages, sK[None, None, nxt],
                        cute.composition(sV[None, None, nxt], key_by_d), n0 + BN, k_hi)
            cute.arch.cp_async_commit_group()
            # This tile (and Q) landed; cp.async and the zero fills write through the generic
            # proxy and WGMMA reads through the async one: fence, then make every thread's rows
            # visible to every warpgroup.
            cute.arch.cp_async_wait_group(1)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

            # S = Q K^T
            qk_mma.set(warpgroup.Field.ACCUMULATE, False)
            warpgroup.fence()
            for kk in cutlass.range_constexpr(k_blocks_qk):
                cute.gemm(qk_mma, acc_s, tSrQ[None, None, kk, 0], tSrK[None, None, kk, stage], acc_s)
                qk_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # Online softmax (exp2 domain), causal mask where the tile reaches past the first row.
            if n0 + BN - 1 > row_pos[0]:
                for i in cutlass.range_constexpr(s_vals):
                    if n0 + s_coords[i][1] > row_pos[row_of(i)]:
                        acc_s[i] = f32(ninf)
            corr = cute.make_rmem_tensor((2,), f32)
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
            for i in cutlass.range_constexpr(o_vals):
                acc_o[i] = acc_o[i] * corr[row_of(i)]
            r_p.store(acc_s.load().to(bf16))

            # O += P V (P and the rescaled O were written by this thread's own registers: the
            # WGMMA fence orders them before the MMA reads them).
            warpgroup.fence()
            for kk in cutlass.range_constexpr(BN // 16):
                cute.gemm(pv_mma, acc_o, t_p[None, None, kk], tOrV[None, None, kk, stage], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warpgroup is done with this stage (and, last, with sQ)
        cute.arch.cp_async_wait_group(0)

        # ---- epilogue
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            row_sum[h] = total
        if cutlass.const_expr(kv_split):
            # The split's O / sum (fp32) and log2-sum-exp per row that has keys in it (a row that
            # ends before k_lo has none: its values are not finite and the combine never reads them).
            for h in cutlass.range_constexpr(2):
                row = m0 + s_coords[2 * h][0]
                if row < m and row_pos[h] >= k_lo and tid % 4 == 0:
                    cute.make_tensor(lse + (cutlass.Int64(row) * hq + head) * ns + sidx, cute.make_layout(1))[0] = (
                        row_max[h] * f32(scale_log2) + cute.math.log2(row_sum[h]))
            for i in cutlass.range_constexpr(o_vals):
                r, c = o_coords[i]
                if m0 + r < m and row_pos[row_of(i)] >= k_lo:
                    base = (cutlass.Int64(m0 + r) * hq + head) * ns + sidx
                    cute.make_tensor(o_part + base * d + c, cute.make_layout(1))[0] = acc_o[i] / row_sum[row_of(i)]
        else:
            # O / sum -> bf16 into Q's buffer, then out = O * sigmoid(gate), coalesced
            sO = sQ[None, None, 0]
            _attention_tiles.wgmma_o_to_smem(acc_o, row_sum, o_coords, sO, o_vals)
            _attention_tiles.store_gated_rows(tid, sO, x, out, m0, m, head, threads, hq, d, stride, bm)

    if kv_split:
        @cute.kernel
        def kernel(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
                   qseq: cute.Pointer, pos: cute.Pointer, o_part: cute.Pointer, lse: cute.Pointer, m: cutlass.Int32,
                   maxp: cutlass.Int32, ns: cutlass.Int32, split: cutlass.Int32):
            attend(q, k_pages, v_pages, table, qseq, pos, q, q, o_part, lse, m, maxp, ns, split)

        @cute.jit
        def launch(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
                   qseq: cute.Pointer, pos: cute.Pointer, o_part: cute.Pointer, lse: cute.Pointer, m: cutlass.Int32,
                   maxp: cutlass.Int32, ns: cutlass.Int32, split: cutlass.Int32, stream: Any):
            kernel(q, k_pages, v_pages, table, qseq, pos, o_part, lse, m, maxp, ns, split).launch(
                grid=_dsl.grid(variant, {"M": m, "S": ns}), block=list(variant.block), stream=stream)

        aligns = {"table": 4, "qseq": 4, "pos": 4, "lse": 4, "o_part": 4}
    else:
        @cute.kernel
        def kernel(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
                   qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
                   maxp: cutlass.Int32):
            attend(q, k_pages, v_pages, table, qseq, pos, x, out, x, x, m, maxp, cutlass.Int32(1), cutlass.Int32(BN))

        @cute.jit
        def launch(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
                   qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
                   maxp: cutlass.Int32, stream: Any):
            kernel(q, k_pages, v_pages, table, qseq, pos, x, out, m, maxp).launch(
                grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

        aligns = {"table": 4, "qseq": 4, "pos": 4}
    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_wgmma_{variant.key}")
    return launch, _dsl.example_args(variant, aligns=aligns)
