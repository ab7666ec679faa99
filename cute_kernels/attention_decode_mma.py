"""Split-KV decode attention on tensor cores: the `mma_*` drop-in for `attention.split_*`.

Same inputs and outputs as `attention.split_*` (q `[M, Hq, D]` from `attention.prep`, the K/V page
pools `[NP * 64, Hkv, D]`, the page table, `qseq`, `pos`; each row's normalised split partials
`o_part [M, Hq, S, D]` fp32 and their log2-sum-exp `lse [M, Hq, S]`) and the same split plan (a
fixed split count S per row, each row's split length from its own position:
`attention.split_length`), so `attention.combine_*` merges them unchanged.

One CTA per (sequence, KV head, split). Its M side is the Hq/Hkv query heads sharing the KV head
times the sequence's T query tokens (T = 1 at decode; up to `tmax` for speculative verification,
where rows are position-major: token t of sequence b is row `t * B + b`, B = M / T), padded to
m16 tiles, so every K/V row is read once for all of them. Row (t, h) sees the keys of ITS split
(`attention.split_length` of its own position: verification rows may split differently), the
CTA reads the union of its rows' ranges and masks per row (causal inside the query block).

K and V stream through shared memory in tiles of `BN` keys (16 a key slice; at most a page: a tile
never straddles a page, and split starts are whole pages) with cp.async, `STAGES` tiles in flight (decode is a
streaming read; the bytes in flight are what keeps HBM busy). Warps are (m-tile, key slice): warp
(mt, ks) computes S = Q K^T for its m-tile and keys [16 ks, 16 ks + 16) of each tile with warp
`mma.sync` m16n8k16 bf16 (fp32 accumulate; operands by ldmatrix from swizzled shared memory, V
through the transposing ldmatrix), keeps its own online softmax in fp32 registers (exp2 domain,
as `split_*`) and O += P V, P in bf16 registers as the A operand. After the last tile the key
slices of an m-tile merge through shared memory in slice order (a fixed order: a sequence's
numbers do not depend on the other sequences of the batch).

FP8 / INT8 pages (`runtime.model.kv_format`; the `*_fp8` / `*_int8` variants): the same kernel
over half the bytes. A tile's code bytes and per token-head scales stream into a deeper staging
ring (`KVQ_STAGES`) and stay codes in shared memory; each warp converts the codes of its key
slice in registers into its B operands (exactly: every code is a bf16 value), the K scale
multiplies the score and the V scale the softmax weight before its bf16 rounding
(`_decode_mma_kvq.py`, which describes the permuted fragments this takes).
"""

from typing import Any

import numpy as np

from runtime.model.kv_format import FORMATS as KV_FORMATS
from runtime.model.kv_format import page_bytes

from . import attention
from .bf16 import round_bf16
from .variant import HOPPER, Variant, i32, ptr, tensor

FAMILY = "attention_decode_mma"
PAGE = attention.PAGE
KS = 2  # warps over the keys of a tile, 16 keys each: tiles of 16 * KS keys (config "BN")
STAGES = 3  # tiles in flight per CTA (bf16 pages)
# Tiles in flight over quantised pages: a tile is half the bytes, so one more stage keeps as many
# bytes in flight and still fits 3 CTAs per SM at T = 1 (73 KB at D = 256); the key slices'
# merge of a T = 8 CTA (64 rows x D fp32) needs the 4 stages' room.
KVQ_STAGES = 4
# Other forms of the quantised variants (keys `..._{kv}_{form}`, config "form"), built so that
# `bench.attention_forms` times them beside the runner's (form ""): form -> (key slices a tile, stages,
# K codes by `cvt`, the most query tokens it is built for). At 250K keys, batch 1, the first form
# reached 68 % of the copy bandwidth on the H200 against the bf16 form's 92 %, and 3 stages (3 CTAs
# per SM, fewer bytes in flight) or 6 (2 CTAs per SM) did no better: the conversions of the codes,
# not the bytes in flight, bound it. "cvt" (e4m3 only) converts K by the conversion unit
# (`_decode_mma_kvq` module doc); "k4" runs 4 key slices (warps) over tiles of 64 keys in 2 stages,
# twice the warps an SM to hide the conversions' latency with the same bytes in flight.
KVQ_FORMS = {"s3": (KS, 3, False, 1), "s6": (KS, 6, False, 1), "cvt": (KS, KVQ_STAGES, True, 8),
             "k4": (4, 2, False, 1), "k4cvt": (4, 2, True, 1)}
