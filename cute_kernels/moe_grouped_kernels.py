"""The CuTe DSL code of the `moe_grouped` family's SIMT kernels: `perm`, `gather` and `combine`
(what each computes, and the layouts, are in cute_kernels/moe_grouped.py's docstring; the grouped
GEMM is moe_grouped_gemm.py)."""

from typing import Any

from .moe_grouped import BM, GATHER_THREADS, PERM_WARPS
from .variant import Variant


def build(variant: Variant) -> tuple[Any, list[Any]]:
    builder = {"perm": _perm, "gather": _gather, "combine": _combine}[variant.config["kind"]]
    return builder(variant)


def _at(ptr: Any, index: Any) -> Any:
    """A one-element view of ptr[index] (read with [0], written with [0] = ...)."""
    import cutlass
    import cutlass.cute as cute

    return cute.make_tensor(ptr + cutlass.Int64(index), cute.make_layout(1))


def _lane_rank(expert: Any) -> tuple[Any, Any, Any]:
    """For the 32 entries a warp holds (one per lane, lane order = entry order): (rank, same,
    last) of this lane's entry among the lanes holding the same expert: how many come before it,
    how many there are, and whether it is the last of them."""
    import cutlass
    import cutlass.cute as cute

    peers = cute.arch.match_sync(0xFFFFFFFF, expert, "any")
    rank = cutlass.Int32(cute.arch.popc(peers & cute.arch.lanemask_lt()))
    same = cutlass.Int32(cute.arch.popc(peers))
    last = (peers & cute.arch.lanemask_gt()) == cutlass.Uint32(0)
    return rank, same, last


