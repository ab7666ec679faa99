"""Partial rotary position embedding, rotate-half (NeoX) style, applied in place.

For each token m and head h of `x[M, heads, D]` (contiguous), the first `rd = D * fraction` dims
rotate with the cos/sin row of the token's position (`positions[m]`): with x1 = x[:rd/2] and
x2 = x[rd/2:rd], `x1' = x1 cos - x2 sin` and `x2' = x2 cos + x1 sin`; the other dims pass through.
`cos` and `sin` are bf16 tables `[P, rd/2]` (the runtime fills them once from `rope_theta`, as
the Hugging Face model computes them in fp32 then casts to bf16). The maths is fp32 with one
rounding at the end. A position outside `[0, P)` leaves its token unrotated instead of reading out
of bounds. Qwen3.5/3.6 text tokens use the same position on every MRoPE axis, so text-only RoPE
is this plain 1-D form.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "rope"
THREADS = 128
FRACTION = 0.25  # partial_rotary_factor of every Qwen3.5/3.6 and Qwen3-Next config

# (key, heads, head_dim): q and k of the 27B (24/4 heads) and of the 35B-A3B / 80B-A3B (16/2).
_SHAPES = [("h24_d256", 24, 256), ("h4_d256", 4, 256), ("h16_d256", 16, 256), ("h2_d256", 2, 256)]


def _variant(key: str, heads: int, d: int) -> Variant:
    rd = int(d * FRACTION)
    return Variant(
        family=FAMILY,
        key=key,
        config={"heads": heads, "D": d, "rotary_dims": rd, "threads": THREADS},
        params=[ptr("x"), ptr("positions"), ptr("cos"), ptr("sin"), i32("M"), i32("P")],
        tensors={
            "x": tensor("bf16", "M", heads, d, role="inout"),
            "positions": tensor("i32", "M"),
            "cos": tensor("bf16", "P", rd // 2),
            "sin": tensor("bf16", "P", rd // 2),
        },
        sizes=("M", "P"),
        block=(THREADS, 1, 1),
        grid=(f"cdiv(M * {heads * rd // 16}, {THREADS})", 1, 1),
        requires=("M >= 1", "P >= 1"),
        arches=ALL_ARCHES,
        note=f"rotate-half RoPE on the first {rd} of {d} dims, {heads} heads, in place",
        example_sizes={"M": 8192, "P": 65536},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in _SHAPES]


def tables(positions: int, rotary_dims: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """fp32 cos/sin tables [positions, rd/2], as Hugging Face computes them (before the bf16 cast)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dims, 2, dtype=np.float32) / rotary_dims))
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :].astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def reference(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """RoPE of x [M, heads, D] with bf16-valued cos/sin [P, rd/2].

    exact=False is the same-precision baseline (Hugging Face's bf16 arithmetic: each product and
    the sum rounded to bf16); exact=True is float64 without rounding. Bad positions pass through.
    """
    ft = np.float64 if exact else np.float32
    rnd = (lambda a: a) if exact else (lambda a: round_bf16(a.astype(np.float32)).astype(ft))
    half = cos.shape[1]
    out = x.astype(ft).copy()
    ok = (positions >= 0) & (positions < cos.shape[0])
    c = cos[np.where(ok, positions, 0)].astype(ft)[:, None, :]
    s = sin[np.where(ok, positions, 0)].astype(ft)[:, None, :]
    x1, x2 = out[..., :half].copy(), out[..., half : 2 * half].copy()
    r1 = rnd(rnd(x1 * c) - rnd(x2 * s))
    r2 = rnd(rnd(x2 * c) + rnd(x1 * s))
    out[ok, :, :half] = r1[ok]
    out[ok, :, half : 2 * half] = r2[ok]
    return out


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    heads, d, rd = variant.config["heads"], variant.config["D"], variant.config["rotary_dims"]
    half = rd // 2
    groups = half // 8  # 8-pair groups per head
    items_per_token = heads * groups
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, positions: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer,
               m: cutlass.Int32, p: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        item = bid * THREADS + tid
        token = item // items_per_token
        rem = item % items_per_token
        head = rem // groups
        group = rem % groups
        if token < m:
            gpos = cute.make_tensor(positions, cute.make_layout(m))
            pos = gpos[token]
            if pos >= 0 and pos < p:
                vec = cute.make_layout((8,))
                base = x + cutlass.Int64(token) * (heads * d) + head * d + group * 8
                g1 = cute.make_tensor(base, vec)
                g2 = cute.make_tensor(base + half, vec)
                gc = cute.make_tensor(cos + cutlass.Int64(pos) * half + group * 8, vec)
                gs = cute.make_tensor(sin + cutlass.Int64(pos) * half + group * 8, vec)
                x1 = g1.load().to(f32)
                x2 = g2.load().to(f32)
                c = gc.load().to(f32)
                s = gs.load().to(f32)
                g1.store((x1 * c - x2 * s).to(bf16))
                g2.store((x2 * c + x1 * s).to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_rope_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, positions: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer,
               m: cutlass.Int32, p: cutlass.Int32, stream: Any):
        kernel(x, positions, cos, sin, m, p).launch(grid=_dsl.grid(variant, {"M": m, "P": p}),
                                                    block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"positions": 4})
