"""The CuTe DSL code of the `moe` family's `fused` kernel: one row's routing, the experts' gate/up +
SwiGLU and their down projections + routing weights + combine in one launch (batch-1 decode).

Why: the decode form's `route_up` and `down_wide` leave the DRAM idle between them (down_wide waits
for every route_up CTA, then reads its ids before its first weight load), and route_up's 576 CTAs
run in two waves, the second ranking the logits again before it loads anything. Here S CTAs (one
per SM, `S` at launch) rank the row's logits once each and stream a fixed share of the work
through a ring of R stages per warp:

- items: the P * I gate/up features (slot order: the shared expert first, whose rows need no
  routing and are staged before the PDL wait), then the H / G down items (G output rows, one per
  lane group of `lanes_per_row(I)` lanes); warp w of the grid takes items w, w + W, w + 2W, ...
  (W = 8 S warps), so every SM reads an equal share of the bytes;
- the ring: a lane copies its own 16-byte vectors of item j + R - 1 with `cp.async` (one commit
  group per item, empty past the last) and reads back only what it copied, so `wait_group(R - 1)`
  alone orders copy and read, as in `moe_decode_kernels.py`; the down items' weights are staged
  while the last gate/up items are computed;
- between the phases the grid meets once: each CTA's act writes, a barrier, then thread 0
  publishes them (`atom.add.release.gpu` on `sync[0]`) and spins (`atom.acquire.gpu`) until all S
  CTAs have; every CTA must be resident at once, which one CTA an SM (the ring's shared memory)
  and S = the SM count give. The last CTA out (`sync[1]`) sets both counters back to zero for the
  next launch.

The numbers are the decode form's op for op: `rank_top_k`, `slot_weight`, `shared_gate`, `_dot`
and the roundings of `route_up`, the slot-ordered fp32 sum of `down_wide`, so the fused kernel
and the decode and split forms agree bit for bit (tests/gpu/test_moe_kernels.py).
"""

from typing import Any

import cutlass
import cutlass.cute as cute

from .moe import WARPS, lanes_per_row
from .moe_decode_kernels import THREADS, _dot, _stage, rank_smem, rank_top_k, shared_gate, slot_weight
from .moe_kernels import _at, _load_vecs
from .variant import Variant

RING = 3  # stages per warp, fewer where they would not fit (`ring_stages`)
SMEM_BYTES = 220 * 1024  # the ring's budget: one CTA an SM, beside the ranking buffers


