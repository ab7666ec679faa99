"""Number formats of `.infernix` tensors, in pure NumPy (NumPy has no bf16/fp8/fp4 dtypes, so
encoded values travel as unsigned integers of the right width).

- bf16: uint16, the top half of an IEEE float32; encoding rounds to nearest, ties to even.
- fp8 e4m3 ("e4m3fn"): uint8, 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
  0x7F/0xFF are NaN, largest finite 448. Encoding rounds to nearest even and saturates at 448.
- e2m1 (fp4): 4-bit codes, bit 3 sign, bits 0..2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6].

Block-quantised weights (layouts in docs/artifact.md) are matrices [*lead, N, K] whose N rows
may be a concatenation of `row_groups` equal groups (a fused gate|up expert has 2); blocks and
global scales never span two groups, so fusing per-expert tensors keeps their encoding exact.

- fp8 block: codes [*lead, N, K] e4m3; scales fp32 [*lead, R*ceil(Ng/128), ceil(K/128)],
  W = e4m3(code) * scale[block row, block col].
- nvfp4: codes [*lead, N, K/2] uint8, column 2j in the low nibble and 2j+1 in the high nibble;
  scales e4m3 [*lead, N, K/16]; global fp32 [*lead, R];  W = e2m1(code) * e4m3(scale) * global.
"""

from __future__ import annotations

import numpy as np

FP8_MAX = 448.0
FP8_BLOCK = 128
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# bf16

def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16, any strides) -> new float32 array (exact), in one pass: the
    GPU runner converts up to 32 MB of logits a verification step with it."""
    bits = np.asarray(bits, dtype=np.uint16)
    out = np.empty(bits.shape, np.uint32)
    np.left_shift(bits, 16, out=out, dtype=np.uint32)
    return out.view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest, ties to even; NaN stays NaN."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds the dropped 16 bits to nearest-even; a carry
    # into the exponent is the correct result (up to inf on overflow). In place: this runs on
    # whole embeddings.
    rounded = (bits >> 16) & 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        # Keep sign and force a quiet-NaN mantissa bit: rounding could otherwise carry a NaN
        # with only low mantissa bits set into an infinity.
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


# ---------------------------------------------------------------------------------------------
# fp8 e4m3

def _e4m3_table() -> np.ndarray:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = sign * (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = sign * (mantissa / 8.0) * 2.0 ** -6
    table = np.where(exponent == 0, subnormal, normal)
    table[(codes & 0x7F) == 0x7F] = np.nan
    return table.astype(np.float32)


E4M3_VALUES = _e4m3_table()


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    """e4m3 codes (uint8) -> new float32 array (exact)."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def f32_to_e4m3(values: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 codes (uint8): round to nearest even, saturate to +-448, NaN -> 0x7F."""
    values = np.asarray(values, dtype=np.float32)
    nan = np.isnan(values)
    magnitude = np.abs(values)
    np.minimum(magnitude, np.float32(FP8_MAX), out=magnitude)
    if nan.any():
        magnitude[nan] = 0
    # Normal range (>= 2^-6): round the float32 mantissa to 3 bits (nearest even) and rebias the
    # exponent from 127 to 7; a mantissa carry rolls into the exponent as it should. Magnitudes
    # are at most 448, so int32 arithmetic cannot overflow. (In place: this runs on whole
    # weight matrices.)
    bits = magnitude.view(np.int32)
    code = bits >> 20
    code &= 1
    code += 0x7FFFF
    code += bits
    code >>= 20
    code -= (127 - 7) << 3
    # Subnormals are multiples of 2^-9 (scaling by 512 is exact; rint rounds half to even), and
    # code 8 (= 2^-6) is exactly the first normal code, so the two ranges join without a seam.
    subnormal = magnitude < np.float32(2.0 ** -6)
    code[subnormal] = np.rint(magnitude[subnormal] * np.float32(512.0)).astype(np.int32)
    np.minimum(code, 0x7E, out=code)
    out = code.astype(np.uint8)
    out |= np.signbit(values).view(np.uint8) << 7
    out[nan] = 0x7F
    return out


# ---------------------------------------------------------------------------------------------
# e2m1 and nibble packing

def f32_to_e2m1(values: np.ndarray) -> np.ndarray:
    """float32 -> e2m1 codes (uint8 0..15), round to nearest even, saturate at +-6.

    Codes 0..7 are monotone in value and an even code has a zero mantissa bit, so comparing
    against the midpoints (strictly where the lower neighbour is even, inclusively where the
    upper one is) gives round-half-to-even.
    """
    values = np.asarray(values, dtype=np.float32)
    m = np.abs(values)
    code = ((m > 0.25).astype(np.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75)
            + (m > 2.5) + (m >= 3.5) + (m > 5.0))
    return (code | np.where(np.signbit(values) & (code > 0), 8, 0)).astype(np.uint8)


def e2m1_to_f32(codes: np.ndarray) -> np.ndarray:
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0xF]


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., K] 4-bit codes -> [..., K/2] bytes, column 2j in the low nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., K/2] bytes -> [..., K] 4-bit codes."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


# ---------------------------------------------------------------------------------------------
# block layouts

