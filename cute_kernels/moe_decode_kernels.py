"""The CuTe DSL code of the `moe` family's decode form: `logits_wide` (`logits` with its loads
staged), `route_up` (top-k routing fused in front of the experts' gate/up) and `down_wide`
(`down` with every slot's weights staged at once), all four built for programmatic dependent
launch (cute_kernels/_pdl.py: what reads or writes an earlier kernel's data follows the wait;
the router rows of `logits_wide` are staged before it). What each
computes, and why the loads are staged, is in cute_kernels/moe.py's docstring; the arithmetic is
`route`'s, `up`'s and `down`'s op for op, so the forms agree (down_wide and down bit for bit).

Staging: a lane copies 16-byte vectors into shared memory with `cp.async` (one commit group per
batch) and later reads back exactly the vectors it copied, so `cp.async.wait_group` alone orders
the copy before the read; the buffers are thread-minor (vector v of thread t at (v * threads + t)
* 8 elements), so a warp's 16-byte accesses fall in distinct banks."""

from typing import Any

import cutlass
import cutlass.cute as cute

from .moe import WARPS, lanes_per_row
from .moe_kernels import _at, _expert, _load_vecs, softmax_denominator
from .variant import Variant

THREADS = 32 * WARPS


def build(variant: Variant) -> tuple[Any, list[Any]]:
    builder = {"logits_wide": _logits_wide, "route_up": _route_up, "up_wide": _up_wide,
               "down_wide": _down_wide}[variant.config["kind"]]
    return builder(variant)


def _stage(src: Any, src_offset: Any, dst: Any, dst_offset: Any) -> None:
    """cp.async of 8 bf16 (16 bytes) from src + src_offset (global) to dst + dst_offset (shared);
    both offsets are element counts that are multiples of 8."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync

    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), cutlass.BFloat16,
                               num_bits_per_copy=128)
    cute.copy(atom, cute.make_tensor(src + cute.assume(src_offset, divby=8), cute.make_layout((8,))),
              cute.make_tensor(dst + cute.assume(dst_offset, divby=8), cute.make_layout((8,))))


def _staged(buf: Any, index: int, tid: Any) -> Any:
    """Thread tid's staged vector `index` (bf16 x 8) from a thread-minor shared buffer."""
    import cutlass.cute as cute

    return cute.make_tensor(buf + cute.assume((index * THREADS + tid) * 8, divby=8), cute.make_layout((8,))).load()


def _dot_lane(x_vecs: list, w_vecs: list) -> Any:
    """This lane's part of x . w (x fp32, w bf16 vectors), before the butterfly over the row's
    lanes: moe_kernels._dot's operations in its order."""
    import cutlass
    import cutlass.cute as cute

    f32 = cutlass.Float32
    acc = f32(0.0)
    for c in range(len(x_vecs)):
        acc = acc + (x_vecs[c] * w_vecs[c].to(f32)).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
    return acc


def _dot(x_vecs: list, w_vecs: list, lanes: int) -> Any:
    from . import _dsl

    return _dsl.warp_sum(_dot_lane(x_vecs, w_vecs), lanes)


# --- logits_wide --------------------------------------------------------------------------------

