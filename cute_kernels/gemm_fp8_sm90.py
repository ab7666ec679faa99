"""FP8 prefill GEMM for Hopper (W8A8, block scaled): `out[M, :N] = dequant(xq)[M, K] @ dequant(W)[N, K]^T`.

Operands as the runtime holds them: the weight `w[N, K]` e4m3 with one fp32 scale per 128 x 128
block, `w_scale[cdiv(N, 128), cdiv(K, 128)]` (the artifact's `fp8_e4m3` layout, as `gemv_fp8`
reads it), and the activations `xq[M, K]` e4m3 with one fp32 scale per row and 128 columns,
`x_scale[M, cdiv(K, 128)]` (written by `quantize_act`). So

    out[m, n] = bf16( sum_kb  x_scale[m, kb] * w_scale[n / 128, kb] * sum_{k in kb} xq[m, k] * w[n, k] ).

The kernel is gemm_sm90's (warp-specialised TMA + WGMMA, persistent CTAs over tiles rasterised in
bands of GROUP_M M-tiles, one producer warpgroup, two consumer warpgroups of 64 rows each; see that
module's docstring), with what FP8 block scaling changes:

- tile 128 x BN x 128: a k-tile is one scale block of both operands (128 e4m3 = one 128-byte
  swizzled line); BN is the form's (`FORMS`): 128 (today's, untagged keys: an N tile is one
  weight-scale row), 160 or 192 (an N tile spans two weight-scale rows, see below);
- each k-tile's 4 WGMMAs (K = 32, both operands K-major from shared memory) accumulate into a
  fresh fp32 fragment, which after `wait_group(0)` is added into the tile's accumulator times
  `x_scale[row, kb] * w_scale[column / 128, kb]` (fp32 FMA): the per-block promotion also bounds
  the FP8 WGMMA's reduced-precision accumulation to 128 products. The scales are loaded from
  global memory (L1/L2) one k-tile ahead (loaded in the same k-tile, their latency stalled the
  WGMMAs issued beside the scales' products: ncu on the H200). The stage is released as soon as
  the WGMMAs finished reading it; while one consumer warpgroup scales, the other's WGMMAs run.
  The `d` forms (BN = 128) issue k-tiles in pairs into two fragments and promote the first while
  the second runs (`_fp8_pairs`), so a warpgroup also keeps the tensor cores fed on its own;
- BN = 160 / 192: tile t starts `off = (t * BN) % 128` columns into its first weight-scale block
  (160: 0, 32, 64 or 96; 192: 0 or 64) and so covers exactly two blocks (`off + BN <= 256`; BN
  such as 176 or 208 would reach a third and are refused). A thread's accumulator slots sit in
  8-column groups and every block edge inside a tile is a multiple of 32 columns from the tile's
  start, so which block a slot belongs to is known at compile time for each `off`: each `off` has
  its own k-loop with the slots' scales fixed inside it, chosen once per tile (a branch per
  k-tile compiled to a jump table whose latency stalled the promotion). The second block
  of the last tile may lie past N (its columns are TMA zeros, never stored): its scale row is
  clamped to the last;
- registers: two fp32 fragments of BN / 2 values per thread (accumulator and partial); BN = 192
  takes 192 of them, so those forms run the producer at 24 registers and the consumers at 240
  (DeepGEMM's split); BN = 256 would need 256 for the fragments alone and is not built;
- clusters (`c2` forms): two CTAs on M-tiles 2i and 2i + 1 of one N tile each TMA-load half of
  the weight tile (bn / 2 rows: the manifest's box) and multicast it into both CTAs' stage, so
  the weight bytes leave L2 once per pair. A stage's full barrier expects the x tile plus the whole
  weight tile; its empty barrier takes one arrive per consumer warp of both CTAs (8 x 2), as each
  producer writes into both. Both CTAs walk the same work items (a pair of M-tiles, then the next),
  so their rings stay in step; when M has an odd number of tiles the second CTA of the last pair
  computes an all-zero tile past M and stores nothing. The grid is whole clusters (132 = 66 x 2);
  how many clusters of 2 the H200's GPCs co-schedule is not measured here;
- edges: TMA reads rows past M and N and columns past K as zeros (a partial last k-block or
  N-block contributes nothing past the edge); rows past M read row M - 1's scale (their results
  are never stored). K must be a multiple of 16 (TMA strides) and N of 2 (paired stores);
- the output row stride is `ld` = N + NT: a fused projection whose last NT rows are BF16 (the
  runner's `tail`) has them written after column N by gemm_sm90 with the same stride.

Numerics: each block's partial is the WGMMA's (exact products of e4m3 values; an accumulation
that keeps at least the top ~14 bits of the block sum, DeepSeek-V3 section 3.3), scaled and summed
in fp32 in k-block order, rounded once to bf16. `reference` models it in fp32. Every form runs the
same 4 WGMMAs per k-tile per output and the same promotion (`acc + part * (x_scale * w_scale)`,
blocks in order), so the forms are expected to agree bit for bit (tests/gpu checks it).

Forms (`FORMS`; the runtime picks one per shape, `runtime/model/gpu/kernels.py: gemm_fp8_form`): wave
balance over 132 SMs differs by shape (`wave_efficiency`): at M = 2048 the N = 5120 shapes give
40 / 32 / 27 N tiles at BN = 128 / 160 / 192, i.e. 640 / 512 / 432 tiles = 97 / 97 / 81 % of
their last wave's slots used.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.cuda.manifest import TmaEncode

from .bf16 import round_bf16
from .gemm_sm90 import CONSUMER_REGS, GROUP_M, PRODUCER_REGS, SMS, THREADS, tile_coords
from .gemv_fp8 import e4m3_values
from .variant import HOPPER, Variant, i32, ptr, tensor, tma

FAMILY = "gemm_fp8_sm90"
BM, BK = 128, 128  # BK = the 128-column scale block of both operands
SCALE_BLOCK = 128  # rows of W per weight scale
SMEM_BYTES = 227 * 1024  # the H100 / H200 per-block shared-memory limit


@dataclass(frozen=True)
class Form:
    """One tile configuration: its N tile, shared-memory stages and register split."""

    bn: int  # N tile (columns of the output per CTA tile)
    stages: int  # shared-memory ring depth: (BM + bn) * BK bytes a stage
    regs: tuple[int, int]  # setmaxnreg of the producer and of the two consumer warpgroups
    cluster: int = 1  # CTAs per cluster along M, sharing each weight tile by TMA multicast
    # Two partial fragments: a k-tile's WGMMAs are issued before the previous k-tile's are waited
    # for and promoted, so each consumer warpgroup keeps the tensor cores fed on its own.
    overlap: bool = False

    def offsets(self, n: int) -> list[int]:
        """Where the N tiles of an N-column weight start inside their first weight-scale block."""
        return sorted({(t * self.bn) % SCALE_BLOCK for t in range(-(-n // self.bn))})


# The tile forms every shape is built in; "bn128" is today's (untagged keys), the others are
# tagged `_{form}`. Stages: as many as fit in 227 KiB (bn192: 5 x 40 KiB; the others 6 x 32 / 36 KiB).
# `c2`: clusters of two CTAs on M-tiles 2i and 2i + 1 of the same N tile, each loading half of the
# weight tile and multicasting it to both (half the weight traffic from L2). `d`: overlapped
# k-tiles (`Form.overlap`; three fragments of bn / 2 registers: only 128-column tiles fit).
FORMS = {
    "bn128": Form(128, 6, (PRODUCER_REGS, CONSUMER_REGS)),
    "bn160": Form(160, 6, (24, 240)),
    "bn192": Form(192, 5, (24, 240)),
    "bn160c2": Form(160, 6, (24, 240), cluster=2),
    "bn192c2": Form(192, 5, (24, 240), cluster=2),
    "bn128d": Form(128, 6, (24, 240), overlap=True),
    "bn128dc2": Form(128, 6, (24, 240), cluster=2, overlap=True),
}
DEFAULT_FORM = "bn128"

# (name, N, NT, K): the FP8 linears of Qwen3.6-27B in Qwen's FP8 recipe (`weights.fp8_recipe_format`:
# every projection but the GDN in_proj_b / in_proj_a, which follow gdn_in as a 96-row BF16 tail, and the
# lm_head), of the A3B models' attention and GDN projections and of the tiny fp8 test model
# (tools/make_tiny.py), the same shapes as gemv_fp8; then two
# ragged ones for tests (N, K not multiples of 128: partial blocks at both edges; test_wide's N tiles
# start at every offset a 160- or 192-column tile has in its scale block, and its last 160-column
# tile's second block lies past N).
SHAPES = [
    ("gdn_in", 16384, 96, 5120),
    ("o_proj", 5120, 0, 6144),  # GDN out_proj and attention o_proj
    ("attn_qkv", 14336, 0, 5120),
    ("gate_up", 34816, 0, 5120),
    ("down", 5120, 0, 17408),
    # Qwen3.5/3.6-35B-A3B and Qwen3-Next-80B-A3B (hidden 2048; their MoE MLPs are the moe family's).
    ("a3b_gdn_in", 12288, 64, 2048),
    ("a3b_o_proj", 2048, 0, 4096),
    ("a3b_attn_qkv", 9216, 0, 2048),
    ("tiny_gdn_in", 384, 8, 256),
    ("tiny_gdn_out", 256, 0, 128),
    ("tiny_attn_qkv", 768, 0, 256),
    ("tiny_o_proj", 256, 0, 256),
    ("tiny_gate_up", 1024, 0, 256),
    ("tiny_down", 256, 0, 512),
    ("test", 328, 0, 320),
    ("test_wide", 680, 0, 320),
]


def key(name: str, n: int, nt: int, k: int, form: str = DEFAULT_FORM) -> str:
    """The variant key of a shape in a form (today's form untagged)."""
    return f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}" + ("" if form == DEFAULT_FORM else f"_{form}")


