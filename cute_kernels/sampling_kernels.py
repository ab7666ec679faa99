"""The CuTe DSL code of the `sampling` family: the `candidates` and `pick` kernels and the warp-wide
top-k they share, for the variants cute_kernels/sampling.py declares (its `build` calls this).

What each kernel computes, and the host decisions they reproduce, are in that module's docstring;
`sampling.reference_candidates` and `sampling.reference` model their outputs.
"""

from typing import Any

from runtime.model.sampling import (
    DEAD_END,
    DRAW_INDEX,
    DRAW_SALT,
    GREEDY,
    MIN_P,
    PEN_END,
    PEN_START,
    ROW_F32,
    ROW_I32,
    SEED_KEY,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    TOP_P_SLACK,
    USE_MASK,
)

from .sampling import NO_ID
from .variant import Variant

_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (runtime.model.sampling.mix32)


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["kind"] == "candidates":
        return _build_candidates(variant)
    return _build_pick(variant)


def _make_rounds(per_lane: int, k: int) -> Any:
    """A warp-wide top-k: each lane holds `per_lane` (value, id) pairs in registers (ids unique
    among finite values); k rounds of a butterfly argmax over (value desc, id asc); the winning
    lane retires its element and rescans its own. Lane 0 writes round r's winner to
    `out_val[r]`, `out_id[r]` (id NO_ID when the value is -inf), so the list comes out sorted."""
    import cutlass
    from cutlass import cute

    f32 = cutlass.Float32
    neg_inf = float("-inf")

    depth = max(per_lane - 1, 0).bit_length()  # levels of the pairwise tree below

    @cute.jit
    def best_of(vals: cute.Tensor, ids: cute.Tensor) -> Any:
        # A pairwise tree (depth log2(per_lane) instead of a chain of per_lane compares); the
        # left element, from the lower slot, wins exact ties.
        level = [(vals[s], ids[s], cutlass.Int32(s)) for s in range(per_lane)]  # a comprehension: plain Python
        for _ in cutlass.range_constexpr(depth):
            pairs = []
            for a in cutlass.range_constexpr(0, len(level) - 1, 2):
                av, ai, aslot = level[a]
                bv, bi, bslot = level[a + 1]
                if bv > av or (bv == av and bi < ai):
                    av = bv
                    ai = bi
                    aslot = bslot
                pairs.append((av, ai, aslot))
            if cutlass.const_expr(len(level) % 2 == 1):
                pairs.append(level[-1])
            level = pairs
        return level[0]

    @cute.jit
    def rounds(vals: cute.Tensor, ids: cute.Tensor, out_val: cute.Tensor, out_id: cute.Tensor, lane: cutlass.Int32):
        best_v, best_i, best_s = best_of(vals, ids)
        for r in cutlass.range_constexpr(k):
            win_v = best_v
            win_i = best_i
            for off in cutlass.range_constexpr(5):
                other_v = cute.arch.shuffle_sync_bfly(win_v, offset=16 >> off)
                other_i = cute.arch.shuffle_sync_bfly(win_i, offset=16 >> off)
                if other_v > win_v or (other_v == win_v and other_i < win_i):
                    win_v = other_v
                    win_i = other_i
            if lane == 0:
                out_val[r] = win_v
                out_id[r] = win_i
                if win_v == f32(neg_inf):
                    out_id[r] = cutlass.Int32(NO_ID)
            if win_i == best_i and win_v == best_v:
                for s in cutlass.range_constexpr(per_lane):
                    if s == best_s:
                        vals[s] = f32(neg_inf)
                best_v, best_i, best_s = best_of(vals, ids)

    return rounds


