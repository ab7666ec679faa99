"""The CuTe DSL kernel of `gemm_bs_sm100` (imported by its `build()` only; see that module).

One CTA computes one 128 x 256 output tile with 192 threads in three roles:

- warp 5 (producer): per k-tile, one TMA load of A's 128 x BK and of B's 256 x BK codes (128
  bytes of K per row, 128-byte swizzle; the descriptors are over bytes, UINT8, whatever the
  codes, so the runtime encodes them as it does gemm_fp8_sm90's) and plain bulk copies
  (`cp.async.bulk`, no tensor map) of the tile's scale factors, which the caller stores
  pre-tiled (`gemm_bs_sm100.tile_scales`), so a k-tile's scales are one contiguous run per 128
  rows and land in shared memory already in the layout `tcgen05.cp` reads. All of it completes
  on the stage's one mbarrier;
- warp 4 (MMA): per k-tile, waits for the stage, copies its scales shared -> tensor memory
  (`tcgen05.cp` 4x32x128b), issues the 4 block-scaled UMMAs of the k-tile into the fp32
  accumulator in tensor memory (128 lanes x 256 columns) and releases the stage with a
  `tcgen05.commit` (the copy and the MMAs run in issue order, so one scale buffer suffices);
  after the last k-tile it commits the accumulator barrier;
- warps 0-3 (epilogue; warp 0 also allocates and frees the 512 tensor-memory columns): wait for
  the accumulator, then each thread reads its own row (warp w owns lanes 32w..32w+31) 32 columns
  at a time (`tcgen05.ld` 32x32b x32), multiplies by the activation's global scale and the
  weight row's global scale in fp32, rounds to bf16 and stores column pairs; rows past M are
  skipped.

Tensor memory columns: [0, 256) accumulator, then SFA, then SFB (`tcgen05.mma`'s scale inputs).
"""

from typing import Any

from .variant import Variant

BM, BN = 128, 256
STAGES = 4
KBYTES = 128  # bytes of a row per k-tile: one 128-byte swizzle line
EPI_N = 32  # accumulator columns per tcgen05.ld
TMEM_COLS = 512  # a power of two >= 256 accumulator + scale columns
SF_CHUNK = 512  # bytes of one 128-row x 4-scale tile of the scale layout
WARP_MMA, WARP_TMA = 4, 5
THREADS = 192


