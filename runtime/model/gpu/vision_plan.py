"""The host side of one GPU vision-tower call (`vision.GpuVisionTower`): what depends only on the
grid, computed in NumPy and uploaded with the patches.

For an image or video of grid (t, h, w) patches (merge-window order per frame, as
`runtime.media.image` cuts them), a batch of such items encoded in one call gets:

- `pos_idx`, `pos_wts`: each patch's 4 bilinear corners in the learned position table and their
  weights (align_corners, as `vision_reference.resampled_positions`), `[N, 4]` int32 / fp32: the
  `vision_pos` kernel blends the table rows on the device into the rows the patch embedding is
  added onto (8 numbers a patch cross the bus, not a row of W: at 16 MP the resampled rows would
  be 150 MB, and computing them on the host took seconds);
- `cos`, `sin`: the 2-D rotary tables `[N, D/2]` fp32 (row frequencies, then column frequencies;
  the kernel uses entry i for dims i and i + D/2, the rotate-half pairing);
- `cu`: the attention groups cu_seqlens style, one group per frame (`[G + 1]` int32);
- `merged`: each item's merged-token row range in the output.

The patch order is `vision_reference.window_order_rows_cols`, so the GPU tower and the NumPy tower
place and rotate every patch the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from runtime.model.vision_reference import VisionConfig, bilinear_axis, window_order_rows_cols


@dataclass(frozen=True)
class VisionPlan:
    """One call's per-patch tables (see the module docstring); rows = N patches in item order."""

    rows: int
    pos_idx: np.ndarray    # int32 [N, 4]: table rows of the corners (r0 c0, r0 c1, r1 c0, r1 c1)
    pos_wts: np.ndarray    # float32 [N, 4]: their bilinear weights
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


def rotary_tables(config: VisionConfig, rows: np.ndarray, cols: np.ndarray, grid_h: int, grid_w: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n, D/2] float32: D/4 row frequencies, then the same D/4 of the column (angles in
    float64, as `VisionTower._rotary`). Taken per distinct row and column, then gathered: a
    16 MP image has 65,536 patches but 256 rows and 256 columns."""
    quarter = config.head_dim // 2
    inv_freq = config.rope_theta ** (-np.arange(0, quarter, 2, dtype=np.float64) / quarter)
    by_row = np.arange(grid_h)[:, None] * inv_freq
    by_col = np.arange(grid_w)[:, None] * inv_freq
    cos = np.concatenate([np.cos(by_row)[rows], np.cos(by_col)[cols]], axis=-1).astype(np.float32)
    sin = np.concatenate([np.sin(by_row)[rows], np.sin(by_col)[cols]], axis=-1).astype(np.float32)
    return cos, sin


def position_corners(side: int, rows: np.ndarray, cols: np.ndarray, grid_h: int, grid_w: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(corner table rows [n, 4] int32, weights [n, 4] float32) of patches at (rows, cols) of a
    grid_h x grid_w grid over a side x side table, align_corners (`resampled_positions`)."""
    r0, r1, fr = bilinear_axis(rows, grid_h, side)
    c0, c1, fc = bilinear_axis(cols, grid_w, side)
    idx = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=1)
    wts = np.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], axis=1)
    return idx.astype(np.int32), wts.astype(np.float32)


def check_grid(config: VisionConfig, grid: Sequence[int]) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in grid)
    m = config.spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(f"grid {t, h, w} is empty or not a multiple of the merge size {m}")
    return t, h, w


def plan_items(config: VisionConfig, grids: Sequence[Sequence[int]]) -> VisionPlan:
    """The tables for items of these grids encoded together."""
    if not grids:
        raise ValueError("a vision call needs at least one item")
    side = math.isqrt(config.num_position_embeddings)
    idx, wts, cos, sin, bounds, merged = [], [], [], [], [0], []
    merge2 = config.spatial_merge_size ** 2
    out_row = 0
    for grid in grids:
        t, h, w = check_grid(config, grid)
        rows, cols = window_order_rows_cols(h, w, config.spatial_merge_size)
        corners, weights = position_corners(side, rows, cols, h, w)
        idx.append(np.tile(corners, (t, 1)))
        wts.append(np.tile(weights, (t, 1)))
        item_cos, item_sin = rotary_tables(config, rows, cols, h, w)
        cos.append(np.tile(item_cos, (t, 1)))
        sin.append(np.tile(item_sin, (t, 1)))
        bounds += [bounds[-1] + (f + 1) * h * w for f in range(t)]
        merged.append((out_row, out_row + t * h * w // merge2))
        out_row = merged[-1][1]
    return VisionPlan(rows=bounds[-1], pos_idx=np.concatenate(idx), pos_wts=np.concatenate(wts),
                      cos=np.concatenate(cos), sin=np.concatenate(sin),
                      cu=np.asarray(bounds, np.int32), merged=tuple(merged))
