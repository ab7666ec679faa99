"""Vision-tower bias epilogues over rows of N bf16 (the GEMMs write `x @ W^T` without the bias).

Modes (`out` may be `x` itself):
- `none`: `out = x + b` (the fused qkv projection before the rotary, the merger's output);
- `gelu_tanh`: `out = gelu_tanh(x + b)` (the blocks' MLP, HF `gelu_pytorch_tanh`);
- `gelu_erf`: `out = gelu(x + b)` with the exact erf (the merger's MLP, HF `nn.GELU()`);
- `residual`: `res = bf16(res + bf16(x + b))` (attention and MLP outputs onto the residual
  stream; also the patch embedding onto the resampled position embeddings).

The bias sum is rounded to bf16 before the activation or the residual add because Hugging Face's
linear layer returns bf16 with its bias included. One thread handles one 16-byte vector (8
values); M is dynamic.
"""

import math
from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "vision_bias"
THREADS = 256
MODES = ("none", "gelu_tanh", "gelu_erf", "residual")

# (mode, N): the 27B tower (width 1152, MLP 4304, merger 4608 -> 5120) and the tiny test tower
# (tools/make_tiny.py: width 64, MLP 128, merger 256 -> 256).
SHAPES = [
    ("none", 3456), ("gelu_tanh", 4304), ("residual", 1152), ("gelu_erf", 4608), ("none", 5120),
    ("none", 192), ("gelu_tanh", 128), ("residual", 64), ("gelu_erf", 256), ("none", 256),
]


def _variant(mode: str, n: int) -> Variant:
    if mode not in MODES or n % 8:
        raise ValueError(f"vision_bias {mode}/{n}: unknown mode or N not a multiple of 8")
    per_row = n // 8
    out_name = "res" if mode == "residual" else "out"
    return Variant(
        family=FAMILY,
        key=f"{mode}_n{n}",
        config={"mode": mode, "N": n, "threads": THREADS},
        params=[ptr("x"), ptr("b"), ptr(out_name), i32("M")],
        tensors={"x": tensor("bf16", "M", n), "b": tensor("bf16", n),
                 out_name: tensor("bf16", "M", n, role="inout" if mode == "residual" else "out")},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(f"cdiv(M * {per_row}, {THREADS})", 1, 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // per_row}"),
        arches=ALL_ARCHES,
        note=f"vision bias + {mode} over rows of {n} bf16",
        example_sizes={"M": 4096},
    )


def variants() -> list[Variant]:
    return [_variant(mode, n) for mode, n in SHAPES]


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf, otypes=[x.dtype])(x / math.sqrt(2.0)))


def reference(x: np.ndarray, b: np.ndarray, *, mode: str, res: np.ndarray | None = None,
              exact: bool = False) -> np.ndarray:
    """The mode's output (the new residual for `residual`) for bf16-valued inputs: float64 with no
    rounding when exact, else fp32 with the kernel's bf16 roundings."""
    ft = np.float64 if exact else np.float32
    rnd = (lambda a: a) if exact else (lambda a: round_bf16(np.asarray(a, np.float32)).astype(ft))
    y = rnd(x.astype(ft) + b.astype(ft))
    if mode == "gelu_tanh":
        y = rnd(gelu_tanh(y))
    elif mode == "gelu_erf":
        y = rnd(gelu_erf(y))
    elif mode == "residual":
        assert res is not None
        y = rnd(res.astype(ft) + y)
    return y


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    mode, n = variant.config["mode"], variant.config["N"]
    per_row = n // 8
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    tanh_k = math.sqrt(2.0 / math.pi)

    @cute.kernel
    def kernel(x: cute.Pointer, b: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * THREADS + tid
        row = item // per_row
        col = (item % per_row) * 8
        if row < m:
            vec = cute.make_layout((8,))
            at = cutlass.Int64(row) * n + col
            y = (cute.make_tensor(x + at, vec).load().to(f32)
                 + cute.make_tensor(b + col, vec).load().to(f32)).to(bf16).to(f32)
            dst = cute.make_tensor(out + at, vec)
            if cutlass.const_expr(mode == "gelu_tanh"):
                inner = f32(tanh_k) * (y + f32(0.044715) * y * y * y)
                y = f32(0.5) * y * (f32(1.0) + cute.math.tanh(inner, fastmath=False))
            if cutlass.const_expr(mode == "gelu_erf"):
                y = f32(0.5) * y * (f32(1.0) + cute.math.erf(y * f32(1.0 / math.sqrt(2.0)), fastmath=False))
            if cutlass.const_expr(mode == "residual"):
                y = dst.load().to(f32) + y
            dst.store(y.to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_vision_bias_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, b: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(x, b, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