def build(variant: Variant, fmt: Any) -> tuple[Any, list[Any]]:
    """`fmt`: the variant's `gemm_bs_sm100.Format` (element and scale types, K per scale, BK)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.blackwell_helpers as sm100
    import cutlass.utils.blockscaled_layout as bsl
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
    from cutlass.cute.runtime import make_fake_compact_tensor, make_ptr
    from cutlass.memory.tmem import TmemAllocator

    from . import _dsl

    n, k = variant.config["N"], variant.config["K"]
    bk, vec = fmt.bk, fmt.vec
    ab = getattr(cutlass, fmt.dsl_elem)
    sf = getattr(cutlass, fmt.dsl_scale)
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    k_tiles = k // bk
    chunks_k = k // vec // 4  # scale-layout chunks along K per 128 rows
    sfa_stage = BM * bk // vec  # scale bytes of a k-tile per 128 rows
    tile = (BM, BN, bk)
    k_major = OperandMajorMode.K
    byte = cutlass.Float8E4M3FN  # a code byte as TMA moves it (encoded UINT8, as for gemm_fp8_sm90)
    byte_tile = (BM, BN, KBYTES)
    stage_bytes = (BM + BN) * KBYTES + sfa_stage * (1 + BN // BM)

    def make_mma() -> Any:
        return sm100.make_blockscaled_trivial_tiled_mma(ab, ab, k_major, k_major, sf, vec, tcgen05.CtaGroup.ONE,
                                                        (BM, BN))

    def make_byte_mma() -> Any:
        # TMA works on bytes, whatever the codes: it is set up with the MX-FP8 MMA of the same tile,
        # whose operand layouts are, byte for byte, those of the NVFP4 one (checked in `launch`).
        return sm100.make_blockscaled_trivial_tiled_mma(byte, byte, k_major, k_major, cutlass.Float8E8M0FNU, 32,
                                                        tcgen05.CtaGroup.ONE, (BM, BN))

    def smem_layouts(tiled_mma: Any, byte_mma: Any) -> tuple[Any, ...]:
        a = sm100.make_smem_layout_a(tiled_mma, tile, ab, STAGES)
        b = sm100.make_smem_layout_b(tiled_mma, tile, ab, STAGES)
        a_bytes = sm100.make_smem_layout_a(byte_mma, byte_tile, byte, STAGES)
        b_bytes = sm100.make_smem_layout_b(byte_mma, byte_tile, byte, STAGES)
        sfa = bsl.make_smem_layout_sfa(tiled_mma, tile, vec, STAGES)
        sfb = bsl.make_smem_layout_sfb(tiled_mma, tile, vec, STAGES)
        return a, b, a_bytes, b_bytes, sfa, sfb

    def check_byte_layouts(codes: Any, raw: Any) -> None:
        """The MMA's view of an operand's shared memory must be the bytes TMA writes, with the
        128-byte swizzle the manifest's descriptors promise."""
        same = str(cute.recast_layout(8, ab.width, codes.outer)) == str(raw.outer)
        if not same or str(codes.inner) != str(raw.inner) or "S<3,4,3>" not in str(raw.inner):
            raise ValueError(f"{variant.name}: smem layout {codes} is not the 128-byte-swizzled {raw} TMA fills")

    def check_scale_stage(layout: Any, rows: int) -> None:
        """A stage of an operand's scales must be the `rows` x BK / V bytes the bulk copies fill."""
        stage = cute.cosize(cute.filter_zeros(cute.slice_(layout, (None, None, None, 0))))
        if stage != rows * bk // vec:
            raise ValueError(f"{variant.name}: a stage of scales spans {stage} bytes, not {rows * bk // vec}")

    def s2t(s_sf: Any, t_sf: Any) -> tuple[Any, Any, Any]:
        """The shared -> tensor memory copy of one operand's scales, partitioned."""
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), sf)
        t_compact = cute.filter_zeros(t_sf)
        copy = tcgen05.make_s2t_copy(atom, t_compact)
        thr = copy.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(cute.filter_zeros(s_sf)))
        return copy, src, thr.partition_D(t_compact)

    @cute.kernel
    def kernel(tma_a: cute.CopyAtom, m_a: cute.Tensor, tma_b: cute.CopyAtom, m_b: cute.Tensor, sfa: cute.Pointer,
               sfb: cute.Pointer, a_gscale: cute.Pointer, b_gscale: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32):
        tiled_mma, byte_mma = make_mma(), make_byte_mma()
        a_layout, b_layout, a_bytes, b_bytes, sfa_layout, sfb_layout = smem_layouts(tiled_mma, byte_mma)
        tid, _, _ = cute.arch.thread_idx()
        n_tile, m_tile, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp == WARP_TMA:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        @cute.struct
        class Storage:
            ring: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
            acc_bar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: cutlass.Int32
            sa: cute.struct.Align[cute.struct.MemRange[byte, cute.cosize(a_bytes.outer)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[byte, cute.cosize(b_bytes.outer)], 1024]
            ssfa: cute.struct.Align[cute.struct.MemRange[sf, cute.cosize(sfa_layout)], 128]
            ssfb: cute.struct.Align[cute.struct.MemRange[sf, cute.cosize(sfb_layout)], 128]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        ring = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ring.data_ptr(),
            num_stages=STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        acc_ready = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_bar.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        tmem = TmemAllocator(storage.tmem_addr.ptr, barrier_for_retrieve=pipeline.NamedBarrier(
            barrier_id=1, num_threads=160), allocator_warp_id=0)
        epi_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=128)

        s_a = storage.sa.get_tensor(a_layout.outer, swizzle=a_layout.inner, dtype=ab)
        s_b = storage.sb.get_tensor(b_layout.outer, swizzle=b_layout.inner, dtype=ab)
        s_sfa = storage.ssfa.get_tensor(sfa_layout)
        s_sfb = storage.ssfb.get_tensor(sfb_layout)
        acc_fake = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C((BM, BN)))

        if warp == WARP_TMA:
            s_a8 = storage.sa.get_tensor(a_bytes.outer, swizzle=a_bytes.inner)
            s_b8 = storage.sb.get_tensor(b_bytes.outer, swizzle=b_bytes.inner)
            thr_bytes = byte_mma.get_slice(0)
            g_a = thr_bytes.partition_A(cute.local_tile(m_a, (BM, KBYTES), (m_tile, None)))
            g_b = thr_bytes.partition_B(cute.local_tile(m_b, (BN, KBYTES), (n_tile, None)))
            t_sa, t_ga = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(s_a8, 0, 3),
                                               cute.group_modes(g_a, 0, 3))
            t_sb, t_gb = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(s_b8, 0, 3),
                                               cute.group_modes(g_b, 0, 3))
            # Scales: 1-D runs of sfa_stage bytes, in global and shared memory alike.
            num_m = (m + BM - 1) // BM
            g_sfa = cute.make_tensor(sfa, cute.make_layout(num_m * chunks_k * SF_CHUNK))
            g_sfb = cute.make_tensor(sfb, cute.make_layout((n // BM) * chunks_k * SF_CHUNK))
            flat_sfa = cute.make_tensor(s_sfa.iterator, cute.make_layout(STAGES * sfa_stage))
            flat_sfb = cute.make_tensor(s_sfb.iterator, cute.make_layout(STAGES * sfa_stage * (BN // BM)))
            bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), sf, num_bits_per_copy=sfa_stage * sf.width)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            for kt in cutlass.range(k_tiles, unroll=1):
                ring.producer_acquire(state)
                bar = ring.producer_get_barrier(state)
                cute.copy(tma_a, t_ga[(None, kt)], t_sa[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, t_gb[(None, kt)], t_sb[(None, state.index)], tma_bar_ptr=bar)
                with cute.arch.elect_one():
                    a_run = m_tile * k_tiles + kt
                    cute.copy(bulk, cute.local_tile(g_sfa, (sfa_stage,), (a_run,)),
                              cute.local_tile(flat_sfa, (sfa_stage,), (state.index,)), mbar_ptr=bar)
                    for h in cutlass.range_constexpr(BN // BM):
                        b_run = (n_tile * (BN // BM) + h) * k_tiles + kt
                        cute.copy(bulk, cute.local_tile(g_sfb, (sfa_stage,), (b_run,)),
                                  cute.local_tile(flat_sfb, (sfa_stage,), (state.index * (BN // BM) + h,)),
                                  mbar_ptr=bar)
                ring.producer_commit(state)
                state.advance()
            ring.producer_tail(state)

        if warp == WARP_MMA:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(f32)
            t_acc = cute.make_tensor(acc_ptr, acc_fake.layout)
            sfa_cols = BM // 32 * (bk // tiled_mma.shape_mnk[2])
            t_sfa = cute.make_tensor(cute.recast_ptr(acc_ptr + BN, dtype=sf), bsl.make_tmem_layout_sfa(
                tiled_mma, tile, vec, cute.slice_(sfa_layout, (None, None, None, 0))))
            t_sfb = cute.make_tensor(cute.recast_ptr(acc_ptr + BN + sfa_cols, dtype=sf), bsl.make_tmem_layout_sfb(
                tiled_mma, tile, vec, cute.slice_(sfb_layout, (None, None, None, 0))))
            cp_sfa, src_sfa, dst_sfa = s2t(s_sfa, t_sfa)
            cp_sfb, src_sfb, dst_sfb = s2t(s_sfb, t_sfb)
            t_ca = tiled_mma.make_fragment_A(s_a)
            t_cb = tiled_mma.make_fragment_B(s_b)
            k_blocks = cute.size(t_ca, mode=[2])

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            acc_ready.producer_acquire(acc_state)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for kt in cutlass.range(k_tiles, unroll=1):
                ring.consumer_wait(read)
                cute.copy(cp_sfa, src_sfa[(None, None, None, None, read.index)], dst_sfa)
                cute.copy(cp_sfb, src_sfb[(None, None, None, None, read.index)], dst_sfb)
                for kb in cutlass.range_constexpr(k_blocks):
                    tiled_mma.set(tcgen05.Field.SFA, t_sfa[(None, None, kb)].iterator)
                    tiled_mma.set(tcgen05.Field.SFB, t_sfb[(None, None, kb)].iterator)
                    cute.gemm(tiled_mma, t_acc, t_ca[(None, None, kb, read.index)], t_cb[(None, None, kb, read.index)],
                              t_acc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                ring.consumer_release(read)
                read.advance()
            acc_ready.producer_commit(acc_state)

        if warp < WARP_MMA:
            tmem.allocate(TMEM_COLS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(f32)
            t_acc = cute.make_tensor(acc_ptr, acc_fake.layout)
            acc_epi = cute.flat_divide(t_acc[((None, None), 0, 0)], (BM, EPI_N))
            t2r = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), f32),
                                         acc_epi[(None, None, 0, 0)])
            thr = t2r.get_slice(tid)
            t_src = thr.partition_S(acc_epi)
            coords = thr.partition_D(cute.flat_divide(cute.make_identity_tensor((BM, BN)), (BM, EPI_N)))
            frag = cute.make_rmem_tensor(coords[(None, None, None, 0, 0)].shape, f32)
            result = cute.make_rmem_tensor(frag.shape, bf16)
            packed = cute.recast_tensor(result, cutlass.Int32)
            g_out = cute.make_tensor(cute.recast_ptr(out, dtype=cutlass.Int32),
                                     cute.make_layout((m, n // 2), stride=(n // 2, 1)))
            g_bs = cute.make_tensor(b_gscale, cute.make_layout(n))
            a_g = cute.make_tensor(a_gscale, cute.make_layout(1))[0]
            row0, col0 = m_tile * BM, n_tile * BN

            acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            acc_ready.consumer_wait(acc_state)
            for c in cutlass.range_constexpr(BN // EPI_N):
                cute.copy(t2r, t_src[(None, None, None, 0, c)], frag)
                crd = coords[(None, None, None, 0, c)]
                for j in cutlass.range_constexpr(cute.size(frag)):
                    _, col = crd[j]
                    frag[j] = frag[j] * a_g * g_bs[col0 + col]
                result.store(frag.load().to(bf16))
                for j in cutlass.range_constexpr(cute.size(packed)):
                    r, col = crd[2 * j]
                    if row0 + r < m:
                        g_out[row0 + r, (col0 + col) // 2] = packed[j]
            acc_ready.consumer_release(acc_state)
            # Every epilogue thread is done reading tensor memory before warp 0 frees it.
            tmem.relinquish_alloc_permit()
            epi_bar.arrive_and_wait()
            tmem.free(acc_ptr)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gemm_bs_sm100_{variant.key}")

    @cute.jit
    def launch(a: cute.Tensor, b: cute.Tensor, sfa: cute.Pointer, sfb: cute.Pointer, a_gscale: cute.Pointer,
               b_gscale: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        tiled_mma, byte_mma = make_mma(), make_byte_mma()
        a_layout, b_layout, a_bytes, b_bytes, sfa_layout, sfb_layout = smem_layouts(tiled_mma, byte_mma)
        check_byte_layouts(a_layout, a_bytes)
        check_byte_layouts(b_layout, b_bytes)
        check_scale_stage(sfa_layout, BM)
        check_scale_stage(sfb_layout, BN)
        tma_a, t_a = cute.nvgpu.make_tiled_tma_atom_A(cpasync.CopyBulkTensorTileG2SOp(), a,
                                                      cute.slice_(a_bytes, (None, None, None, 0)), byte_tile, byte_mma)
        tma_b, t_b = cute.nvgpu.make_tiled_tma_atom_B(cpasync.CopyBulkTensorTileG2SOp(), b,
                                                      cute.slice_(b_bytes, (None, None, None, 0)), byte_tile, byte_mma)
        kernel(tma_a, t_a, tma_b, t_b, sfa, sfb, a_gscale, b_gscale, out, m).launch(
            grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream
        )

    m_sym = cute.sym_int32(divisibility=1)
    a_fake = make_fake_compact_tensor(byte, (m_sym, k * ab.width // 8), stride_order=(1, 0), assumed_align=16)
    b_fake = make_fake_compact_tensor(byte, (n, k * ab.width // 8), stride_order=(1, 0), assumed_align=16)

    def sf_ptr() -> Any:
        return make_ptr(sf, 0, cute.AddressSpace.gmem, assumed_align=16)

    return launch, [a_fake, b_fake, sf_ptr(), sf_ptr(), _dsl.fake_ptr("f32"), _dsl.fake_ptr("f32"),
                    _dsl.fake_ptr("bf16"), cutlass.Int32(1), _dsl.stream()]
