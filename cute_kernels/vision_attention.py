"""Vision-tower attention: bidirectional (no mask) within each image / frame group, CUDA cores.

q, k, v are read straight from the fused qkv rows `[M, 3 W]` (after the bias and the rotary), and
the output is written as `[M, W]` rows (head h at columns h D .. h D + D - 1), ready for the
`attn.proj` GEMM. Groups are given cu_seqlens style: group g is rows `cu[g] .. cu[g + 1] - 1`
and attends only within itself (a video's frames are groups of equal size, a batch of images
groups of their own sizes).

Grid (query tiles of the longest group S, heads, groups G); a CTA of 128 threads takes 128 query
rows of one head of one group, one query row per thread: q (pre-scaled by log2(e) / sqrt(D)) and
the fp32 accumulator live in registers; keys and values come through shared memory (fp32) in tiles
of 32 keys; each tile's scores are computed whole, then one online-softmax rescale per tile. The
inner products are CUDA-core FMAs (the shared-memory reads are warp broadcasts); a tensor-core
(mma.sync) form is the known next step if `bench/vision.py` shows attention dominating.
"""

import math
from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "vision_attention"
QROWS = 128  # query rows (= threads) per CTA
KEYS = 32  # keys per shared-memory tile

# (heads, D): the 27B tower (16 heads of 72) and the tiny test tower (2 heads of 32).
SHAPES = [(16, 72), (2, 32)]


def _variant(heads: int, d: int) -> Variant:
    if d % 8:
        raise ValueError(f"vision_attention D={d}: must be a multiple of 8 (16-byte vectors)")
    width = heads * d
    return Variant(
        family=FAMILY,
        key=f"h{heads}_d{d}",
        config={"heads": heads, "D": d, "qrows": QROWS, "keys": KEYS},
        params=[ptr("qkv"), ptr("cu"), ptr("out"), i32("G"), i32("S")],
        tensors={"qkv": tensor("bf16", "M", 3 * width), "cu": tensor("i32", "G + 1"),
                 "out": tensor("bf16", "M", width, role="out")},
        sizes=("M", "G", "S"),
        block=(QROWS, 1, 1),
        grid=(f"cdiv(S, {QROWS})", heads, "G"),
        requires=("M >= 1", "G >= 1", "G <= 65535", "S >= 1", "S <= M"),
        arches=ALL_ARCHES,
        note=f"vision bidirectional attention per group, {heads} heads of {d} (CUDA cores)",
        example_sizes={"M": 4096, "G": 1, "S": 4096},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in SHAPES]