def _logits_wide(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    e, h = variant.config["E"], variant.config["H"]
    vecs = h // 256
    f32 = cutlass.Float32

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        expert = tile * WARPS + warp
        smem = cutlass.utils.SmemAllocator()
        s_v = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(2 * vecs * THREADS * 8), byte_alignment=128)
        # The lane's router-row vectors and x vectors, all in flight before the first product; the
        # router rows (weights) while the previous kernel drains, x (its output) after the wait.
        for c in cutlass.range_constexpr(vecs):
            _stage(w, cutlass.Int64(expert) * h + (c * 32 + lane) * 8, s_v.iterator, ((vecs + c) * THREADS + tid) * 8)
        _pdl.wait()
        for c in cutlass.range_constexpr(vecs):
            _stage(x, cutlass.Int64(row) * h + (c * 32 + lane) * 8, s_v.iterator, (c * THREADS + tid) * 8)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        _pdl.launch_dependents()
        xs = [_staged(s_v.iterator, c, tid).to(f32) for c in range(vecs)]
        total = _dot(xs, [_staged(s_v.iterator, vecs + c, tid) for c in range(vecs)], 32)
        if lane == 0:
            _at(out, row * e + expert)[0] = total

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(x, w, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


def rank_smem(smem: Any, e: int, k: int) -> tuple[Any, Any, Any, Any]:
    """Shared buffers of `rank_top_k`: candidates (value, index: k per group of 32 logits) and the
    top k (value, index)."""
    n_cand = -(-e // 32) * k
    return (smem.allocate_tensor(cutlass.Float32, cute.make_layout(n_cand), byte_alignment=16),
            smem.allocate_tensor(cutlass.Int32, cute.make_layout(n_cand), byte_alignment=16),
            smem.allocate_tensor(cutlass.Float32, cute.make_layout(k), byte_alignment=16),
            smem.allocate_tensor(cutlass.Int32, cute.make_layout(k), byte_alignment=16))


@cute.jit
def rank_top_k(src: cute.Tensor, e: cutlass.Constexpr, k: cutlass.Constexpr, warp: cutlass.Int32,
               lane: cutlass.Int32, tid: cutlass.Int32, s_cand_v: cute.Tensor, s_cand_i: cute.Tensor,
               s_top_v: cute.Tensor, s_top_i: cute.Tensor) -> None:
    """The k best of a row's E logits `src` (a tensor of E fp32) by (value desc, index asc) into
    s_top_v / s_top_i (shared, rank order), by the whole CTA (every thread calls it; it ends on a
    barrier). A logit's rank is how many logits beat it. Round 1: each warp ranks the 32 logits
    of its group among themselves (lane i ^ o through a butterfly shuffle) and keeps its k best as
    candidates (s_cand_v / s_cand_i: groups * k); every global top-k logit is a candidate (fewer
    than k beat it anywhere). Round 2: each candidate is ranked among the candidates; every logit
    that beats a top-k logit is itself in the top k, so that rank is its global rank, and the
    candidates outside the top k rank k or later. (A `cute.jit` helper: its loops and branches
    are traced as the kernel's are.)"""
    f32, i32_t = cutlass.Float32, cutlass.Int32
    n_groups = -(-e // 32)
    n_cand = n_groups * k
    for c in cutlass.range_constexpr(-(-n_groups // WARPS)):
        g = c * WARPS + warp
        if g < n_groups:
            i = g * 32 + lane
            v = f32(float("-inf"))
            if i < e:
                v = src[i]
            rank = i32_t(0)
            for o in cutlass.range_constexpr(1, 32):
                u = cute.arch.shuffle_sync_bfly(v, offset=o)
                if u > v or (u == v and (lane ^ o) < lane):
                    rank = rank + 1
            if rank < k:
                s_cand_v[g * k + rank] = v
                s_cand_i[g * k + rank] = i
    cute.arch.sync_threads()
    for c in cutlass.range_constexpr(-(-n_cand // THREADS)):
        t = c * THREADS + tid
        if t < n_cand:
            v = s_cand_v[t]
            i = s_cand_i[t]
            rank = i32_t(0)
            for jj in cutlass.range(n_cand, unroll=8):
                u = s_cand_v[jj]
                if u > v or (u == v and s_cand_i[jj] < i):
                    rank = rank + 1
            if rank < k:
                s_top_v[rank] = v
                s_top_i[rank] = i
    cute.arch.sync_threads()


@cute.jit
def slot_weight(src: cute.Tensor, s_top_v: cute.Tensor, s: cutlass.Int32, k: cutlass.Constexpr,
                e: cutlass.Constexpr, lane: cutlass.Int32, renorm: cutlass.Constexpr) -> cutlass.Float32:
    """The routing weight of routed slot s: exp(l_s - l_max) / sum, the sum over the k selected
    logits in rank order (renorm) or over all E (a butterfly over the warp: every lane calls it)."""
    lead = s_top_v[0]
    rest = []  # this lane's logits c * 32 + lane (-inf past E), for the softmax over all E
    if cutlass.const_expr(not renorm):
        for c in cutlass.range_constexpr(-(-e // 32)):
            val = cutlass.Float32(float("-inf"))
            if c * 32 + lane < e:
                val = src[c * 32 + lane]
            rest.append(val)
    denom = softmax_denominator([s_top_v[r] for r in range(k)], rest, lead, renorm)
    return cute.math.exp(s_top_v[s] - lead, fastmath=True) / denom


def shared_gate(xs: list, w_sg: Any, lane: Any) -> Any:
    """The shared expert's weight sigmoid(x . w_sg) (fp32; the warp's 32 lanes split H)."""
    f32 = cutlass.Float32
    gate = _dot(xs, [cute.make_tensor(w_sg + (c * 32 + lane) * 8, cute.make_layout((8,))).load()
                     for c in range(len(xs))], 32)
    return f32(1.0) / (f32(1.0) + cute.math.exp(-gate, fastmath=True))


# --- route_up and up_wide ------------------------------------------------------------------------

def _stage_gate_up(w: Any, expert: Any, f0: Any, per_warp: int, h: int, inter: int, s_w: Any, lane: Any,
                   tid: Any) -> None:
    """Stage this warp's gate and up rows (features f0 .. f0 + per_warp - 1 of the expert's
    [2I, H] block), every vector in flight at once, as one commit group."""
    import cutlass
    import cutlass.cute as cute

    vecs = h // 256
    for t in range(per_warp):
        for half in range(2):
            for c in range(vecs):
                _stage(w, cutlass.Int64(expert) * (2 * inter * h) + cutlass.Int64(half * inter + f0 + t) * h
                       + (c * 32 + lane) * 8, s_w, (((t * 2 + half) * vecs + c) * THREADS + tid) * 8)
    cute.arch.cp_async_commit_group()


def _gate_up_act(xs: list, per_warp: int, s_w: Any, tid: Any) -> list:
    """Per staged feature t: bf16(bf16(silu(g)) * u), g and u the bf16-rounded dot products of x
    with the staged gate and up rows (`up`'s roundings)."""
    import cutlass

    from . import _dsl

    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    vecs = len(xs)
    values = []
    for t in range(per_warp):
        g = _dot(xs, [_staged(s_w, (t * 2) * vecs + c, tid) for c in range(vecs)], 32).to(bf16).to(f32)
        u = _dot(xs, [_staged(s_w, (t * 2 + 1) * vecs + c, tid) for c in range(vecs)], 32).to(bf16).to(f32)
        values.append((_dsl.silu_f32(g).to(bf16).to(f32) * u).to(bf16))
    return values


def _up_wide(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    e, h, inter, uf = cfg["E"], cfg["H"], cfg["I"], cfg["features"]
    p = cfg["P"]
    vecs = h // 256
    per_warp = uf // WARPS

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, act: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        slot, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        row = slot // p
        smem = cutlass.utils.SmemAllocator()
        s_w = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(per_warp * 2 * vecs * THREADS * 8),
                                   byte_alignment=128)
        f0 = tile * uf + warp * per_warp
        _pdl.wait()  # the slot's expert id (from `route`) picks the weights
        _stage_gate_up(w, _expert(ids, slot, e), f0, per_warp, h, inter, s_w.iterator, lane, tid)
        xs = _load_vecs(x + cutlass.Int64(row) * h, vecs, 32, lane)
        cute.arch.cp_async_wait_group(0)
        _pdl.launch_dependents()
        values = _gate_up_act(xs, per_warp, s_w.iterator, tid)
        for t in cutlass.range_constexpr(per_warp):
            if lane == 0:
                _at(act, slot * inter + f0 + t)[0] = values[t]

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, act: cute.Pointer, m: cutlass.Int32,
               stream: Any):
        kernel(x, w, ids, act, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


def _route_up(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    e, k, h, inter, p, renorm, uf = cfg["E"], cfg["K"], cfg["H"], cfg["I"], cfg["P"], cfg["renorm"], cfg["features"]
    vecs = h // 256
    per_warp = uf // WARPS
    if k > min(32, e):
        raise ValueError(f"{variant.name}: top-{k} of {e} logits in groups of 32")
    bf16, i32_t = cutlass.BFloat16, cutlass.Int32

    @cute.kernel
    def kernel(logits: cute.Pointer, x: cute.Pointer, w_sg: cute.Pointer, w: cute.Pointer, ids: cute.Pointer,
               wts: cute.Pointer, act: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        slot, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        row = slot // p
        s = slot - row * p
        smem = cutlass.utils.SmemAllocator()
        s_w = smem.allocate_tensor(bf16, cute.make_layout(per_warp * 2 * vecs * THREADS * 8), byte_alignment=128)
        s_cand_v, s_cand_i, s_top_v, s_top_i = rank_smem(smem, e, k)
        expert = i32_t(e)  # the shared slot s == k
        src = cute.make_tensor(logits + cutlass.Int64(row) * e, cute.make_layout(e))
        f0 = tile * uf + warp * per_warp
        if s == k:
            # The shared expert is routed by nothing: its rows load while the logits kernel drains.
            _stage_gate_up(w, expert, f0, per_warp, h, inter, s_w.iterator, lane, tid)
        _pdl.wait()  # the logits, x, and the ids / weights / act an earlier step's kernels read
        if s < k:
            rank_top_k(src, e, k, warp, lane, tid, s_cand_v, s_cand_i, s_top_v, s_top_i)
            # Clamped as `up` clamps ids: NaN logits leave the ranks short of a permutation, and an
            # unwritten slot must not send the loads outside the expert stack.
            expert = cutlass.max(cutlass.min(s_top_i[s], e), 0)
            _stage_gate_up(w, expert, f0, per_warp, h, inter, s_w.iterator, lane, tid)
        xs = _load_vecs(x + cutlass.Int64(row) * h, vecs, 32, lane)
        if tile == 0:
            # The slot's id and routing weight for `down`, as `route` computes them.
            if s < k:
                weight = slot_weight(src, s_top_v, s, k, e, lane, renorm)
                if tid == 0:
                    _at(ids, slot)[0] = expert
                    _at(wts, slot)[0] = weight
            else:
                if warp == 0:
                    gate = shared_gate(xs, w_sg, lane)
                    if lane == 0:
                        _at(ids, slot)[0] = i32_t(e)
                        _at(wts, slot)[0] = gate
        cute.arch.cp_async_wait_group(0)
        _pdl.launch_dependents()
        values = _gate_up_act(xs, per_warp, s_w.iterator, tid)
        for t in cutlass.range_constexpr(per_warp):
            if lane == 0:
                _at(act, slot * inter + f0 + t)[0] = values[t]

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(logits: cute.Pointer, x: cute.Pointer, w_sg: cute.Pointer, w: cute.Pointer, ids: cute.Pointer,
               wts: cute.Pointer, act: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(logits, x, w_sg, w, ids, wts, act, m).launch(grid=_dsl.grid(variant, {"M": m}),
                                                            block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


# --- down_wide ----------------------------------------------------------------------------------

def _down_wide(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    e, h, inter, p, rows = cfg["E"], cfg["H"], cfg["I"], cfg["P"], cfg["rows_per_warp"]
    lanes = lanes_per_row(inter)
    groups = 32 // lanes  # rows a warp works on at once
    vecs = inter // (8 * lanes)
    iters = rows // groups
    features = WARPS * rows  # per CTA
    act_vecs = p * inter // 8  # the row's act, staged by the whole CTA
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(act: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        group_idx, j = lane // lanes, lane % lanes
        first = tile * features + warp * rows + group_idx  # this lane group's feature in iteration 0
        smem = cutlass.utils.SmemAllocator()
        s_act = smem.allocate_tensor(bf16, cute.make_layout(p * inter), byte_alignment=128)
        s_w = smem.allocate_tensor(bf16, cute.make_layout(p * iters * vecs * THREADS * 8), byte_alignment=128)

        def stage_rows(s: int, expert: Any) -> None:
            """Slot s's weight rows (expert `expert`) as one commit group."""
            for it in cutlass.range_constexpr(iters):
                for c in cutlass.range_constexpr(vecs):
                    _stage(w, cutlass.Int64(expert) * (h * inter) + cutlass.Int64(first + it * groups) * inter
                           + (c * lanes + j) * 8, s_w.iterator, (((s * iters + it) * vecs + c) * THREADS + tid) * 8)
            cute.arch.cp_async_commit_group()

        # The shared slot (the last) is routed by nothing: its rows load while route_up drains.
        stage_rows(p - 1, e)
        _pdl.wait()  # act, ids and wts are route_up's output; the expert ids pick the weights
        for c in cutlass.range_constexpr(-(-act_vecs // THREADS)):
            if c * THREADS + tid < act_vecs:
                _stage(act, cutlass.Int64(row) * (p * inter) + (c * THREADS + tid) * 8, s_act.iterator,
                       (c * THREADS + tid) * 8)
        cute.arch.cp_async_commit_group()
        # Lane s reads slot s's id and weight, so all of them arrive in one round trip (ptxas
        # would otherwise issue them one by one next to their first use).
        mine = cutlass.min(lane, p - 1)
        lane_expert = _expert(ids, row * p + mine, e)
        lane_weight = _at(wts, row * p + mine)[0]
        # The routed slots' weight rows: one commit group per slot after the shared slot's and the
        # act's, all consumed in slot order (the shared slot last, as the sum goes).
        for s in cutlass.range_constexpr(p - 1):
            stage_rows(s, cute.arch.shuffle_sync(lane_expert, s))
        cute.arch.cp_async_wait_group(p - 1)  # the shared rows and the act
        cute.arch.sync_threads()  # the act vectors other threads staged
        accs = [f32(0.0) for _ in range(iters)]
        for s in cutlass.range_constexpr(p):
            weight = cute.arch.shuffle_sync(lane_weight, s)
            xs = [cute.make_tensor(s_act.iterator + cute.assume(s * inter + (c * lanes + j) * 8, divby=8),
                                   cute.make_layout((8,))).load().to(f32) for c in range(vecs)]
            if cutlass.const_expr(s < p - 1):
                cute.arch.cp_async_wait_group(p - 2 - s)
            else:
                _pdl.launch_dependents()  # every load has landed: only the last slot's sums are left
            for it in cutlass.range_constexpr(iters):
                ws = [_staged(s_w.iterator, (s * iters + it) * vecs + c, tid) for c in range(vecs)]
                accs[it] = accs[it] + weight * _dot(xs, ws, lanes)
        for it in cutlass.range_constexpr(iters):
            if j == 0:
                _at(out, row * h + first + it * groups)[0] = accs[it].to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(act: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32, stream: Any):
        kernel(act, w, ids, wts, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                stream=stream)

    return launch, _dsl.example_args(variant)