def _split_groups(w: np.ndarray, row_groups: int) -> np.ndarray:
    """[*lead, N, K] -> [*lead, R, N/R, K] (a view)."""
    *lead, n, k = w.shape
    if n % row_groups:
        raise ValueError(f"{n} rows do not split into {row_groups} equal row groups")
    return w.reshape(*lead, row_groups, n // row_groups, k)


def _pad_to(x: np.ndarray, axis: int, multiple: int) -> np.ndarray:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return np.pad(x, pad)


def _blocks(x: np.ndarray, row_groups: int) -> np.ndarray:
    """[*lead, N, K] -> zero-padded view [*lead, R, nb, 128, kb, 128] of 128x128 blocks."""
    grouped = _split_groups(x, row_groups)
    *lead, r, _, _ = grouped.shape
    padded = _pad_to(_pad_to(grouped, -2, FP8_BLOCK), -1, FP8_BLOCK)
    nb, kb = padded.shape[-2] // FP8_BLOCK, padded.shape[-1] // FP8_BLOCK
    return padded.reshape(*lead, r, nb, FP8_BLOCK, kb, FP8_BLOCK)


def _unblock(blocks: np.ndarray, shape: tuple[int, ...], row_groups: int) -> np.ndarray:
    """Inverse of _blocks (drops the padding)."""
    *lead, r, nb, _, kb, _ = blocks.shape
    ng, k = shape[-2] // row_groups, shape[-1]
    grouped = blocks.reshape(*lead, r, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :ng, :k]
    return grouped.reshape(shape)


def fp8_block_quantize(w: np.ndarray, row_groups: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """[*lead, N, K] float -> (e4m3 codes [*lead, N, K], fp32 scales) with per-128x128-block
    absmax scales (scale = absmax / 448, so the block's largest value maps to 448)."""
    w = np.asarray(w, dtype=np.float32)
    blocks = _blocks(w, row_groups)
    absmax = np.maximum(blocks.max(axis=(-3, -1)), -blocks.min(axis=(-3, -1)))
    scales = np.where(absmax > 0, absmax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    codes = f32_to_e4m3(blocks / scales[..., :, None, :, None])
    *lead, r, nb, kb = scales.shape
    return _unblock(codes, w.shape, row_groups), scales.reshape(*lead, r * nb, kb)


def fp8_block_dequantize(codes: np.ndarray, scales: np.ndarray, row_groups: int = 1) -> np.ndarray:
    """Inverse of fp8_block_quantize: -> new float32 [*lead, N, K]."""
    blocks = _blocks(e4m3_to_f32(codes), row_groups)
    *lead, r, nb, _, kb, _ = blocks.shape
    grid = np.asarray(scales, dtype=np.float32).reshape(*lead, r, nb, kb)
    return _unblock(blocks * grid[..., :, None, :, None], codes.shape, row_groups)


def nvfp4_quantize(w: np.ndarray, row_groups: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[*lead, N, K] float (K % 16 == 0) -> (packed codes [*lead, N, K/2], e4m3 block scales
    [*lead, N, K/16], fp32 global scales [*lead, R]).

    The global scale maps the group's absmax onto the largest product 6 * 448, so block scales
    use e4m3's full range; each block's scale maps its absmax onto 6.
    """
    w = np.asarray(w, dtype=np.float32)
    *lead, n, k = w.shape
    if k % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs the last dimension to be a multiple of 16, got {k}")
    grouped = _split_groups(w, row_groups)
    group_absmax = np.abs(grouped).max(axis=(-2, -1))                  # [*lead, R]
    global_scale = np.where(group_absmax > 0, group_absmax / np.float32(E2M1_MAX * FP8_MAX),
                            np.float32(1.0)).astype(np.float32)
    blocks = grouped.reshape(*lead, row_groups, n // row_groups, k // NVFP4_BLOCK, NVFP4_BLOCK)
    g = global_scale[..., None, None]
    block_absmax = np.abs(blocks).max(axis=-1)
    scale_codes = f32_to_e4m3(block_absmax / np.float32(E2M1_MAX) / g)
    effective = e4m3_to_f32(scale_codes) * g
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(effective[..., None] > 0, blocks / effective[..., None], 0.0)
    codes = f32_to_e2m1(scaled).reshape(*lead, n, k)
    return pack_nibbles(codes), scale_codes.reshape(*lead, n, k // NVFP4_BLOCK), global_scale


def nvfp4_dequantize(packed: np.ndarray, scales: np.ndarray, global_scale: np.ndarray,
                     row_groups: int = 1) -> np.ndarray:
    """Inverse of nvfp4_quantize: -> new float32 [*lead, N, K]."""
    values = e2m1_to_f32(unpack_nibbles(packed))
    *lead, n, k = values.shape
    block_scale = e4m3_to_f32(scales).reshape(*lead, row_groups, n // row_groups, k // NVFP4_BLOCK, 1)
    g = np.asarray(global_scale, dtype=np.float32).reshape(*lead, row_groups, 1, 1, 1)
    blocks = values.reshape(*lead, row_groups, n // row_groups, k // NVFP4_BLOCK, NVFP4_BLOCK)
    return (blocks * (block_scale * g)).reshape(*lead, n, k)
