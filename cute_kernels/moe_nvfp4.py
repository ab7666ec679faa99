"""NumPy references of the `moe` family's NVFP4 expert kernels (`up_nvfp4`, `down_nvfp4`:
cute_kernels/moe_nvfp4_kernels.py, whose docstring states the rounding model).

A stack is stored as `weights.Slot` keeps an `nvfp4` slot: packed e2m1 codes [rows, K / 2], e4m3
block-scale codes [rows, K / 16] (uint8) and fp32 globals [rows] (each expert tensor's global
repeated over its rows). Gate/up stacks hold per expert 2I rows (gate rows, then up rows), down
stacks H rows; the shared expert is expert E.
"""

from __future__ import annotations

import numpy as np

from .bf16 import round_bf16
from .gemv_fp8 import e4m3_values
from .gemv_nvfp4 import GROUP, e2m1_values

# `nvfp4_values`'s decodes as tables: a packed byte's two values (low nibble first) and an e4m3
# scale code's value. Indexing them gives the same float64 values in one pass over the codes.
_E2M1_PAIRS = e2m1_values(np.arange(256, dtype=np.uint8)[:, None])  # [256, 2]
_E4M3 = e4m3_values(np.arange(256, dtype=np.uint8))


def expert_rows(codes: np.ndarray, scales: np.ndarray, gscale: np.ndarray, expert: int, per_expert: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(code x block scale as float64 [per_expert, K], exact; the rows' fp32 globals) of one expert."""
    rows = slice(expert * per_expert, (expert + 1) * per_expert)
    values = np.take(_E2M1_PAIRS, codes[rows], axis=0).reshape(per_expert, -1, GROUP)  # [rows, K / 16, 16]
    scaled = (values * np.take(_E4M3, scales[rows])[..., None]).reshape(per_expert, -1)
    return scaled, np.asarray(gscale[rows], np.float32)


def dequantise(codes: np.ndarray, scales: np.ndarray, gscale: np.ndarray, per_expert: int,
               experts: np.ndarray) -> np.ndarray:
    """float64 weights [len(experts), per_expert, K] of the given experts: code x scale x global,
    exact (2 + 4 + 24 significand bits)."""
    out = []
    for ex in experts:
        scaled, g = expert_rows(codes, scales, gscale, int(ex), per_expert)
        out.append(scaled * g.astype(np.float64)[:, None])
    return np.stack(out)


def reference_up(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, gscale: np.ndarray, ids: np.ndarray,
                 inter: int) -> np.ndarray:
    """act [M, P, I] as `up_nvfp4` rounds: g and u the fp32 dot products of x and the exactly
    scaled weights times the row's fp32 global, rounded to bf16; act = bf16(bf16(silu(g)) * u)."""
    out = np.empty((*ids.shape, inter), np.float32)
    for expert in np.unique(ids):  # each expert decoded once, for all its slots
        scaled, g_rows = expert_rows(codes, scales, gscale, int(expert), 2 * inter)
        w = scaled.astype(np.float32)
        for r, s in zip(*np.nonzero(ids == expert)):
            dot = np.matmul(w, x[r].astype(np.float32), dtype=np.float32)
            gu = round_bf16((dot * g_rows).astype(np.float32))
            g, u = gu[:inter], gu[inter:]
            out[r, s] = round_bf16(round_bf16(g / (1.0 + np.exp(-g))) * u)
    return out


def reference_down(act: np.ndarray, codes: np.ndarray, scales: np.ndarray, gscale: np.ndarray, ids: np.ndarray,
                   wts: np.ndarray, h: int) -> np.ndarray:
    """Delta rows [M, H] as `down_nvfp4` rounds: per slot (in order) the fp32 dot products of act
    and the exactly scaled weights times the rows' globals, times the routing weight, summed in
    fp32 and rounded once to bf16."""
    terms = np.empty((*ids.shape, h), np.float32)
    for expert in np.unique(ids):  # each expert decoded once, for all its slots
        scaled, g_rows = expert_rows(codes, scales, gscale, int(expert), h)
        w = scaled.astype(np.float32)
        for r, s in zip(*np.nonzero(ids == expert)):
            dot = np.matmul(w, act[r, s].astype(np.float32), dtype=np.float32)
            terms[r, s] = np.float32(wts[r, s]) * (dot * g_rows)
    out = np.zeros((ids.shape[0], h), np.float32)
    for s in range(ids.shape[1]):  # the slots summed in order, in fp32
        out += terms[:, s]
    return round_bf16(out)
