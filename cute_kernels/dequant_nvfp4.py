"""NVFP4 weights to BF16 for prefill (W4A16 through the BF16 GEMM): `out[n, k] = bf16(e2m1(w[n, k]) *
e4m3(scale[n, k / 16]) * gscale[n])`.

A prefill piece of many rows multiplies each NVFP4 weight once: the runner decodes the weight
into a BF16 scratch (one linear at a time) and runs gemm_sm90 on it, so the weight costs one
extra pass (0.56 bytes per weight read, 2 written, 2 read back by the GEMM) against the piece's
2 * rows FLOPs per weight: small for pieces of thousands of rows.

One thread decodes 32 columns of one row (16 code bytes, 2 scale bytes) with the GEMVs' `lut`
decoder (`_dequant.e2m1_row`): code * block scale is exact in bf16 (2 + 4 significand bits). The
row's fp32 global scale is then applied in fp32 and the product rounded once to bf16: the one
inexact step, the same rounding a BF16 checkpoint of the dequantised weights has (the BF16 torch
baseline of the runner tests rounds its weights the same way). N (rows) is a runtime size, K a
compile-time one (a multiple of 32).
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .gemv_nvfp4 import GROUP, nvfp4_values
from .variant import HOPPER, Variant, i32, ptr, tensor

FAMILY = "dequant_nvfp4"
THREADS = 256
COLUMNS = 32  # per thread: one `e2m1_row`

# The K of the NVFP4 linears (gemv_nvfp4 / gemv_fp8 SHAPES): 27B 5120, 6144, 17408; tiny 256, 128, 512;
# and of the NVFP4 MoE expert stacks (moe_prefill.py): 35B-A3B / 80B-A3B gate/up 2048 (down 512), tiny
# gate/up 256, down 64.
KS = (5120, 6144, 17408, 128, 256, 512, 2048, 64)


def _variant(k: int) -> Variant:
    if k % COLUMNS:
        raise ValueError(f"dequant_nvfp4: K = {k} must be a multiple of {COLUMNS}")
    per_row = k // COLUMNS
    return Variant(
        family=FAMILY,
        key=f"k{k}",
        config={"K": k, "threads": THREADS},
        params=[ptr("w"), ptr("scale"), ptr("gscale"), ptr("out"), i32("N")],
        tensors={"w": tensor("u8", "N", k // 2), "scale": tensor("e4m3", "N", k // GROUP),
                 "gscale": tensor("f32", "N"), "out": tensor("bf16", "N", k, role="out")},
        sizes=("N",),
        block=(THREADS, 1, 1),
        grid=(f"cdiv(N * {per_row}, {THREADS})", 1, 1),
        requires=("N >= 1", f"N <= {(2**31 - 1) // k}"),
        arches=HOPPER,
        note=f"nvfp4 W[N,{k}] (e4m3 scale per 16, fp32 per row) -> bf16",
        example_sizes={"N": 34816},
    )


def variants() -> list[Variant]:
    return [_variant(k) for k in KS]


def reference(w: np.ndarray, scale: np.ndarray, gscale: np.ndarray) -> np.ndarray:
    """Packed codes [N, K / 2], e4m3 scale codes [N, K / 16], fp32 globals [N] -> the kernel's
    bf16 values as float32 (code * scale exact, times the global in fp32, rounded once)."""
    exact = nvfp4_values(w, scale)
    return round_bf16((exact.astype(np.float32) * gscale.astype(np.float32)[:, None]).astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dequant, _dsl

    k = variant.config["K"]
    per_row = k // COLUMNS
    f32 = cutlass.Float32

    @cute.kernel
    def kernel(w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, out: cute.Pointer, n: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * THREADS + tid
        row = item // per_row
        step = item % per_row
        if row < n:
            values = _dequant.e2m1_row("lut", w + cutlass.Int64(row) * (k // 2) + step * (COLUMNS // 2),
                                       scale + cutlass.Int64(row) * (k // GROUP) + step * (COLUMNS // GROUP))
            g = cute.make_tensor(gscale + row, cute.make_layout(1))[0]
            scaled = values.load().to(f32) * g
            cute.make_tensor(out + cutlass.Int64(row) * k + step * COLUMNS, cute.make_layout((COLUMNS,))).store(
                scaled.to(cutlass.BFloat16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_dequant_nvfp4_{variant.key}")

    @cute.jit
    def launch(w: cute.Pointer, scale: cute.Pointer, gscale: cute.Pointer, out: cute.Pointer, n: cutlass.Int32,
               stream: Any):
        kernel(w, scale, gscale, out, n).launch(grid=_dsl.grid(variant, {"N": n}), block=list(variant.block),
                                                stream=stream)

    return launch, _dsl.example_args(variant)
