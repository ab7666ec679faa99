"""Block-scaled prefill GEMMs for Blackwell GeForce (sm_120a, RTX 50-series):
`out[M, N] (bf16) = A[M, K] @ B[N, K]^T` with A = the activations `x`, B = the weight `w`,
in two kinds, each compiled for the Qwen3.6-27B prefill projections and a small test shape.

sm_120a has neither tcgen05/TMEM nor WGMMA: its tensor cores run warp-level `mma.sync`, which
includes block-scaled FP4 (`kind::mxf4nvf4`, scale per 16 columns) and plain FP8. Hence:

- `nvfp4`: both operands NVFP4, as the artifact stores a weight (docs/artifact.md): e2m1 codes
  two per byte `[rows, K / 2]` uint8, column 2j in the low nibble; one e4m3 scale per 16 columns
  `[rows, K / 16]` uint8; fp32 globals, `x_gscale[1]` for the activations and `w_gscale[N]` for
  the weight (the runner's per-row expansion, as gemv_nvfp4 takes it: a fused projection's parts
  have their own globals). `out[m, n] = bf16(x_gscale * w_gscale[n] * sum_k x[m, k] w[n, k])`
  with x, w the codes times their block scales. The codes and scales need no reordering: lane
  (r, q) of `mma.sync.m16n8k64` takes 8 consecutive columns (4 bytes) of a row per register, low
  nibble first, and one 32-bit word of 4 consecutive scales (the step's four 16-column blocks).
  `nvfp4_weight_operands` / `nvfp4_activation_operands` give the kernel's buffers.
- `fp8`: both operands e4m3 with fp32 block scales in Qwen's recipe, as `gemm_fp8_sm90` takes
  them: the weight `w[N, K]` with `w_scale[N / 128, K / 128]` (128 x 128 blocks, the artifact's
  `fp8_e4m3` layout), the activations `x[M, K]` with `x_scale[M, K / 128]` (1 x 128 groups, what
  `quantize_act` writes). Plain FP8 MMAs (`mma.sync.m16n8k32.e4m3`) sum each 128-column k-tile
  into a fresh fp32 fragment, added into the accumulator times `x_scale[row, kb] * w_scale[n /
  128, kb]` in registers: `out[m, n] = bf16(sum_kb x_scale[m, kb] w_scale[n / 128, kb] sum_{k in
  kb} x[m, k] w[n, k])`. (The MX kind, ue8m0 per 32, would need the weights requantised; the
  128 x 128 scales are used as stored.) `fp8_weight_operands` / `fp8_activation_operands`.

Schedule (simple rather than fast): one CTA of 4 warps (2 x 2, 32 x 64 each) per 64 x 128 output
tile, grid (N / 128, cdiv(M, 64)). A k-tile is 128 bytes of every operand row (128 e4m3 or 256
e2m1 columns); a 3-slot cp.async ring of (64 + 128) rows x 128 bytes (72 KiB; NVFP4 adds its
scales, 9 KiB: under the ~99 KiB a block gets on an RTX 5090), rows XOR-swizzled by 16-byte chunk
so the fragment loads (32-bit words from shared memory) are free of bank conflicts. Rows past M
read row M - 1 (their results are never stored); N must be a multiple of 128 and K of 256
(NVFP4: 128-byte k-tiles and 16-byte scale rows; FP8: the 128-column scale blocks).

Numerics: NVFP4 products (code times scale, each side) are exact in fp32 and summed by the MMA in
fp32 over the whole K; FP8 as in gemm_fp8_sm90 (exact e4m3 products, per-128 partial, promoted
in fp32). `reference` models both in fp32 and rounds to bf16 once.

Status: compiled for sm_120a only (`arches`); it has not run on hardware, and the runner does not
use it (docs/kernels.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import gemm_fp8_sm90, quantize_act
from ._blackwell_shapes import SHAPES
from .bf16 import round_bf16
from .gemv_nvfp4 import GROUP, nvfp4_values
from .variant import Variant, i32, ptr, tensor

FAMILY = "gemm_bs_sm120"
ARCHES = ("sm_120a",)
KINDS = ("nvfp4", "fp8")
BM, BN = 64, 128  # output tile; BN is also one weight-scale block row (FP8)
STAGES = 3
THREADS = 128
FP8_BLOCK = 128  # columns per FP8 scale block



def smem_bytes(kind: str) -> int:
    """Shared memory of the ring: operand rows, and NVFP4's 16 scale bytes per row and k-tile."""
    row_bytes = 128 + (16 if kind == "nvfp4" else 0)
    return STAGES * (BM + BN) * row_bytes


