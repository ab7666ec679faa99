"""Sampling on the GPU: logits rows -> token ids, deciding exactly as the host sampler does.

Two launches per step; the contract (hash, `RowSampling`, the cap of 20 candidates, `DEAD_END`)
is `runtime.model.sampling`, and the semantics are those of `runtime.engine.sampler`:

1. mask: ids the row's bitmask disallows become -inf (NaN logits too: a NaN never wins);
2. greedy rows: the argmax of the masked logits, lowest id on ties; nothing below applies;
3. penalties: `logit[id] = float32(logit) - float32(delta)` for the row's penalty entries;
4. the top k (1..20) by (value desc, id asc), -inf dropped; none left: `DEAD_END`;
5. `z = value / temperature`, minus `z[0]`, exp, normalise (float64 on the host; the kernel
   takes `exp((value - value[0]) / temperature)` in fp32);
6. top-p (only when top_p < 1): keep up to the first index whose cumulative sum reaches
   `top_p - 1e-9`; 7. min-p (only when min_p > 0): keep probabilities >= `min_p * p[0]`;
8. renormalise; 9. the index is the number of cumulative probabilities <= u, clamped to the last
   candidate, with `u = draw_uniform(seed, draw_index)` computed on the GPU from the seed key.

Kernels:

- `candidates`: grid (C, R), C = 64 CTAs of 256 threads per row. CTA c owns the slice
  `[c * span, min((c + 1) * span, V))`, span = cdiv(V, C) <= 4096 (so V <= 262144). The slice is
  loaded as fp32 into shared memory (16 KB) with the mask applied, the penalty entries whose id
  falls in the slice are subtracted (the block strides over the row's entries; ids are distinct,
  so no two threads touch one element), then each thread holds its 16 strided elements in
  registers. Each warp extracts its top 20 with 20 rounds of a butterfly argmax over
  (value desc, id asc) in which the winning lane retires its element and rescans; warp 0 merges
  the 8 warps' lists the same way and writes the CTA's 20 best, sorted, with unused slots
  `-inf` / `NO_ID`. Fixed reduction order, no atomics: deterministic.
- `pick`: grid (R,), 128 threads: the same two-level selection over the row's C x 20 candidates
  gives the row's top 20, then thread 0 runs steps 4-9 in fp32 and writes the id (or `DEAD_END`).

The float64 host and the fp32 kernel agree on every decision except when a draw or a cut lies
within float rounding of its threshold; `runtime.model.sampling.decide` reports that distance
(`RowDraw.margin`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    TOP_K_CAP,
    TOP_P,
    TOP_P_SLACK,
    USE_MASK,
    RowSampling,
    decide,
    fill_row,
    masked_scores,
    mix32,
    top_ids,
)

from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "sampling"
CONTRACT = "runtime/model/sampling.py"  # hash constants and row layout are compiled in: a source
CTAS_PER_ROW = 64  # C: CTAs per row in `candidates` (~3.9K ids each at V = 248320)
CAND_THREADS = 256
PER_THREAD = 16  # elements a `candidates` thread holds
SLICE_CAP = CAND_THREADS * PER_THREAD  # most ids one CTA owns
MAX_VOCAB = CTAS_PER_ROW * SLICE_CAP  # 262144
PICK_THREADS = 128
NO_ID = 0x7FFFFFFF  # the id of an unused candidate slot (its value is -inf)
_MIX1, _MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers (runtime.model.sampling.mix32)


def _candidates_variant() -> Variant:
    c, k = CTAS_PER_ROW, TOP_K_CAP
    return Variant(
        family=FAMILY,
        key="candidates",
        config={"kind": "candidates", "C": c, "K": k, "threads": CAND_THREADS, "per_thread": PER_THREAD},
        params=[ptr("logits"), ptr("bitmask"), ptr("row_i32"), ptr("pen_ids"), ptr("pen_delta"),
                ptr("cand_val"), ptr("cand_id"), i32("R"), i32("V")],
        tensors={
            "logits": tensor("bf16", "R", "V"),
            "bitmask": tensor("i32", "R", "cdiv(V, 32)"),
            "row_i32": tensor("i32", "R", ROW_I32),
            # All rows' penalty entries back to back; the kernel reads row r's [pen_start,
            # pen_end) only, so the length is not a launch size (no entries: a 4-byte dummy).
            "pen_ids": tensor("i32", 1),
            "pen_delta": tensor("f32", 1),
            "cand_val": tensor("f32", "R", c, k, role="out"),
            "cand_id": tensor("i32", "R", c, k, role="out"),
        },
        sizes=("R", "V"),
        block=(CAND_THREADS, 1, 1),
        grid=(c, "R", 1),
        requires=("R >= 1", "R <= 65535", "V >= 1", f"V <= {MAX_VOCAB}"),
        arches=ALL_ARCHES,
        extra_sources=(CONTRACT,),
        note=f"sampling step 1: mask, penalties, the top {k} of each of {c} slices of a row",
        example_sizes={"R": 8, "V": 248320},
    )


def _pick_variant() -> Variant:
    c, k = CTAS_PER_ROW, TOP_K_CAP
    return Variant(
        family=FAMILY,
        key="pick",
        config={"kind": "pick", "C": c, "K": k, "threads": PICK_THREADS},
        params=[ptr("cand_val"), ptr("cand_id"), ptr("row_i32"), ptr("row_f32"), ptr("ids"), i32("R")],
        tensors={
            "cand_val": tensor("f32", "R", c, k),
            "cand_id": tensor("i32", "R", c, k),
            "row_i32": tensor("i32", "R", ROW_I32),
            "row_f32": tensor("f32", "R", ROW_F32),
            "ids": tensor("i32", "R", role="out"),
        },
        sizes=("R",),
        block=(PICK_THREADS, 1, 1),
        grid=("R", 1, 1),
        requires=("R >= 1",),
        arches=ALL_ARCHES,
        extra_sources=(CONTRACT,),
        note=f"sampling step 2: merge {c} x {k} candidates, top-k/p/min-p, seeded draw",
        example_sizes={"R": 8},
    )


def variants() -> list[Variant]:
    if (CTAS_PER_ROW * TOP_K_CAP) % PICK_THREADS or CAND_THREADS % 32 or PICK_THREADS % 32:
        raise ValueError("sampling: the candidate lists do not split evenly over the pick threads")
    return [_candidates_variant(), _pick_variant()]


# --------------------------------------------------------------------------- host side


@dataclass
class PackedRows:
    """`RowSampling`s in the kernels' buffer layout (what a runner uploads each step)."""

    row_i32: np.ndarray  # int32 [R, 8]
    row_f32: np.ndarray  # float32 [R, 4]
    bitmask: np.ndarray  # int32 [R, cdiv(V, 32)]; rows without a constraint are all zero, unread
    pen_ids: np.ndarray  # int32 [max(P, 1)], P = all rows' penalty entries
    pen_delta: np.ndarray  # float32 [max(P, 1)]
    num_penalties: int  # P