def _perm(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e1, p = cfg["E"] + 1, cfg["P"]
    warps = PERM_WARPS
    threads = 32 * warps
    i32_t = cutlass.Int32

    @cute.kernel
    def kernel(ids: cute.Pointer, pos: cute.Pointer, src: cute.Pointer, tiles: cute.Pointer, m: cutlass.Int32,
               c: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        warp, lane = tid // 32, tid % 32
        smem = cutlass.utils.SmemAllocator()
        # cnt[w, e]: entries of expert e in warp w's range, then (after the scan) the first of
        # them's offset inside the expert's segment, then a cursor while scattering.
        cnt = smem.allocate_tensor(i32_t, cute.make_layout((warps, e1), stride=(e1, 1)), byte_alignment=16)
        total = smem.allocate_tensor(i32_t, cute.make_layout(e1), byte_alignment=16)
        starts = smem.allocate_tensor(i32_t, cute.make_layout(e1 + 1), byte_alignment=16)
        for q in cutlass.range(tid, warps * e1, threads, unroll=1):
            cnt[q // e1, q % e1] = i32_t(0)
        cute.arch.sync_threads()

        # Warp w owns entries [lo, hi) (entry i = row * P + slot), taken 32 at a time in order.
        n = m * p
        per = (n + warps - 1) // warps
        lo = warp * per
        hi = cutlass.min(lo + per, n)
        chunks = (per + 31) // 32
        for ch in cutlass.range(chunks, unroll=1):
            i = lo + ch * 32 + lane
            expert = i32_t(-1)
            if i < hi:
                expert = cutlass.max(cutlass.min(_at(ids, i)[0], e1 - 1), 0)
            rank, same, last = _lane_rank(expert)
            if expert >= 0 and last:
                cnt[warp, expert] = cnt[warp, expert] + same
            cute.arch.sync_warp()
        cute.arch.sync_threads()

        # Per expert: its total, and each warp's first offset inside the segment (warps in order).
        for ex in cutlass.range(tid, e1, threads, unroll=1):
            run = i32_t(0)
            for w in cutlass.range_constexpr(warps):
                v = cnt[w, ex]
                cnt[w, ex] = run
                run = run + v
            total[ex] = run
        cute.arch.sync_threads()

        # Segment starts, each segment padded to whole tiles (E + 1 steps: cheaper than a scan's
        # barriers at these sizes).
        if tid == 0:
            off = i32_t(0)
            for ex in cutlass.range(e1, unroll=1):
                starts[ex] = off
                off = off + (total[ex] + BM - 1) // BM * BM
            starts[e1] = off
            _at(tiles, 0)[0] = off // BM
        cute.arch.sync_threads()

        # The tile list and the padding rows of each segment.
        for ex in cutlass.range(tid, e1, threads, unroll=1):
            first = starts[ex]
            end = starts[ex + 1]
            for t in cutlass.range(first // BM, end // BM, unroll=1):
                _at(tiles, 1 + t)[0] = ex
            for q in cutlass.range(first + total[ex], end, unroll=1):
                _at(src, q)[0] = i32_t(-1)

        # Scatter: the same chunks in the same order, so ranks ascend with the entry index.
        for ch in cutlass.range(chunks, unroll=1):
            i = lo + ch * 32 + lane
            expert = i32_t(-1)
            if i < hi:
                expert = cutlass.max(cutlass.min(_at(ids, i)[0], e1 - 1), 0)
            rank, same, last = _lane_rank(expert)
            if expert >= 0:
                q = starts[expert] + cnt[warp, expert] + rank
                _at(pos, i)[0] = q
                _at(src, q)[0] = i // p
            cute.arch.sync_warp()  # every lane has read its cursor before the last one moves it
            if expert >= 0 and last:
                cnt[warp, expert] = cnt[warp, expert] + same
            cute.arch.sync_warp()

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_grouped_{variant.key}")

    @cute.jit
    def launch(ids: cute.Pointer, pos: cute.Pointer, src: cute.Pointer, tiles: cute.Pointer, m: cutlass.Int32,
               c: cutlass.Int32, stream: Any):
        kernel(ids, pos, src, tiles, m, c).launch(grid=_dsl.grid(variant, {"M": m, "C": c}),
                                                  block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


def _gather(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    h = variant.config["H"]
    vecs = h // 8  # 16-byte vectors per row
    bf16 = cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, src: cute.Pointer, tiles: cute.Pointer, xg: cute.Pointer, m: cutlass.Int32,
               c: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile, _, _ = cute.arch.block_idx()
        if tile < _at(tiles, 0)[0]:
            vec = cute.make_layout((8,))
            zero = cute.make_rmem_tensor((8,), bf16)
            zero.fill(0.0)
            for item in cutlass.range(tid, BM * vecs, GATHER_THREADS, unroll=1):
                q = tile * BM + item // vecs
                col = (item % vecs) * 8
                row = _at(src, q)[0]
                dst = cute.make_tensor(xg + cutlass.Int64(q) * h + col, vec)
                if row >= 0:
                    dst.store(cute.make_tensor(x + cutlass.Int64(row) * h + col, vec).load())
                else:
                    dst.store(zero.load())

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_grouped_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, src: cute.Pointer, tiles: cute.Pointer, xg: cute.Pointer, m: cutlass.Int32,
               c: cutlass.Int32, stream: Any):
        kernel(x, src, tiles, xg, m, c).launch(grid=_dsl.grid(variant, {"M": m, "C": c}),
                                               block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


def _combine(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    h, p = variant.config["H"], variant.config["P"]
    threads = variant.block[0]
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(dn: cute.Pointer, pos: cute.Pointer, wts: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               c: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        col = (tile * threads + tid) * 8
        if col < h:
            vec = cute.make_layout((8,))
            acc = cute.make_rmem_tensor((8,), f32)
            acc.fill(0.0)
            # Slots in order 0..P-1 (the routed experts, then the shared one), as the decode
            # `down` kernel adds them.
            for s in cutlass.range_constexpr(p):
                entry = row * p + s
                q = _at(pos, entry)[0]
                weight = _at(wts, entry)[0]
                acc.store(acc.load() + weight * cute.make_tensor(dn + cutlass.Int64(q) * h + col, vec).load())
            cute.make_tensor(out + cutlass.Int64(row) * h + col, vec).store(acc.load().to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_grouped_{variant.key}")

    @cute.jit
    def launch(dn: cute.Pointer, pos: cute.Pointer, wts: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               c: cutlass.Int32, stream: Any):
        kernel(dn, pos, wts, out, m, c).launch(grid=_dsl.grid(variant, {"M": m, "C": c}),
                                               block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
