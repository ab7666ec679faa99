"""Prefill GEMM for Hopper: `out[M, N] = x[M, K] @ W[N, K]^T`, BF16 in, FP32 accumulate, BF16 out
(or FP32 out: the `out_f32` shapes, the MoE router logits of a prefill chunk).

A warp-specialised TMA + WGMMA kernel with a dynamic M (tokens) and static N, K (one variant per
weight shape):

- CTA tile 128 x 256 x 64; 384 threads: warpgroup 0 is the producer (its first warp issues the
  TMA loads; registers lowered to 40), warpgroups 1 and 2 are consumers (registers raised to 232),
  each owning 64 rows of the tile with a 64 x 256 fp32 accumulator;
- a 4-stage shared-memory ring (48 KiB per stage, 128-byte swizzle) guarded by a `PipelineTmaAsync`
  (full barriers counted in TMA bytes, empty barriers released by the 8 consumer warps);
- each k-tile is 4 WGMMAs (K = 16 each); one k-tile of WGMMAs stays in flight
  (`wait_group(1)`) and the stage it finished reading is released to the producer;
- persistent: the grid is min(tiles, 132) CTAs and CTA b takes tiles b, b + grid, ...; the
  producer warp runs on into the next tile's k-tiles while the consumers store the last one, so
  the pipeline fill is paid once per CTA, not once per tile;
- tiles are rasterised in bands of 8 M-tiles so the tiles in flight at once share activation and
  weight tiles in L2;
- the epilogue converts to bf16 and stores straight from registers, two adjacent columns per
  32-bit store, predicated on M and N (TMA clips the loads: rows past M and columns past N read
  zeros); an FP32-out variant stores the accumulator as it is, one value per store (its N is an
  expert count: the stores are a small part of its time).

The TMA descriptors are encoded by the runtime (`cuTensorMapEncodeTiled`) with the settings in the
manifest, which come from the same constants this module compiles with.
"""

from typing import Any

import numpy as np

from runtime.cuda.manifest import TmaEncode

from .bf16 import round_bf16
from .variant import HOPPER, Variant, i32, ptr, tensor, tma

FAMILY = "gemm_sm90"
BM, BN, BK = 128, 256, 64
STAGES = 4
GROUP_M = 8  # M-tiles per raster band
SMS = 132  # persistent grid: at most one CTA per SM of an H100/H200 SXM (any grid size is correct)
THREADS = 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232

# (name, N, K): the 27B's prefill linear layers, and its lm_head for the logits of more rows
# than a GEMV variant takes (prompt log-probabilities: all positions of a chunk).
SHAPES = [
    ("gdn_in", 16480, 5120),
    ("o_proj", 5120, 6144),
    ("attn_qkv", 14336, 5120),
    ("gate_up", 34816, 5120),
    ("down", 5120, 17408),
    ("lm_head", 248320, 5120),
    ("mtp_fc", 5120, 10240),  # the MTP head's fc (2H -> H) over a prompt chunk's catch-up rows
    # Qwen3.5/3.6-35B-A3B (hidden 2048; its MoE MLP is the moe family's).
    ("a3b_gdn_in", 12352, 2048),  # in_proj_qkv + in_proj_z + in_proj_b + in_proj_a
    ("a3b_o_proj", 2048, 4096),  # GDN out_proj and attention o_proj
    ("a3b_attn_qkv", 9216, 2048),
    ("a3b_lm_head", 248320, 2048),
    ("next80b_lm_head", 151936, 2048),  # Qwen3-Next-80B-A3B (its other projections are the a3b shapes)
    ("test", 328, 192),  # small and ragged (N not a multiple of the tile) for tests
    # The tiny dense test model (tools/make_tiny.py: hidden 256, GDN 2/4 heads of 32, attention
    # 4/2 heads of 64, MLP 512, vocabulary 512), prefill and decode alike.
    ("tiny_gdn_in", 392, 256),
    ("tiny_gdn_out", 256, 128),
    ("tiny_attn_qkv", 768, 256),
    ("tiny_o_proj", 256, 256),
    ("tiny_gate_up", 1024, 256),
    ("tiny_down", 256, 512),  # also the MTP head's fc (2H -> H)
    ("tiny_lm_head", 512, 256),
    # The 27B vision tower (width 1152, MLP 4304, patch 3*2*16*16 = 1536, merger 4 x 1152 -> 5120;
    # K = 4304 is not a multiple of BK: TMA reads the last k-tile's missing columns as zeros).
    ("vit_patch", 1152, 1536),
    ("vit_qkv", 3456, 1152),
    ("vit_proj", 1152, 1152),
    ("vit_fc1", 4304, 1152),
    ("vit_fc2", 1152, 4304),
    ("vit_merge_fc1", 4608, 4608),
    ("vit_merge_fc2", 5120, 4608),
    # The tiny test tower (width 64, MLP 128; its merger's 256 x 256 layers use tiny_o_proj).
    ("tiny_vit_patch", 64, 1536),
    ("tiny_vit_qkv", 192, 64),
    ("tiny_vit_proj", 64, 64),
    ("tiny_vit_fc1", 128, 64),
    ("tiny_vit_fc2", 64, 128),
]
# (name, N, K, ld): GEMMs writing some of the columns of wider output rows (row stride ld), for
# fused quantised projections with a BF16 tail (the GDN in_proj_b / in_proj_a of the 27B and of
# the tiny model): the tails themselves (N = NT, written after the quantised columns: the runner
# passes out = y + N_q columns) and the NVFP4 heads `[in_proj_qkv | in_proj_z]` decoded to BF16
# (`dequant_nvfp4`) and written first.
STRIDED_SHAPES = [
    ("gdn_in_tail", 96, 5120, 16480),
    ("tiny_gdn_in_tail", 8, 256, 392),
    ("gdn_in_head", 16384, 5120, 16480),
    ("a3b_gdn_in_tail", 64, 2048, 12352),
    ("a3b_gdn_in_head", 12288, 2048, 12352),
    ("tiny_gdn_in_head", 384, 256, 392),
]

