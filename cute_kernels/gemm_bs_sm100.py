"""Block-scaled prefill GEMMs for Blackwell datacenter GPUs (sm_100a, tcgen05 / UMMA):
`out[M, N] (bf16) = A[M, K] @ B[N, K]^T` with A the activations and B the weight.

COMPILED ONLY: nothing in this project has a Blackwell GPU, so these kernels have never run and
the runner (Hopper-only today) does not use them. `docs/kernels.md` says the same.

Formats (`FORMATS`), both with the scale factors applied by the tensor core per K block:

- `nvfp4`: A and B e2m1 codes two per byte, column 2j in the low nibble (the artifact's `nvfp4`
  packing, unchanged), one e4m3 scale per 16 columns (`MmaMXF4NVF4Op`, scale vector 16), and
  fp32 global scales applied in the epilogue: `a_gscale[1]` (the activations' per-tensor
  global) and `b_gscale[N]` (the weight's global expanded to one per row, as gemv_nvfp4 takes it:
  a fused projection's parts have their own). The activations would be quantised to NVFP4 per
  (row, 16 columns) by a separate kernel that does not exist yet;
- `mxfp8`: A and B e4m3 codes with MX scales: one ue8m0 (a power of two, 2^(byte - 127)) per 32
  columns (`MmaMXF8Op`, scale vector 32); the global scales are there too (pass 1.0 for none).
  Qwen's FP8 weights (e4m3 with fp32 128 x 128 block scales) are NOT of this form: an fp32
  block scale is not a power of two, so `mxfp8_from_block128` requantises them (the e4m3 codes
  change; the result is as close as e4m3 with power-of-two scales per 32 gets), and the
  activations would need an MX quantiser (again a kernel that does not exist yet).

    out[m, n] = bf16( fp32(sum_k dA[m, k] * dB[n, k]) * a_gscale * b_gscale[n] ),
    dA[m, k] = code_A[m, k] * scale_A[m, k // V]   (V = 16 nvfp4, 32 mxfp8), dB likewise.

Scale-factor layout (what `tcgen05.mma` reads, after `tcgen05.cp` from shared memory): the
kernel takes each operand's scales as `tile_scales` writes them from a row-major `[R, K / V]`
byte matrix: rows padded to a multiple of 128, scale columns in groups of 4, and each
(128-row block, 4-column group) stored as a 512-byte chunk in which the scale of row
r = 32 * i + j (i < 4, j < 32) and column c < 4 sits at byte 16 * j + 4 * i + c; chunks go
K-block fastest: chunk (row block rb, column group g) starts at (rb * K / (4 V) + g) * 512. One
k-tile of 128 rows is thus one contiguous run, which the kernel copies with a plain bulk copy.
The activation scales have `cdiv(M, 128) * 128` rows (padding rows are read, never stored).

Kernel (`_gemm_bs_sm100_kernel.py`): one CTA per 128 x 256 output tile (grid N / 256 x
cdiv(M, 128)), a 4-stage TMA ring of 128-byte k-tiles (BK = 256 fp4 or 128 fp8 elements), a
warp-specialised producer / MMA / epilogue split, the fp32 accumulator in tensor memory, and a
tensor memory -> registers -> global bf16 epilogue. Simple over fast: no persistence, no
clusters or 2-CTA MMA, no TMA store. N must be a multiple of 256 and K of BK (every Qwen3.6-27B
shape is). M is dynamic; TMA reads rows past M as zeros, and they are not stored.

Numerics: the products of e2m1 / e4m3 codes and their scales are exact in the tensor core; its
fp32 accumulation order is not specified, so `reference` models the sum as the float64 sum
rounded once to fp32, then the global scales in fp32, then bf16 (the GPU tests allow the
kernel's own summation order 2^-16 of sum |a b| on top of the bf16 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.cuda.manifest import TmaEncode

from . import _gemm_bs_sm100_kernel as _kernel
from ._blackwell_shapes import SHAPES
from .bf16 import round_bf16
from .gemv_fp8 import e4m3_values
from .gemv_nvfp4 import nvfp4_values
from .quantize_act import e4m3_codes
from .variant import Variant, i32, ptr, tensor, tma

FAMILY = "gemm_bs_sm100"
ARCH = "sm_100a"
BM, BN = _kernel.BM, _kernel.BN
ROWS_PER_CHUNK, COLS_PER_CHUNK = 128, 4  # the 512-byte scale chunk


@dataclass(frozen=True)
class Format:
    name: str
    elem: str  # manifest dtype of a code byte
    per_byte: int  # codes per byte
    vec: int  # K columns per scale factor
    bk: int  # K elements per k-tile (128 bytes of a row)
    dsl_elem: str  # cutlass numeric type names
    dsl_scale: str


FORMATS = {
    "nvfp4": Format("nvfp4", "u8", 2, 16, 256, "Float4E2M1FN", "Float8E4M3FN"),
    "mxfp8": Format("mxfp8", "e4m3", 1, 32, 128, "Float8E4M3FN", "Float8E8M0FNU"),
}



def _variant(fmt: Format, name: str, n: int, k: int) -> Variant:
    if n % BN or k % fmt.bk:
        raise ValueError(f"{FAMILY} shape {name}: N = {n} must be a multiple of {BN} and K = {k} of {fmt.bk}")
    kbytes = k // fmt.per_byte
    enc_a = TmaEncode(dtype="UINT8", dims=(kbytes, "M"), strides_bytes=(kbytes,), box=(128, BM), elem_strides=(1, 1))
    enc_b = TmaEncode(dtype="UINT8", dims=(kbytes, n), strides_bytes=(kbytes,), box=(128, BN), elem_strides=(1, 1))
    return Variant(
        family=FAMILY,
        key=f"{fmt.name}_{name}_n{n}_k{k}",
        config={"format": fmt.name, "N": n, "K": k, "tile": [BM, BN, fmt.bk], "stages": _kernel.STAGES,
                "scale_vec": fmt.vec, "threads": _kernel.THREADS, "tmem_cols": _kernel.TMEM_COLS},
        params=[tma("a_desc", "a", enc_a), i32("a_rows", "M"), tma("b_desc", "b", enc_b), ptr("a_scale"),
                ptr("b_scale"), ptr("a_gscale"), ptr("b_gscale"), ptr("out"), i32("M")],
        tensors={"a": tensor(fmt.elem, "M", kbytes), "b": tensor(fmt.elem, n, kbytes),
                 "a_scale": tensor("u8", f"cdiv(M, {ROWS_PER_CHUNK}) * {ROWS_PER_CHUNK}", k // fmt.vec),
                 "b_scale": tensor("u8", n, k // fmt.vec), "a_gscale": tensor("f32", 1),
                 "b_gscale": tensor("f32", n), "out": tensor("bf16", "M", n, role="out")},
        sizes=("M",),
        block=(_kernel.THREADS, 1, 1),
        grid=(n // BN, f"cdiv(M, {BM})", 1),
        requires=("M >= 1", f"M <= {(2**31 - 1) // max(n, kbytes)}"),
        arches=(ARCH,),
        note=f"prefill {fmt.name} A[M,{k}] @ B[{n},{k}]^T, tcgen05 block-scaled (compiled only, never run)",
        example_sizes={"M": 8192},
    )


def variants() -> list[Variant]:
    return [_variant(fmt, *s) for fmt in FORMATS.values() for s in SHAPES]


# --------------------------------------------------------------------------- scale layout


def tile_scales(sf: np.ndarray) -> np.ndarray:
    """Row-major scale bytes `[R, S]` -> the kernel's chunked layout, flat uint8 of
    `cdiv(R, 128) * 128 * S` bytes (padding rows are zero). S must be a multiple of 4."""
    sf = np.asarray(sf, dtype=np.uint8)
    r, s = sf.shape
    if s % COLS_PER_CHUNK:
        raise ValueError(f"{s} scale columns are not a multiple of {COLS_PER_CHUNK}")
    rb = -(-r // ROWS_PER_CHUNK)
    padded = np.zeros((rb * ROWS_PER_CHUNK, s), dtype=np.uint8)
    padded[:r] = sf
    # [rb, i, j, g, c] (row = 128 rb + 32 i + j, column = 4 g + c) -> [rb, g, j, i, c]
    blocks = padded.reshape(rb, 4, 32, s // COLS_PER_CHUNK, COLS_PER_CHUNK)
    return np.ascontiguousarray(blocks.transpose(0, 3, 2, 1, 4)).reshape(-1)


def untile_scales(tiled: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Inverse of `tile_scales`: -> `[rows, cols]`."""
    rb = -(-rows // ROWS_PER_CHUNK)
    blocks = np.asarray(tiled, dtype=np.uint8).reshape(rb, cols // COLS_PER_CHUNK, 32, 4, COLS_PER_CHUNK)
    return blocks.transpose(0, 3, 2, 1, 4).reshape(rb * ROWS_PER_CHUNK, cols)[:rows]


def nvfp4_operand(codes: np.ndarray, scales: np.ndarray, gscale: np.ndarray | float) -> tuple[np.ndarray, ...]:
    """The artifact's NVFP4 tensor (packed codes `[R, K / 2]`, e4m3 scales `[R, K / 16]`, fp32
    global per tensor or per row) -> this kernel's (codes, tiled scales, fp32 global per row).
    The codes are used as they are: the tensor core reads column 2j from the low nibble too."""
    rows = codes.shape[0]
    g = np.broadcast_to(np.asarray(gscale, dtype=np.float32).reshape(-1), (rows,)) if np.size(gscale) == 1 else \
        np.asarray(gscale, dtype=np.float32).reshape(rows)
    return np.ascontiguousarray(codes, dtype=np.uint8), tile_scales(scales), np.ascontiguousarray(g)


def ue8m0_values(sf: np.ndarray) -> np.ndarray:
    """ue8m0 scale bytes -> float64 2^(byte - 127) (0xFF, NaN, is never produced here)."""
    b = np.asarray(sf, dtype=np.uint8).astype(np.float64)
    return np.where(b == 255, np.nan, np.exp2(b - 127.0))


def mxfp8_quantize(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float `[R, K]` (K % 32 == 0) -> (e4m3 codes `[R, K]`, ue8m0 scales `[R, K / 32]`): each
    32-column block gets the smallest power of two that maps its absmax to at most 448."""
    v = np.asarray(values, dtype=np.float64)
    r, k = v.shape
    blocks = v.reshape(r, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.ceil(np.log2(amax / 448.0)), 0.0)
    e = np.clip(e, -127, 127)
    codes = e4m3_codes((blocks / np.exp2(e)[..., None]).astype(np.float32))
    return codes.reshape(r, k), (e + 127).astype(np.uint8)


def mxfp8_from_block128(codes: np.ndarray, block_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Qwen's FP8 weight (e4m3 codes `[N, K]`, fp32 scales `[cdiv(N, 128), cdiv(K, 128)]`) ->
    MX (e4m3 codes `[N, K]`, row-major ue8m0 scales `[N, K / 32]`; `tile_scales` them for the
    kernel). Lossy: the weight is dequantised and requantised per 32 columns."""
    n, k = codes.shape
    s = np.repeat(np.repeat(np.asarray(block_scale, dtype=np.float64), 128, axis=0), 128, axis=1)[:n, :k]
    return mxfp8_quantize(e4m3_values(codes) * s)


# --------------------------------------------------------------------------- reference


def dequant(fmt: str, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 operand `[R, K]` from codes and row-major scale bytes `[R, K / V]` (no global)."""
    f = FORMATS[fmt]
    if fmt == "nvfp4":
        return nvfp4_values(codes, scales)
    return e4m3_values(codes) * np.repeat(ue8m0_values(scales), f.vec, axis=1)


def reference(fmt: str, a: np.ndarray, a_scale: np.ndarray, b: np.ndarray, b_scale: np.ndarray,
              a_gscale: float, b_gscale: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """`out[M, N]` from codes and ROW-MAJOR scale bytes (`[M, K / V]`, `[N, K / V]`; the kernel
    takes them `tile_scales`d): float64 product of the dequantised operands times the globals
    (exact), or the kernel's roundings (fp32 accumulator, fp32 global scaling, bf16)."""
    acc = dequant(fmt, a, a_scale) @ dequant(fmt, b, b_scale).T
    g = np.asarray(b_gscale, dtype=np.float64).reshape(1, -1)
    if exact:
        return acc * float(a_gscale) * g
    out = acc.astype(np.float32) * np.float32(a_gscale) * g.astype(np.float32)
    return round_bf16(out)


def build(variant: Variant) -> tuple[Any, list[Any]]:
    return _kernel.build(variant, FORMATS[variant.config["format"]])
