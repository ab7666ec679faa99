"""Mixture-of-experts MLP for a few rows (decode, verification; prefill in blocks), BF16 weights.

The MoE MLP of one layer (research/qwen-arch.md 2.5) is four launches, all sized for the worst
case and reading the routing from device memory only, so a step captures in a CUDA graph:

1. `logits`: router logits `x[M, H] @ Wr[E, H]^T` in fp32 (not rounded to bf16: a rounded logit
   ties its neighbours more often, and a tie flips an expert). Grid (M, E / 8): each warp owns one
   expert row, lanes split H, a shuffle sum finishes the dot product.
2. `route`: one warp per row. The top k logits by (value desc, index asc) (the lowest index wins a
   tie, as the NumPy reference's stable argsort does), found by k rounds of a butterfly argmax;
   their weights `exp(l_j - l_max) / sum` in fp32, the sum over the k selected logits (Qwen3.5-MoE
   always renormalises, Qwen3-Next when `norm_topk_prob`) or over all E (no renormalisation:
   softmax over all). The shared expert is slot k of every row: id E (its weights are stored as
   expert E, right after the routed ones) with weight `sigmoid(x . w_sg)` (fp32 dot product).
   Output: ids int32 [M, P], weights fp32 [M, P], P = k + 1 slots per row.
3. `up`: grid (M * P, I / 16), one CTA per (row, slot) and 16 features: expert e = ids[slot]
   read on the device; gate and up dot products (rows f and I + f of the expert's [2I, H] block)
   rounded to bf16 as the dense path's GEMM rounds them, `act = bf16(bf16(silu(g)) * u)` as
   `silu_mul` computes it. Output act bf16 [M, P, I].
4. `down`: grid (M, H / FD): a CTA owns FD output features of one row and, for p = 0..P-1 in
   that fixed order, adds `w_p * (act_p . Wd[e_p, f, :])` in fp32 (down projection, routing
   weight and combine fused; no atomics, so the sum is deterministic and a row's numbers do not
   depend on the other rows), then rounds once to bf16. Output: the MLP's delta rows [M, H].

Dot products: a row of K bf16 values is split over L = min(32, K / 8) lanes (16-byte vectors,
lane j takes vectors j, j + L, ...), so a warp works on 32 / L rows at once; the partial sums meet
through a butterfly over the L lanes, a fixed order. Every expert slot reads its expert's weights
itself: with several rows routed to one expert the weights are read again (from L2); a grouped
kernel that reads each expert once for all its rows is later work (docs/kernels.md).

The decode form (cute_kernels/moe_decode_kernels.py) computes the same numbers in three launches,
with its loads made asynchronous (`cp.async` into shared memory: a lane's plain loads go
out one slot at a time, ptxas sinks them to their use, so `up` and `down` wait on DRAM once per
dot product; staged copies are all in flight at once, and each lane reads back only what it
copied itself, so no barrier guards them):

1'. `logits_wide`: `logits` with every lane's x and router vectors staged before the first product
   (the same sums in the same order).

3'. `route_up`: `up` with the routing fused in front, UF features a CTA. A CTA of a routed slot s
   loads its row's E logits into shared memory and every thread ranks its logits (rank = how
   many logits beat it by (value desc, index asc), a permutation of 0..E-1); the logit of rank s
   is the slot's expert. No launch boundary stands between the routing and the weight loads, and
   the shared slot's CTAs start loading at once. The CTAs of feature tile 0 write ids and wts
   (`route`'s formulas, sums in `route`'s order) for `down`.
   `up_wide` is `up` with the same staging and the ids from `route` (the decode form without
   the fused routing: four launches, no ranking in every CTA).
4'. `down_wide`: `down` with every slot's weight rows staged at once (R rows per warp, FD = 8 R
   features a CTA) and the row's act vectors staged once per CTA. The sums are `down`'s, in the
   same order, so the two agree bit for bit.

Which form the runner launches is one switch in runtime/model/gpu/kernels.py (MOE_DECODE_FORM);
bench/kernels.py --only moe times every form side by side.

FP8 expert stacks (e4m3 codes, fp32 scales per `block_rows` x 128) have `up_fp8` and `down_fp8`
(cute_kernels/moe_fp8_kernels.py): `up` and `down` with each 8-code vector decoded in registers
and its fp32 partial sum scaled; the routing kernels are shared. No staged decode form reads FP8
yet.

NVFP4 expert stacks (packed e2m1 codes, an e4m3 scale per 16 columns, an fp32 global per row)
have `up_nvfp4` and `down_nvfp4` (cute_kernels/moe_nvfp4_kernels.py, references in
cute_kernels/moe_nvfp4.py): `up` and `down` with each 32-column chunk decoded exactly to bf16 in
registers and the row's global scale applied to the fp32 dot product.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "moe"
FP8_BLOCK = 128  # rows and columns per fp8 scale (the artifact's block)
WARPS = 8  # warps per CTA of logits, up and down
UP_FEATURES = 16  # intermediate features per `up` and `route_up` CTA (2 per warp)
# The decode forms built (bench/kernels.py times each; runtime/model/gpu/kernels.py
# MOE_DECODE_FORM picks one): `route_up` / `up_wide` features a CTA, `down_wide` rows a warp.
ROUTE_UP_FEATURES = (8, 16)
DOWN_WIDE_ROWS = (1, 2)

# (name, H, E, k, I, renormalise, rows per warp of `down`): the MoE shapes we serve.
SHAPES = [
    ("tiny", 256, 8, 2, 64, True, 4),  # tools/make_tiny.py --moe
    ("a3b", 2048, 256, 8, 512, True, 2),  # Qwen3.5/3.6-35B-A3B
    ("next80b", 2048, 512, 10, 512, True, 2),  # Qwen3-Next-80B-A3B (norm_topk_prob true)
]


def lanes_per_row(k: int) -> int:
    """Lanes sharing one dot product over K bf16 values (16-byte vectors, at most 32)."""
    chunks = k // 8
    lanes = min(32, chunks)
    if k % 8 or chunks % lanes or 32 % lanes:
        raise ValueError(f"moe: a row of {k} values does not split into 16-byte vectors over a power of two of lanes")
    return lanes


# The decode form's kernels (moe_decode_kernels.py): built with programmatic dependent launch
# (config `pdl`, cute_kernels/_pdl.py), as the decode step chains them.
DECODE_KINDS = ("logits_wide", "route_up", "up_wide", "down_wide")


def _variant(name: str, kind: str, key: str, config: dict, params: list, tensors: dict, grid: tuple,
            block: int, note: str) -> Variant:
    pdl = {"pdl": True} if kind in DECODE_KINDS else {}
    return Variant(family=FAMILY, key=f"{kind}_{key}", config={"kind": kind, **config, **pdl}, params=params,
                   tensors=tensors, sizes=("M",), block=(block, 1, 1), grid=grid,
                   requires=("M >= 1", "M <= 65535"), arches=ALL_ARCHES, note=f"{note} ({name})",
                   example_sizes={"M": 1})


def _variants(name: str, h: int, e: int, k: int, inter: int, renorm: bool, down_rows: int) -> list[Variant]:
    p = k + 1
    key = f"h{h}_e{e}_k{k}_i{inter}"
    # H a multiple of 256: the logits, route and up kernels split a row of H over all 32 lanes.
    if e % WARPS or inter % UP_FEATURES or h % (WARPS * down_rows) or h % 256:
        raise ValueError(f"moe shape {name}: H={h}, E={e}, I={inter} do not tile")
    shape = {"H": h, "E": e, "K": k, "I": inter, "P": p}
    down_lanes = lanes_per_row(inter)
    if down_rows % (32 // down_lanes):
        raise ValueError(f"moe shape {name}: {down_rows} down rows per warp is not a multiple of {32 // down_lanes}")
    fd = WARPS * down_rows
    return [
        _variant(name, "logits", f"e{e}_h{h}", {"E": e, "H": h},
                [ptr("x"), ptr("w"), ptr("out"), i32("M")],
                {"x": tensor("bf16", "M", h), "w": tensor("bf16", e, h), "out": tensor("f32", "M", e, role="out")},
                ("M", e // WARPS, 1), 32 * WARPS, f"router logits x[M,{h}] @ Wr[{e},{h}]^T in fp32"),
        _variant(name, "route", key, {**shape, "renorm": renorm},
                [ptr("logits"), ptr("x"), ptr("w_sg"), ptr("ids"), ptr("wts"), i32("M")],
                {"logits": tensor("f32", "M", e), "x": tensor("bf16", "M", h), "w_sg": tensor("bf16", h),
                 "ids": tensor("i32", "M", p, role="out"), "wts": tensor("f32", "M", p, role="out")},
                ("M", 1, 1), 32, f"top-{k} of {e} experts, fp32 weights, shared-expert gate"),
        _variant(name, "up", key, shape,
                [ptr("x"), ptr("w"), ptr("ids"), ptr("act"), i32("M")],
                {"x": tensor("bf16", "M", h), "w": tensor("bf16", (e + 1) * 2 * inter, h),
                 "ids": tensor("i32", "M", p), "act": tensor("bf16", "M", p, inter, role="out")},
                (f"M * {p}", inter // UP_FEATURES, 1), 32 * WARPS,
                f"expert gate/up + SwiGLU, {p} slots per row, I={inter}"),
        _variant(name, "down", key, {**shape, "rows_per_warp": down_rows},
                [ptr("act"), ptr("w"), ptr("ids"), ptr("wts"), ptr("out"), i32("M")],
                {"act": tensor("bf16", "M", p, inter), "w": tensor("bf16", (e + 1) * h, inter),
                 "ids": tensor("i32", "M", p), "wts": tensor("f32", "M", p),
                 "out": tensor("bf16", "M", h, role="out")},
                ("M", h // fd, 1), 32 * WARPS, f"expert down x routing weight, summed over {p} slots in order"),
        _variant(name, "logits_wide", f"e{e}_h{h}", {"E": e, "H": h},
                [ptr("x"), ptr("w"), ptr("out"), i32("M")],
                {"x": tensor("bf16", "M", h), "w": tensor("bf16", e, h), "out": tensor("f32", "M", e, role="out")},
                ("M", e // WARPS, 1), 32 * WARPS, f"router logits x[M,{h}] @ Wr[{e},{h}]^T in fp32, loads staged"),
    ] + [_route_up(name, key, shape, renorm, uf) for uf in ROUTE_UP_FEATURES] + [
        _up_wide(name, key, shape, uf) for uf in ROUTE_UP_FEATURES] + [
        _down_wide(name, key, shape, rows) for rows in DOWN_WIDE_ROWS] + _fp8(name, key, shape, down_rows) + \
        _nvfp4(name, key, shape, down_rows)


def fp8_block_rows(inter: int) -> int:
    """Rows per fp8 scale row of a gate/up expert stack: 128, or I when an expert's gate (or up)
    half is narrower (the tiny model's I = 64: each half is one scale row); `weights.WeightLayout`
    lays the stacks out so. The down stacks' H rows per expert take 128 (H is a multiple)."""
    return min(FP8_BLOCK, inter)


def _fp8(name: str, key: str, shape: dict, down_rows: int) -> list[Variant]:
    """`up_fp8` and `down_fp8` (cute_kernels/moe_fp8_kernels.py): `up` and `down` reading
    block-scaled e4m3 expert stacks, their fp32 scales [rows / block_rows, cdiv(K, 128)] beside."""
    h, e, inter, p = shape["H"], shape["E"], shape["I"], shape["P"]
    br_up = fp8_block_rows(inter)
    if inter % br_up or h % FP8_BLOCK:
        raise ValueError(f"moe shape {name}: fp8 experts need I below or a multiple of {FP8_BLOCK} and H a multiple")
    kb_up, kb_down = -(-h // FP8_BLOCK), -(-inter // FP8_BLOCK)
    fd = WARPS * down_rows
    return [
        _variant(name, "up_fp8", key, {**shape, "block_rows": br_up},
                 [ptr("x"), ptr("w"), ptr("scale"), ptr("ids"), ptr("act"), i32("M")],
                 {"x": tensor("bf16", "M", h), "w": tensor("e4m3", (e + 1) * 2 * inter, h),
                  "scale": tensor("f32", (e + 1) * 2 * inter // br_up, kb_up),
                  "ids": tensor("i32", "M", p), "act": tensor("bf16", "M", p, inter, role="out")},
                 (f"M * {p}", inter // UP_FEATURES, 1), 32 * WARPS,
                 f"fp8 expert gate/up + SwiGLU, {p} slots per row, I={inter}"),
        _variant(name, "down_fp8", key, {**shape, "rows_per_warp": down_rows, "block_rows": FP8_BLOCK},
                 [ptr("act"), ptr("w"), ptr("scale"), ptr("ids"), ptr("wts"), ptr("out"), i32("M")],
                 {"act": tensor("bf16", "M", p, inter), "w": tensor("e4m3", (e + 1) * h, inter),
                  "scale": tensor("f32", (e + 1) * h // FP8_BLOCK, kb_down),
                  "ids": tensor("i32", "M", p), "wts": tensor("f32", "M", p),
                  "out": tensor("bf16", "M", h, role="out")},
                 ("M", h // fd, 1), 32 * WARPS, f"fp8 expert down x routing weight, summed over {p} slots in order"),
    ]


def nvfp4_lanes(k: int) -> int:
    """Lanes sharing one NVFP4 dot product over K columns (a lane reads 32-column chunks)."""
    lanes = min(32, k // 32)
    if k % 32 or (k // 32) % lanes or 32 % lanes:
        raise ValueError(f"moe: a row of {k} nvfp4 values does not split into 32-column chunks over a power of two "
                         "of lanes")
    return lanes


def _nvfp4(name: str, key: str, shape: dict, down_rows: int) -> list[Variant]:
    """`up_nvfp4` and `down_nvfp4` (cute_kernels/moe_nvfp4_kernels.py): `up` and `down` reading
    NVFP4 expert stacks (codes [rows, K / 2], e4m3 scales [rows, K / 16], fp32 globals [rows]).
    A warp takes at least one row per lane group (the tiny shape's narrow rows split over few
    lanes), so its features a CTA (up) and rows a warp (down) round up to that."""
    h, e, inter, p = shape["H"], shape["E"], shape["I"], shape["P"]
    features = WARPS * max(UP_FEATURES // WARPS, 32 // nvfp4_lanes(h))
    rows = max(down_rows, 32 // nvfp4_lanes(inter))
    if inter % features or h % (WARPS * rows):
        raise ValueError(f"moe shape {name}: nvfp4 experts with {features} features a CTA or {rows} rows a warp "
                         f"do not tile I={inter}, H={h}")
    gu_rows, dn_rows = (e + 1) * 2 * inter, (e + 1) * h
    return [
        _variant(name, "up_nvfp4", key, {**shape, "features": features},
                 [ptr("x"), ptr("w"), ptr("scale"), ptr("gscale"), ptr("ids"), ptr("act"), i32("M")],
                 {"x": tensor("bf16", "M", h), "w": tensor("u8", gu_rows, h // 2),
                  "scale": tensor("e4m3", gu_rows, h // 16), "gscale": tensor("f32", gu_rows),
                  "ids": tensor("i32", "M", p), "act": tensor("bf16", "M", p, inter, role="out")},
                 (f"M * {p}", inter // features, 1), 32 * WARPS,
                 f"nvfp4 expert gate/up + SwiGLU, {p} slots per row, I={inter}"),
        _variant(name, "down_nvfp4", key, {**shape, "rows_per_warp": rows},
                 [ptr("act"), ptr("w"), ptr("scale"), ptr("gscale"), ptr("ids"), ptr("wts"), ptr("out"), i32("M")],
                 {"act": tensor("bf16", "M", p, inter), "w": tensor("u8", dn_rows, inter // 2),
                  "scale": tensor("e4m3", dn_rows, inter // 16), "gscale": tensor("f32", dn_rows),
                  "ids": tensor("i32", "M", p), "wts": tensor("f32", "M", p),
                  "out": tensor("bf16", "M", h, role="out")},
                 ("M", h // (WARPS * rows), 1), 32 * WARPS,
                 f"nvfp4 expert down x routing weight, summed over {p} slots in order"),
    ]


def _route_up(name: str, key: str, shape: dict, renorm: bool, uf: int) -> Variant:
    h, e, k, inter, p = shape["H"], shape["E"], shape["K"], shape["I"], shape["P"]
    if uf % WARPS or inter % uf:
        raise ValueError(f"moe shape {name}: route_up with {uf} features a CTA does not tile I={inter}")
    return _variant(name, "route_up", f"{key}_f{uf}", {**shape, "renorm": renorm, "features": uf},
                    [ptr("logits"), ptr("x"), ptr("w_sg"), ptr("w"), ptr("ids"), ptr("wts"), ptr("act"), i32("M")],
                    {"logits": tensor("f32", "M", e), "x": tensor("bf16", "M", h), "w_sg": tensor("bf16", h),
                     "w": tensor("bf16", (e + 1) * 2 * inter, h), "ids": tensor("i32", "M", p, role="out"),
                     "wts": tensor("f32", "M", p, role="out"), "act": tensor("bf16", "M", p, inter, role="out")},
                    (f"M * {p}", inter // uf, 1), 32 * WARPS,
                    f"top-{k} of {e} + shared gate fused into the experts' gate/up + SwiGLU, {uf} features a CTA")


def _up_wide(name: str, key: str, shape: dict, uf: int) -> Variant:
    h, e, inter, p = shape["H"], shape["E"], shape["I"], shape["P"]
    return _variant(name, "up_wide", f"{key}_f{uf}", {**shape, "features": uf},
                    [ptr("x"), ptr("w"), ptr("ids"), ptr("act"), i32("M")],
                    {"x": tensor("bf16", "M", h), "w": tensor("bf16", (e + 1) * 2 * inter, h),
                     "ids": tensor("i32", "M", p), "act": tensor("bf16", "M", p, inter, role="out")},
                    (f"M * {p}", inter // uf, 1), 32 * WARPS,
                    f"expert gate/up + SwiGLU with its loads staged, {uf} features a CTA")


def _down_wide(name: str, key: str, shape: dict, rows: int) -> Variant:
    """The `down_wide` form with `rows` rows a warp; a warp takes at least one row per lane group
    (the tiny shape's I = 64 splits over 8 lanes, so 4 rows at once), so small shapes round up."""
    h, e, inter, p = shape["H"], shape["E"], shape["I"], shape["P"]
    form = f"r{rows}"
    rows = max(rows, 32 // lanes_per_row(inter))
    if h % (WARPS * rows) or rows % (32 // lanes_per_row(inter)):
        raise ValueError(f"moe shape {name}: down_wide {form} does not tile H={h}")
    return _variant(name, "down_wide", f"{key}_{form}", {**shape, "form": form, "rows_per_warp": rows},
                    [ptr("act"), ptr("w"), ptr("ids"), ptr("wts"), ptr("out"), i32("M")],
                    {"act": tensor("bf16", "M", p, inter), "w": tensor("bf16", (e + 1) * h, inter),
                     "ids": tensor("i32", "M", p), "wts": tensor("f32", "M", p),
                     "out": tensor("bf16", "M", h, role="out")},
                    ("M", h // (WARPS * rows), 1), 32 * WARPS,
                    f"expert down x routing weight, every slot's loads at once, {WARPS * rows} features a CTA")


def variants() -> list[Variant]:
    return [v for shape in SHAPES for v in _variants(*shape)]


# --- NumPy references (bf16-valued float32 inputs) ------------------------------------------------

def reference_logits(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Router logits [M, E] in float64 (the kernel's fp32 sums differ by rounding only)."""
    return x.astype(np.float64) @ w.astype(np.float64).T


def reference_route(logits: np.ndarray, x: np.ndarray, w_sg: np.ndarray, k: int, renorm: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [M, k + 1], weights float64 [M, k + 1]): the k largest logits by (value desc,
    index asc), their softmax over the selected (renorm) or over all E, then the shared expert
    (id E, weight sigmoid(x . w_sg))."""
    m, e = logits.shape
    logits = logits.astype(np.float64)
    order = np.lexsort((np.broadcast_to(np.arange(e), logits.shape), -logits), axis=-1)[:, :k]
    top = np.take_along_axis(logits, order, axis=-1)
    exps = np.exp(top - top[:, :1])
    denom = exps.sum(-1, keepdims=True) if renorm else np.exp(logits - top[:, :1]).sum(-1, keepdims=True)
    gate = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w_sg.astype(np.float64))))
    ids = np.concatenate([order, np.full((m, 1), e)], axis=-1).astype(np.int32)
    return ids, np.concatenate([exps / denom, gate[:, None]], axis=-1)


def reference_up(x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """act [M, P, I] for w [E + 1, 2I, H] (gate rows first), rounded as the kernel rounds."""
    inter = w.shape[1] // 2
    out = np.empty((*ids.shape, inter), np.float32)
    for r, row in enumerate(ids):
        for s, expert in enumerate(row):
            gu = round_bf16((w[expert].astype(np.float32) @ x[r].astype(np.float32)).astype(np.float32))
            g, u = gu[:inter], gu[inter:]
            out[r, s] = round_bf16(round_bf16(g / (1.0 + np.exp(-g))) * u)
    return out


def reference_down(act: np.ndarray, w: np.ndarray, ids: np.ndarray, wts: np.ndarray, *, exact: bool = False
                   ) -> np.ndarray:
    """Delta rows [M, H] = sum over slots p (in order) of wts[p] * (act[p] @ w[ids[p]]^T), w
    [E + 1, H, I]; rounded once to bf16 unless exact."""
    out = np.zeros((ids.shape[0], w.shape[1]), np.float64)
    for r, row in enumerate(ids):
        for s, expert in enumerate(row):
            out[r] += wts[r, s] * (w[expert].astype(np.float64) @ act[r, s].astype(np.float64))
    return out if exact else round_bf16(out.astype(np.float32))


def reference(x: np.ndarray, router: np.ndarray, w_sg: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
              k: int, renorm: bool = True) -> np.ndarray:
    """The four kernels chained: the MoE MLP's delta rows for x [M, H]; gate_up [E + 1, 2I, H] and
    down [E + 1, H, I] hold the shared expert as expert E."""
    ids, wts = reference_route(reference_logits(x, router), x, w_sg, k, renorm)
    return reference_down(reference_up(x, gate_up, ids), down, ids, wts)


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["kind"] in ("up_nvfp4", "down_nvfp4"):
        from .moe_nvfp4_kernels import build as build_nvfp4

        return build_nvfp4(variant)
    if variant.config["kind"] in ("up_fp8", "down_fp8"):
        from .moe_fp8_kernels import build as build_fp8

        return build_fp8(variant)
    if variant.config["kind"] in DECODE_KINDS:
        from .moe_decode_kernels import build as build_decode

        return build_decode(variant)
    from .moe_kernels import build as build_kernel

    return build_kernel(variant)