# (name, N, K) with FP32 output: the MoE router logits x[M, H] @ Wr[E, H]^T of a prefill chunk, in
# fp32 as the `moe` family's logits kernel writes them (its route kernel reads them; a bf16 logit
# would tie its neighbours more often). N = E experts, K = H.
SHAPES_F32 = [
    ("a3b_router", 256, 2048),  # Qwen3.5/3.6-35B-A3B
    ("next_router", 512, 2048),  # Qwen3-Next-80B-A3B
    ("tiny_router", 8, 256),  # tools/make_tiny.py --moe
    ("test_f32", 328, 192),  # small and ragged, for tests
]

def _variant(name: str, n: int, k: int, ld: int | None = None, out: str = "bf16") -> Variant:
    """ld: the output row stride in elements (default N; wider for a tail written beside other
    columns); out: the output dtype (bf16, or f32 for the router logits)."""
    ld = n if ld is None else ld
    if n % 2 or ld % 2 or ld < n:
        raise ValueError(f"gemm_sm90 shape {name}: N = {n} and the output stride {ld} must be even (the epilogue "
                         "stores column pairs) and the stride at least N")
    num_n = -(-n // BN)
    enc_a = TmaEncode(dtype="BFLOAT16", dims=(k, "M"), strides_bytes=(k * 2,), box=(BK, BM), elem_strides=(1, 1))
    enc_b = TmaEncode(dtype="BFLOAT16", dims=(k, n), strides_bytes=(k * 2,), box=(BK, BN), elem_strides=(1, 1))
    return Variant(
        family=FAMILY,
        key=f"{name}_n{n}_k{k}" + (f"_ld{ld}" if ld != n else ""),
        config={"N": n, "K": k, "ld": ld, "out": out, "tile": [BM, BN, BK], "stages": STAGES, "group_m": GROUP_M,
                "threads": THREADS, "regs": [PRODUCER_REGS, CONSUMER_REGS], "persistent_ctas": SMS},
        # The TMA coordinate tensor of x carries its dynamic M as an int32 right after the descriptor.
        params=[tma("x_desc", "x", enc_a), i32("x_rows", "M"), tma("w_desc", "w", enc_b), ptr("out"), i32("M")],
        tensors={"x": tensor("bf16", "M", k), "w": tensor("bf16", n, k), "out": tensor(out, "M", ld, role="out")},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(f"min(cdiv(M, {BM}) * {num_n}, {SMS})", 1, 1),
        requires=("M >= 1", "M <= 2147483647 // 2"),
        arches=HOPPER,
        note=f"prefill x[M,{k}] @ W[{n},{k}]^T, TMA + WGMMA, tile {BM}x{BN}x{BK}, {out} out",
        example_sizes={"M": 8192},
    )


def variants() -> list[Variant]:
    return ([_variant(*s) for s in SHAPES] + [_variant(*s) for s in STRIDED_SHAPES]
            + [_variant(*s, out="f32") for s in SHAPES_F32])


def reference(x: np.ndarray, w: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """float64 products (exact), else the bf16 output: fp32 sums rounded to bf16. An FP32-out
    variant's output is the exact products up to fp32 summation rounding."""
    if exact:
        return x.astype(np.float64) @ w.astype(np.float64).T
    return round_bf16((x.astype(np.float32) @ w.astype(np.float32).T).astype(np.float32))


def tile_coords(t: Any, tiles_m: Any, band: Any) -> tuple[Any, Any]:
    """(M tile, N tile) of persistent tile t (traced inside a kernel; band = GROUP_M * N tiles):
    bands of GROUP_M M-tiles, M fastest within a band, so the tiles in flight at once share
    activation and weight tiles in L2."""
    import cutlass

    first_m = (t // band) * GROUP_M
    band_rows = cutlass.min(tiles_m - first_m, GROUP_M)
    local = t % band
    return first_m + local % band_rows, local // band_rows


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

    n, k, ld = variant.config["N"], variant.config["K"], variant.config["ld"]
    out_f32 = variant.config["out"] == "f32"
    num_n = -(-n // BN)
    k_tiles = -(-k // BK)
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    k_major = LayoutEnum.ROW_MAJOR
    stage_bytes = (BM + BN) * BK * 2

    def smem_layouts() -> tuple[Any, Any]:
        a = sm90.make_smem_layout_a(k_major, (BM, BN, BK), bf16, STAGES)
        b = sm90.make_smem_layout_b(k_major, (BM, BN, BK), bf16, STAGES)
        for what, lay in (("x", a), ("w", b)):
            # The manifest promises 128-byte swizzle to the runtime's descriptor encode.
            if "S<3,4,3>" not in str(lay.inner):
                raise ValueError(f"{variant.name}: {what} smem layout is {lay.inner}, expected 128-byte swizzle")
        return a, b

    def make_mma() -> Any:
        return sm90.make_trivial_tiled_mma(
            bf16, bf16, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(), f32, (2, 1, 1),
            tiler_mn=(64, BN),
        )

    @cute.kernel
    def kernel(tma_x: cute.CopyAtom, m_x: cute.Tensor, tma_w: cute.CopyAtom, m_w: cute.Tensor,
               out: cute.Pointer, m: cutlass.Int32):
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

        # Persistent: CTA b takes tiles b, b + grid, b + 2 * grid, ... The producer warp runs ahead
        # into the next tile's k-tiles while the consumers store the current tile.
        num_m = (m + BM - 1) // BM
        num_tiles = num_m * num_n
        grid_size, _, _ = cute.arch.grid_dim()
        per_band = GROUP_M * num_n

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                for t in cutlass.range(bid, num_tiles, grid_size, unroll=1):
                    m_tile, n_tile = tile_coords(t, num_m, per_band)
                    g_x = cute.local_tile(m_x, (BM, BK), (m_tile, None))  # (BM, BK, k_tiles)
                    g_w = cute.local_tile(m_w, (BN, BK), (n_tile, None))  # (BN, BK, k_tiles)
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
            coords = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
            acc = cute.make_rmem_tensor(coords.shape, f32)
            result = cute.make_rmem_tensor(coords.shape, bf16)
            # Accumulator slots 2j and 2j + 1 are columns c and c + 1 of one row: stored as one
            # 32-bit word (N is even, so a pair is either wholly inside N or wholly past it).
            packed = cute.recast_tensor(result, cutlass.Int32)
            if cutlass.const_expr(out_f32):
                g_out = cute.make_tensor(cute.recast_ptr(out, dtype=f32), cute.make_layout((m, n), stride=(ld, 1)))
            else:
                g_out = cute.make_tensor(cute.recast_ptr(out, dtype=cutlass.Int32),
                                         cute.make_layout((m, n // 2), stride=(ld // 2, 1)))
            k_blocks = cute.size(t_ca, mode=[2])

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for t in cutlass.range(bid, num_tiles, grid_size, unroll=1):
                m_tile, n_tile = tile_coords(t, num_m, per_band)
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

                row0 = m_tile * BM
                col0 = n_tile * BN
                if cutlass.const_expr(out_f32):
                    for j in cutlass.range_constexpr(cute.size(acc)):
                        r, c = coords[j]
                        if row0 + r < m and col0 + c < n:
                            g_out[row0 + r, col0 + c] = acc[j]
                else:
                    result.store(acc.load().to(bf16))
                    if row0 + BM <= m and col0 + BN <= n:
                        for j in cutlass.range_constexpr(cute.size(packed)):
                            r, c = coords[2 * j]
                            g_out[row0 + r, (col0 + c) // 2] = packed[j]
                    else:
                        for j in cutlass.range_constexpr(cute.size(packed)):
                            r, c = coords[2 * j]
                            if row0 + r < m and col0 + c < n:
                                g_out[row0 + r, (col0 + c) // 2] = packed[j]

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gemm_{variant.key}")

    @cute.jit
    def launch(x: cute.Tensor, w: cute.Tensor, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        a_layout, b_layout = smem_layouts()
        tma_x, t_x = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, cute.slice_(a_layout, (None, None, 0)), (BM, BK)
        )
        tma_w, t_w = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), w, cute.slice_(b_layout, (None, None, 0)), (BN, BK)
        )
        kernel(tma_x, t_x, tma_w, t_w, out, m).launch(
            grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream
        )

    m_sym = cute.sym_int32(divisibility=1)
    x_fake = make_fake_compact_tensor(bf16, (m_sym, k), stride_order=(1, 0), assumed_align=16)
    w_fake = make_fake_compact_tensor(bf16, (n, k), stride_order=(1, 0), assumed_align=16)
    return launch, [x_fake, w_fake, _dsl.fake_ptr("f32" if out_f32 else "bf16"), cutlass.Int32(1), _dsl.stream()]
