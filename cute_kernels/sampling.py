"""Sampling on the GPU: logits rows -> token ids, deciding exactly as the host sampler does.

Two launches per step; the contract (hash, `RowSampling`, the cap of 20 candidates, `DEAD_END`)
is `runtime.model.sampling`, and the semantics are those of `runtime.engine.sampler`:

1. mask: ids the row's bitmask disallows become -inf (NaN logits too: a NaN never wins);
2. greedy rows: the argmax of the masked logits, lowest id on ties; nothing below applies;
3. penalties: `logit[id] = float32(logit) - float32(delta)` for the row's penalty entries;
4. the top k (1..20) by (value desc, id asc), -inf dropped; none left: `DEAD_END`;
5. `z = value / temperature`, minus `z[0]`, exp, normalise (float64 on the host; the kernel
   takes `exp((value - value[0]) / temperature)` in fp32);
6. top-p (only when top_p < 1): keep up to the first index whose cumulative sum reaches
   `top_p - 1e-9`; 7. min-p (only when min_p > 0): keep probabilities >= `min_p * p[0]`;
8. renormalise; 9. the index is the number of cumulative probabilities <= u, clamped to the last
   candidate, with `u = draw_uniform(seed, draw_index)` computed on the GPU from the seed key.

Kernels (their CuTe DSL code is cute_kernels/sampling_kernels.py):

- `candidates`: grid (C, R), C = 64 CTAs of 256 threads per row. CTA c owns the slice
  `[c * span, min((c + 1) * span, V))`, span = cdiv(V, C) <= 4096 (so V <= 262144). The slice is
  loaded as fp32 into shared memory (16 KB) with the mask applied, the penalty entries whose id
  falls in the slice are subtracted (the block strides over the row's entries; ids are distinct,
  so no two threads touch one element), then each thread holds its 16 strided elements in
  registers. Each warp extracts its top 20 with 20 rounds of a butterfly argmax over
  (value desc, id asc) in which the winning lane retires its element and rescans; warp 0 merges
  the 8 warps' lists the same way and writes the CTA's 20 best, sorted, with unused slots
  `-inf` / `NO_ID`. Fixed reduction order, no atomics: deterministic.
- `pick`: grid (R,), 128 threads: the same two-level selection over the row's C x 20 candidates
  gives the row's top 20, then thread 0 runs steps 4-9 in fp32 and writes the id (or `DEAD_END`).

The float64 host and the fp32 kernel agree on every decision except when a draw or a cut lies
within float rounding of its threshold; `runtime.model.sampling.decide` reports that distance
(`RowDraw.margin`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.model.sampling import (
    DRAW_SALT,
    ROW_F32,
    ROW_I32,
    TOP_K_CAP,
    RowSampling,
    decide,
    fill_row,
    masked_scores,
    mix32,
    top_ids,
)

from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "sampling"
CONTRACT = "runtime/model/sampling.py"  # hash constants and row layout are compiled in: a source
CTAS_PER_ROW = 64  # C: CTAs per row in `candidates` (~3.9K ids each at V = 248320)
CAND_THREADS = 256
PER_THREAD = 16  # elements a `candidates` thread holds
SLICE_CAP = CAND_THREADS * PER_THREAD  # most ids one CTA owns
MAX_VOCAB = CTAS_PER_ROW * SLICE_CAP  # 262144
PICK_THREADS = 128
NO_ID = 0x7FFFFFFF  # the id of an unused candidate slot (its value is -inf)


def _candidates_variant() -> Variant:
    c, k = CTAS_PER_ROW, TOP_K_CAP
    return Variant(
        family=FAMILY,
        key="candidates",
        config={"kind": "candidates", "C": c, "K": k, "threads": CAND_THREADS, "per_thread": PER_THREAD},
        params=[ptr("logits"), ptr("bitmask"), ptr("row_i32"), ptr("pen_ids"), ptr("pen_delta"),
                ptr("cand_val"), ptr("cand_id"), i32("R"), i32("V")],
        tensors={
            "logits": tensor("bf16", "R", "V"),
            "bitmask": tensor("i32", "R", "cdiv(V, 32)"),
            "row_i32": tensor("i32", "R", ROW_I32),
            # All rows' penalty entries back to back; the kernel reads row r's [pen_start,
            # pen_end) only, so the length is not a launch size (no entries: a 4-byte dummy).
            "pen_ids": tensor("i32", 1),
            "pen_delta": tensor("f32", 1),
            "cand_val": tensor("f32", "R", c, k, role="out"),
            "cand_id": tensor("i32", "R", c, k, role="out"),
        },
        sizes=("R", "V"),
        block=(CAND_THREADS, 1, 1),
        grid=(c, "R", 1),
        requires=("R >= 1", "R <= 65535", "V >= 1", f"V <= {MAX_VOCAB}"),
        arches=ALL_ARCHES,
        extra_sources=(CONTRACT,),
        note=f"sampling step 1: mask, penalties, the top {k} of each of {c} slices of a row",
        example_sizes={"R": 8, "V": 248320},
    )


def _pick_variant() -> Variant:
    c, k = CTAS_PER_ROW, TOP_K_CAP
    return Variant(
        family=FAMILY,
        key="pick",
        config={"kind": "pick", "C": c, "K": k, "threads": PICK_THREADS},
        params=[ptr("cand_val"), ptr("cand_id"), ptr("row_i32"), ptr("row_f32"), ptr("ids"), i32("R")],
        tensors={
            "cand_val": tensor("f32", "R", c, k),
            "cand_id": tensor("i32", "R", c, k),
            "row_i32": tensor("i32", "R", ROW_I32),
            "row_f32": tensor("f32", "R", ROW_F32),
            "ids": tensor("i32", "R", role="out"),
        },
        sizes=("R",),
        block=(PICK_THREADS, 1, 1),
        grid=("R", 1, 1),
        requires=("R >= 1",),
        arches=ALL_ARCHES,
        extra_sources=(CONTRACT,),
        note=f"sampling step 2: merge {c} x {k} candidates, top-k/p/min-p, seeded draw",
        example_sizes={"R": 8},
    )


def variants() -> list[Variant]:
    if (CTAS_PER_ROW * TOP_K_CAP) % PICK_THREADS or CAND_THREADS % 32 or PICK_THREADS % 32:
        raise ValueError("sampling: the candidate lists do not split evenly over the pick threads")
    return [_candidates_variant(), _pick_variant()]


# --------------------------------------------------------------------------- host side


@dataclass
class PackedRows:
    """`RowSampling`s in the kernels' buffer layout (what a runner uploads each step)."""

    row_i32: np.ndarray  # int32 [R, 8]
    row_f32: np.ndarray  # float32 [R, 4]
    bitmask: np.ndarray  # int32 [R, cdiv(V, 32)]; rows without a constraint are all zero, unread
    pen_ids: np.ndarray  # int32 [max(P, 1)], P = all rows' penalty entries
    pen_delta: np.ndarray  # float32 [max(P, 1)]
    num_penalties: int  # P


