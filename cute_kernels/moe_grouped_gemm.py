"""The grouped GEMM of the `moe_grouped` family: `out[q] = xg[q] @ W[e(q)]^T` over expert segments.

gemm_sm90's kernel (warp-specialised TMA + WGMMA, 128 x BN x 64 tiles, 4-stage ring, persistent
CTAs; see that module's docstring), changed where experts come in:

- the tiles come from the device: `tiles[0]` BM-row tiles are in use (written by `perm`), and tile
  t's rows all belong to expert `tiles[1 + t]`, so the grid is sized for the capacity C and CTAs
  stop at the count read from memory (no host read: the step captures in a graph);
- the weights are the expert stack [E + 1, N, K] seen as one [(E + 1) * N, K] matrix: the B tile of
  (expert e, N tile j) is row tile e * N / BN + j (N is a multiple of BN, so a tile never straddles
  two experts);
- tiles are ordered N fastest (t = m_tile * num_n + n_tile): the CTAs in flight together cover
  every N tile of a few consecutive M tiles, so an expert's weight tiles are read from HBM about
  once per segment and its rows once per N pass;
- the epilogue stores whole tiles (C is a multiple of BM and N of BN): bf16 (gate_up, rounded as
  the dense GEMM rounds) or fp32 (down, summed per row by `combine` before its one rounding).
"""

from typing import Any

from runtime.cuda.manifest import TmaEncode

from .gemm_sm90 import BK, CONSUMER_REGS, PRODUCER_REGS, SMS, STAGES, THREADS
from .moe_grouped import BM, FAMILY
from .variant import HOPPER, Variant, i32, ptr, tensor, tma


