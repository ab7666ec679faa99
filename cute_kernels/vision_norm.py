"""Vision-tower LayerNorm with weight and bias over rows of W bf16 (statistics in fp32, eps 1e-6).

`out = (x - mean) / sqrt(var + eps) * w + b`, the blocks' norm1 / norm2 and the merger's norm.
Each row is handled by T threads (a power of two up to 32, so the reductions are warp shuffles);
a thread keeps its W / (8 T) 16-byte vectors in registers for the two passes (the mean, then the
variance around it: exact even when the mean is large against the spread). M is dynamic.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "vision_norm"
EPS = 1e-6
BLOCK = 128

# (W, threads per row): the 27B tower's width (1152 = 144 vectors = 16 x 9) and the tiny tower's.
SHAPES = [(1152, 16), (64, 8)]


def _variant(w: int, t: int) -> Variant:
    if w % (8 * t) or t & (t - 1) or t > 32:
        raise ValueError(f"vision_norm W={w}: must split into 16-byte vectors over {t} threads")
    return Variant(
        family=FAMILY,
        key=f"layer_norm_w{w}",
        config={"W": w, "threads_per_row": t, "block": BLOCK, "eps": EPS},
        params=[ptr("x"), ptr("w"), ptr("b"), ptr("out"), i32("M")],
        tensors={"x": tensor("bf16", "M", w), "w": tensor("bf16", w), "b": tensor("bf16", w),
                 "out": tensor("bf16", "M", w, role="out")},
        sizes=("M",),
        block=(BLOCK, 1, 1),
        grid=(f"cdiv(M, {BLOCK // t})", 1, 1),
        requires=("M >= 1",),
        arches=ALL_ARCHES,
        note=f"LayerNorm with bias over rows of {w} bf16",
        example_sizes={"M": 4096},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in SHAPES]


def reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, *, eps: float = EPS,
              exact: bool = False) -> np.ndarray:
    ft = np.float64 if exact else np.float32
    x = x.astype(ft)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + ft(eps)) * w.astype(ft) + b.astype(ft)
    return y if exact else round_bf16(y.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    width, t, eps = cfg["W"], cfg["threads_per_row"], float(cfg["eps"])
    vecs = width // (8 * t)
    rows = BLOCK // t
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, b: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane = tid % t
        # Rows past M clamp to the last row (every lane of a shuffle group must run) and skip the store.
        row = cutlass.min(bid * rows + tid // t, m - 1)
        # Element e of vector v of lane j sits at j*8 + v*T*8 + e: each vector step is one coalesced sweep.
        layout = cute.make_layout((8, vecs, t), stride=(1, t * 8, 8))
        offset = cutlass.Int64(row) * width
        gx = cute.make_tensor(x + offset, layout)
        xs = cute.make_rmem_tensor((8, vecs), f32)
        total = f32(0.0)
        for v in cutlass.range_constexpr(vecs):
            xv = gx[None, v, lane].load().to(f32)
            xs[None, v].store(xv)
            total = total + xv.reduce(cute.ReductionOp.ADD, f32(0.0), 0)
        mean = _dsl.warp_sum(total, t) * f32(1.0 / width)
        spread = f32(0.0)
        for v in cutlass.range_constexpr(vecs):
            dv = xs[None, v].load() - mean
            xs[None, v].store(dv)
            spread = spread + (dv * dv).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
        rstd = cute.math.rsqrt(_dsl.warp_sum(spread, t) * f32(1.0 / width) + f32(eps))
        if bid * rows + tid // t < m:
            gw = cute.make_tensor(w, layout)
            gb = cute.make_tensor(b, layout)
            gout = cute.make_tensor(out + offset, layout)
            for v in cutlass.range_constexpr(vecs):
                y = xs[None, v].load() * rstd * gw[None, v, lane].load().to(f32) + gb[None, v, lane].load().to(f32)
                gout[None, v, lane].store(y.to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_vision_norm_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, b: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
               stream: Any):
        kernel(x, w, b, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