def pack_rows(rows: Sequence[RowSampling], vocab: int) -> PackedRows:
    """The `row_i32`, `row_f32`, `bitmask` and penalty buffers for `rows` over a vocabulary."""
    words = -(-vocab // 32)
    r = len(rows)
    row_i32 = np.zeros((r, ROW_I32), np.int32)
    row_f32 = np.zeros((r, ROW_F32), np.float32)
    bitmask = np.zeros((r, words), np.int32)
    pen_ids, pen_delta = [], []
    start = 0
    for i, row in enumerate(rows):
        n = fill_row(row, row_i32[i], row_f32[i], start)
        if row.bitmask is not None:
            bitmask[i] = np.asarray(row.bitmask, np.uint32)[:words].view(np.int32)
        pen_ids.append(np.asarray(row.penalty_ids, np.int32))
        pen_delta.append(np.asarray(row.penalty_deltas, np.float32))
        start += n
    ids = np.concatenate(pen_ids) if start else np.zeros(1, np.int32)
    delta = np.concatenate(pen_delta) if start else np.zeros(1, np.float32)
    return PackedRows(row_i32, row_f32, bitmask, ids, delta, start)


def reference(logits: np.ndarray, rows: Sequence[RowSampling]) -> np.ndarray:
    """int32 [R]: each row's token id (DEAD_END where nothing is allowed), as the host sampler
    decides it (`runtime.model.sampling.decide`). `logits`: float [R, V]."""
    return np.array([decide(logits[i], row).token for i, row in enumerate(rows)], np.int32)


def reference_candidates(logits: np.ndarray, rows: Sequence[RowSampling],
                         ctas: int = CTAS_PER_ROW) -> tuple[np.ndarray, np.ndarray]:
    """What `candidates` writes: (cand_val float32 [R, C, 20], cand_id int32 [R, C, 20])."""
    r, vocab = logits.shape
    span = -(-vocab // ctas)
    vals = np.full((r, ctas, TOP_K_CAP), -np.inf, np.float32)
    cids = np.full((r, ctas, TOP_K_CAP), NO_ID, np.int32)
    for i, row in enumerate(rows):
        x = masked_scores(logits[i], row)
        for c in range(ctas):
            lo, hi = c * span, min((c + 1) * span, vocab)
            if lo >= hi:
                continue
            ids = top_ids(x[lo:hi], TOP_K_CAP)
            vals[i, c, :ids.shape[0]] = x[lo + ids]
            cids[i, c, :ids.shape[0]] = lo + ids
    return vals, cids


def draw_uniform_from_key(key: int, index: int) -> float:
    """`draw_uniform` from the stored seed key, step by step as the kernel computes it."""
    h = mix32((key & 0xFFFFFFFF) ^ mix32((index + DRAW_SALT) & 0xFFFFFFFF))
    return (h >> 8) * 2.0 ** -24


# --------------------------------------------------------------------------- kernels


def build(variant: Variant) -> tuple[Any, list[Any]]:
    """The kernels and their launchers: the CuTe DSL code is in cute_kernels/sampling_kernels.py."""
    from . import sampling_kernels

    return sampling_kernels.build(variant)
