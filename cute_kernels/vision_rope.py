"""Vision-tower 2-D rotary on q and k, in place in the fused qkv rows `[M, 3 W]` (q | k | v, each
`heads x D`), after the bias (`vision_bias` mode `none`).

Rotate-half over the whole head: for i < D/2, with c = cos[row, i] and s = sin[row, i] (the host
builds the tables from each token's patch row and column, `runtime.model.gpu.vision_plan`),
`y[i] = x[i] c - x[i + D/2] s` and `y[i + D/2] = x[i + D/2] c + x[i] s`, in fp32, rounded to bf16
once (as Hugging Face's `apply_rotary_pos_emb_vision`, which rotates in float). One thread per
(row, head, i) pair rotates it in q and in k. M is dynamic.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "vision_rope"
THREADS = 256

# (heads, D): the 27B tower (16 heads of 72) and the tiny test tower (2 heads of 32).
SHAPES = [(16, 72), (2, 32)]


def _variant(heads: int, d: int) -> Variant:
    width, half = heads * d, d // 2
    per_row = heads * half
    return Variant(
        family=FAMILY,
        key=f"h{heads}_d{d}",
        config={"heads": heads, "D": d, "threads": THREADS},
        params=[ptr("qkv"), ptr("cos"), ptr("sin"), i32("M")],
        tensors={"qkv": tensor("bf16", "M", 3 * width, role="inout"), "cos": tensor("f32", "M", half),
                 "sin": tensor("f32", "M", half)},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(f"cdiv(M * {per_row}, {THREADS})", 1, 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // per_row}"),
        arches=ALL_ARCHES,
        note=f"vision 2-D rotary on q and k of {heads} heads of {d}",
        example_sizes={"M": 4096},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in SHAPES]


def reference(qkv: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, heads: int,
              exact: bool = False) -> np.ndarray:
    """qkv [M, 3 W] with q and k rotated (v untouched); cos, sin [M, D/2]."""
    ft = np.float64 if exact else np.float32
    m, width3 = qkv.shape
    d = width3 // 3 // heads
    x = qkv.astype(ft).reshape(m, 3, heads, 2, d // 2)
    c, s = cos.astype(ft)[:, None, None, :], sin.astype(ft)[:, None, None, :]
    lo, hi = x[:, :2, :, 0], x[:, :2, :, 1]
    x[:, :2, :, 0], x[:, :2, :, 1] = lo * c - hi * s, hi * c + lo * s
    out = x.reshape(m, width3)
    return out if exact else round_bf16(out.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    heads, d = variant.config["heads"], variant.config["D"]
    half, width = d // 2, heads * d
    per_row = heads * half
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(qkv: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * THREADS + tid
        row = item // per_row
        head = (item % per_row) // half
        i = item % half
        if row < m:
            one = cute.make_layout(1)
            c = cute.make_tensor(cos + cutlass.Int64(row) * half + i, one)[0]
            s = cute.make_tensor(sin + cutlass.Int64(row) * half + i, one)[0]
            for part in cutlass.range_constexpr(2):
                at = cutlass.Int64(row) * (3 * width) + part * width + head * d + i
                lo_t = cute.make_tensor(qkv + at, one)
                hi_t = cute.make_tensor(qkv + at + half, one)
                lo = lo_t[0].to(f32)
                hi = hi_t[0].to(f32)
                lo_t[0] = (lo * c - hi * s).to(bf16)
                hi_t[0] = (hi * c + lo * s).to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_vision_rope_{variant.key}")

    @cute.jit
    def launch(qkv: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(qkv, cos, sin, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"qkv": 2, "cos": 4, "sin": 4})
