"""Prefill attention on tensor cores: causal, GQA, paged K/V, sigmoid output gate fused.

One CTA computes a tile of 64 query rows of one query head (`fwd_*`, 4 warps, each warp 16
rows) flash-attention style: Q stays in shared memory, K and V stream in tiles of 64 keys (one KV
page per tile, found through the page table) with cp.async, S = Q Kᵀ and O += P V run as
warp-level `mma.sync` m16n8k16 BF16 with fp32 accumulators (operands from swizzled shared memory
through ldmatrix; V through the transposing ldmatrix), and the online softmax runs in registers
(exp2 domain, fp32), P is converted to bf16 in registers and used directly as the A operand of
the PV product.

Inputs are the ones the split-KV path already has: `q [M, Hq, D]` as `attention.prep` writes it
(normed, roped), the K/V pages `[NP * 64, Hkv, D]` (the chunk's own K/V already written by prep),
the page table `table [R, maxp]` with the sequence's row `qseq[0]`, and `pos[m]`, the position of
query row m: row m sees keys `0..pos[m]`. Positions must be non-decreasing over the rows (a
prefill chunk): a CTA reads the keys up to the position of its last row. The epilogue divides by
the softmax sum, rounds to bf16, multiplies by `sigmoid(gate)` (gate read from the fused
projection `x`, rounded like `attention.combine`) and writes bf16 `out [M, Hq * D]` for o_proj, so
the runner launches this kernel in place of `split` + `combine`.

Head dim 256 and registers: the O accumulator of a 64 x 256 tile is 128 fp32 registers per
thread with 4 warps (the tile shape FA2 uses for d=256 on SM80). We chose 64-query tiles over a
split of D: splitting D would compute S twice (or exchange P through shared memory) for the two
halves, and 64 rows x 64 keys keeps shared memory at 96 KB (Q, K, V one tile each).

Query tiles run longest first (the grid's y index counts down from the last tile), and the Hq
heads of one tile are consecutive CTAs, so the Hq/Hkv heads sharing a KV head read its tiles
from L2 at about the same time (no GQA packing: at prefill sizes each head fills its own tiles).

Not yet: WGMMA/TMA (the Hopper form, kernel-playbook section 6.1), double-buffered K/V, LSE out.
"""

from typing import Any

import numpy as np

from . import attention
from .variant import HOPPER, Variant, i32, ptr, tensor

FAMILY = "attention_prefill"
PAGE = attention.PAGE
BM = 64  # query rows per CTA
BN = PAGE  # keys per tile: one KV page
THREADS = 128
LOG2E = attention.LOG2E

# Same shapes as cute_kernels/attention.py: tiny dense model, Qwen3.6-27B, Qwen3.6-35B-A3B.
_SHAPES = [(name, hq, hkv, d) for name, hq, hkv, d, _ in attention._SHAPES]


def _fwd(name: str, hq: int, hkv: int, d: int) -> Variant:
    stride = attention.x_stride(hq, hkv, d)
    return Variant(
        family=FAMILY,
        key=f"fwd_{name}",
        config={"kind": "fwd", "Hq": hq, "Hkv": hkv, "D": d, "x_stride": stride, "BM": BM, "BN": BN,
                "threads": THREADS},
        params=[ptr("q"), ptr("k_pages"), ptr("v_pages"), ptr("table"), ptr("qseq"), ptr("pos"), ptr("x"),
                ptr("out"), i32("M"), i32("maxp")],
        tensors={
            **attention.paged_query_tensors(hq, hkv, d),
            "x": tensor("bf16", "M", stride),
            "out": tensor("bf16", "M", hq * d, role="out"),
        },
        sizes=("M", "maxp", "R", "NP"),
        block=(THREADS, 1, 1),
        grid=(hq, f"cdiv(M, {BM})", 1),
        requires=("M >= 1", "maxp >= 1", "R >= 1", "NP >= 1", f"cdiv(M, {BM}) <= 65535"),
        arches=HOPPER,
        note=f"tensor-core causal prefill attention (mma.sync), paged K/V, gate fused, GQA {hq}/{hkv}, D={d}",
        example_sizes={"M": 2048, "maxp": 64, "R": 1, "NP": 64},
    )