def pack_rows(rows: Sequence[RowSampling], vocab: int) -> PackedRows:
    """The `row_i32`, `row_f32`, `bitmask` and penalty buffers for `rows` over a vocabulary."""
    words = -(-vocab // 32)
    r = len(rows)
    row_i32 = np.zeros((r, ROW_I32), np.int32)
    row_f32 = np.zeros((r, ROW_F32), np.float32)
    bitmask = np.zeros((r, words), np.int32)
    pen_ids, pen_delta = [], []
    start = 0
    for i, row in enumerate(rows):
        n = fill_row(row, row_i32[i], row_f32[i], start)
        if row.bitmask is not None:
            bitmask[i] = np.asarray(row.bitmask, np.uint32)[:words].view(np.int32)
        pen_ids.append(np.asarray(row.penalty_ids, np.int32))
        pen_delta.append(np.asarray(row.penalty_deltas, np.float32))
        start += n
    ids = np.concatenate(pen_ids) if start else np.zeros(1, np.int32)
    delta = np.concatenate(pen_delta) if start else np.zeros(1, np.float32)
    return PackedRows(row_i32, row_f32, bitmask, ids, delta, start)


def reference(logits: np.ndarray, rows: Sequence[RowSampling]) -> np.ndarray:
    """int32 [R]: each row's token id (DEAD_END where nothing is allowed), as the host sampler
    decides it (`runtime.model.sampling.decide`). `logits`: float [R, V]."""
    return np.array([decide(logits[i], row).token for i, row in enumerate(rows)], np.int32)


def reference_candidates(logits: np.ndarray, rows: Sequence[RowSampling],
                         ctas: int = CTAS_PER_ROW) -> tuple[np.ndarray, np.ndarray]:
    """What `candidates` writes: (cand_val float32 [R, C, 20], cand_id int32 [R, C, 20])."""
    r, vocab = logits.shape
    span = -(-vocab // ctas)
    vals = np.full((r, ctas, TOP_K_CAP), -np.inf, np.float32)
    cids = np.full((r, ctas, TOP_K_CAP), NO_ID, np.int32)
    for i, row in enumerate(rows):
        x = masked_scores(logits[i], row)
        for c in range(ctas):
            lo, hi = c * span, min((c + 1) * span, vocab)
            if lo >= hi:
                continue
            ids = top_ids(x[lo:hi], TOP_K_CAP)
            vals[i, c, :ids.shape[0]] = x[lo + ids]
            cids[i, c, :ids.shape[0]] = lo + ids
    return vals, cids


def draw_uniform_from_key(key: int, index: int) -> float:
    """`draw_uniform` from the stored seed key, step by step as the kernel computes it."""
    h = mix32((key & 0xFFFFFFFF) ^ mix32((index + DRAW_SALT) & 0xFFFFFFFF))
    return (h >> 8) * 2.0 ** -24


# --------------------------------------------------------------------------- kernels


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
