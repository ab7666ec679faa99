"""Block bootstrap intervals.

Requests of one run are not independent (a slow turn delays the turns after it, one large
prompt evicts the next one's cache), so rows are resampled in blocks of consecutive rows (by
send time) rather than one by one. A statistic is a function of an index array into the rows,
so the same resampled indices serve every metric of an arm and can be applied to two arms at
once (a paired interval for a change: the arms ran the same plan, request for request).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
MIN_BLOCKS = 5  # fewer blocks than this give no interval: it would claim more than it knows

Statistic = Callable[[np.ndarray], float]


class Resamples:
    """`count` block-bootstrap samples of n rows: as many blocks as the data has, drawn with
    replacement and concatenated (the last block may be shorter). Empty below MIN_BLOCKS."""

    def __init__(self, n: int, block: int = 10, count: int = RESAMPLES, seed: int = 0):
        self.n = n
        blocks = -(-n // block)
        self.indices: list[np.ndarray] = []
        if blocks >= MIN_BLOCKS:
            chosen = np.random.default_rng(seed).integers(0, blocks, size=(count, blocks))
            rows = (chosen[:, :, None] * block + np.arange(block)).reshape(count, -1)
            self.indices = [row[row < n] for row in rows]

    def interval(self, statistic: Statistic, level: float = LEVEL
                 ) -> Optional[tuple[float, float]]:
        """Percentile interval of `statistic`; None without samples or finite values."""
        return _percentiles([statistic(i) for i in self.indices], level)


def independent_interval(a: Resamples, stat_a: Statistic, b: Resamples, stat_b: Statistic,
                         combine: Callable[[float, float], float], level: float = LEVEL
                         ) -> Optional[tuple[float, float]]:
    """Interval of combine(stat_a, stat_b) when the two samples are not paired row by row
    (decode segments of two arms): each side resampled on its own."""
    if not a.indices or not b.indices:
        return None
    return _percentiles([combine(stat_a(i), stat_b(j)) for i, j in zip(a.indices, b.indices)],
                        level)


def _percentiles(values: list[float], level: float) -> Optional[tuple[float, float]]:
    finite = np.array(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if len(finite) == 0:
        return None
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high)
