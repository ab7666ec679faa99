"""The FP8 prefill GEMM's (`gemm_fp8_sm90`) issue of a k-tile's WGMMAs, for every form, and the
overlapped k-tile pairs of its `d` forms (128-column tiles): a consumer warpgroup issues two
k-tiles' WGMMAs into two fp32 fragments, waits for the first group (`wait_group(1)`), promotes it
while the second runs, then the second. Imports the CuTe DSL inside the functions: only
`build()` calls them.

These are plain functions called while the kernel is traced, so everything they touch comes in as
an argument, and nothing they change must outlive the call inside a staged loop: a ring state or
an MMA's accumulate flag changed in here is not carried through the loop around the call (the DSL
threads only the loop body's own locals), hence the state rebuilt from a count (`ring_state`) and
the MMA passed with its flag off and on (`issue`). No WGMMA group stays in flight across a loop's
back edge: with one, ptxas serialised every WGMMA of the kernel (its warning C7514)."""

from __future__ import annotations

from typing import Any


def issue(mmas: tuple, ring: Any, state: Any, part: Any, t_ca: Any, t_cb: Any, k_blocks: int) -> None:
    """Wait for the ring stage at `state`, issue its k-tile's WGMMAs into the fresh fragment `part`
    as one commit group (`promote` releases the stage once the group completed). `mmas`: the
    tiled MMA with its accumulate flag off, then on, set once outside the loops (a flag set in
    here would not be carried through the staged loop around the call)."""
    from cutlass.cute.nvgpu import warpgroup

    import cutlass.cute as cute

    ring.consumer_wait(state)
    warpgroup.fence()
    for kb in range(k_blocks):
        cute.gemm(mmas[min(kb, 1)], part, t_ca[(None, None, kb, state.index)], t_cb[(None, None, kb, state.index)],
                  part)
    warpgroup.commit_group()


def promote(ring: Any, state: Any, acc: Any, part: Any, scales: Any, buf: int) -> None:
    """Release the ring stage at `state` (its WGMMAs completed) and add the partial `part` of a
    128-column tile to `acc` times its scales (`scales[buf]`: x_lo, x_hi, w_s)."""
    import cutlass.cute as cute

    ring.consumer_release(state)
    s_lo = scales[buf, 0] * scales[buf, 2]
    s_hi = scales[buf, 1] * scales[buf, 2]
    for j in range(cute.size(acc)):  # plain loops: they unroll while tracing
        acc[j] = acc[j] + part[j] * (s_hi if (j // 2) % 2 else s_lo)


def ring_state(stages: int, n: Any) -> Any:
    """The consumer's ring state after n k-tiles (`pipeline.make_pipeline_state` advanced n times),
    built where it is used: a state stepped inside a helper is not carried through a staged loop."""
    import cutlass.pipeline as pipeline

    return pipeline.PipelineState(stages, n, n % stages, (n // stages) % 2)


def load_scales(scales: Any, buf: int, g_xs: Any, g_ws: Any, row_lo: Any, row_hi: Any, block0: Any,
                kt: Any) -> None:
    """scales[buf] = the thread's two rows' activation scales and the tile's weight scale of
    k-tile kt, loaded when its WGMMAs are issued and used when they are promoted."""
    scales[buf, 0] = g_xs[row_lo, kt]
    scales[buf, 1] = g_xs[row_hi, kt]
    scales[buf, 2] = g_ws[block0, kt]