def gemm_variant(name: str, proj: str, e1: int, n: int, k: int, out_dtype: str, bn: int) -> Variant:
    """The grouped GEMM over the [e1, n, k] expert stack of one projection."""
    if n % bn or n % 2 or k % 8:
        raise ValueError(f"moe_grouped gemm {name}/{proj}: N={n} must be a multiple of the N tile {bn}, K={k} of 8")
    num_n = n // bn
    enc_a = TmaEncode(dtype="BFLOAT16", dims=(k, "C"), strides_bytes=(k * 2,), box=(BK, BM), elem_strides=(1, 1))
    enc_b = TmaEncode(dtype="BFLOAT16", dims=(k, e1 * n), strides_bytes=(k * 2,), box=(BK, bn),
                      elem_strides=(1, 1))
    return Variant(
        family=FAMILY,
        key=f"gemm_{proj}_e{e1}_n{n}_k{k}",
        config={"kind": "gemm", "proj": proj, "E1": e1, "N": n, "K": k, "out": out_dtype, "tile": [BM, bn, BK],
                "stages": STAGES, "threads": THREADS, "persistent_ctas": SMS},
        params=[tma("x_desc", "x", enc_a), i32("x_rows", "C"), tma("w_desc", "w", enc_b), ptr("tiles"), ptr("out"),
                i32("C")],
        tensors={"x": tensor("bf16", "C", k), "w": tensor("bf16", e1 * n, k), "tiles": tensor("i32", f"C // {BM} + 1"),
                 "out": tensor(out_dtype, "C", n, role="out")},
        sizes=("C",),
        block=(THREADS, 1, 1),
        grid=(f"min(C // {BM} * {num_n}, {SMS})", 1, 1),
        requires=("C >= 1", f"C % {BM} == 0", "C <= 2147483647 // 2"),
        arches=HOPPER,
        note=f"grouped {proj} xg[C,{k}] @ W[e][{n},{k}]^T over expert tiles, {out_dtype} out ({name})",
        example_sizes={"C": 51072},
    )


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.tensor_utils.layout import LayoutEnum

    from . import _dsl
    from ._tma_ring import operand_ring

    cfg = variant.config
    e1, n, k = cfg["E1"], cfg["N"], cfg["K"]
    bn = cfg["tile"][1]
    num_n = n // bn
    k_tiles = -(-k // BK)
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    out_f32 = cfg["out"] == "f32"
    k_major = LayoutEnum.ROW_MAJOR
    stage_bytes = (BM + bn) * BK * 2

    def smem_layouts() -> tuple[Any, Any]:
        a = sm90.make_smem_layout_a(k_major, (BM, bn, BK), bf16, STAGES)
        b = sm90.make_smem_layout_b(k_major, (BM, bn, BK), bf16, STAGES)
        for what, lay in (("x", a), ("w", b)):
            # The manifest promises 128-byte swizzle to the runtime's descriptor encode.
            if "S<3,4,3>" not in str(lay.inner):
                raise ValueError(f"{variant.name}: {what} smem layout is {lay.inner}, expected 128-byte swizzle")
        return a, b

    def make_mma() -> Any:
        return sm90.make_trivial_tiled_mma(
            bf16, bf16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(), f32, (2, 1, 1),
            tiler_mn=(64, bn),
        )

    @cute.kernel
    def kernel(tma_x: cute.CopyAtom, m_x: cute.Tensor, tma_w: cute.CopyAtom, m_w: cute.Tensor,
               tiles: cute.Pointer, out: cute.Pointer, c: cutlass.Int32):
        a_layout, b_layout = smem_layouts()
        tiled_mma = make_mma()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        if warp == 0:
            cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_w)

        ring, s_a, s_b = operand_ring(a_layout, b_layout, bf16, STAGES, stage_bytes, 8)  # 8 consumer warps

        tile_list = cute.make_tensor(tiles, cute.make_layout(c // BM + 1))
        num_tiles = tile_list[0] * num_n
        grid_size, _, _ = cute.arch.grid_dim()

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                for t in cutlass.range(bid, num_tiles, grid_size, unroll=1):
                    m_tile, n_tile = t // num_n, t % num_n
                    # The expert id is clamped into the stack so a corrupt list never reads past it.
                    expert = cutlass.max(cutlass.min(tile_list[1 + m_tile], e1 - 1), 0)
                    g_x = cute.local_tile(m_x, (BM, BK), (m_tile, None))  # (BM, BK, k_tiles)
                    g_w = cute.local_tile(m_w, (bn, BK), (expert * num_n + n_tile, None))  # (bn, BK, k_tiles)
                    t_sx, t_gx = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2),
                                                       cute.group_modes(g_x, 0, 2))
                    t_sw, t_gw = cpasync.tma_partition(tma_w, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2),
                                                       cute.group_modes(g_w, 0, 2))
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(state)
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_x, t_gx[(None, kt)], t_sx[(None, state.index)], tma_bar_ptr=bar)
                        cute.copy(tma_w, t_gw[(None, kt)], t_sw[(None, state.index)], tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                ring.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            ctid = tid - 128
            wg_mma = tiled_mma.get_slice((ctid // 128) * 128)
            thr_mma = tiled_mma.get_slice(ctid)
            t_ca = tiled_mma.make_fragment_A(wg_mma.partition_A(s_a))
            t_cb = tiled_mma.make_fragment_B(wg_mma.partition_B(s_b))
            coords = thr_mma.partition_C(cute.make_identity_tensor((BM, bn)))
            acc = cute.make_rmem_tensor(coords.shape, f32)
            # Accumulator slots 2j and 2j + 1 are columns c and c + 1 of one row: one 32-bit store
            # of two bf16, or one 64-bit store of two fp32.
            if cutlass.const_expr(out_f32):
                result = cute.make_rmem_tensor(coords.shape, f32)
                packed = cute.recast_tensor(result, cutlass.Int64)
                g_out = cute.make_tensor(cute.recast_ptr(out, dtype=cutlass.Int64),
                                         cute.make_layout((c, n // 2), stride=(n // 2, 1)))
            else:
                result = cute.make_rmem_tensor(coords.shape, bf16)
                packed = cute.recast_tensor(result, cutlass.Int32)
                g_out = cute.make_tensor(cute.recast_ptr(out, dtype=cutlass.Int32),
                                         cute.make_layout((c, n // 2), stride=(n // 2, 1)))
            k_blocks = cute.size(t_ca, mode=[2])

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for t in cutlass.range(bid, num_tiles, grid_size, unroll=1):
                m_tile, n_tile = t // num_n, t % num_n
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                ring.consumer_wait(read)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, t_ca[(None, None, kb, read.index)], t_cb[(None, None, kb, read.index)],
                              acc)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                read.advance()
                for kt in cutlass.range(1, k_tiles, unroll=1):
                    ring.consumer_wait(read)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(k_blocks):
                        cute.gemm(tiled_mma, acc, t_ca[(None, None, kb, read.index)],
                                  t_cb[(None, None, kb, read.index)], acc)
                    warpgroup.commit_group()
                    # The previous k-tile's WGMMAs are done once at most one group is pending.
                    warpgroup.wait_group(1)
                    ring.consumer_release(release)
                    release.advance()
                    read.advance()
                warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()

                if cutlass.const_expr(out_f32):
                    result.store(acc.load())
                else:
                    result.store(acc.load().to(bf16))
                row0 = m_tile * BM
                col0 = n_tile * bn
                for j in cutlass.range_constexpr(cute.size(packed)):
                    r, cc = coords[2 * j]
                    g_out[row0 + r, (col0 + cc) // 2] = packed[j]

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_grouped_{variant.key}")

    @cute.jit
    def launch(x: cute.Tensor, w: cute.Tensor, tiles: cute.Pointer, out: cute.Pointer, c: cutlass.Int32,
               stream: Any):
        a_layout, b_layout = smem_layouts()
        tma_x, t_x = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, cute.slice_(a_layout, (None, None, 0)), (BM, BK)
        )
        tma_w, t_w = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w, cute.slice_(b_layout, (None, None, 0)), (bn, BK)
        )
        kernel(tma_x, t_x, tma_w, t_w, tiles, out, c).launch(
            grid=_dsl.grid(variant, {"C": c}), block=list(variant.block), stream=stream
        )

    c_sym = cute.sym_int32(divisibility=BM)
    x_fake = make_fake_compact_tensor(bf16, (c_sym, k), stride_order=(1, 0), assumed_align=16)
    w_fake = make_fake_compact_tensor(bf16, (e1 * n, k), stride_order=(1, 0), assumed_align=16)
    return launch, [x_fake, w_fake, _dsl.fake_ptr("i32"), _dsl.fake_ptr(cfg["out"]), cutlass.Int32(BM),
                    _dsl.stream()]
