"""The shared-memory operand ring of the warp-specialised Hopper GEMMs (imports the CuTe DSL; build
time only): `gemm_sm90`, `gemm_fp8_sm90` and `moe_grouped_gemm` stage their A (activation) and
B (weight) tiles the same way, one TMA producer warp filling a ring that the consumer warps drain.

(No `from __future__ import annotations` here: `cute.struct` reads the class's annotations as
objects while a kernel is traced.)
"""

from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline


def operand_ring(a_layout: Any, b_layout: Any, dtype: Any, stages: int, stage_bytes: int,
                 consumer_warps: int, cluster: int = 1) -> tuple[Any, Any, Any]:
    """(ring, s_a, s_b) for a kernel being traced: `stages` full/empty barrier pairs and the A / B
    tiles (1024-byte aligned, swizzled per their layouts) in shared memory, and the TMA pipeline
    over them: one producer thread, one arrive per consumer warp of every CTA of the cluster
    (`cluster` CTAs along the weight tile's N, each receiving the others' parts), `stage_bytes`
    landing per stage."""

    @cute.struct
    class Storage:
        barriers: cute.struct.MemRange[cutlass.Int64, 2 * stages]
        sa: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_layout)], 1024]
        sb: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_layout)], 1024]

    storage = cutlass.memory.SmemAllocator().allocate(Storage)
    ring = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * cluster),
        tx_count=stage_bytes,
        cta_layout_vmnk=cute.make_layout((1, cluster, 1, 1)),
    )
    return (ring, storage.sa.get_tensor(a_layout.outer, swizzle=a_layout.inner),
            storage.sb.get_tensor(b_layout.outer, swizzle=b_layout.inner))
