"""bfloat16 in NumPy (which has no bf16 dtype): values travel as uint16 bit patterns.

Used by the references, the GPU tests and the benchmarks. Rounding is round-to-nearest-even,
the same as the GPU's `cvt.rn.bf16.f32`; NaN stays NaN.
"""

from __future__ import annotations

import numpy as np

__all__ = ["to_bits", "from_bits", "round_bf16"]


def to_bits(x: np.ndarray) -> np.ndarray:
    """float32 (or anything castable) -> bf16 bit patterns as uint16, rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def from_bits(b: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 values (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, returned as float32."""
    return from_bits(to_bits(x))
