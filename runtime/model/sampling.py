"""The sampling contract shared by the host sampler, the GPU sampling kernels and their reference.

A runner that samples on its device (`CudaRunner.decode_sampled`) must pick exactly the token the
host sampler (`runtime.engine.sampler.sample_token`) picks from the same logits, so a request
gives the same output whichever path served a step, and after a preemption and replay. What
makes that possible lives here:

- `draw_uniform(seed, index)`: the request's `index`-th uniform draw is a pure function of its
  seed and the draw counter (a counter-based generator, not a stateful one), cheap in 32-bit
  integer arithmetic on a GPU thread and in NumPy alike;
- `RowSampling`: everything one row's draw depends on, resolved on the host (penalties as
  per-token deltas, the constraint as a packed bitmask), in the form the kernels read;
- `decide(logits, row)`: the decision itself, in float64, which the host sampler runs and the GPU
  kernels are tested against.

The integer hash is "lowbias32" (Chris Wellons' published constants): a bijection on 32-bit
words with low avalanche bias. Mixing in the seed's two halves and the index through it gives
well-spread 24-bit uniforms; a draw is `(h >> 8) * 2**-24`, in [0, 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

TOP_K_CAP = 20
"""Most candidates any draw considers (top-k is 1..20; the command line's 0 means 20)."""

GREEDY_TEMPERATURE = 1e-5
"""At or below: greedy (division by the temperature would overflow)."""

_MASK32 = 0xFFFFFFFF
SEED_SALT = 0x9E3779B9
DRAW_SALT = 0x6A09E667


def mix32(x):
    """lowbias32 on uint32 (a Python int or a NumPy uint32 array)."""
    if isinstance(x, np.ndarray):
        x = x.astype(np.uint32)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
        return x
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def seed_key(seed: int) -> int:
    """The 32-bit key of a 64-bit seed (computed once per request, on the host)."""
    seed &= (1 << 64) - 1
    return mix32((seed & _MASK32) ^ mix32((seed >> 32) ^ SEED_SALT))


def draw_bits(key: int, index: int) -> int:
    """The 32-bit hash behind draw `index` of the request with seed key `key`."""
    return mix32(key ^ mix32((index + DRAW_SALT) & _MASK32))


def draw_uniform(seed: int, index: int) -> float:
    """The request's `index`-th uniform draw in [0, 1): a multiple of 2**-24."""
    return (draw_bits(seed_key(seed), index) >> 8) * 2.0 ** -24


@dataclass
class RowSampling:
    """One row's sampling inputs, resolved on the host.

    greedy: argmax (lowest id on ties) over the masked logits; nothing else applies.
    temperature, top_p, min_p: as in `SamplingParams` (temperature > GREEDY_TEMPERATURE).
    top_k: 1..TOP_K_CAP.
    seed: the request seed; draw_index: how many draws the request made before this one.
    penalty_ids / penalty_deltas: `logit[id] -= delta` before the cut (presence + frequency
        penalties of the request's output counts); distinct ids; empty when none apply.
    bitmask: the constraint's packed allowed-token mask (bit `i % 32` of word `i // 32` set =
        id `i` allowed; uint32 [ceil(V / 32)]), or None for no constraint.
    """

    greedy: bool
    temperature: float = 1.0
    top_k: int = TOP_K_CAP
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    draw_index: int = 0
    penalty_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    penalty_deltas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    bitmask: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        if not self.greedy:
            if not 1 <= self.top_k <= TOP_K_CAP:
                raise ValueError(f"top_k must be in 1..{TOP_K_CAP}, got {self.top_k}")
            if not self.temperature > GREEDY_TEMPERATURE:
                raise ValueError(f"temperature {self.temperature} is greedy; set greedy=True")
        if len(self.penalty_ids) != len(self.penalty_deltas):
            raise ValueError("penalty_ids and penalty_deltas differ in length")


DEAD_END = -1
"""The id a device sampler returns for a row whose constraint allows no token."""

def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """The packed form of a bool [V] allowed-token mask: uint32 [ceil(V / 32)], bit `i % 32` of
    word `i // 32` set for an allowed id `i` (the padding bits clear)."""
    allowed = np.asarray(allowed, bool)
    bits = np.zeros(-(-allowed.shape[0] // 32) * 32, bool)
    bits[:allowed.shape[0]] = allowed
    return np.packbits(bits, bitorder="little").view(np.uint32)


def unpack_mask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Bool [vocab_size] of a packed mask (the inverse of `pack_mask`)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, np.uint32).view(np.uint8), count=vocab_size,
                         bitorder="little")
    return bits.view(np.bool_)


TOP_P_SLACK = 1e-9
"""Tolerance on the top-p mass: p = 0.8 over {0.5, 0.3, ...} keeps two tokens despite rounding."""

SAMPLE_STRIDE = 64
"""Top-k pre-filter: every 64th score bounds the k-th largest from below (see `top_ids`)."""


def penalized(values: np.ndarray, ids: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """A float32 copy of `values` with `values[id] -= delta` (float32, as the GPU does)."""
    out = np.asarray(values, np.float32).copy()
    ids = np.asarray(ids, np.int64)
    keep = (ids >= 0) & (ids < out.shape[0])
    out[ids[keep]] -= np.asarray(deltas, np.float32)[keep]
    return out


def masked_scores(logits_row: np.ndarray, row: RowSampling) -> np.ndarray:
    """[V]: the row's logits (float32, or float64 when given float64) with NaN and disallowed
    ids at -inf, then, for a sampled row with penalties, those applied in float32 (a NaN a
    penalty produces counts as -inf too)."""
    x = np.array(logits_row, dtype=np.result_type(logits_row, np.float32))
    x[np.isnan(x)] = -np.inf
    if row.bitmask is not None:
        x[~unpack_mask(row.bitmask, x.shape[0])] = -np.inf
    if not row.greedy and len(row.penalty_ids):
        x = penalized(x, row.penalty_ids, row.penalty_deltas)
        x[np.isnan(x)] = -np.inf
    return x


def top_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest scores, ordered by (score desc, id asc); -inf ids are dropped.

    A full selection over 248k logits costs milliseconds, so the k-th largest value of a strided
    sample (a lower bound of the true k-th largest) first cuts the vocabulary down to the few
    ids that can be in the top k; ties are all kept, so the result is exact.
    """
    n = scores.shape[0]
    pool = None
    if n > SAMPLE_STRIDE * k * 4:
        sample = scores[::SAMPLE_STRIDE]
        threshold = np.partition(sample, sample.shape[0] - k)[sample.shape[0] - k]
        if threshold > -np.inf:
            pool = np.flatnonzero(scores >= threshold)
    if pool is None or pool.shape[0] > 16 * SAMPLE_STRIDE * k:
        pool = np.flatnonzero(scores > -np.inf)
        if pool.shape[0] > k:
            part = np.argpartition(-scores[pool], k - 1)[:k]
            kth = scores[pool[part]].min()
            pool = pool[scores[pool] >= kth]
    values = scores[pool]
    keep = values > -np.inf
    pool, values = pool[keep], values[keep]
    return pool[np.lexsort((pool, -values))[:k]]


@dataclass
class RowDraw:
    """One row's decision and how close it came to going another way.

    token: the id (or DEAD_END); ids / probs: the final candidates and their renormalised
    probabilities (float64; empty for greedy and dead ends); u: the draw (None when no draw);
    margin: the smallest distance of a quantity that decides from its threshold (the cumulative
    probabilities but the last from u, the top-p cumulative sums but the last from
    `top_p - TOP_P_SLACK`, the probabilities but the first from `min_p * p[0]`); inf when none
    does. A float32 computation (the GPU's) may decide differently only when the margin is of the
    order of its rounding.
    """

    token: int
    ids: np.ndarray
    probs: np.ndarray
    u: float | None
    margin: float


def _distance(values: np.ndarray, threshold: float) -> float:
    return float(np.abs(values - threshold).min()) if values.shape[0] else np.inf


def decide(logits_row: np.ndarray, row: RowSampling) -> RowDraw:
    """The row's token, in float64 on the host: the decision the host sampler takes and the GPU
    kernels reproduce. Order: mask, greedy argmax (lowest id on ties; nothing below applies),
    penalties, the top k by (score desc, id asc), softmax of score / temperature, top-p, min-p,
    renormalise, inverse CDF at `draw_uniform(seed, draw_index)`."""
    x = masked_scores(logits_row, row)
    ids = top_ids(x, 1 if row.greedy else row.top_k)
    return decide_candidates(ids, x[ids], row)


def decide_candidates(ids: np.ndarray, scores: np.ndarray, row: RowSampling) -> RowDraw:
    """`decide` from the row's candidates: its top k (1 when greedy) masked, penalised scores
    and their ids, ordered by (score desc, id asc), -inf dropped."""
    empty = np.zeros(0)
    if ids.shape[0] == 0:
        return RowDraw(DEAD_END, ids, empty, None, np.inf)
    if row.greedy:
        return RowDraw(int(ids[0]), ids, empty, None, np.inf)
    z = scores.astype(np.float64) / row.temperature
    z -= z[0]
    probs = np.exp(z)
    probs /= probs.sum()
    margin = np.inf
    if row.top_p < 1.0:
        cums = np.cumsum(probs)
        threshold = row.top_p - TOP_P_SLACK
        margin = min(margin, _distance(cums[:-1], threshold))  # reaching it only at the end: no cut
        cutoff = int(np.searchsorted(cums, threshold, side="left")) + 1
        ids, probs = ids[:cutoff], probs[:cutoff]
    if row.min_p > 0.0:
        threshold = row.min_p * probs[0]
        margin = min(margin, _distance(probs[1:], threshold))
        keep = probs >= threshold
        ids, probs = ids[keep], probs[keep]
    probs = probs / probs.sum()
    u = draw_uniform(row.seed, row.draw_index)
    cums = np.cumsum(probs)
    margin = min(margin, _distance(cums[:-1], u))  # past the last boundary: clamped to the last
    index = int(np.searchsorted(cums, u, side="right"))
    return RowDraw(int(ids[min(index, ids.shape[0] - 1)]), ids, probs, u, margin)


def shard_row(row: RowSampling, start: int, stop: int) -> RowSampling:
    """`row` as the rank holding vocabulary ids [start, stop) applies it to its logits: the
    constraint's bits of those ids, the penalties on them, at local ids."""
    keep = (row.penalty_ids >= start) & (row.penalty_ids < stop)
    bitmask = None
    if row.bitmask is not None:
        bitmask = pack_mask(unpack_mask(row.bitmask, stop)[start:stop])
    return dataclasses.replace(row, penalty_ids=row.penalty_ids[keep] - start,
                               penalty_deltas=row.penalty_deltas[keep], bitmask=bitmask)


def shard_candidates(logits_shard: np.ndarray, start: int, row: RowSampling
                     ) -> tuple[np.ndarray, np.ndarray]:
    """One rank's candidates for the vocabulary-parallel lm_head: the top k (1 when greedy) of
    its logits for ids [start, start + len), as global ids and their masked, penalised scores.
    What the GPU ranks would all-gather (k id/score pairs a row, a few hundred bytes)."""
    local = shard_row(row, start, start + logits_shard.shape[0])
    x = masked_scores(logits_shard, local)
    ids = top_ids(x, 1 if row.greedy else row.top_k)
    return ids + start, x[ids]


def decide_sharded(logits_shards: Sequence[np.ndarray], starts: Sequence[int], row: RowSampling
                   ) -> RowDraw:
    """`decide` over logits split by vocabulary (shard r holds ids [starts[r], ...)), equal to
    `decide` of their concatenation: every score depends on its own logit only (mask, penalty),
    so a shard's top k is its part of the global order; the global top k lies in the union of the
    shards' top k, and sorting that union by (score desc, id asc) gives exactly the global
    candidates, which then decide as `decide` does."""
    pairs = [shard_candidates(shard, start, row) for shard, start in zip(logits_shards, starts)]
    ids = np.concatenate([p[0] for p in pairs])
    scores = np.concatenate([p[1] for p in pairs])
    order = np.lexsort((ids, -scores))[:1 if row.greedy else row.top_k]
    return decide_candidates(ids[order], scores[order], row)


# The device sampler's per-row parameter blocks: row_i32 [R, ROW_I32] and row_f32 [R, ROW_F32].
GREEDY, TOP_K, SEED_KEY, DRAW_INDEX, USE_MASK, PEN_START, PEN_END = range(7)
ROW_I32 = 8
TEMPERATURE, TOP_P, MIN_P = range(3)
ROW_F32 = 4


def _int32_bits(value: int) -> int:
    """The int32 with the bits of `value` mod 2**32."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def fill_row(row: RowSampling, row_i32: np.ndarray, row_f32: np.ndarray, pen_start: int) -> int:
    """Write `row`'s parameters into one row of the blocks (its penalties go to entries
    [pen_start, pen_start + n) of the penalty lists, written by the caller); returns n. The seed
    key and the draw index travel as the int32 bits of their uint32 values."""
    n = len(row.penalty_ids)
    row_i32[:] = (int(row.greedy), row.top_k, _int32_bits(seed_key(row.seed)), _int32_bits(row.draw_index),
                  int(row.bitmask is not None), pen_start, pen_start + n, 0)
    row_f32[:] = (row.temperature, row.top_p, row.min_p, 0.0)
    return n
