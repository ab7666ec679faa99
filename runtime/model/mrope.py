"""Qwen3.5's multimodal RoPE positions (qwen-arch sections 2.4 and 4).

Every token has three positions (t, h, w). Text tokens have t = h = w = their text position, so
a prompt without media is plain 1-D RoPE at the KV position. A media block of merged grid
t' x h' x w' whose first pad sits at text position p gets T = p + frame, H = p + row,
W = p + col; the text after it resumes at p + max(h', w'), so every later token's rotary
position is its KV position plus a fixed delta (negative for blocks larger than their extent).

`MediaSpan` (the runner contract) gives each block's KV offset and patch grid; these functions
need nothing else, so a chunk, a decode row or a replay computes its positions alone.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from runtime.model.runner import MediaSpan


def span_layout(span: MediaSpan, merge: int) -> tuple[int, int, int]:
    """(tokens, merged rows x cols per frame, extent) of one media block."""
    t, h, w = span.grid
    rows, cols = h // merge, w // merge
    return t * rows * cols, rows * cols, max(rows, cols)


def mrope_positions(positions: np.ndarray, media: Sequence[MediaSpan], merge: int) -> np.ndarray:
    """KV positions [...] -> rotary positions [3, ...] (t, h, w) given the sequence's media."""
    positions = np.asarray(positions, dtype=np.int64)
    out = np.broadcast_to(positions, (3, *positions.shape)).copy()
    shift = 0                       # rotary minus KV position for tokens after the last block
    for span in sorted(media, key=lambda s: s.offset):
        tokens, per_frame, extent = span_layout(span, merge)
        cols = span.grid[2] // merge
        base = span.offset + shift
        inside = (positions >= span.offset) & (positions < span.offset + tokens)
        k = positions[inside] - span.offset
        out[0][inside] = base + k // per_frame
        out[1][inside] = base + (k % per_frame) // cols
        out[2][inside] = base + k % cols
        shift += extent - tokens
        after = positions >= span.offset + tokens
        out[:, after] = positions[after] + shift
    return out


def mrope_cos_sin(positions3: np.ndarray, rotary_dim: int, theta: float,
                  section: Sequence[int], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [..., rotary_dim/2] where frequency i takes its angle from axis H if
    i % 3 == 1 and i < 3 * section[1], W if i % 3 == 2 and i < 3 * section[2], else T
    (the interleaved layout), computed in float64 like `reference_layers.rope_cos_sin`."""
    half = rotary_dim // 2
    index = np.arange(half)
    axis = np.zeros(half, dtype=np.int64)
    axis[(index % 3 == 1) & (index < 3 * section[1])] = 1
    axis[(index % 3 == 2) & (index < 3 * section[2])] = 2
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    chosen = np.moveaxis(np.asarray(positions3, dtype=np.float64), 0, -1)[..., axis]  # [..., half]
    angles = chosen * inv_freq
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
