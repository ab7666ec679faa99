"""The host side of one GPU vision-tower call (`vision.GpuVisionTower`): what depends only on the
grid, computed in NumPy and uploaded with the patches.

For an image or video of grid (t, h, w) patches (merge-window order per frame, as
`runtime.media.image` cuts them), a batch of such items encoded in one call gets:

- `pos`: the learned position embedding resampled to each item's grid, tiled over its frames,
  as the rows the patch embedding is added onto (bf16 bits, `[N, W]`);
- `cos`, `sin`: the 2-D rotary tables `[N, D/2]` fp32 (row frequencies, then column frequencies;
  the kernel uses entry i for dims i and i + D/2, the rotate-half pairing);
- `cu`: the attention groups cu_seqlens style, one group per frame (`[G + 1]` int32);
- `merged`: each item's merged-token row range in the output.

The maths is `vision_reference`'s (`window_order_rows_cols`, `resampled_positions`), so the GPU
tower and the NumPy tower place and rotate every patch the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from runtime.artifact.formats import f32_to_bf16
from runtime.model.vision_reference import VisionConfig, resampled_positions, window_order_rows_cols


@dataclass(frozen=True)
class VisionPlan:
    """One call's per-patch tables (see the module docstring); rows = N patches in item order."""

    rows: int
    pos: np.ndarray        # uint16 bf16 bits [N, W]
    cos: np.ndarray        # float32 [N, D/2]
    sin: np.ndarray        # float32 [N, D/2]
    cu: np.ndarray         # int32 [G + 1]
    merged: tuple[tuple[int, int], ...]   # per item: [start, stop) rows of the merged output

    @property
    def groups(self) -> int:
        return len(self.cu) - 1

    @property
    def longest(self) -> int:
        """The longest group (the attention grid's query extent)."""
        return int(np.max(np.diff(self.cu)))


def rotary_angles(config: VisionConfig, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """[n, D/2] float64: D/4 row frequencies, then the same D/4 of the column."""
    quarter = config.head_dim // 2
    inv_freq = config.rope_theta ** (-np.arange(0, quarter, 2, dtype=np.float64) / quarter)
    return np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)


def check_grid(config: VisionConfig, grid: Sequence[int]) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in grid)
    m = config.spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(f"grid {t, h, w} is empty or not a multiple of the merge size {m}")
    return t, h, w


def plan_items(config: VisionConfig, pos_table: np.ndarray, grids: Sequence[Sequence[int]]) -> VisionPlan:
    """The tables for items of these grids encoded together; pos_table: the float32
    `pos_embed.weight` [side*side, W] (the host keeps a copy, it is small)."""
    if not grids:
        raise ValueError("a vision call needs at least one item")
    pos, cos, sin, bounds, merged = [], [], [], [0], []
    merge2 = config.spatial_merge_size ** 2
    out_row = 0
    for grid in grids:
        t, h, w = check_grid(config, grid)
        rows, cols = window_order_rows_cols(h, w, config.spatial_merge_size)
        pos.append(np.tile(resampled_positions(pos_table, rows, cols, h, w), (t, 1)))
        angles = np.tile(rotary_angles(config, rows, cols), (t, 1))
        cos.append(np.cos(angles).astype(np.float32))
        sin.append(np.sin(angles).astype(np.float32))
        bounds += [bounds[-1] + (f + 1) * h * w for f in range(t)]
        merged.append((out_row, out_row + t * h * w // merge2))
        out_row = merged[-1][1]
    return VisionPlan(rows=bounds[-1], pos=f32_to_bf16(np.concatenate(pos).astype(np.float32)),
                      cos=np.concatenate(cos), sin=np.concatenate(sin),
                      cu=np.asarray(bounds, np.int32), merged=tuple(merged))
