"""SiLU-and-multiply: `out[m, i] = silu(x[m, i]) * x[m, I + i]` for x = [gate | up] of width 2I.

Rounded like the Hugging Face bf16 MLP: silu(gate) is rounded to bf16, then the product is
rounded again. One thread handles one 16-byte vector (8 outputs); M is dynamic.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "silu_mul"
THREADS = 256

# 27B dense MLP; 35B/80B expert and shared-expert width; the tiny MoE model's experts (moe_grouped prefill)
_SHAPES = [("i17408", 17408), ("i512", 512), ("i64", 64)]


def _variant(key: str, inter: int) -> Variant:
    per_row = inter // 8
    return Variant(
        family=FAMILY,
        key=key,
        config={"I": inter, "threads": THREADS, "pdl": True},
        params=[ptr("x"), ptr("out"), i32("M")],
        tensors={"x": tensor("bf16", "M", 2 * inter), "out": tensor("bf16", "M", inter, role="out")},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(f"cdiv(M * {per_row}, {THREADS})", 1, 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // per_row}"),
        arches=ALL_ARCHES,
        note=f"silu(gate) * up over rows of 2 x {inter} bf16",
        example_sizes={"M": 8192},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in _SHAPES]


def reference(x: np.ndarray, *, exact: bool = False) -> np.ndarray:
    inter = x.shape[-1] // 2
    ft = np.float64 if exact else np.float32
    g, u = x[..., :inter].astype(ft), x[..., inter:].astype(ft)
    s = g / (ft(1.0) + np.exp(-g))
    if exact:
        return s * u
    return round_bf16((round_bf16(s.astype(np.float32)) * u).astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    inter = variant.config["I"]
    per_row = inter // 8
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * THREADS + tid
        row = item // per_row
        col = (item % per_row) * 8
        _pdl.wait()  # PDL (cute_kernels/_pdl.py): x is the previous kernel's output
        if row < m:
            vec = cute.make_layout((8,))
            src = x + cutlass.Int64(row) * (2 * inter) + col
            g = cute.make_tensor(src, vec).load().to(f32)
            u = cute.make_tensor(src + inter, vec).load().to(f32)
            _pdl.launch_dependents()
            s = (g / (f32(1.0) + cute.math.exp(-g, fastmath=True))).to(bf16).to(f32)
            cute.make_tensor(out + cutlass.Int64(row) * inter + col, vec).store((s * u).to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_silu_mul_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(x, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
