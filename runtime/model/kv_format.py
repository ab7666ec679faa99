"""The KV-cache storage formats (`--kv-dtype bf16|fp8|int8`): page sizes, and the NumPy quantiser
that the GPU kernels' tests and references follow bit for bit.

bf16: a layer's K (or V) page is `[64 tokens, Hkv, D]` bf16 (2 bytes a value).
fp8 / int8: one code byte per value and one fp32 scale per (token, KV head), both inside the
page so that every copy of whole pages (host tier, file tier, prefix cache) carries the scales
with the codes. Page p of one layer's pool is bytes [p * PB, (p + 1) * PB):

    PB = 64 * Hkv * D + 64 * Hkv * 4
    code of (token slot t, head h, dim d) at ((t * Hkv) + h) * D + d          (row-major codes)
    scale of (t, h)                     at 64 * Hkv * D + ((t * Hkv) + h) * 4

value = decode(code) * scale. The scale is per token-head: the token's K (or V) over the head's D
dims after norm + RoPE as the bf16 pool would hold them, amax / QMAX; the code is x / scale
plus +0 (fp32 division; +0 makes a -0 +0) rounded to nearest-even (fp8: e4m3, saturated at +-448; int8: clamped to
+-127). A token-head whose values are all zero gets scale 0 and codes 0. Per token-head scales
are known the moment a token is written (decode writes one token at a time), so no code ever
needs re-quantising when a later token of the same page arrives.
"""

from __future__ import annotations

import numpy as np

PAGE = 64
FORMATS = ("bf16", "fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
SCALE_BYTES = 4  # one fp32 scale per (token, KV head)
# The divisor's floor: the smallest fp32. A non-zero bf16 amax over QMAX is never below it, so
# it only replaces a zero scale (whose values are zeros, quantised to code 0).
TINY = float(np.float32(2.0 ** -149))


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"KV format {fmt!r} is not one of {', '.join(FORMATS)}")
    return fmt


def page_bytes(fmt: str, kv_heads: int, head_dim: int) -> int:
    """Bytes of one page (64 tokens) of one layer's K pool (the V pool's are the same)."""
    if check_format(fmt) == "bf16":
        return PAGE * kv_heads * head_dim * 2
    return PAGE * kv_heads * (head_dim + SCALE_BYTES)


def token_head_bytes(fmt: str, head_dim: int) -> int:
    """Bytes per token and KV head, K and V together (D = 256: bf16 1024, fp8 / int8 520)."""
    return 2 * page_bytes(fmt, 1, head_dim) // PAGE


def scale_offset(kv_heads: int, head_dim: int) -> int:
    """Byte offset of the scales inside a page of a quantised format."""
    return PAGE * kv_heads * head_dim


# --------------------------------------------------------------------------- e4m3 (OCP, "fn")

# Every non-negative finite e4m3 value, indexed by its code 0x00 .. 0x7E (0x7F is NaN).
_E4M3 = np.array([(c & 7) / 8.0 * 2.0 ** -6 if c >> 3 == 0 else (1.0 + (c & 7) / 8.0) * 2.0 ** ((c >> 3) - 7)
                  for c in range(0x7F)])


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """e4m3fn codes (uint8) -> float64 values (0x7F / 0xFF are NaN)."""
    c = np.asarray(codes, np.uint8)
    mag = _E4M3[np.minimum(c & 0x7F, 0x7E)]
    return np.where((c & 0x7F) == 0x7F, np.nan, np.where(c & 0x80, -mag, mag))


def e4m3_encode(y: np.ndarray) -> np.ndarray:
    """float32 values -> e4m3fn codes, rounded to nearest with ties to the even code and
    saturated at +-448 (PTX `cvt.rn.satfinite.e4m3x2.f32`); the sign of a zero is kept."""
    y = np.asarray(y, np.float32)
    if np.isnan(y).any():
        raise ValueError("e4m3_encode: NaN input")
    a = np.minimum(np.abs(y), np.float32(_E4M3[-1]))
    # On the fp32 bits (a table search over float64 was most of the time of a test's pools): from
    # 2^-6 up the codes are fp32's exponent and top 3 mantissa bits, rounded to nearest even on
    # the dropped 20 bits (a carry steps the exponent) and rebased (fp32 bias 127, e4m3 bias 7);
    # below 2^-6 (where `normal` wraps, unused) the subnormal codes are the multiples of 2^-9
    # (a * 512 is exact, rint ties to even).
    u = a.view(np.uint32)
    normal = ((u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)) - np.uint32(120 << 3)
    code = np.where(a < np.float32(2.0 ** -6), np.rint(a * np.float32(512.0)).astype(np.uint32), normal)
    return code.astype(np.uint8) | (np.signbit(y).view(np.uint8) << np.uint8(7))


# --------------------------------------------------------------------------- quantise


def quantise(x: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [..., D], scales float32 [...]) of bf16-valued x [..., D], one scale per
    row of D values, the way the prep kernel writes them (fp32 arithmetic throughout)."""
    if check_format(fmt) == "bf16":
        raise ValueError("quantise: bf16 KV is stored as it is")
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = (amax / np.float32(QMAX[fmt])).astype(np.float32)
    den = np.maximum(scale, np.float32(TINY))
    # + 0 turns -0 into +0 (the kernel adds +0 after its division too).
    y = ((x / den[..., None]).astype(np.float32) + np.float32(0.0)).astype(np.float32)
    if fmt == "fp8":
        codes = e4m3_encode(y)
    else:
        codes = np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
    return codes, scale


def dequantise(codes: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """float64 values code * scale of codes [..., D] and scales [...]."""
    if check_format(fmt) == "bf16":
        raise ValueError("dequantise: bf16 KV is stored as it is")
    c = np.asarray(codes, np.uint8)
    values = e4m3_decode(c) if fmt == "fp8" else c.view(np.int8).astype(np.float64)
    return values * np.asarray(scales, np.float64)[..., None]


def pack_pages(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The pool bytes (uint8 [NP * PB]) of codes [NP * 64, Hkv, D] and scales [NP * 64, Hkv]."""
    rows, hkv, d = codes.shape
    if rows % PAGE or scales.shape != (rows, hkv):
        raise ValueError(f"pack_pages: codes {codes.shape} and scales {scales.shape} are not whole pages")
    pages = rows // PAGE
    c = np.asarray(codes, np.uint8).reshape(pages, PAGE * hkv * d)
    s = np.asarray(scales, np.float32).reshape(pages, PAGE * hkv).view(np.uint8)
    return np.concatenate([c, s], axis=1).reshape(-1)


def unpack_pages(pool: np.ndarray, kv_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes [NP * 64, Hkv, D] uint8, scales [NP * 64, Hkv] float32) of pool bytes."""
    pb = PAGE * kv_heads * (head_dim + SCALE_BYTES)
    raw = np.asarray(pool, np.uint8)
    if raw.size % pb:
        raise ValueError(f"unpack_pages: {raw.size} bytes are not whole pages of {pb}")
    raw = raw.reshape(-1, pb)
    split = scale_offset(kv_heads, head_dim)
    codes = raw[:, :split].reshape(-1, kv_heads, head_dim)
    scales = np.ascontiguousarray(raw[:, split:]).view(np.float32).reshape(-1, kv_heads)
    return codes, scales