def wave_efficiency(form: str, m: int, n: int) -> float:
    """The fraction of the persistent grid's tile slots (132 CTAs x its waves) that hold useful
    output columns, for an M x N output in a form: tile count rounding and the last partial N
    tile both count as waste."""
    bn, c = FORMS[form].bn, FORMS[form].cluster
    units = -(-m // (BM * c)) * -(-n // bn)  # cluster work items (c M-tiles of one N tile)
    clusters = SMS // c
    return (-(-m // BM) * n / bn) / (-(-units // clusters) * clusters * c)


def slot_block(off: int, j: int) -> int:
    """Which of a tile's two weight-scale blocks (0 or 1) accumulator slot j of every consumer
    thread lies in, for a tile starting `off` columns into its first block: slot j is in the
    8-column group j // 4 of the m64nNk32 C layout (the thread's columns 2 (lane % 4) + j % 2 of the
    group stay inside it, as every block edge is a multiple of 8 columns from the tile's start)."""
    return (off + 8 * (j // 4)) // SCALE_BLOCK


def _variant(name: str, n: int, nt: int, k: int, form_name: str) -> Variant:
    form = FORMS[form_name]
    bn = form.bn
    if n % 2 or k % 16:
        raise ValueError(f"gemm_fp8_sm90 shape {name}: N = {n} must be even (paired stores) and K = {k} a "
                         "multiple of 16 (TMA row strides)")
    if max(form.offsets(n)) + bn > 2 * SCALE_BLOCK or bn % 32:
        raise ValueError(f"gemm_fp8_sm90 form {form_name}: an N tile of {bn} columns must be a multiple of 32 "
                         "that spans at most two 128-row weight-scale blocks")
    if form.overlap and bn != SCALE_BLOCK:
        raise ValueError(f"gemm_fp8_sm90 form {form_name}: overlapped k-tiles hold three fragments of bn / 2 "
                         "registers, which fit only 128-column tiles")
    if form.stages * (BM + bn) * BK + 1024 > SMEM_BYTES:
        raise ValueError(f"gemm_fp8_sm90 form {form_name}: {form.stages} stages of {(BM + bn) * BK} bytes do not "
                         "fit in shared memory")
    num_n, kb, nwb = -(-n // bn), -(-k // BK), -(-n // SCALE_BLOCK)
    ld = n + nt
    enc_a = TmaEncode(dtype="UINT8", dims=(k, "M"), strides_bytes=(k,), box=(BK, BM), elem_strides=(1, 1))
    c = form.cluster
    # Each CTA of a cluster loads bn / c weight rows and multicasts them to all c.
    enc_b = TmaEncode(dtype="UINT8", dims=(k, n), strides_bytes=(k,), box=(BK, bn // c), elem_strides=(1, 1))
    return Variant(
        family=FAMILY,
        key=key(name, n, nt, k, form_name),
        config={"N": n, "NT": nt, "K": k, "ld": ld, "form": form_name, "tile": [BM, bn, BK], "stages": form.stages,
                "group_m": GROUP_M, "threads": THREADS, "regs": list(form.regs), "cluster": form.cluster,
                "persistent_ctas": SMS},
        params=[tma("x_desc", "x", enc_a), i32("x_rows", "M"), tma("w_desc", "w", enc_b), ptr("x_scale"),
                ptr("w_scale"), ptr("out"), i32("M")],
        tensors={"x": tensor("e4m3", "M", k), "w": tensor("e4m3", n, k), "x_scale": tensor("f32", "M", kb),
                 "w_scale": tensor("f32", nwb, kb), "out": tensor("bf16", "M", ld, role="out")},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(f"min(cdiv(M, {BM}) * {num_n}, {SMS})" if c == 1 else f"min(cdiv(M, {BM * c}) * {num_n * c}, {SMS})",
              1, 1),
        cluster=(c, 1, 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // max(ld, k)}"),
        arches=HOPPER,
        note=f"prefill fp8 xq[M,{k}] @ W[{n},{k}]^T, 1x128 / 128x128 block scales, tile {BM}x{bn}x{BK}, "
             f"out stride {ld}" + (f", clusters of {c} CTAs along M multicasting W" if c > 1 else ""),
        example_sizes={"M": 8192},
    )


def variants() -> list[Variant]:
    return [_variant(*s, form) for form in FORMS for s in SHAPES]


def reference(xq: np.ndarray, x_scale: np.ndarray, w: np.ndarray, w_scale: np.ndarray, *,
              exact: bool = False) -> np.ndarray:
    """The product from the codes and scales, block by block: exact (float64: the e4m3 products
    and their 128-term sums are exact there, so this is the product of the dequantised operands
    up to float64 rounding), or the kernel's order in fp32 (per-block partial, times both scales,
    summed over blocks, rounded to bf16)."""
    ft = np.float64 if exact else np.float32
    m, k = xq.shape
    n = w.shape[0]
    a, b = e4m3_values(xq).astype(ft), e4m3_values(w).astype(ft)
    w_rows = np.repeat(w_scale.astype(ft), SCALE_BLOCK, axis=0)[:n]
    total = np.zeros((m, n), dtype=ft)
    for kb in range(-(-k // BK)):
        part = a[:, kb * BK:(kb + 1) * BK] @ b[:, kb * BK:(kb + 1) * BK].T
        total += part * (x_scale[:, kb:kb + 1].astype(ft) * w_rows[None, :, kb])
    return total if exact else round_bf16(total)


def _scales(g_xs: Any, g_ws: Any, row_lo: Any, row_hi: Any, block0: Any, block1: Any, kt: Any) -> tuple:
    """A consumer thread's scales of k-tile kt: its two rows' activation scales, the weight scales
    of the tile's two weight-scale blocks (the same block twice where the tile has one)."""
    return g_xs[row_lo, kt], g_xs[row_hi, kt], g_ws[block0, kt], g_ws[block1, kt]


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.tensor_utils.layout import LayoutEnum

    from . import _dsl
    from ._fp8_pairs import issue, load_scales, promote, ring_state
    from ._tma_ring import operand_ring

    n, k, ld = variant.config["N"], variant.config["K"], variant.config["ld"]
    form = FORMS[variant.config["form"]]
    bn, stages = form.bn, form.stages
    producer_regs, consumer_regs = form.regs
    cluster, overlap = form.cluster, form.overlap
    num_n = -(-n // bn)
    k_tiles = -(-k // BK)
    last_block = -(-n // SCALE_BLOCK) - 1
    # Where tiles start inside their first weight-scale block (`off`); those past 0 take two weight
    # scales per k-tile, the promotion one compile-time slot -> block map per offset. Every tile of
    # a 128-column form starts at 0.
    tile_offsets = form.offsets(n) if bn > SCALE_BLOCK else [0]
    e4m3, bf16, f32 = cutlass.Float8E4M3FN, cutlass.BFloat16, cutlass.Float32
    k_major = LayoutEnum.ROW_MAJOR
    stage_bytes = (BM + bn) * BK

    def smem_layouts() -> tuple[Any, Any]:
        a = sm90.make_smem_layout_a(k_major, (BM, bn, BK), e4m3, stages)
        b = sm90.make_smem_layout_b(k_major, (BM, bn, BK), e4m3, stages)
        for what, lay in (("x", a), ("w", b)):
            # The manifest promises 128-byte swizzle to the runtime's descriptor encode.
            if "S<3,4,3>" not in str(lay.inner):
                raise ValueError(f"{variant.name}: {what} smem layout is {lay.inner}, expected 128-byte swizzle")
        return a, b

    def make_mma() -> Any:
        return sm90.make_trivial_tiled_mma(e4m3, e4m3, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
                                           f32, (2, 1, 1), tiler_mn=(64, bn))

    @cute.kernel
    def kernel(tma_x: cute.CopyAtom, m_x: cute.Tensor, tma_w: cute.CopyAtom, m_w: cute.Tensor,
               x_scale: cute.Pointer, w_scale: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        a_layout, b_layout = smem_layouts()
        tiled_mma = make_mma()
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // 4

        if warp == 0:
            cpasync.prefetch_descriptor(tma_x)
            cpasync.prefetch_descriptor(tma_w)

        # One arrive per consumer warp into every CTA of the cluster (each producer writes its half
        # of the weight tile into all of them, so waits for all their consumers); stage_bytes: the x
        # tile + the whole weight tile (its parts from every CTA).
        ring, s_a, s_b = operand_ring(a_layout, b_layout, e4m3, stages, stage_bytes, 8, cluster)

        num_m = (m + BM - 1) // BM
        # Work items: `cluster` consecutive M-tiles of one N tile; CTA `rank` of a cluster takes the
        # rank-th (past M when M has fewer tiles: TMA reads zeros, nothing is stored). Both CTAs
        # walk the same items, so their pipelines stay in step.
        num_mc = num_m
        if cutlass.const_expr(cluster > 1):
            num_mc = (num_m + cluster - 1) // cluster
        num_items = num_mc * num_n
        grid_size, _, _ = cute.arch.grid_dim()
        per_band = GROUP_M * num_n
        first, step, rank = bid, grid_size, 0
        if cutlass.const_expr(cluster > 1):
            first, step, rank = bid // cluster, grid_size // cluster, bid % cluster

        if wg == 0:
            cute.arch.setmaxregister_decrease(producer_regs)
            if warp == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for t in cutlass.range(first, num_items, step, unroll=1):
                    mc, n_tile = tile_coords(t, num_mc, per_band)
                    m_tile = mc * cluster + rank
                    g_x = cute.local_tile(m_x, (BM, BK), (m_tile, None))
                    g_w = cute.local_tile(m_w, (bn, BK), (n_tile, None))
                    t_sx, t_gx = cpasync.tma_partition(tma_x, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2),
                                                       cute.group_modes(g_x, 0, 2))
                    t_sw, t_gw = cpasync.tma_partition(tma_w, rank, cute.make_layout(cluster),
                                                       cute.group_modes(s_b, 0, 2), cute.group_modes(g_w, 0, 2))
                    for kt in cutlass.range(k_tiles, unroll=1):
                        ring.producer_acquire(state)
                        bar = ring.producer_get_barrier(state)
                        cute.copy(tma_x, t_gx[(None, kt)], t_sx[(None, state.index)], tma_bar_ptr=bar)
                        if cutlass.const_expr(cluster > 1):
                            cute.copy(tma_w, t_gw[(None, kt)], t_sw[(None, state.index)], tma_bar_ptr=bar,
                                      mcast_mask=cutlass.Int16((1 << cluster) - 1))
                        else:
                            cute.copy(tma_w, t_gw[(None, kt)], t_sw[(None, state.index)], tma_bar_ptr=bar)
                        ring.producer_commit(state)
                        state.advance()
                ring.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(consumer_regs)
            ctid = tid - 128
            wg_mma = tiled_mma.get_slice((ctid // 128) * 128)
            thr_mma = tiled_mma.get_slice(ctid)
            t_ca = tiled_mma.make_fragment_A(wg_mma.partition_A(s_a))
            t_cb = tiled_mma.make_fragment_B(wg_mma.partition_B(s_b))
            coords = thr_mma.partition_C(cute.make_identity_tensor((BM, bn)))
            acc = cute.make_rmem_tensor(coords.shape, f32)
            part = cute.make_rmem_tensor(coords.shape, f32)
            parts = (part, cute.make_rmem_tensor(coords.shape, f32) if cutlass.const_expr(overlap) else part)
            result = cute.make_rmem_tensor(coords.shape, bf16)
            packed = cute.recast_tensor(result, cutlass.Int32)
            g_out = cute.make_tensor(cute.recast_ptr(out, dtype=cutlass.Int32),
                                     cute.make_layout((m, ld // 2), stride=(ld // 2, 1)))
            g_xs = cute.make_tensor(x_scale, cute.make_layout((m, k_tiles), stride=(k_tiles, 1)))
            g_ws = cute.make_tensor(w_scale, cute.make_layout((last_block + 1, k_tiles), stride=(k_tiles, 1)))
            k_blocks = cute.size(t_ca, mode=[2])
            # A WGMMA accumulator holds 2 rows per thread: slot j is row r0 + 8 * ((j // 2) % 2) of
            # the warpgroup's 64 (the m64nNk32 C layout: column pairs, then the row half, then
            # 8-column steps), so each k-tile needs two activation scales per thread; its
            # weight-scale block is `slot_block(off, j)`.
            r_lo, _ = coords[0]
            r_hi, _ = coords[2]

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            mmas = (make_mma(), make_mma())  # accumulate off / on (`_fp8_pairs.issue`)
            mmas[0].set(warpgroup.Field.ACCUMULATE, False)
            mmas[1].set(warpgroup.Field.ACCUMULATE, True)
            scales = cute.make_rmem_tensor((2, 3), f32)  # overlapped forms: each fragment's k-tile scales
            for t in cutlass.range(first, num_items, step, unroll=1):
                mc, n_tile = tile_coords(t, num_mc, per_band)
                m_tile = mc * cluster + rank
                row0 = m_tile * BM
                col0 = n_tile * bn
                row_lo = cutlass.min(row0 + r_lo, m - 1)
                row_hi = cutlass.min(row0 + r_hi, m - 1)
                block0 = col0 // SCALE_BLOCK
                block1 = cutlass.min(block0 + 1, last_block)  # past N: any row (its columns are zeros)
                off = col0 - block0 * SCALE_BLOCK
                acc.fill(0.0)
                if cutlass.const_expr(overlap):
                    # k-tiles in pairs: both issued, the first promoted while the second runs
                    # (128-column tiles: one weight-scale block, offset 0). No WGMMA group stays in
                    # flight across the loop's back edge: with one, ptxas serialised every WGMMA
                    # of the kernel (its warning C7514).
                    c0 = read.count
                    for pair in cutlass.range(k_tiles // 2, unroll=1):
                        for h in cutlass.range_constexpr(2):
                            load_scales(scales, h, g_xs, g_ws, row_lo, row_hi, block0, 2 * pair + h)
                            issue(mmas, ring, ring_state(stages, c0 + 2 * pair + h), parts[h], t_ca, t_cb,
                                   k_blocks)
                        for h in cutlass.range_constexpr(2):
                            warpgroup.wait_group(1 - h)
                            promote(ring, ring_state(stages, c0 + 2 * pair + h), acc, parts[h], scales, h)
                    if cutlass.const_expr(k_tiles % 2):
                        load_scales(scales, 0, g_xs, g_ws, row_lo, row_hi, block0, k_tiles - 1)
                        issue(mmas, ring, ring_state(stages, c0 + k_tiles - 1), parts[0], t_ca, t_cb, k_blocks)
                        warpgroup.wait_group(0)
                        promote(ring, ring_state(stages, c0 + k_tiles - 1), acc, parts[0], scales, 0)
                # One k-loop per tile offset, chosen once per tile: the slot -> scale-block map is
                # a compile-time one inside it (a branch per k-tile, a jump table, stalled the
                # promotion). Each runs all k_tiles stages on its own copy of the ring state.
                for o in cutlass.range_constexpr(0 if overlap else len(tile_offsets)):
                    if off == tile_offsets[o]:
                        k_state = read.clone()
                        # A k-tile's scales are loaded one k-tile ahead: loaded at the top of the
                        # same k-tile, their L2 latency stalled the WGMMAs issued beside the
                        # products of the scales.
                        x_lo, x_hi, w_s, w_s1 = _scales(g_xs, g_ws, row_lo, row_hi, block0, block1, 0)
                        for kt in cutlass.range(k_tiles, unroll=1):
                            ahead = cutlass.min(kt + 1, k_tiles - 1)
                            nx_lo, nx_hi, nw_s, nw_s1 = _scales(g_xs, g_ws, row_lo, row_hi, block0, block1, ahead)
                            s_lo, s_hi = x_lo * w_s, x_hi * w_s
                            s1_lo, s1_hi = x_lo * w_s1, x_hi * w_s1
                            issue(mmas, ring, k_state, part, t_ca, t_cb, k_blocks)
                            warpgroup.wait_group(0)
                            ring.consumer_release(k_state)
                            k_state.advance()
                            for j in cutlass.range_constexpr(cute.size(acc)):
                                if cutlass.const_expr(slot_block(tile_offsets[o], j)):
                                    acc[j] = acc[j] + part[j] * (s1_hi if (j // 2) % 2 else s1_lo)
                                else:
                                    acc[j] = acc[j] + part[j] * (s_hi if (j // 2) % 2 else s_lo)
                            x_lo, x_hi, w_s, w_s1 = nx_lo, nx_hi, nw_s, nw_s1
                read.advance(k_tiles)

                result.store(acc.load().to(bf16))
                if row0 + BM <= m and col0 + bn <= n:
                    for j in cutlass.range_constexpr(cute.size(packed)):
                        r, c = coords[2 * j]
                        g_out[row0 + r, (col0 + c) // 2] = packed[j]
                else:
                    for j in cutlass.range_constexpr(cute.size(packed)):
                        r, c = coords[2 * j]
                        if row0 + r < m and col0 + c < n:
                            g_out[row0 + r, (col0 + c) // 2] = packed[j]

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gemm_fp8_sm90_{variant.key}")

    @cute.jit
    def launch(x: cute.Tensor, w: cute.Tensor, x_scale: cute.Pointer, w_scale: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32, stream: Any):
        a_layout, b_layout = smem_layouts()
        tma_x, t_x = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, cute.slice_(a_layout, (None, None, 0)), (BM, BK)
        )
        if cutlass.const_expr(cluster > 1):
            tma_w, t_w = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), w,
                                                     cute.slice_(b_layout, (None, None, 0)), (bn, BK),
                                                     num_multicast=cluster)
        else:
            tma_w, t_w = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), w, cute.slice_(b_layout, (None, None, 0)), (bn, BK)
            )
        kernel(tma_x, t_x, tma_w, t_w, x_scale, w_scale, out, m).launch(
            grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
            **({"cluster": [cluster, 1, 1]} if cluster > 1 else {}), stream=stream
        )

    m_sym = cute.sym_int32(divisibility=1)
    x_fake = make_fake_compact_tensor(e4m3, (m_sym, k), stride_order=(1, 0), assumed_align=16)
    w_fake = make_fake_compact_tensor(e4m3, (n, k), stride_order=(1, 0), assumed_align=16)
    return launch, [x_fake, w_fake, _dsl.fake_ptr("f32"), _dsl.fake_ptr("f32"), _dsl.fake_ptr("bf16"),
                    cutlass.Int32(1), _dsl.stream()]
