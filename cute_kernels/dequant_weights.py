"""Dequantise a block-scaled FP8 weight matrix into BF16: `out[r, c] = bf16(e4m3(w[r, c]) *
scale[r // BR, c // 128])` for w [R, K] e4m3 codes and fp32 scales [R / BR, cdiv(K, 128)].

For prefill of FP8 MoE experts (`runtime/model/gpu/moe_prefill.py`): a chunk's experts are
dequantised one layer at a time (R = the layer's (E + 1) x expert rows) into a BF16 scratch, then
the BF16 grouped GEMMs (cute_kernels/moe_grouped.py) run unchanged. Generic: any 2-D block-scaled
matrix whose rows fill whole scale rows of BR (128, or fewer where an expert half is narrower,
`moe.fp8_block_rows`); a dense FP8 projection's prefill may use it as a fallback.

Rounding: the fp32 product code x scale (rounded to fp32: 4 x 24 significant bits), then to bf16
nearest-even; `reference` computes exactly that, so the kernel matches it bit for bit. The FP8
decode kernels (`moe` `up_fp8` / `down_fp8`) never round a weight: they scale fp32 partial sums.
So prefill's expert weights carry one bf16 rounding (2^-9 relative) that decode's do not: the
same rounding a BF16 forward of the dequantised model makes (the GPU tests' baseline), and the
two paths agree to that.

Cost (not yet run on a GPU): per layer this reads the fp8 stack (1 byte a weight) and writes it
in bf16 (2 bytes), 3 bytes a weight, whatever the chunk's length; the grouped GEMMs then read
the bf16 copy (2 bytes) instead of the fp8 codes. For Qwen3-Next-80B (513 experts of 3 x 512 x
2048 weights) that is 1.61 G weights, 4.8 GB of extra traffic a layer (about 1.6 ms at 3 TB/s),
against 2 x T x 11 x 3 x 512 x 2048 = T x 69 MFLOP of expert GEMMs for a chunk of T tokens (at T
= 8192, 567 GFLOP: about 1 ms at 600 TFLOP/s). Dequantising is thus of the order of the GEMMs at
8K-token chunks and dominates below; an FP8 grouped GEMM (the codes read as they are) removes it.

One thread converts 8 consecutive codes (an 8-byte load, a 16-byte store); R is a runtime size.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "dequant_weights"
THREADS = 256
BLOCK = 128  # scale block columns (and rows, unless BR says fewer)

# (K, BR): the FP8 expert stacks of the MoE shapes (cute_kernels/moe.py): gate/up [.., H] and
# down [.., I] of the tiny model (I = 64: gate and up halves of 64 rows each) and of the
# 35B-A3B / 80B-A3B (H 2048, I 512).
_SHAPES = [(256, 64), (64, 128), (2048, 128), (512, 128)]


def _variant(k: int, br: int) -> Variant:
    if k % 8 or br > BLOCK or BLOCK % br:
        raise ValueError(f"dequant_weights: K = {k} must be a multiple of 8 and BR = {br} divide {BLOCK}")
    per_row = k // 8
    kb = -(-k // BLOCK)
    return Variant(
        family=FAMILY, key=f"fp8_k{k}_br{br}", config={"format": "fp8_e4m3", "K": k, "BR": br, "threads": THREADS},
        params=[ptr("w"), ptr("scale"), ptr("out"), i32("R")],
        tensors={"w": tensor("e4m3", "R", k), "scale": tensor("f32", f"R // {br}", kb),
                 "out": tensor("bf16", "R", k, role="out")},
        sizes=("R",), block=(THREADS, 1, 1), grid=(f"cdiv(R * {per_row}, {THREADS})", 1, 1),
        requires=("R >= 1", f"R % {br} == 0", f"R <= {(2**31 - 1) // per_row}"), arches=ALL_ARCHES,
        note=f"fp8 [R, {k}] with fp32 scales per {br} x {BLOCK} -> bf16", example_sizes={"R": 1024})


def variants() -> list[Variant]:
    return [_variant(*s) for s in _SHAPES]


def reference(codes: np.ndarray, scales: np.ndarray, block_rows: int) -> np.ndarray:
    """bf16-valued float32 [R, K] of e4m3 codes (uint8) [R, K] and fp32 scales [R / BR, cdiv(K, 128)]:
    the fp32 product rounded to bf16."""
    from .gemv_fp8 import e4m3_values

    r, k = codes.shape
    grid = np.repeat(np.repeat(np.asarray(scales, np.float32), block_rows, axis=0), BLOCK, axis=1)[:r, :k]
    return round_bf16(e4m3_values(codes).astype(np.float32) * grid)


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    k, br = variant.config["K"], variant.config["BR"]
    per_row = k // 8
    kb = -(-k // BLOCK)
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(w: cute.Pointer, scale: cute.Pointer, out: cute.Pointer, r: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = cutlass.Int64(bid) * THREADS + tid
        row = item // per_row
        col = (item % per_row) * 8
        if row < r:
            vec = cute.make_layout((8,))
            codes = cute.make_tensor(w + row * k + col, vec).load().to(bf16).to(f32)  # exact: e4m3 is in bf16
            s = cute.make_tensor(scale + (row // br) * kb + col // BLOCK, cute.make_layout(1))[0]
            cute.make_tensor(out + row * k + col, vec).store((codes * s).to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_dequant_weights_{variant.key}")

    @cute.jit
    def launch(w: cute.Pointer, scale: cute.Pointer, out: cute.Pointer, r: cutlass.Int32, stream: Any):
        kernel(w, scale, out, r).launch(grid=_dsl.grid(variant, {"R": r}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