def _make_merge(merged: int, k: int) -> Any:
    """Warp 0's merge of the warps' lists: lane l gathers entries l, l + 32, ... of the `merged`
    (value, id) pairs in shared memory (missing slots -inf / NO_ID) and the warp writes the top k,
    sorted, to `out_val` / `out_id` (see `_make_rounds`)."""
    import cutlass
    from cutlass import cute

    per_lane = -(-merged // 32)
    rounds = _make_rounds(per_lane, k)
    f32, i32_t = cutlass.Float32, cutlass.Int32
    neg_inf = float("-inf")

    @cute.jit
    def merge(s_val: cute.Tensor, s_id: cute.Tensor, out_val: cute.Tensor, out_id: cute.Tensor,
              lane: cutlass.Int32):
        vals = cute.make_rmem_tensor((per_lane,), f32)
        ids = cute.make_rmem_tensor((per_lane,), i32_t)
        for s in cutlass.range_constexpr(per_lane):
            e = s * 32 + lane
            vals[s] = f32(neg_inf)
            ids[s] = i32_t(NO_ID)
            if e < merged:
                vals[s] = s_val[e]
                ids[s] = s_id[e]
        rounds(vals, ids, out_val, out_id, lane)

    return merge


def _build_candidates(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    from cutlass import cute

    from . import _dsl

    cfg = variant.config
    c, k, threads, per = cfg["C"], cfg["K"], cfg["threads"], cfg["per_thread"]
    warps = threads // 32
    merged = warps * k  # warp-list entries warp 0 merges
    f32, i32_t = cutlass.Float32, cutlass.Int32
    neg_inf = float("-inf")
    rounds_1 = _make_rounds(per, k)
    merge = _make_merge(merged, k)

    @cute.kernel
    def kernel(logits: cute.Pointer, bitmask: cute.Pointer, row_i32: cute.Pointer, pen_ids: cute.Pointer,
               pen_delta: cute.Pointer, cand_val: cute.Pointer, cand_id: cute.Pointer, nrows: cutlass.Int32,
               vocab: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, row, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        s_x = smem.allocate_tensor(f32, cute.make_layout(per * threads), byte_alignment=16)
        s_val = smem.allocate_tensor(f32, cute.make_layout(merged), byte_alignment=16)
        s_id = smem.allocate_tensor(i32_t, cute.make_layout(merged), byte_alignment=16)
        meta = cute.make_tensor(row_i32 + row * ROW_I32, cute.make_layout(ROW_I32))
        greedy = meta[GREEDY]
        use_mask = meta[USE_MASK]
        pen_start = meta[PEN_START]
        pen_end = meta[PEN_END]
        span = (vocab + (c - 1)) // c
        start = cta * span
        stop = cutlass.min(start + span, vocab)
        words = (vocab + 31) // 32
        last = vocab - 1
        g_x = cute.make_tensor(logits + cutlass.Int64(row) * vocab, cute.make_layout(vocab))
        g_mask = cute.make_tensor(bitmask + cutlass.Int64(row) * words, cute.make_layout(words))
        # 1. the slice, masked, as fp32 in shared memory (-inf past its end). Every load is
        # issued before any is used (indices clamped into the row), so they overlap.
        xs = cute.make_rmem_tensor((per,), f32)
        for j in cutlass.range_constexpr(per):
            xs[j] = g_x[cutlass.min(start + j * threads + tid, last)].to(f32)
        if use_mask != 0:
            mask_words = cute.make_rmem_tensor((per,), i32_t)
            for j in cutlass.range_constexpr(per):
                mask_words[j] = g_mask[cutlass.min(start + j * threads + tid, last) >> 5]
            for j in cutlass.range_constexpr(per):
                if ((mask_words[j] >> ((start + j * threads + tid) & 31)) & 1) == 0:
                    xs[j] = f32(neg_inf)
        for j in cutlass.range_constexpr(per):
            x = xs[j]
            if start + j * threads + tid >= stop:
                x = f32(neg_inf)
            s_x[j * threads + tid] = x
        cute.arch.sync_threads()
        # 2. the penalties of a sampled row whose ids fall in the slice (distinct ids: no races).
        if greedy == 0:
            g_pid = cute.make_tensor(pen_ids, cute.make_layout(cutlass.max(pen_end, 1)))
            g_pdelta = cute.make_tensor(pen_delta, cute.make_layout(cutlass.max(pen_end, 1)))
            for p in cutlass.range(pen_start + tid, pen_end, threads):
                pid = g_pid[p]
                if pid >= start and pid < stop:
                    s_x[pid - start] = s_x[pid - start] - g_pdelta[p]
        cute.arch.sync_threads()
        # 3. each warp's top k over its lanes' strided elements, then warp 0 merges the lists.
        vals = cute.make_rmem_tensor((per,), f32)
        ids = cute.make_rmem_tensor((per,), i32_t)
        for j in cutlass.range_constexpr(per):
            v = s_x[j * threads + tid]
            if not v > f32(neg_inf):  # NaN (a NaN logit or delta) counts as -inf
                v = f32(neg_inf)
            vals[j] = v
            ids[j] = start + j * threads + tid
        rounds_1(vals, ids, cute.make_tensor(s_val.iterator + warp * k, cute.make_layout(k)),
                 cute.make_tensor(s_id.iterator + warp * k, cute.make_layout(k)), lane)
        cute.arch.sync_threads()
        if warp == 0:
            out = (cutlass.Int64(row) * c + cta) * k
            merge(s_val, s_id, cute.make_tensor(cand_val + out, cute.make_layout(k)),
                  cute.make_tensor(cand_id + out, cute.make_layout(k)), lane)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_sampling_{variant.key}")

    @cute.jit
    def launch(logits: cute.Pointer, bitmask: cute.Pointer, row_i32: cute.Pointer, pen_ids: cute.Pointer,
               pen_delta: cute.Pointer, cand_val: cute.Pointer, cand_id: cute.Pointer, nrows: cutlass.Int32,
               vocab: cutlass.Int32, stream: Any):
        kernel(logits, bitmask, row_i32, pen_ids, pen_delta, cand_val, cand_id, nrows, vocab).launch(
            grid=_dsl.grid(variant, {"R": nrows}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"logits": 2, "bitmask": 4, "row_i32": 4, "pen_ids": 4,
                                                      "pen_delta": 4, "cand_val": 4, "cand_id": 4})


def _build_pick(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    from cutlass import cute

    from . import _dsl

    cfg = variant.config
    c, k, threads = cfg["C"], cfg["K"], cfg["threads"]
    warps = threads // 32
    total = c * k
    per = total // threads
    merged = warps * k
    f32, i32_t, u32 = cutlass.Float32, cutlass.Int32, cutlass.Uint32
    neg_inf = float("-inf")
    rounds_1 = _make_rounds(per, k)
    merge = _make_merge(merged, k)

    @cute.jit
    def mix(x: cutlass.Uint32) -> cutlass.Uint32:
        # lowbias32: uint32 wrap-around multiplies, logical shifts (Uint32 lowers to shrui).
        x = x ^ (x >> 16)
        x = x * u32(_MIX1)
        x = x ^ (x >> 15)
        x = x * u32(_MIX2)
        return x ^ (x >> 16)

    @cute.kernel
    def kernel(cand_val: cute.Pointer, cand_id: cute.Pointer, row_i32: cute.Pointer, row_f32: cute.Pointer,
               out_ids: cute.Pointer, nrows: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        s_val = smem.allocate_tensor(f32, cute.make_layout(merged), byte_alignment=16)
        s_id = smem.allocate_tensor(i32_t, cute.make_layout(merged), byte_alignment=16)
        s_top_val = smem.allocate_tensor(f32, cute.make_layout(k), byte_alignment=16)
        s_top_id = smem.allocate_tensor(i32_t, cute.make_layout(k), byte_alignment=16)
        g_val = cute.make_tensor(cand_val + cutlass.Int64(row) * total, cute.make_layout(total))
        g_id = cute.make_tensor(cand_id + cutlass.Int64(row) * total, cute.make_layout(total))
        vals = cute.make_rmem_tensor((per,), f32)
        ids = cute.make_rmem_tensor((per,), i32_t)
        for j in cutlass.range_constexpr(per):
            v = g_val[j * threads + tid]
            i = g_id[j * threads + tid]
            if not v > f32(neg_inf):  # -inf or NaN: an unused slot
                v = f32(neg_inf)
                i = i32_t(NO_ID)
            vals[j] = v
            ids[j] = i
        rounds_1(vals, ids, cute.make_tensor(s_val.iterator + warp * k, cute.make_layout(k)),
                 cute.make_tensor(s_id.iterator + warp * k, cute.make_layout(k)), lane)
        cute.arch.sync_threads()
        if warp == 0:
            # Lane 0 (thread 0) writes the row's sorted top k and reads it back below.
            merge(s_val, s_id, s_top_val, s_top_id, lane)
        if tid == 0:
            meta = cute.make_tensor(row_i32 + row * ROW_I32, cute.make_layout(ROW_I32))
            fmeta = cute.make_tensor(row_f32 + row * ROW_F32, cute.make_layout(ROW_F32))
            greedy = meta[GREEDY]
            top_k = cutlass.min(cutlass.max(meta[TOP_K], 1), k)
            if greedy != 0:
                top_k = i32_t(1)
            n = i32_t(0)
            for i in cutlass.range_constexpr(k):
                if i < top_k and s_top_val[i] > f32(neg_inf):
                    n = i32_t(i + 1)
            result = i32_t(DEAD_END)
            if n > 0:
                result = s_top_id[0]
                if greedy == 0:
                    temperature = fmeta[TEMPERATURE]
                    top_p = fmeta[TOP_P]
                    min_p = fmeta[MIN_P]
                    probs = cute.make_rmem_tensor((k,), f32)
                    v0 = s_top_val[0]
                    norm = f32(0.0)
                    for i in cutlass.range_constexpr(k):
                        probs[i] = f32(0.0)
                        if i < n:
                            probs[i] = cute.math.exp((s_top_val[i] - v0) / temperature)
                            norm = norm + probs[i]
                    for i in cutlass.range_constexpr(k):
                        probs[i] = probs[i] / norm
                    if top_p < f32(1.0):
                        threshold = top_p - f32(TOP_P_SLACK)
                        cum = f32(0.0)
                        cutoff = n
                        for i in cutlass.range_constexpr(k):
                            if i < n:
                                cum = cum + probs[i]
                                if cum >= threshold and cutoff == n:
                                    cutoff = i32_t(i + 1)
                        n = cutoff
                    if min_p > f32(0.0):
                        threshold = min_p * probs[0]
                        kept = i32_t(0)
                        for i in cutlass.range_constexpr(k):
                            if i < n and probs[i] >= threshold:
                                kept = kept + 1  # a prefix: the probabilities do not increase
                        n = cutlass.max(kept, 1)
                    norm = f32(0.0)
                    for i in cutlass.range_constexpr(k):
                        if i < n:
                            norm = norm + probs[i]
                    key = meta[SEED_KEY].to(u32)
                    bits = mix(key ^ mix(meta[DRAW_INDEX].to(u32) + u32(DRAW_SALT)))
                    u = (bits >> 8).to(f32) * f32(2.0 ** -24)
                    cum = f32(0.0)
                    index = i32_t(0)
                    for i in cutlass.range_constexpr(k):
                        if i < n:
                            cum = cum + probs[i] / norm
                            if cum <= u:
                                index = index + 1
                    index = cutlass.min(index, n - 1)
                    result = s_top_id[index]
            cute.make_tensor(out_ids, cute.make_layout(nrows))[row] = result

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_sampling_{variant.key}")

    @cute.jit
    def launch(cand_val: cute.Pointer, cand_id: cute.Pointer, row_i32: cute.Pointer, row_f32: cute.Pointer,
               out_ids: cute.Pointer, nrows: cutlass.Int32, stream: Any):
        kernel(cand_val, cand_id, row_i32, row_f32, out_ids, nrows).launch(
            grid=_dsl.grid(variant, {"R": nrows}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"cand_val": 4, "cand_id": 4, "row_i32": 4, "row_f32": 4,
                                                      "ids": 4})