# k4cvt takes 227 registers a thread, so 2 of its 128-thread CTAs an SM. Tried on the H200 and
# dropped (250K keys, batch 1): its registers capped at 168 for 3 CTAs an SM (`.minnctapersm 3`, a
# few spills), 194.8 us at 99 splits (one wave) against k4cvt's 138.3 at 66; a third stage (105 KB
# of shared memory, the same 2 CTAs an SM, twice the bytes in flight): the whole 27B step 16.80 ms
# against k4cvt's 16.74.
LOG2E = attention.LOG2E
TOKENS = (1, 8)  # query tokens per sequence a variant serves at most: decode, verification

_SHAPES = [(name, hq, hkv, d) for name, hq, hkv, d, _ in attention._SHAPES]


def m_tiles(hq: int, hkv: int, tmax: int) -> int:
    """m16 tiles of a CTA's M side (group heads x tokens), rounded up to a power of two so that
    the thread count tiles the K/V copies (8 threads per 64 columns, a tile's rows)."""
    tiles = -(-(hq // hkv * tmax) // 16)
    return 1 << (tiles - 1).bit_length()


def stage_count(kv: str) -> int:
    """Tiles in flight per CTA over pages of format kv."""
    return STAGES if kv == "bf16" else KVQ_STAGES


def _mma(name: str, hq: int, hkv: int, d: int, tmax: int, kv: str, form: str = "", ks: int = KS,
         stages: int = 0, k_cvt: bool = False) -> Variant:
    mt = m_tiles(hq, hkv, tmax)
    threads = 32 * mt * ks
    stages = stages or stage_count(kv)
    suffix = "" if kv == "bf16" else f"_{kv}"  # the bf16 keys predate the formats
    # The key slices' merge (fp32 rows) reuses the K/V stages' shared memory.
    width = 2 if kv == "bf16" else 1  # bytes per staged K/V value (codes: 1)
    if d % 64 or hq % hkv or (ks - 1) * mt * 16 * 4 > 2 * stages * 16 * ks * width:
        raise ValueError(f"attention_decode_mma {name} t{tmax} {kv} {form or 'runner form'}: shape does not tile")
    return Variant(
        family=FAMILY,
        key=f"mma_{name}_t{tmax}{suffix}" + (f"_{form}" if form else ""),
        config={"kind": "mma", "Hq": hq, "Hkv": hkv, "D": d, "tmax": tmax, "MT": mt, "KS": ks, "BN": 16 * ks,
                "stages": stages, "form": form, "k_cvt": k_cvt, "threads": threads, "kv": kv, "pdl": True},
        params=[ptr("q"), ptr("k_pages"), ptr("v_pages"), ptr("table"), ptr("qseq"), ptr("pos"), ptr("o_part"),
                ptr("lse"), i32("M"), i32("T"), i32("S"), i32("min_split"), i32("maxp")],
        tensors={
            **attention.paged_query_tensors(hq, hkv, d, kv),
            "o_part": tensor("f32", "M", hq, "S", d, role="out"),
            "lse": tensor("f32", "M", hq, "S", role="out"),
        },
        sizes=("M", "T", "S", "min_split", "maxp", "R", "NP"),
        block=(threads, 1, 1),
        grid=(f"M // T * {hkv}", "S", 1),
        requires=("M >= 1", "T >= 1", f"T <= {tmax}", "M % T == 0", "S >= 1", "S <= 65535", "min_split >= 1",
                  "maxp >= 1", "R >= 1", "NP >= 1"),
        arches=HOPPER,
        # The page layout of the quantised formats is kv_format's (outside this package).
        extra_sources=() if kv == "bf16" else ("runtime/model/kv_format.py",),
        note=f"tensor-core split-KV decode attention over {kv} KV (mma.sync, cp.async x{stages}), up to "
             f"{tmax} tokens per sequence, GQA {hq}/{hkv}, D={d}",
        example_sizes={"M": tmax, "T": tmax, "S": 32, "min_split": 128, "maxp": 128, "R": 1, "NP": 128},
    )


def variants() -> list[Variant]:
    out = []
    for kv in KV_FORMATS:
        for name, hq, hkv, d in _SHAPES:
            # Quantised pages must keep each tile's code rows 16-byte aligned for cp.async (whole
            # pages of codes + scales).
            if kv != "bf16" and page_bytes(kv, hkv, d) % 16:
                raise ValueError(f"attention_decode_mma {name} {kv}: pages are not 16-byte multiples")
            for tmax in TOKENS:
                out.append(_mma(name, hq, hkv, d, tmax, kv))
                if kv == "bf16":
                    continue
                for form, (ks, stages, k_cvt, most) in KVQ_FORMS.items():
                    if tmax <= most and (kv == "fp8" or not k_cvt):
                        out.append(_mma(name, hq, hkv, d, tmax, kv, form, ks, stages, k_cvt))
    return out


def reference(q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray, pos: int, splits: int, min_split: int,
              *, exact: bool = True, k_scales: np.ndarray | None = None,
              v_scales: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One query row's split partials: q [Hq, D] at position pos over its keys k_rows, v_rows
    [>= pos + 1, Hkv, D] (in sequence order). Returns (o_part [Hq, n, D], lse [Hq, n]) for the
    n splits that hold keys (`attention.split_length`), lse the log2-sum-exp of the scores
    scaled by D^-0.5 * log2(e), as `split_*` writes them. exact=False: the kernel's precision
    model (fp32; the weights P rounded to bf16 for P V, the tensor-core operand, while their sum
    stays fp32), the same-precision baseline of its tests.

    Quantised pages: k_rows / v_rows the decoded codes and k_scales / v_scales [rows, Hkv] their
    token-heads' scales (value = code * scale). The kernel's model then scales the score
    (q . code) by the K scale times D^-0.5 * log2(e), and rounds each weight times its V scale
    to bf16 (the row sum stays the sum of the unscaled weights)."""
    ft = np.float64 if exact else np.float32
    hq, d = q.shape
    r = hq // k_rows.shape[1]
    keys = pos + 1
    ones = np.ones((keys, k_rows.shape[1]))
    # Converted once (not per split and query head); the products read a split's rows of a KV
    # head in place, the same BLAS calls on the same values as over a copy.
    k_rows, v_rows = k_rows[:keys].astype(ft, copy=False), v_rows[:keys].astype(ft, copy=False)
    k_scales = (ones if k_scales is None else k_scales[:keys]).astype(ft) * ft(d ** -0.5 * LOG2E)
    v_scales = (ones if v_scales is None else v_scales[:keys]).astype(ft, copy=False)
    split = int(attention.split_length(pos, splits, min_split))
    n = (pos + split) // split
    o = np.empty((hq, n, d), ft)
    lse = np.empty((hq, n), ft)
    for s in range(n):
        lo, hi = s * split, min((s + 1) * split, keys)
        for h in range(hq):
            sc = (k_rows[lo:hi, h // r] @ q[h].astype(ft)) * k_scales[lo:hi, h // r]
            p = np.exp2(sc - sc.max())
            pv = p * v_scales[lo:hi, h // r]
            o[h, s] = ((pv if exact else round_bf16(pv)) @ v_rows[lo:hi, h // r]) / p.sum()
            lse[h, s] = sc.max() + np.log2(p.sum())
    return o, lse


# --------------------------------------------------------------------------- kernel
# (Helpers at module level, arguments explicit: the DSL does not stage a call of a closure
# inside a runtime loop or if.)


def _k_tile(s_kv: Any, stage: Any, ks: Any, d: int) -> Any:
    """Key slice ks (16 keys x d) of the K tile in `stage`."""
    import cutlass.cute as cute

    return cute.local_tile(s_kv[None, None, stage], (16, d), (ks, 0))


def _vt_tile(s_kv: Any, stage: Any, ks: Any, d: int, bn: int, stages: int) -> Any:
    """Key slice ks of the V tile in `stage`, transposed (d x 16 keys): the B operand of P V."""
    import cutlass.cute as cute

    vt = cute.composition(s_kv[None, None, stages + stage], cute.make_layout((d, bn), stride=(bn, 1)))
    return cute.local_tile(vt, (d, 16), (0, ks))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warp

    from . import _attention_tiles, _decode_mma_kvq, _dsl, _pdl

    cfg = variant.config
    hq, hkv, d, mtiles, ks_n, bn, stages = (cfg[k] for k in ("Hq", "Hkv", "D", "MT", "KS", "BN", "stages"))
    threads, kv, k_cvt = cfg["threads"], cfg["kv"], cfg["k_cvt"]
    quant = kv != "bf16"
    width = d // 2 if quant else d  # 16-bit elements per staged K/V row (quantised: code pairs)
    group = hq // hkv
    rows_cta = mtiles * 16
    f32, bf16, i32t = cutlass.Float32, cutlass.BFloat16, cutlass.Int32
    # Q's type in shared memory and in the scores' product (f16 in the `cvt` forms, scaled by
    # Q_SCALE: `_decode_mma_kvq` module doc), and the factor taking a product to the exp2 domain.
    qtype = cutlass.Float16 if k_cvt else bf16
    scale_log2 = d ** -0.5 * LOG2E / (_decode_mma_kvq.Q_SCALE if k_cvt else 1.0)
    # e4m3 V codes enter P V unscaled by 2^120 (`_decode_mma_kvq` module doc): the weights carry
    # V_SHIFT and the output the rest.
    v_shift = _decode_mma_kvq.V_SHIFT if kv == "fp8" else 1.0
    out_shift = 2.0 ** 120 / v_shift if kv == "fp8" else 1.0
    ninf = -float("inf")

    @cute.kernel
    def kernel(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, o_part: cute.Pointer, lse: cute.Pointer, m: cutlass.Int32,
               tq: cutlass.Int32, ns: cutlass.Int32, min_split: cutlass.Int32, maxp: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        nseq = m // tq
        b = bx // hkv
        kvh = bx % hkv
        wid = tid // 32
        lane = tid % 32
        mt = wid // ks_n
        ks = wid % ks_n
        one = cute.make_layout(1)
        gpos = cute.make_tensor(pos, cute.make_layout(m))
        seq = cute.make_tensor(qseq, cute.make_layout(m))[b]  # row b: the sequence's first token
        trow = cute.make_tensor(table + cutlass.Int64(seq) * maxp, cute.make_layout(maxp))

        # The CTA's keys: the union of its tokens' ranges in split sp (each [lo, hi), empty when
        # the split is past the token's keys).
        start = i32t(2147483647)
        end = i32t(0)
        for t in cutlass.range(tq):
            p = gpos[t * nseq + b]
            split = attention.split_length(p, ns, min_split, cutlass.max)
            lo = sp * split
            hi = cutlass.min(lo + split, p + 1)
            if lo < hi:
                start = cutlass.min(start, lo)
                end = cutlass.max(end, hi)

        # ---- shared memory: Q, then K and V stages (one buffer: the merge reuses it), 128-byte
        # rows swizzled for ldmatrix; quantised pages: code stages and their scales
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
        smem = cutlass.utils.SmemAllocator()
        sQ = smem.allocate_tensor(qtype, cute.tile_to_shape(atom, (rows_cta, d), (0, 1)), byte_alignment=1024)
        if cutlass.const_expr(quant):
            sKV = smem.allocate_tensor(bf16, _decode_mma_kvq.staging_layout(bn, d, stages), byte_alignment=1024)
            s_scale = smem.allocate_tensor(f32, cute.make_layout((bn, 2 * stages)), byte_alignment=16)
        else:
            sKV = smem.allocate_tensor(bf16, cute.tile_to_shape(atom, (bn, d, 2 * stages), (0, 1, 2)),
                                       byte_alignment=1024)
        s_stat = smem.allocate_tensor(f32, cute.make_layout((2, ks_n, rows_cta)), byte_alignment=16)

        # PDL (cute_kernels/_pdl.py): the key range came from the step's metadata; q and the
        # newest K/V rows are the previous kernel's (prep's) output.
        _pdl.wait()
        if start < end:
            ntiles = (end - start + bn - 1) // bn
            keys = (start, end, kvh)
            shape = (threads, hkv, d, bn, stages)

            for s in cutlass.range_constexpr(stages - 1):
                page = _attention_tiles.tile_page(trow, start, end, s, bn)
                if cutlass.const_expr(quant):
                    _decode_mma_kvq.load_tile(tid, sKV, s_scale, k_pages, v_pages, page, *keys, s, s, kv, *shape)
                else:
                    _attention_tiles.load_kv_tile(tid, sKV, k_pages, v_pages, page, *keys, s, s, *shape)
                cute.arch.cp_async_commit_group()

            # Q rows (token t = i // group, head kvh * group + i % group), zeros past the tokens.
            v8 = cute.make_layout((8,))
            qbuf = cute.make_rmem_tensor((8,), bf16)
            qrow = cute.make_rmem_tensor((8,), qtype)
            for c in cutlass.range(tid, rows_cta * (d // 8), threads):
                i = c // (d // 8)
                col = c % (d // 8) * 8
                t = i // group
                qbuf.fill(0)
                if t < tq:
                    src = q + (cutlass.Int64(t * nseq + b) * hq + kvh * group + i % group) * d + col
                    qbuf.store(cute.make_tensor(src, v8).load())
                if cutlass.const_expr(k_cvt):
                    qrow.store((qbuf.load().to(f32) * f32(_decode_mma_kvq.Q_SCALE)).to(qtype))
                else:
                    qrow.store(qbuf.load())
                for e in cutlass.range_constexpr(8):
                    if cutlass.const_expr(quant):
                        sQ[i, _decode_mma_kvq.q_column(col + e)] = qrow[e]  # the K fragments' dim order
                    else:
                        sQ[i, col + e] = qrow[e]

            # ---- one warp's tensor-core tiles: S [16, 16] = Q_mt K_ks^T, O [16, d] += P V_ks
            mma = cute.make_tiled_mma(warp.MmaF16BF16Op(bf16, f32, (16, 8, 16)), (1, 1, 1),
                                      permutation_mnk=(16, 16, 16))
            thr = mma.get_slice(lane)
            # The scores' product: of Q's type (the fragments' layouts are bf16's).
            mma_s = cute.make_tiled_mma(warp.MmaF16BF16Op(qtype, f32, (16, 8, 16)), (1, 1, 1),
                                        permutation_mnk=(16, 16, 16))
            thr_s = mma_s.get_slice(lane)
            ld_a = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), qtype), mma_s)
            ld_b = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), bf16), mma)
            ld_v = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), bf16), mma)
            thr_la, thr_lb, thr_lv = ld_a.get_slice(lane), ld_b.get_slice(lane), ld_v.get_slice(lane)

            sQw = cute.local_tile(sQ, (16, d), (mt, 0))
            tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQw))
            # Quantised pages: tSrK / tOrVt receive code bytes, converted into k_frag / v_frag.
            tSrK = thr.make_fragment_B(thr.partition_B(_k_tile(sKV, 0, ks, width)))
            tOrVt = thr.make_fragment_B(thr.partition_B(_vt_tile(sKV, 0, ks, width, bn, stages)))
            tSsQ, tSrQv = thr_la.partition_S(sQw), thr_la.retile(tSrQ)
            tSrKv, tOrVtv = thr_lb.retile(tSrK), thr_lv.retile(tOrVt)
            if cutlass.const_expr(quant):  # B fragments of one k16 x n16 tile: K's of Q's type, V's bf16
                k_frag = thr_s.make_fragment_B(thr_s.partition_B(cute.local_tile(sQw, (16, 16), (0, 0))))
                v_frag = thr.make_fragment_B(thr.partition_B(cute.local_tile(sKV[None, None, 0], (16, 16), (0, 0))))
            acc_o = cute.make_rmem_tensor(thr.partition_shape_C((16, d)), f32)
            acc_o.fill(0.0)
            acc_o_mn = _attention_tiles.acc_rows_cols(acc_o)
            tScS = _attention_tiles.acc_rows_cols(thr.partition_C(cute.make_identity_tensor((16, 16))))
            nrows = cute.size(tScS.shape[0])
            ncols = cute.size(tScS.shape[1])

            # This thread's rows: their key ranges in split sp ([0, 0) for padding rows).
            row_lo = cute.make_rmem_tensor((nrows,), i32t)
            row_hi = cute.make_rmem_tensor((nrows,), i32t)
            row_max = cute.make_rmem_tensor((nrows,), f32)
            row_sum = cute.make_rmem_tensor((nrows,), f32)
            row_corr = cute.make_rmem_tensor((nrows,), f32)  # a tile's factor on each row's O
            for r in cutlass.range_constexpr(nrows):
                t = (mt * 16 + tScS[r, 0][0]) // group
                lo = i32t(0)
                hi = i32t(0)
                if t < tq:
                    p = gpos[t * nseq + b]
                    split = attention.split_length(p, ns, min_split, cutlass.max)
                    lo = sp * split
                    hi = cutlass.min(lo + split, p + 1)
                row_lo[r] = lo
                row_hi[r] = hi
                row_max[r] = f32(ninf)
                row_sum[r] = f32(0.0)
            busy = mt * 16 < group * tq  # a warp whose m-tile is all padding only copies

            next_page = _attention_tiles.tile_page(trow, start, end, stages - 1, bn)
            for it in cutlass.range(ntiles, unroll=1):
                stage = it % stages
                # The page of the tile this iteration loads was read one iteration ahead
                # (`tile_page`: read here, ptxas issued it after the wait, just before the copies).
                page = next_page
                next_page = _attention_tiles.tile_page(trow, start, end, it + stages, bn)
                cute.arch.cp_async_wait_group(stages - 2)
                cute.arch.sync_threads()  # tile it landed for all; every warp is done with tile it - 1
                ahead = (it + stages - 1, (it + stages - 1) % stages)
                if cutlass.const_expr(quant):
                    _decode_mma_kvq.load_tile(tid, sKV, s_scale, k_pages, v_pages, page, *keys, *ahead, kv, *shape)
                else:
                    _attention_tiles.load_kv_tile(tid, sKV, k_pages, v_pages, page, *keys, *ahead, *shape)
                cute.arch.cp_async_commit_group()
                if busy:
                    acc_s = cute.make_rmem_tensor(thr.partition_shape_C((16, 16)), f32)
                    acc_s.fill(0.0)
                    tSsK = thr_lb.partition_S(_k_tile(sKV, stage, ks, width))
                    if cutlass.const_expr(quant):
                        cute.copy(ld_b, tSsK, tSrKv)  # all the slice's codes: 8 ldmatrix in flight
                        _decode_mma_kvq.scores(mma_s, acc_s, tSrK, k_frag, ld_a, tSsQ, tSrQ, tSrQv, kv, d, k_cvt)
                    else:
                        for k in cutlass.range_constexpr(cute.size(tSsQ.shape[2])):
                            cute.copy(ld_a, tSsQ[None, None, k], tSrQv[None, None, k])
                            cute.copy(ld_b, tSsK[None, None, k], tSrKv[None, None, k])
                            cute.gemm(mma, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
                    # Scores in the exp2 domain (quantised: times each key's K scale), keys
                    # outside a row's range at -inf; a row with no key yet keeps max -inf and
                    # subtracts 0 (its weights are all 0).
                    s_mn = _attention_tiles.acc_rows_cols(acc_s)
                    n0 = start + it * bn + ks * 16
                    key_scale = [f32(scale_log2)] * ncols
                    if cutlass.const_expr(quant):
                        for c in cutlass.range_constexpr(ncols):
                            key_scale[c] = s_scale[ks * 16 + tScS[0, c][1], stage] * f32(scale_log2)
                    for r in cutlass.range_constexpr(nrows):
                        for c in cutlass.range_constexpr(ncols):
                            key = n0 + tScS[0, c][1]
                            sc = s_mn[r, c] * key_scale[c]
                            if key < row_lo[r] or key >= row_hi[r]:
                                sc = f32(ninf)
                            s_mn[r, c] = sc
                    for r in cutlass.range_constexpr(nrows):
                        srow = s_mn[r, None].load()
                        cur = _attention_tiles.quad_reduce(srow.reduce(cute.ReductionOp.MAX, f32(ninf), 0), cute.arch.fmax)
                        new_max = cute.arch.fmax(row_max[r], cur)
                        base = new_max
                        if new_max == f32(ninf):
                            base = f32(0.0)
                        corr = cute.math.exp2(row_max[r] - base, fastmath=True)
                        pr = cute.math.exp2(srow - base, fastmath=True)
                        row_sum[r] = row_sum[r] * corr + pr.reduce(cute.ReductionOp.ADD, f32(0.0), 0)
                        row_max[r] = new_max
                        s_mn[r, None] = pr
                        row_corr[r] = corr
                    # O is rescaled only when some row of the warp's tile has a new maximum: once
                    # the maxima settle, a factor of exactly 1 would leave every bit as it is,
                    # and the 128 products a thread would spend on it are the conversions' pipe
                    # time (quantised pages).
                    moved = row_corr[0] != f32(1.0)
                    for r in cutlass.range_constexpr(1, nrows):
                        moved = moved | (row_corr[r] != f32(1.0))
                    if cute.arch.vote_any_sync(moved):
                        for r in cutlass.range_constexpr(nrows):
                            acc_o_mn[r, None] = acc_o_mn[r, None].load() * row_corr[r]
                    if cutlass.const_expr(quant):
                        # The V scale goes into the weight before its bf16 rounding; the row sum
                        # above added the unscaled weights.
                        for c in cutlass.range_constexpr(ncols):
                            value_scale = s_scale[ks * 16 + tScS[0, c][1], stages + stage] * f32(v_shift)
                            for r in cutlass.range_constexpr(nrows):
                                s_mn[r, c] = s_mn[r, c] * value_scale
                    r_p = cute.make_rmem_tensor(acc_s.layout, bf16)
                    r_p.store(acc_s.load().to(bf16))
                    t_p = _attention_tiles.acc_as_a_operand(r_p)
                    tOsVt = thr_lv.partition_S(_vt_tile(sKV, stage, ks, width, bn, stages))
                    cute.copy(ld_v, tOsVt[None, None, 0], tOrVtv[None, None, 0])
                    if cutlass.const_expr(quant):
                        _decode_mma_kvq.weighted_values(mma, acc_o, t_p, tOrVt, v_frag, kv, d)
                    else:
                        cute.gemm(mma, acc_o, t_p[None, None, 0], tOrVt[None, None, 0], acc_o)
            cute.arch.cp_async_wait_group(0)
            _pdl.launch_dependents()  # the keys are done: only the slices' merge is left
            cute.arch.sync_threads()  # the stages are free: the merge reuses them

            # ---- merge the key slices of each m-tile (slice order), write the rows of this split
            s_o = cute.make_tensor(cute.recast_ptr(sKV.iterator, dtype=f32),
                                   cute.make_layout((ks_n - 1, rows_cta, d), stride=(rows_cta * d, d, 1)))
            tOcO = _attention_tiles.acc_rows_cols(thr.partition_C(cute.make_identity_tensor((16, d))))
            for r in cutlass.range_constexpr(nrows):
                row_sum[r] = _attention_tiles.quad_reduce(row_sum[r], lambda x, y: x + y)
                row = mt * 16 + tScS[r, 0][0]
                if ks > 0:
                    s_stat[0, ks, row] = row_max[r]
                    s_stat[1, ks, row] = row_sum[r]
                    for c in cutlass.range_constexpr(cute.size(tOcO.shape[1])):
                        s_o[ks - 1, row, tOcO[0, c][1]] = acc_o_mn[r, c]
            cute.arch.sync_threads()
            if ks == 0:
                for r in cutlass.range_constexpr(nrows):
                    i = mt * 16 + tScS[r, 0][0]
                    if row_lo[r] < row_hi[r]:
                        best = row_max[r]
                        for j in cutlass.range_constexpr(1, ks_n):
                            best = cute.arch.fmax(best, s_stat[0, j, i])
                        w0 = cute.math.exp2(row_max[r] - best, fastmath=True)
                        total = row_sum[r] * w0
                        wj = []
                        for j in cutlass.range_constexpr(1, ks_n):
                            wj.append(cute.math.exp2(s_stat[0, j, i] - best, fastmath=True))
                            total = total + s_stat[1, j, i] * wj[j - 1]
                        inv = f32(out_shift) / total
                        t = i // group
                        head = kvh * group + i % group
                        base = (cutlass.Int64(t * nseq + b) * hq + head) * ns + sp
                        for c in cutlass.range_constexpr(cute.size(tOcO.shape[1])):
                            col = tOcO[0, c][1]
                            value = acc_o_mn[r, c] * w0
                            for j in cutlass.range_constexpr(1, ks_n):
                                value = value + s_o[j - 1, i, col] * wj[j - 1]
                            dim = col
                            if cutlass.const_expr(quant):
                                dim = _decode_mma_kvq.out_column(col)
                            cute.make_tensor(o_part + base * d + dim, one)[0] = value * inv
                        if lane % 4 == 0:
                            cute.make_tensor(lse + base, one)[0] = best + cute.math.log2(total)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_decode_mma_{variant.key}")

    @cute.jit
    def launch(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, o_part: cute.Pointer, lse: cute.Pointer, m: cutlass.Int32,
               tq: cutlass.Int32, ns: cutlass.Int32, min_split: cutlass.Int32, maxp: cutlass.Int32, stream: Any):
        kernel(q, k_pages, v_pages, table, qseq, pos, o_part, lse, m, tq, ns, min_split, maxp).launch(
            grid=_dsl.grid(variant, {"M": m, "T": tq, "S": ns}), block=list(variant.block),
            stream=stream)

    return launch, _dsl.example_args(variant, aligns={"table": 4, "qseq": 4, "pos": 4, "lse": 4, "o_part": 4})