def reference(qkv: np.ndarray, cu: np.ndarray, *, heads: int, exact: bool = False) -> np.ndarray:
    """out [M, W] for qkv [M, 3 W] (bf16 values) and group bounds cu [G + 1]."""
    ft = np.float64 if exact else np.float32
    m = qkv.shape[0]
    width = qkv.shape[1] // 3
    d = width // heads
    x = qkv.astype(ft).reshape(m, 3, heads, d)
    out = np.zeros((m, heads, d), ft)
    for g in range(len(cu) - 1):
        lo, hi = int(cu[g]), int(cu[g + 1])
        q, k, v = (x[lo:hi, i].transpose(1, 0, 2) for i in range(3))       # [heads, n, d]
        scores = q @ k.transpose(0, 2, 1) / ft(math.sqrt(d))
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[lo:hi] = ((p / p.sum(axis=-1, keepdims=True)) @ v).transpose(1, 0, 2)
    out = out.reshape(m, width)
    return out if exact else round_bf16(out.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    heads, d = variant.config["heads"], variant.config["D"]
    width, vecs = heads * d, d // 8
    scale = math.log2(math.e) / math.sqrt(d)
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    neg = -math.inf

    @cute.kernel
    def kernel(qkv: cute.Pointer, cu: cute.Pointer, out: cute.Pointer, g: cutlass.Int32, s: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        tile, head, group = cute.arch.block_idx()
        v8 = cute.make_layout((8,))
        bounds = cute.make_tensor(cu, cute.make_layout(g + 1))
        start = bounds[group]
        length = bounds[group + 1] - start
        smem = cutlass.memory.SmemAllocator()
        ks = smem.allocate_tensor(f32, cute.make_layout((KEYS, d), stride=(d, 1)), byte_alignment=16)
        vs = smem.allocate_tensor(f32, cute.make_layout((KEYS, d), stride=(d, 1)), byte_alignment=16)
        # The whole CTA leaves together (before any barrier) when its tile is past the group.
        if tile * QROWS < length:
            # Rows past the group compute on its last row (they share the barriers) and store nothing.
            qi = tile * QROWS + tid
            row = start + cutlass.min(qi, length - 1)
            qs = []
            accs = []
            for v in cutlass.range_constexpr(vecs):
                src = qkv + cutlass.Int64(row) * (3 * width) + head * d + 8 * v
                qs.append(cute.make_tensor(src, v8).load().to(f32) * f32(scale))
                acc = cute.make_rmem_tensor((8,), f32)
                acc.fill(0.0)
                accs.append(acc)
            stat = cute.make_rmem_tensor((2,), f32)  # running max, running sum
            stat[0] = f32(neg)
            stat[1] = f32(0.0)
            scores = cute.make_rmem_tensor((KEYS,), f32)
            for base in cutlass.range(0, length, KEYS):
                cute.arch.sync_threads()
                # Keys past the group load its last key (finite values) and get probability 0.
                for item in cutlass.range(tid, KEYS * vecs, QROWS):
                    j = item // vecs
                    c = item % vecs
                    key = start + cutlass.min(base + j, length - 1)
                    src = qkv + cutlass.Int64(key) * (3 * width) + width + head * d + 8 * c
                    cute.make_tensor(ks.iterator + j * d + 8 * c, v8).store(
                        cute.make_tensor(src, v8).load().to(f32))
                    cute.make_tensor(vs.iterator + j * d + 8 * c, v8).store(
                        cute.make_tensor(src + width, v8).load().to(f32))
                cute.arch.sync_threads()
                best = stat[0]
                for j in cutlass.range_constexpr(KEYS):
                    dot = f32(0.0)
                    for v in cutlass.range_constexpr(vecs):
                        kv = cute.make_tensor(ks.iterator + j * d + 8 * v, v8).load()
                        dot = dot + (qs[v] * kv).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
                    if base + j >= length:
                        dot = f32(neg)
                    scores[j] = dot
                    best = cute.arch.fmax(best, dot)
                corr = cute.math.exp2(stat[0] - best, fastmath=True)
                total = stat[1] * corr
                for v in cutlass.range_constexpr(vecs):
                    accs[v].store(accs[v].load() * corr)
                for j in cutlass.range_constexpr(KEYS):
                    p = cute.math.exp2(scores[j] - best, fastmath=True)
                    total = total + p
                    for v in cutlass.range_constexpr(vecs):
                        vv = cute.make_tensor(vs.iterator + j * d + 8 * v, v8).load()
                        accs[v].store(accs[v].load() + vv * p)
                stat[0] = best
                stat[1] = total
            if qi < length:
                inv = f32(1.0) / stat[1]
                for v in cutlass.range_constexpr(vecs):
                    dst = out + cutlass.Int64(start + qi) * width + head * d + 8 * v
                    cute.make_tensor(dst, v8).store((accs[v].load() * inv).to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_vision_attention_{variant.key}")

    @cute.jit
    def launch(qkv: cute.Pointer, cu: cute.Pointer, out: cute.Pointer, g: cutlass.Int32, s: cutlass.Int32,
               stream: Any):
        kernel(qkv, cu, out, g, s).launch(grid=_dsl.grid(variant, {"G": g, "S": s}), block=list(variant.block),
                                          stream=stream)

    return launch, _dsl.example_args(variant, aligns={"cu": 4})