def _variant(kind: str, name: str, n: int, k: int) -> Variant:
    k_tiles = (k // 2 if kind == "nvfp4" else k) // 128  # 128-byte k-tiles of an operand row
    if n % BN or k % 256 or k_tiles < STAGES - 1:
        raise ValueError(f"{FAMILY} {kind} {name}: N = {n} must be a multiple of {BN} and K = {k} of 256 "
                         f"with at least {STAGES - 1} k-tiles (the ring's prologue)")
    if kind == "nvfp4":
        tensors = {"x": tensor("u8", "M", k // 2), "x_scale": tensor("e4m3", "M", k // GROUP),
                   "x_gscale": tensor("f32", 1), "w": tensor("u8", n, k // 2),
                   "w_scale": tensor("e4m3", n, k // GROUP), "w_gscale": tensor("f32", n)}
        params = [ptr("x"), ptr("x_scale"), ptr("x_gscale"), ptr("w"), ptr("w_scale"), ptr("w_gscale")]
        what = "nvfp4 x @ W^T (e4m3 scale per 16, fp32 global per tensor / per row)"
    else:
        kb = k // FP8_BLOCK
        tensors = {"x": tensor("e4m3", "M", k), "x_scale": tensor("f32", "M", kb), "w": tensor("e4m3", n, k),
                   "w_scale": tensor("f32", n // FP8_BLOCK, kb)}
        params = [ptr("x"), ptr("x_scale"), ptr("w"), ptr("w_scale")]
        what = "fp8 x @ W^T (1x128 / 128x128 fp32 block scales promoted per k-tile)"
    return Variant(
        family=FAMILY,
        key=f"{kind}_{name}_n{n}_k{k}",
        config={"kind": kind, "N": n, "K": k, "BM": BM, "BN": BN, "stages": STAGES, "threads": THREADS,
                "smem": smem_bytes(kind)},
        params=[*params, ptr("out"), i32("M")],
        tensors={**tensors, "out": tensor("bf16", "M", n, role="out")},
        sizes=("M",),
        block=(THREADS, 1, 1),
        grid=(n // BN, f"cdiv(M, {BM})", 1),
        requires=("M >= 1", f"cdiv(M, {BM}) <= 65535", f"M <= {(2**31 - 1) // max(n, k)}"),
        arches=ARCHES,
        note=f"sm_120a mma.sync {what}, [M,{k}] x [{n},{k}]",
        example_sizes={"M": 4096},
    )


def variants() -> list[Variant]:
    return [_variant(kind, *shape) for kind in KINDS for shape in SHAPES]


# ---------------------------------------------------------------------------- references


def reference_nvfp4(x: np.ndarray, x_scale: np.ndarray, x_gscale: np.ndarray, w: np.ndarray,
                    w_scale: np.ndarray, w_gscale: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """out [M, N] from the kernel's NVFP4 buffers (codes [rows, K / 2] uint8, e4m3 scale codes
    [rows, K / 16] uint8, x_gscale [1], w_gscale [N]).

    exact: float64 of the dequantised operands. Otherwise the kernel's roundings: each code times
    its block scale (exact: 2 + 4 significand bits), their products (exact in fp32), summed in
    fp32, times `x_gscale * w_gscale[n]` (one fp32 product), rounded to bf16."""
    m, n = x.shape[0], w.shape[0]
    k = x.shape[1] * 2
    if w.shape != (n, k // 2) or x_scale.shape != (m, k // GROUP) or w_scale.shape != (n, k // GROUP):
        raise ValueError(f"nvfp4 reference: x {x.shape}, x_scale {x_scale.shape}, w {w.shape}, w_scale "
                         f"{w_scale.shape} do not describe one [M, K] x [N, K] product")
    if np.shape(x_gscale) != (1,) or np.shape(w_gscale) != (n,):
        raise ValueError(f"nvfp4 reference: globals {np.shape(x_gscale)}, {np.shape(w_gscale)}; want (1,), ({n},)")
    a, b = nvfp4_values(x, x_scale), nvfp4_values(w, w_scale)
    if exact:
        return (a @ b.T) * (np.float64(x_gscale[0]) * np.asarray(w_gscale, np.float64))[None, :]
    g = np.float32(x_gscale[0]) * np.asarray(w_gscale, np.float32)
    dot = np.matmul(a.astype(np.float32), b.astype(np.float32).T, dtype=np.float32)
    return round_bf16((dot * g[None, :]).astype(np.float32))


def reference_fp8(x: np.ndarray, x_scale: np.ndarray, w: np.ndarray, w_scale: np.ndarray, *,
                  exact: bool = False) -> np.ndarray:
    """out [M, N] from the kernel's FP8 buffers: the same product and order of roundings as
    gemm_fp8_sm90 (per-128-column partial, times both scales, fp32 sum, bf16), whose reference
    this is."""
    return gemm_fp8_sm90.reference(x, x_scale, w, w_scale, exact=exact)


def reference(kind: str, ops: dict[str, np.ndarray], *, exact: bool = False) -> np.ndarray:
    """out [M, N] of a `kind` variant from its input buffers by their manifest names (`x`,
    `x_scale`, ..., as the `*_operands` functions below return them)."""
    if kind == "nvfp4":
        return reference_nvfp4(ops["x"], ops["x_scale"], ops["x_gscale"], ops["w"], ops["w_scale"], ops["w_gscale"],
                               exact=exact)
    if kind == "fp8":
        return reference_fp8(ops["x"], ops["x_scale"], ops["w"], ops["w_scale"], exact=exact)
    raise ValueError(f"{FAMILY}: unknown kind {kind!r}; the kinds are {KINDS}")


# ---------------------------------------------------------------------------- operands from storage


def nvfp4_weight_operands(codes: np.ndarray, scales: np.ndarray, global_scale: np.ndarray,
                          row_groups: int = 1) -> dict[str, np.ndarray]:
    """An artifact `nvfp4` weight (codes [N, K / 2], e4m3 scales [N, K / 16], fp32 globals [R] of
    its R row groups) -> the kernel's `w`, `w_scale`, `w_gscale [N]` (each group's global on its
    rows). The codes and scales are used as stored."""
    codes, scales = np.ascontiguousarray(codes, np.uint8), np.ascontiguousarray(scales, np.uint8)
    n = codes.shape[0]
    g = np.asarray(global_scale, np.float32).reshape(-1)
    if codes.ndim != 2 or scales.shape != (n, codes.shape[1] * 2 // GROUP) or g.shape != (row_groups,) \
            or n % row_groups:
        raise ValueError(f"nvfp4 weight: codes {codes.shape}, scales {scales.shape}, globals {g.shape} for "
                         f"{row_groups} row groups")
    return {"w": codes, "w_scale": scales, "w_gscale": np.repeat(g, n // row_groups)}


def nvfp4_activation_operands(codes: np.ndarray, scales: np.ndarray, global_scale: np.ndarray) -> dict[str, np.ndarray]:
    """Activations [M, K] in the artifact's NVFP4 encoding with one global for the tensor (what
    `runtime.artifact.formats.nvfp4_quantize(x)` returns: the runtime has no NVFP4 activation
    quantiser) -> the kernel's `x`, `x_scale`, `x_gscale [1]`."""
    codes, scales = np.ascontiguousarray(codes, np.uint8), np.ascontiguousarray(scales, np.uint8)
    g = np.asarray(global_scale, np.float32).reshape(-1)
    if codes.ndim != 2 or scales.shape != (codes.shape[0], codes.shape[1] * 2 // GROUP) or g.shape != (1,):
        raise ValueError(f"nvfp4 activations: codes {codes.shape}, scales {scales.shape}, globals {g.shape}: "
                         "want [M, K / 2], [M, K / 16] and one global")
    return {"x": codes, "x_scale": scales, "x_gscale": g}


def fp8_weight_operands(codes: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
    """An artifact `fp8_e4m3` weight (codes [N, K], fp32 scales [cdiv(N, 128), cdiv(K, 128)]) ->
    the kernel's `w`, `w_scale`: as stored, once checked that every 128-row tile has one scale
    row (a fused weight whose parts are multiples of 128 rows, as the 27B's are)."""
    codes, scales = np.ascontiguousarray(codes, np.uint8), np.ascontiguousarray(scales, np.float32)
    n, k = codes.shape
    if scales.shape != (n // FP8_BLOCK, k // FP8_BLOCK) or n % FP8_BLOCK or k % FP8_BLOCK:
        raise ValueError(f"fp8 weight: codes {codes.shape} with scales {scales.shape}: need N and K multiples of "
                         f"{FP8_BLOCK} and one scale per 128 x 128 block")
    return {"w": codes, "w_scale": scales}


def fp8_activation_operands(x: np.ndarray) -> dict[str, np.ndarray]:
    """Activations [M, K] (bf16 values) -> `x` e4m3 codes and `x_scale [M, K / 128]`, as the
    runtime's `quantize_act` kernel writes them (its reference)."""
    codes, scale = quantize_act.reference(np.asarray(x, np.float32))
    return {"x": codes, "x_scale": scale}


# ---------------------------------------------------------------------------- build


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass

    from . import _dsl, _gemm_bs_sm120_kernel

    cfg = dict(variant.config)
    launch = _gemm_bs_sm120_kernel.build(cfg, f"{_dsl.NAME_PREFIX}_{FAMILY}_{variant.key}",
                                         lambda env: _dsl.grid(variant, env))
    args = [_dsl.fake_ptr(variant.tensors[p.buffer].dtype) for p in variant.params if p.kind == "ptr"]
    return launch, [*args, cutlass.Int32(1), _dsl.stream()]
