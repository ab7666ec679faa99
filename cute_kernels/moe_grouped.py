"""Mixture-of-experts MLP for prefill chunks: route once, then grouped GEMMs on tensor cores.

The decode kernels (cute_kernels/moe.py) give every (row, slot) its own dot products, so with
thousands of rows each expert's weights are re-read once per row routed to it. Here the rows are
sorted by expert and each expert's weight tiles are read once per 128-row tile of its segment.
After the `moe` family's `logits` and `route` (ids [M, P] with the shared expert as id E in slot
k, weights [M, P] in fp32), one prefill MoE MLP is:

1. `perm` (one CTA, graph-safe, deterministic): counts the entries (row, slot) per expert, pads
   each expert's segment to a multiple of BM rows, prefix-sums the segment starts, and writes
   - `pos[M, P]`: where entry (row, slot) sits in the permuted order;
   - `src[C]`: the source row of each permuted position (-1 for padding);
   - `tiles[1 + C / BM]`: tiles[0] = number of BM-row tiles in use, tiles[1 + t] = the expert
     of tile t (segments start on tile boundaries, so a tile has one expert).
   Within an expert the rows are in ascending order (a stable counting sort: each warp owns a
   contiguous range of entries and ranks its 32-entry chunks in lane order), so the result does
   not depend on scheduling. C, the capacity in rows, covers the worst case (every non-empty
   segment padded by BM - 1 rows): `capacity(M)`.
2. `gather`: xg[q] = x[src[q]] (zeros for padding), one CTA per BM-row tile in use.
3. the grouped GEMM (`gemm`, moe_grouped_gemm.py) with `W = gate_up [E + 1, 2I, H]`:
   gu[q] = xg[q] @ W[e(q)]^T in fp32, rounded to bf16 (as the decode `up` kernel rounds gate
   and up); then the `silu_mul` family over the C rows: act = bf16(bf16(silu(g)) * u).
4. the grouped GEMM with `W = down [E + 1, H, I]`: dn[q] = act[q] @ W[e(q)]^T, kept in fp32.
5. `combine`: out[row] = bf16(sum over p = 0..P-1, in that order, of wts[row, p] *
   dn[pos[row, p]]), fp32 fused multiply-adds, rounded once: the decode `down` kernel's order and
   rounding. The one difference from decode: the K order of each dot product (WGMMA k-blocks of
   16 here, lane-split butterflies there), so the two agree to fp32 rounding before the final
   bf16 rounding, and an act element can differ by one bf16 ulp where g or u sits on a rounding
   boundary.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "moe_grouped"
BM = 128  # rows per tile of the grouped GEMM: segments are padded to a multiple of it
PERM_WARPS = 32  # the perm kernel's CTA: each warp owns a contiguous range of entries
GATHER_THREADS = 256
COMBINE_THREADS = 256

# (name, H, E, k, I): the `moe` family's shapes.
SHAPES = [
    ("tiny", 256, 8, 2, 64),  # tools/make_tiny.py --moe
    ("a3b", 2048, 256, 8, 512),  # Qwen3.5/3.6-35B-A3B
    ("next80b", 2048, 512, 10, 512),  # Qwen3-Next-80B-A3B
]


def capacity(m: int, p: int, experts: int) -> int:
    """Rows of the permuted buffers for m rows of p slots over `experts` segments (E + 1): every
    entry plus BM - 1 padding rows for each segment that can be non-empty, in whole tiles."""
    entries = m * p
    return -(-(entries + min(experts, entries) * (BM - 1)) // BM) * BM


def _capacity_rule(p: int, e1: int) -> str:
    return f"C >= roundup(M * {p} + min({e1}, M * {p}) * {BM - 1}, {BM})"


def gemm_block_n(n: int) -> int:
    """The grouped GEMM's N tile: 256, or the whole N of a narrower weight (the tiny model's)."""
    return min(256, n)


def _variants(name: str, h: int, e: int, k: int, inter: int) -> list[Variant]:
    from .moe_grouped_gemm import gemm_variant

    p, e1 = k + 1, e + 1
    key = f"h{h}_e{e}_k{k}_i{inter}"
    shape = {"H": h, "E": e, "K": k, "I": inter, "P": p, "BM": BM}
    if h % 8 or inter % 8:
        raise ValueError(f"moe_grouped shape {name}: H={h}, I={inter} must be multiples of 8")
    combine_threads = min(COMBINE_THREADS, h // 8)
    common = {"sizes": ("M", "C"), "arches": ALL_ARCHES, "example_sizes": {"M": 2048, "C": capacity(2048, p, e1)}}
    return [
        Variant(family=FAMILY, key=f"perm_{key}", config={"kind": "perm", **shape, "warps": PERM_WARPS},
                params=[ptr("ids"), ptr("pos"), ptr("src"), ptr("tiles"), i32("M"), i32("C")],
                tensors={"ids": tensor("i32", "M", p), "pos": tensor("i32", "M", p, role="out"),
                         "src": tensor("i32", "C", role="out"),
                         "tiles": tensor("i32", f"C // {BM} + 1", role="out")},
                block=(32 * PERM_WARPS, 1, 1), grid=(1, 1, 1),
                requires=("M >= 1", "M <= 1048576", _capacity_rule(p, e1)),
                note=f"counting sort of {p} slots per row into {e1} expert segments padded to {BM} ({name})",
                **common),
        Variant(family=FAMILY, key=f"gather_{key}", config={"kind": "gather", **shape},
                params=[ptr("x"), ptr("src"), ptr("tiles"), ptr("xg"), i32("M"), i32("C")],
                tensors={"x": tensor("bf16", "M", h), "src": tensor("i32", "C"),
                         "tiles": tensor("i32", f"C // {BM} + 1"), "xg": tensor("bf16", "C", h, role="out")},
                block=(GATHER_THREADS, 1, 1), grid=(f"C // {BM}", 1, 1),
                requires=("M >= 1", _capacity_rule(p, e1)),
                note=f"gather rows of {h} bf16 into expert order ({name})", **common),
        Variant(family=FAMILY, key=f"combine_{key}", config={"kind": "combine", **shape},
                params=[ptr("dn"), ptr("pos"), ptr("wts"), ptr("out"), i32("M"), i32("C")],
                tensors={"dn": tensor("f32", "C", h), "pos": tensor("i32", "M", p), "wts": tensor("f32", "M", p),
                         "out": tensor("bf16", "M", h, role="out")},
                block=(combine_threads, 1, 1), grid=("M", -(-h // (8 * combine_threads)), 1),
                requires=("M >= 1", "M <= 2147483647", _capacity_rule(p, e1)),
                note=f"sum of {p} weighted expert rows per row, in slot order ({name})", **common),
        gemm_variant(name, "gate_up", e1, 2 * inter, h, "bf16", gemm_block_n(2 * inter)),
        gemm_variant(name, "down", e1, h, inter, "f32", gemm_block_n(h)),
    ]


def variants() -> list[Variant]:
    return [v for shape in SHAPES for v in _variants(*shape)]


# --- NumPy references -----------------------------------------------------------------------------

def reference_perm(ids: np.ndarray, experts: int, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pos [M, P], src [C], tiles [1 + C / BM]) of the `perm` kernel for ids [M, P] (ids clamped
    into [0, experts - 1] as the kernel clamps them). Entries of src past the tiles in use and of
    tiles past their count are not written by the kernel: -2 here."""
    m, p = ids.shape
    flat = np.clip(ids.reshape(-1), 0, experts - 1)
    counts = np.bincount(flat, minlength=experts)
    padded = -(-counts // BM) * BM
    starts = np.concatenate([[0], np.cumsum(padded)])
    pos = np.empty(m * p, np.int32)
    src = np.full(c, -2, np.int32)
    src[:starts[-1]] = -1
    cursor = starts[:-1].copy()
    for i, ex in enumerate(flat):  # ascending entry order: stable within an expert
        pos[i] = cursor[ex]
        src[cursor[ex]] = i // p
        cursor[ex] += 1
    tiles = np.full(c // BM + 1, -2, np.int32)
    tiles[0] = starts[-1] // BM
    tiles[1:1 + tiles[0]] = np.repeat(np.arange(experts), padded // BM)
    return pos.reshape(m, p), src, tiles


def reference_gather(x: np.ndarray, src: np.ndarray, tiles: np.ndarray) -> np.ndarray:
    """xg [tiles[0] * BM, H]: the source rows in permuted order, zero rows for padding."""
    used = src[:tiles[0] * BM]
    out = np.zeros((used.size, x.shape[1]), np.float32)
    out[used >= 0] = x[used[used >= 0]]
    return out


def reference_gemm(xg: np.ndarray, w: np.ndarray, tiles: np.ndarray, *, rounded: bool) -> np.ndarray:
    """out [tiles[0] * BM, N]: each BM-row tile t times its expert's weights w[tiles[1 + t]]^T
    ([E + 1, N, K]) in float32 sums, rounded to bf16 when `rounded` (the gate_up GEMM)."""
    out = np.empty((tiles[0] * BM, w.shape[1]), np.float32)
    for t in range(tiles[0]):
        rows = slice(t * BM, (t + 1) * BM)
        out[rows] = xg[rows].astype(np.float32) @ w[tiles[1 + t]].astype(np.float32).T
    return round_bf16(out) if rounded else out


def reference_combine(dn: np.ndarray, pos: np.ndarray, wts: np.ndarray) -> np.ndarray:
    """out [M, H] = bf16(sum over slots p in order of wts[:, p] * dn[pos[:, p]]), fp32 sums."""
    acc = np.zeros((pos.shape[0], dn.shape[1]), np.float32)
    for s in range(pos.shape[1]):
        acc = acc + wts[:, s:s + 1].astype(np.float32) * dn[pos[:, s]]
    return round_bf16(acc)


def reference(x: np.ndarray, ids: np.ndarray, wts: np.ndarray, gate_up: np.ndarray, down: np.ndarray
              ) -> np.ndarray:
    """The prefill MoE MLP after routing: the delta rows [M, H] for x [M, H], ids / wts [M, P]."""
    from .silu_mul import reference as silu_mul

    experts = gate_up.shape[0]
    c = capacity(x.shape[0], ids.shape[1], experts)
    pos, src, tiles = reference_perm(ids, experts, c)
    xg = reference_gather(x, src, tiles)
    act = silu_mul(reference_gemm(xg, gate_up, tiles, rounded=True))
    return reference_combine(reference_gemm(act, down, tiles, rounded=False), pos, wts)


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["kind"] == "gemm":
        from .moe_grouped_gemm import build as build_gemm

        return build_gemm(variant)
    from .moe_grouped_kernels import build as build_kernel

    return build_kernel(variant)