def variants() -> list[Variant]:
    out = []
    for name, hq, hkv, d in _SHAPES:
        if d % 64 or hq % hkv:
            raise ValueError(f"attention_prefill {name}: head dim must be a multiple of 64")
        out.append(_fwd(name, hq, hkv, d))
    return out


def reference(q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray, table_row: np.ndarray, pos: np.ndarray,
              x: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """Gated causal attention of q [M, Hq, D] (row m at position pos[m]) over the keys of one
    sequence stored in pages (k_pages, v_pages [NP * 64, Hkv, D], page j of the sequence is
    table_row[j]); the gate comes from the fused projection x [M, x_stride]. Returns [M, Hq*D]."""
    m, hq, d = q.shape
    n = int(pos.max()) + 1
    rows = np.asarray(table_row)[np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
    gate = x[:, :hq * 2 * d].reshape(m, hq, 2 * d)[..., d:]
    return attention.reference_attention(q, k_pages[rows], v_pages[rows], pos, gate, exact=exact)


# --------------------------------------------------------------------------- kernel


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync, warp

    from . import _attention_tiles, _dsl

    cfg = variant.config
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    group = hq // hkv
    scale_log2 = d ** -0.5 * LOG2E
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    ninf = -float("inf")

    @cute.kernel
    def kernel(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               maxp: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        head, by, _ = cute.arch.block_idx()
        tiles = (m + BM - 1) // BM
        m0 = (tiles - 1 - by) * BM  # longest tiles first
        kvh = head // group
        gpos = cute.make_tensor(pos, cute.make_layout(m))
        first_pos = gpos[m0]
        end = gpos[cutlass.min(m0 + BM - 1, m - 1)] + 1  # keys this tile reads: 0..end-1
        nkb = (end + BN - 1) // BN
        seq = cute.make_tensor(qseq, cute.make_layout(m))[m0]
        trow = cute.make_tensor(table + cutlass.Int64(seq) * maxp, cute.make_layout(maxp))

        # ---- shared memory: Q, K, V tiles, 128-byte rows swizzled for ldmatrix
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                         cute.make_layout((8, 64), stride=(64, 1)))
        s_layout = cute.tile_to_shape(atom, (BM, d), (0, 1))
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(bf16, s_layout, byte_alignment=1024)
        sK = smem.allocate_tensor(bf16, s_layout, byte_alignment=1024)
        sV = smem.allocate_tensor(bf16, s_layout, byte_alignment=1024)
        sVt = cute.composition(sV, cute.make_layout((d, BN), stride=(BN, 1)))

        # ---- global -> shared copies: 16 bytes per thread per copy, 8 threads per 64 columns
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), bf16,
                                  num_bits_per_copy=128)
        gcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((THREADS // 8, 8), stride=(8, 1)),
                                        cute.make_layout((1, 8)))
        thr_g = gcopy.get_slice(tid)
        tile_rows = thr_g.partition_S(cute.make_identity_tensor((BM, d)))
        tQsQ = thr_g.partition_D(sQ)
        tKsK = thr_g.partition_D(sK)
        tVsV = thr_g.partition_D(sV)
        gQ = cute.make_tensor(q + cute.assume((cutlass.Int64(m0) * hq + head) * d, divby=8), cute.make_layout((BM, d), stride=(hq * d, 1)))
        tQgQ = thr_g.partition_S(gQ)
        for i in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if m0 + tile_rows[0, i, 0][0] < m:
                cute.copy(gcopy, tQgQ[None, i, None], tQsQ[None, i, None])
            else:
                tQsQ[None, i, None].fill(0)
        # Keys past the end read as zeros (pages may hold anything there; P is 0 for them, but
        # 0 * NaN would not be).
        src = cute.make_tensor(k_pages + cute.assume((cutlass.Int64(trow[0]) * (BN * hkv) + kvh) * d, divby=8),
                              cute.make_layout((BN, d), stride=(hkv * d, 1)))
        tsrc = thr_g.partition_S(src)
        for i in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
            if (0) * BN + tile_rows[0, i, 0][0] < end:
                cute.copy(gcopy, tsrc[None, i, None], tKsK[None, i, None])
            else:
                tKsK[None, i, None].fill(0)
        cute.arch.cp_async_commit_group()
        src = cute.make_tensor(v_pages + cute.assume((cutlass.Int64(trow[0]) * (BN * hkv) + kvh) * d, divby=8),
                              cute.make_layout((BN, d), stride=(hkv * d, 1)))
        tsrc = thr_g.partition_S(src)
        for i in cutlass.range_constexpr(cute.size(tVsV.shape[1])):
            if (0) * BN + tile_rows[0, i, 0][0] < end:
                cute.copy(gcopy, tsrc[None, i, None], tVsV[None, i, None])
            else:
                tVsV[None, i, None].fill(0)
        cute.arch.cp_async_commit_group()

        # ---- tensor-core partitions
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(bf16, f32, (16, 8, 16)), (THREADS // 32, 1, 1),
                                  permutation_mnk=(THREADS // 32 * 16, 16, 16))
        thr_mma = mma.get_slice(tid)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
        acc_o = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, d)), f32)
        acc_o.fill(0.0)
        ld_q = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), bf16), mma)
        ld_k = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), bf16), mma)
        ld_v = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), bf16), mma)
        thr_lq, thr_lk, thr_lv = ld_q.get_slice(tid), ld_k.get_slice(tid), ld_v.get_slice(tid)
        tSsQ, tSrQv = thr_lq.partition_S(sQ), thr_lq.retile(tSrQ)
        tSsK, tSrKv = thr_lk.partition_S(sK), thr_lk.retile(tSrK)
        tOsVt, tOrVtv = thr_lv.partition_S(sVt), thr_lv.retile(tOrVt)
        nk_qk = cute.size(tSsQ.shape[2])
        nk_pv = BN // 16

        # Rows of the S tile this thread holds, and their positions.
        tScS = _attention_tiles.acc_rows_cols(thr_mma.partition_C(cute.make_identity_tensor((BM, BN))))
        nrows = cute.size(tScS.shape[0])
        ncols = cute.size(tScS.shape[1])
        row_pos = cute.make_rmem_tensor((nrows,), cutlass.Int32)
        row_max = cute.make_rmem_tensor((nrows,), f32)
        row_sum = cute.make_rmem_tensor((nrows,), f32)
        for r in cutlass.range_constexpr(nrows):
            row_pos[r] = gpos[cutlass.min(m0 + tScS[r, 0][0], m - 1)]
            row_max[r] = f32(ninf)
            row_sum[r] = f32(0.0)
        acc_o_mn = _attention_tiles.acc_rows_cols(acc_o)

        for kb in cutlass.range(nkb, unroll=1):
            n0 = kb * BN
            # S = Q K^T once Q and this K tile have landed (the V tile may still be in flight).
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()
            acc_s = cute.make_rmem_tensor(thr_mma.partition_shape_C((BM, BN)), f32)
            acc_s.fill(0.0)
            cute.copy(ld_q, tSsQ[None, None, 0], tSrQv[None, None, 0])
            cute.copy(ld_k, tSsK[None, None, 0], tSrKv[None, None, 0])
            for k in cutlass.range_constexpr(nk_qk):
                if cutlass.const_expr(k + 1 < nk_qk):
                    cute.copy(ld_q, tSsQ[None, None, k + 1], tSrQv[None, None, k + 1])
                    cute.copy(ld_k, tSsK[None, None, k + 1], tSrKv[None, None, k + 1])
                cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
            cute.arch.sync_threads()  # every warp is done with sK
            if kb + 1 < nkb:
                src = cute.make_tensor(k_pages + cute.assume((cutlass.Int64(trow[kb + 1]) * (BN * hkv) + kvh) * d, divby=8),
                                      cute.make_layout((BN, d), stride=(hkv * d, 1)))
                tsrc = thr_g.partition_S(src)
                for i in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                    if (kb + 1) * BN + tile_rows[0, i, 0][0] < end:
                        cute.copy(gcopy, tsrc[None, i, None], tKsK[None, i, None])
                    else:
                        tKsK[None, i, None].fill(0)
            cute.arch.cp_async_commit_group()

            # Online softmax in registers (exp2 domain); causal mask on tiles that reach past the
            # first row's position. Key 0 is in every row's range, so after the first tile every
            # row max is finite and a fully masked row in a later tile adds exp2(-inf) = 0.
            s_mn = _attention_tiles.acc_rows_cols(acc_s)
            if n0 + BN - 1 > first_pos:
                for r in cutlass.range_constexpr(nrows):
                    for c in cutlass.range_constexpr(ncols):
                        if n0 + tScS[0, c][1] > row_pos[r]:
                            s_mn[r, c] = f32(ninf)
            for r in cutlass.range_constexpr(nrows):
                srow = s_mn[r, None].load()
                cur = _attention_tiles.quad_reduce(srow.reduce(cute.ReductionOp.MAX, f32(ninf), 0), cute.arch.fmax)
                new_max = cute.arch.fmax(row_max[r], cur)
                corr = cute.math.exp2((row_max[r] - new_max) * f32(scale_log2), fastmath=True)
                p = cute.math.exp2(srow * f32(scale_log2) - new_max * f32(scale_log2), fastmath=True)
                row_sum[r] = row_sum[r] * corr + p.reduce(cute.ReductionOp.ADD, f32(0.0), 0)
                row_max[r] = new_max
                s_mn[r, None] = p
                acc_o_mn[r, None] = acc_o_mn[r, None].load() * corr
            r_p = cute.make_rmem_tensor(acc_s.layout, bf16)
            r_p.store(acc_s.load().to(bf16))
            t_p = _attention_tiles.acc_as_a_operand(r_p)

            # O += P V once this V tile has landed (the next K tile may still be in flight).
            cute.arch.cp_async_wait_group(1)
            cute.arch.sync_threads()
            for k in cutlass.range_constexpr(nk_pv):
                cute.copy(ld_v, tOsVt[None, None, k], tOrVtv[None, None, k])
                cute.gemm(mma, acc_o, t_p[None, None, k], tOrVt[None, None, k], acc_o)
            cute.arch.sync_threads()  # every warp is done with sV
            if kb + 1 < nkb:
                src = cute.make_tensor(v_pages + cute.assume((cutlass.Int64(trow[kb + 1]) * (BN * hkv) + kvh) * d, divby=8),
                                      cute.make_layout((BN, d), stride=(hkv * d, 1)))
                tsrc = thr_g.partition_S(src)
                for i in cutlass.range_constexpr(cute.size(tVsV.shape[1])):
                    if (kb + 1) * BN + tile_rows[0, i, 0][0] < end:
                        cute.copy(gcopy, tsrc[None, i, None], tVsV[None, i, None])
                    else:
                        tVsV[None, i, None].fill(0)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

        # ---- epilogue: O / sum -> bf16 into shared memory (Q's buffer), then out = O * sigmoid(gate)
        for r in cutlass.range_constexpr(nrows):
            total = _attention_tiles.quad_reduce(row_sum[r], lambda a, b: a + b)
            acc_o_mn[r, None] = acc_o_mn[r, None].load() * (f32(1.0) / total)
        r_o = cute.make_rmem_tensor(acc_o.layout, bf16)
        r_o.store(acc_o.load().to(bf16))
        cute.arch.sync_threads()
        sO = cute.make_tensor(sQ.iterator, s_layout)
        st_o = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16), mma)
        thr_so = st_o.get_slice(tid)
        cute.copy(st_o, thr_so.retile(r_o), thr_so.partition_D(sO))
        cute.arch.sync_threads()
        _attention_tiles.store_gated_rows(tid, sO, x, out, m0, m, head, THREADS, hq, d, stride, BM)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_prefill_{variant.key}")

    @cute.jit
    def launch(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               maxp: cutlass.Int32, stream: Any):
        kernel(q, k_pages, v_pages, table, qseq, pos, x, out, m, maxp).launch(
            grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"table": 4, "qseq": 4, "pos": 4})
