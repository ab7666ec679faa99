"""The fused gate/up + SiLU epilogue of the decode GEMVs' `_silu` variants (`gemv`, `gemv_fp8`,
`gemv_nvfp4`; imports the CuTe DSL: only `build()` functions import this module).

A `_silu` variant computes `act[M, I] = silu(x @ gate^T) * (x @ up^T)` for the fused weight
`[gate | up]` of 2I rows (the dense MLP's `w_gate_up`): CTA b owns gate rows 8b .. 8b + 7 as the
MMA's rows 0..7 and up rows I + 8b .. I + 8b + 7 as its rows 8..15, so one CTA holds both halves
of 8 outputs and the `silu_mul` launch after the GEMV goes away. The outputs are those of the
GEMV followed by `silu_mul` bit for bit: each row's sum is the plain GEMV's (the same fragments in
the same order, the 8 warps' partials added in warp order), rounded to bf16 as the GEMV stores it,
then silu_mul's arithmetic (fp32 silu of the bf16 gate, rounded to bf16, times the bf16 up,
rounded to bf16).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute

from . import _dsl

PAIRS = 8  # outputs a CTA computes: its 8 gate rows with the 8 up rows of the same index


@cute.jit
def silu_pairs(partial: Any, tid: Any, out: Any, ld: Any, col0: Any, m: Any, mb: cutlass.Constexpr,
               warps: cutlass.Constexpr, row_scale: Any = None, up0: Any = 0) -> None:
    """Once every warp wrote its partials to `partial` (shared memory [16, mb, warps]: rows 0..7
    gate, 8..15 up), thread tid < 8 mb sums gate row tid % 8 and its up row for token tid // 8
    over the warps in warp order and stores silu(gate) * up as bf16 at out[token * ld + col0 +
    tid % 8], for tokens < m. row_scale (fp32 per weight row, NVFP4's global scale): each sum is
    multiplied by its row's once before the rounding (gate row col0 + j, up row up0 + col0 + j), as
    the plain epilogue does."""
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    cute.arch.sync_threads()
    if tid < PAIRS * mb:
        j = tid % PAIRS
        token = tid // PAIRS
        if token < m:
            gate = f32(0.0)
            up = f32(0.0)
            for i in cutlass.range_constexpr(warps):
                gate = gate + partial[j, token, i]
            for i in cutlass.range_constexpr(warps):
                up = up + partial[j + PAIRS, token, i]
            if cutlass.const_expr(row_scale is not None):
                gate = gate * cute.make_tensor(row_scale + col0 + j, cute.make_layout(1))[0]
                up = up * cute.make_tensor(row_scale + up0 + col0 + j, cute.make_layout(1))[0]
            # The GEMV's bf16 outputs, then silu_mul's arithmetic on them.
            silu = _dsl.silu_f32(gate.to(bf16).to(f32)).to(bf16).to(f32)
            dst = cute.make_tensor(out + cutlass.Int64(token) * ld + col0 + j, cute.make_layout(1))
            dst[0] = (silu * up.to(bf16).to(f32)).to(bf16)


def gate_up_rows(bid: Any, r: Any, n: int) -> tuple[Any, Any]:
    """The weight rows lane row r of CTA b reads as the MMA's rows r and r + 8 in a `_silu`
    variant of an [gate | up] weight of n rows: gate row 8b + r, up row n / 2 + 8b + r."""
    return bid * PAIRS + r, n // 2 + bid * PAIRS + r