def ring_stages(stage_vectors: int) -> int:
    """Stages per warp: RING, or fewer when a stage of `stage_vectors` vectors per lane is so large
    that RING of them per warp would not fit in SMEM_BYTES (the Next-80B's 11 slots of down rows)."""
    stages = min(RING, SMEM_BYTES // (WARPS * stage_vectors * 32 * 16))
    if stages < 2:
        raise ValueError(f"moe fused: {stage_vectors} vectors a lane per stage leave no room for two stages")
    return stages


def _ring_at(warp: Any, lane: Any, slot: Any, v: int, dims: tuple) -> Any:
    """Element offset of a lane's vector v in ring stage `slot` of its warp (thread-minor)."""
    stage, ring_n = dims[7], dims[8]
    return ((warp * ring_n + slot) * stage + v) * 256 + lane * 8


def _gate_up_item(gw: Any, j: Any, total: Any, dims: tuple) -> tuple[Any, Any]:
    """(slot, feature) of a warp's gate/up item j: the shared slot (k) first, then 0 .. k-1."""
    inter, p, k = dims[1], dims[3], dims[9]
    q = gw + j * total
    t = q // inter
    return (t + k) % p, q - t * inter


def _stage_gate_up(w: Any, ring: Any, expert: Any, gw: Any, j: Any, total: Any, warp: Any, lane: Any,
                   dims: tuple) -> None:
    """Copy the gate and up rows of gate/up item j (expert `expert`) into its ring stage."""
    h, inter, vecs, ring_n = dims[0], dims[1], dims[2], dims[8]
    _, f = _gate_up_item(gw, j, total, dims)
    for half in range(2):
        for c in range(vecs):
            _stage(w, cutlass.Int64(expert) * (2 * inter * h) + cutlass.Int64(half * inter + f) * h
                   + (c * 32 + lane) * 8, ring, _ring_at(warp, lane, j % ring_n, half * vecs + c, dims))


@cute.jit
def _stage_item(w: cute.Pointer, w_down: cute.Pointer, ring: cute.Pointer, s_ids: cute.Tensor, j: cutlass.Int32,
                mine_gu: cutlass.Int32, mine: cutlass.Int32, gw: cutlass.Int32, total: cutlass.Int32,
                warp: cutlass.Int32, lane: cutlass.Int32, dims: cutlass.Constexpr) -> None:
    """Copy a warp's item j into its ring stage: a gate/up feature, a down item (this lane
    group's row of every slot's expert), or nothing past the last item."""
    h, inter, p, dn_vecs, lanes, groups, ring_n = dims[0], dims[1], dims[3], dims[4], dims[5], dims[6], dims[8]
    if j < mine_gu:
        s, _ = _gate_up_item(gw, j, total, dims)
        _stage_gate_up(w, ring, s_ids[s], gw, j, total, warp, lane, dims)
    elif j < mine:
        row = (gw + (j - mine_gu) * total) * groups + lane // lanes
        for s in cutlass.range_constexpr(p):
            for c in cutlass.range_constexpr(dn_vecs):
                _stage(w_down, cutlass.Int64(s_ids[s]) * (h * inter) + cutlass.Int64(row) * inter
                       + (c * lanes + lane % lanes) * 8, ring, _ring_at(warp, lane, j % ring_n, s * dn_vecs + c, dims))


def _staged(ring: Any, warp: Any, lane: Any, slot: Any, v: int, dims: tuple) -> Any:
    """This lane's staged vector v of ring stage `slot` (bf16 x 8)."""
    return cute.make_tensor(ring + cute.assume(_ring_at(warp, lane, slot, v, dims), divby=8),
                            cute.make_layout((8,))).load()


def build(variant: Variant) -> tuple[Any, list[Any]]:
    from . import _dsl, _pdl

    cfg = variant.config
    e, k, h, inter, p, renorm = cfg["E"], cfg["K"], cfg["H"], cfg["I"], cfg["P"], cfg["renorm"]
    vecs = h // 256  # a lane's vectors of one gate or up row (32 lanes split H)
    lanes = lanes_per_row(inter)  # lanes sharing one down row
    groups = 32 // lanes  # down rows per item (a warp's lane groups)
    dn_vecs = inter // (8 * lanes)  # a lane's vectors of one down row
    stage = max(2 * vecs, p * dn_vecs)  # vectors a lane copies per item, gate/up or down
    ring_n = ring_stages(stage)
    dims = (h, inter, vecs, p, dn_vecs, lanes, groups, stage, ring_n, k)
    n_gu, n_dn = p * inter, h // groups
    f32, bf16, i32_t = cutlass.Float32, cutlass.BFloat16, cutlass.Int32

    @cute.kernel
    def kernel(logits: cute.Pointer, x: cute.Pointer, w_sg: cute.Pointer, w: cute.Pointer, w_down: cute.Pointer,
               ids: cute.Pointer, wts: cute.Pointer, act: cute.Pointer, out: cute.Pointer, sync: cute.Pointer,
               m: cutlass.Int32, n_ctas: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        gw = cta * WARPS + warp  # this warp's index in the grid
        total = n_ctas * WARPS
        smem = cutlass.utils.SmemAllocator()
        ring_t = smem.allocate_tensor(bf16, cute.make_layout(WARPS * ring_n * stage * 256), byte_alignment=128)
        ring = ring_t.iterator
        s_cand_v, s_cand_i, s_top_v, s_top_i = rank_smem(smem, e, k)
        s_ids = smem.allocate_tensor(i32_t, cute.make_layout(p), byte_alignment=16)
        s_wts = smem.allocate_tensor(f32, cute.make_layout(p), byte_alignment=16)
        # This warp's items: gate/up w, w + W, ... below P * I, then down w, w + W, ... below H / G
        # (the numerators stay positive: gw < total).
        mine_gu = (n_gu - gw + total - 1) // total
        mine = mine_gu + (n_dn - gw + total - 1) // total
        early = gw < inter and mine_gu > 0  # item 0 is a shared-expert feature

        # Before the wait: the shared expert's rows, committed with item 0's group below.
        if early:
            _stage_gate_up(w, ring, i32_t(e), gw, 0, total, warp, lane, dims)
        _pdl.wait()  # the logits, x; the act, ids, wts, out an earlier step's kernels read
        src = cute.make_tensor(logits, cute.make_layout(e))
        xs = _load_vecs(x, vecs, 32, lane)
        rank_top_k(src, e, k, warp, lane, tid, s_cand_v, s_cand_i, s_top_v, s_top_i)
        if tid < k:
            # Clamped as `up` clamps ids (NaN logits leave the ranks short of a permutation).
            s_ids[tid] = cutlass.max(cutlass.min(s_top_i[tid], e), 0)
        if tid == k:
            s_ids[k] = i32_t(e)
        if warp == 0:
            weight = slot_weight(src, s_top_v, cutlass.min(lane, k - 1), k, e, lane, renorm)
            if lane < k:
                s_wts[lane] = weight
        if warp == 1:
            gate = shared_gate(xs, w_sg, lane)
            if lane == 0:
                s_wts[k] = gate
        cute.arch.sync_threads()
        if cta == 0 and tid < p:
            _at(ids, tid)[0] = s_ids[tid]
            _at(wts, tid)[0] = s_wts[tid]
        if not early:
            _stage_item(w, w_down, ring, s_ids, i32_t(0), mine_gu, mine, gw, total, warp, lane, dims)
        cute.arch.cp_async_commit_group()
        for j in cutlass.range_constexpr(1, ring_n - 1):
            _stage_item(w, w_down, ring, s_ids, i32_t(j), mine_gu, mine, gw, total, warp, lane, dims)
            cute.arch.cp_async_commit_group()

        for j in cutlass.range(mine_gu):
            _stage_item(w, w_down, ring, s_ids, j + ring_n - 1, mine_gu, mine, gw, total, warp, lane, dims)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(ring_n - 1)
            # `route_up`'s act: bf16(bf16(silu(g)) * u) of the bf16-rounded gate and up sums.
            slot = j % ring_n
            g = _dot(xs, [_staged(ring, warp, lane, slot, c, dims) for c in range(vecs)], 32).to(bf16).to(f32)
            u = _dot(xs, [_staged(ring, warp, lane, slot, vecs + c, dims) for c in range(vecs)], 32).to(bf16).to(f32)
            value = (_dsl.silu_f32(g).to(bf16).to(f32) * u).to(bf16)
            if lane == 0:
                s, f = _gate_up_item(gw, j, total, dims)
                _at(act, s * inter + f)[0] = value

        # Every CTA's act written before any CTA reads it (see the module docstring).
        cute.arch.sync_threads()
        if tid == 0:
            # The release covers the CTA's act writes (ordered before it by the barrier), as a
            # cooperative grid sync does; the acquire spin, then the barrier, orders the reads.
            cute.arch.atomic_add(sync.llvm_ptr, i32_t(1), sem="release", scope="gpu")
            seen = cute.arch.atomic_add(sync.llvm_ptr, i32_t(0), sem="acquire", scope="gpu")
            while seen < n_ctas:
                seen = cute.arch.atomic_add(sync.llvm_ptr, i32_t(0), sem="acquire", scope="gpu")
        cute.arch.sync_threads()
        _pdl.launch_dependents()  # every CTA is resident (all have arrived): the next kernel may start
        # This lane's vectors of every slot's act (the x side of the down sums), kept as bf16.
        acts = [cute.make_tensor(act + s * inter + (c * lanes + lane % lanes) * 8, cute.make_layout((8,))).load()
                for s in range(p) for c in range(dn_vecs)]
        for j in cutlass.range(mine_gu, mine):
            _stage_item(w, w_down, ring, s_ids, j + ring_n - 1, mine_gu, mine, gw, total, warp, lane, dims)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(ring_n - 1)
            slot = j % ring_n
            acc = f32(0.0)
            for s in cutlass.range_constexpr(p):  # `down_wide`'s sum: slot order, weight times the fp32 dot product
                xs_s = [acts[s * dn_vecs + c].to(f32) for c in range(dn_vecs)]
                ws = [_staged(ring, warp, lane, slot, s * dn_vecs + c, dims) for c in range(dn_vecs)]
                acc = acc + s_wts[s] * _dot(xs_s, ws, lanes)
            if lane % lanes == 0:
                _at(out, (gw + (j - mine_gu) * total) * groups + lane // lanes)[0] = acc.to(bf16)

        # The last CTA out sets the counters back for the next launch.
        cute.arch.sync_threads()
        if tid == 0:
            done = cute.arch.atomic_add((sync + 1).llvm_ptr, i32_t(1), sem="acq_rel", scope="gpu")
            if done == n_ctas - 1:
                cute.arch.atomic_exch(sync.llvm_ptr, i32_t(0), sem="relaxed", scope="gpu")
                cute.arch.atomic_exch((sync + 1).llvm_ptr, i32_t(0), sem="relaxed", scope="gpu")

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(logits: cute.Pointer, x: cute.Pointer, w_sg: cute.Pointer, w: cute.Pointer, w_down: cute.Pointer,
               ids: cute.Pointer, wts: cute.Pointer, act: cute.Pointer, out: cute.Pointer, sync: cute.Pointer,
               m: cutlass.Int32, n_ctas: cutlass.Int32, stream: Any):
        kernel(logits, x, w_sg, w, w_down, ids, wts, act, out, sync, m, n_ctas).launch(
            grid=_dsl.grid(variant, {"M": m, "S": n_ctas}), block=[THREADS, 1, 1], stream=stream)

    return launch, _dsl.example_args(variant)
