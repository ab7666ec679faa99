"""Vision-tower position embedding: the learned square table resampled to each patch.

`out[m] = bf16(sum_j wts[m, j] * table[idx[m, j]])` over the 4 bilinear corners (j = 0..3) of
patch m: the host computes each patch's corner rows and weights from its grid (align_corners,
`runtime.model.gpu.vision_plan`), which is 8 numbers per patch instead of a resampled row of W,
and the table stays on the device with the weights. The row starts the residual stream (the patch
embedding is added onto it). One thread handles 8 values of a row; M is dynamic.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "vision_pos"
THREADS = 256

# (W, table rows): the 27B tower (48 x 48 positions of width 1152) and the tiny tower (8 x 8 of 64).
SHAPES = [(1152, 2304), (64, 64)]


def _variant(width: int, rows: int) -> Variant:
    per_row = width // 8
    return Variant(
        family=FAMILY,
        key=f"w{width}_p{rows}",
        config={"W": width, "P": rows, "threads": THREADS},
        params=[ptr("table"), ptr("idx"), ptr("wts"), ptr("out"), i32("M")],
        tensors={"table": tensor("bf16", rows, width), "idx": tensor("i32", "M", 4), "wts": tensor("f32", "M", 4),
                 "out": tensor("bf16", "M", width, role="out")},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(f"cdiv(M * {per_row}, {THREADS})", 1, 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // per_row}"),
        arches=ALL_ARCHES,
        note=f"vision position rows: 4-corner blend of a {rows} x {width} table",
        example_sizes={"M": 4096},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in SHAPES]


def reference(table: np.ndarray, idx: np.ndarray, wts: np.ndarray, *, exact: bool = False) -> np.ndarray:
    ft = np.float64 if exact else np.float32
    out = np.zeros((idx.shape[0], table.shape[1]), ft)
    for j in range(4):
        out += wts[:, j:j + 1].astype(ft) * table[idx[:, j]].astype(ft)
    return out if exact else round_bf16(out.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    width = variant.config["W"]
    per_row = width // 8
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(table: cute.Pointer, idx: cute.Pointer, wts: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * THREADS + tid
        row = item // per_row
        col = (item % per_row) * 8
        if row < m:
            vec = cute.make_layout((8,))
            corners = cute.make_tensor(idx + cutlass.Int64(row) * 4, cute.make_layout(4))
            weights = cute.make_tensor(wts + cutlass.Int64(row) * 4, cute.make_layout(4))
            acc = cute.make_rmem_tensor((8,), f32)
            acc.fill(0.0)
            for j in cutlass.range_constexpr(4):
                src = cute.make_tensor(table + cutlass.Int64(corners[j]) * width + col, vec)
                acc.store(acc.load() + src.load().to(f32) * weights[j])
            cute.make_tensor(out + cutlass.Int64(row) * width + col, vec).store(acc.load().to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_vision_pos_{variant.key}")

    @cute.jit
    def launch(table: cute.Pointer, idx: cute.Pointer, wts: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               stream: Any):
        kernel(table, idx, wts, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                               stream=stream)

    return launch, _dsl.example_args(variant, aligns={"idx": 4, "wts": 4})
