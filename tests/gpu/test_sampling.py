"""The sampling kernels (`sampling/candidates` + `sampling/pick`) against `cute_kernels.sampling`.

Random bf16 logits with exact ties and a NaN, rows of every kind in one launch (greedy, greedy
under a mask, sampled with top-k 1/5/20, top-p 0.8/1, min-p 0/0.05, temperatures 0.6/1/1.5,
penalties, masks allowing a handful of ids, an all-disallowed row), poisoned outputs with one
element past the end that must stay untouched. The candidate lists must equal the reference
exactly (fp32 values and ids); the picked ids must equal the float64 reference except where a
draw or a cut lies within 1e-5 of its threshold, and such rows must be rare. A distribution test
draws one row 4000 times and checks the frequencies with a chi-square bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cute_kernels import sampling
from cute_kernels.bf16 import round_bf16
from runtime.model.sampling import DEAD_END, TOP_K_CAP, RowSampling, decide, pack_mask

pytestmark = pytest.mark.gpu

ID_POISON = 0x5A5A5A5A  # not an id and not DEAD_END
NEAR = 1e-5  # a row may differ from the float64 reference only this close to a threshold
TRIALS = 25
KINDS = ("greedy", "greedy_mask", "sampled", "penalised", "few_allowed", "dead", "sampled")


def _f32(mem, values: np.ndarray) -> int:
    return mem.i32(np.ascontiguousarray(values, np.float32).view(np.int32))


class Launch:
    """Device buffers of one (candidates, pick) pair for R rows over V ids, poisoned outputs."""

    def __init__(self, library, mem, logits: np.ndarray, rows: list[RowSampling]):
        self.mem, self.rows = mem, rows
        self.r, self.v = logits.shape
        self.n_cand = self.r * sampling.CTAS_PER_ROW * TOP_K_CAP
        packed = sampling.pack_rows(rows, self.v)
        self.cand_val = mem.poisoned(2 * (self.n_cand + 1))  # 0xFFFFFFFF: NaN as f32, -1 as i32
        self.cand_id = mem.poisoned(2 * (self.n_cand + 1))
        self.ids = mem.i32(np.full(self.r + 1, ID_POISON, np.int32))
        self.row_i32 = mem.i32(packed.row_i32)
        sizes = {"R": self.r, "V": self.v}
        self.candidates = library.kernel("sampling", "candidates").bind(
            {"logits": mem.bf16(logits), "bitmask": mem.i32(packed.bitmask), "row_i32": self.row_i32,
             "pen_ids": mem.i32(packed.pen_ids), "pen_delta": _f32(mem, packed.pen_delta),
             "cand_val": self.cand_val, "cand_id": self.cand_id}, sizes)
        self.pick = library.kernel("sampling", "pick").bind(
            {"cand_val": self.cand_val, "cand_id": self.cand_id, "row_i32": self.row_i32,
             "row_f32": _f32(mem, packed.row_f32), "ids": self.ids}, {"R": self.r})

    def __call__(self, stream) -> np.ndarray:
        self.candidates(stream)
        self.pick(stream)
        got = self.mem.read_i32(self.ids, self.r + 1)
        assert got[self.r] == ID_POISON, "the id past R was written"
        return got[:self.r]

    def set_draw_indices(self, stream, indices: list[int]) -> None:
        for row, index in zip(self.rows, indices):
            row.draw_index = index
        packed = sampling.pack_rows(self.rows, self.v)
        self.mem.device.memcpy_htod(self.row_i32, packed.row_i32, stream)

    def candidates_out(self) -> tuple[np.ndarray, np.ndarray]:
        shape = (self.r, sampling.CTAS_PER_ROW, TOP_K_CAP)
        vals = self.mem.read_i32(self.cand_val, self.n_cand + 1).view(np.float32)
        ids = self.mem.read_i32(self.cand_id, self.n_cand + 1)
        assert np.isnan(vals[-1]) and ids[-1] == -1, "the candidate slot past the end was written"
        return vals[:-1].reshape(shape), ids[:-1].reshape(shape)


def _logits(rng, r: int, v: int) -> np.ndarray:
    x = round_bf16((rng.standard_normal((r, v)) * 3.0).astype(np.float32))
    for i in range(r):
        top = int(np.argmax(x[i]))
        x[i, rng.integers(0, v, size=min(3, v))] = x[i, top]  # exact ties at the top (and bf16 ones)
    if r > 1 and v > 4:
        x[1, int(np.argmax(x[1]))] = np.nan  # NaN counts as -inf
    return x


def _row(rng, kind: str, x: np.ndarray) -> RowSampling:
    v = x.shape[0]
    if kind == "greedy":
        return RowSampling(greedy=True)
    if kind == "greedy_mask":
        return RowSampling(greedy=True, bitmask=pack_mask(rng.random(v) < 0.5))
    if kind == "dead":
        return RowSampling(greedy=bool(rng.integers(0, 2)), bitmask=pack_mask(np.zeros(v, bool)))
    kw = {"temperature": float(rng.choice([0.6, 1.0, 1.5])), "top_k": int(rng.choice([1, 5, 20])),
          "top_p": float(rng.choice([0.8, 1.0])), "min_p": float(rng.choice([0.0, 0.05])),
          "seed": int(rng.integers(0, 2**63)), "draw_index": int(rng.integers(0, 2**32))}
    if kind == "penalised":
        # The current top ids (so winners change), a few others, and one id past V (ignored).
        top = np.argsort(-np.nan_to_num(x, nan=-np.inf), kind="stable")[:10]
        ids = np.unique(np.concatenate([top, rng.integers(0, v, size=5)]))
        ids = np.append(ids, v + 3).astype(np.int32)
        kw.update(penalty_ids=ids, penalty_deltas=rng.uniform(-0.5, 2.0, ids.shape[0]).astype(np.float32))
    if kind == "few_allowed":
        allowed = np.zeros(v, bool)
        allowed[rng.integers(0, v, size=int(rng.integers(1, 6)))] = True
        allowed[[0, v - 1]] = rng.random(2) < 0.5  # the row's first and last ids, sometimes
        if not allowed.any():
            allowed[v // 2] = True
        kw["bitmask"] = pack_mask(allowed)
    return RowSampling(greedy=False, **kw)


def _check_candidates(launch: Launch, logits: np.ndarray, what: str) -> None:
    vals, ids = launch.candidates_out()
    want_vals, want_ids = sampling.reference_candidates(logits, launch.rows)
    np.testing.assert_array_equal(vals, want_vals, err_msg=f"{what}: candidate values")
    np.testing.assert_array_equal(ids, want_ids, err_msg=f"{what}: candidate ids")


@pytest.mark.parametrize("v", [512, 1000, 248320])
@pytest.mark.parametrize("r", [1, 3, 8])
def test_sampling_matches_the_reference(library, mem, stream, v, r):
    rng = np.random.default_rng(v * 10 + r)
    rows_seen, differ, near, kinds_seen = 0, [], 0, set()
    for trial in range(TRIALS):
        x = _logits(rng, r, v)
        kinds = rng.permutation(KINDS)[:r] if r < len(KINDS) else list(KINDS) + ["sampled"] * (r - len(KINDS))
        rows = [_row(rng, str(kind), x[i]) for i, kind in enumerate(kinds)]
        kinds_seen.update(str(k) for k in kinds)
        launch = Launch(library, mem, x, rows)
        got = launch(stream)
        if trial < 3 or v == 248320:
            _check_candidates(launch, x, f"V={v} R={r} trial {trial}")
        for i, row in enumerate(rows):
            d = decide(x[i], row)
            rows_seen += 1
            near += d.margin < NEAR
            if got[i] != d.token:
                differ.append((trial, i, int(got[i]), d.token, d.margin))
                assert d.margin < NEAR, f"V={v} R={r} trial {trial} row {i} ({kinds[i]}): got {got[i]}, want {d.token}"
            if kinds[i] == "dead":
                assert got[i] == DEAD_END
        mem.free()
    assert len(differ) <= max(1, rows_seen // 200), differ
    assert near <= max(2, rows_seen // 50), f"{near} of {rows_seen} rows sat within {NEAR} of a threshold"
    assert len(kinds_seen) == len(set(KINDS))


@pytest.mark.parametrize("v", [1, 7, 33])
def test_tiny_vocabularies(library, mem, stream, v):
    """V below the CTA count: most CTAs own no id; nothing reads or writes out of bounds."""
    rng = np.random.default_rng(v)
    x = round_bf16(rng.standard_normal((4, v)).astype(np.float32))
    rows = [RowSampling(greedy=True), RowSampling(greedy=False, seed=3, draw_index=11),
            RowSampling(greedy=False, top_k=5, temperature=0.6, bitmask=pack_mask(np.arange(v) == v - 1)),
            RowSampling(greedy=False, penalty_ids=np.array([0], np.int32), penalty_deltas=np.array([1.5], np.float32))]
    launch = Launch(library, mem, x, rows)
    got = launch(stream)
    _check_candidates(launch, x, f"V={v}")
    np.testing.assert_array_equal(got, sampling.reference(x, rows))
    assert got[2] == v - 1


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05}],
                         ids=["plain", "cut"])
def test_draws_follow_the_distribution(library, mem, stream, settings):
    """One row drawn with indices 0..3999 (8 rows per launch): every pick is the reference's, and
    the frequencies pass a chi-square test against the reference probabilities."""
    v, n, r = 1000, 4000, 8
    rng = np.random.default_rng(8)
    x = np.full(v, -4.0, np.float32)
    best = rng.choice(v, size=TOP_K_CAP, replace=False)
    x[best] = round_bf16(np.linspace(2.0, -1.0, TOP_K_CAP).astype(np.float32))
    logits = np.tile(round_bf16(x), (r, 1))
    rows = [RowSampling(greedy=False, seed=1234, **settings) for _ in range(r)]
    launch = Launch(library, mem, logits, rows)
    picks, want = [], []
    for first in range(0, n, r):
        launch.set_draw_indices(stream, list(range(first, first + r)))
        picks += launch(stream).tolist()
        want += [decide(logits[0], row) for row in rows]
    _check_candidates(launch, logits, "distribution row")
    mismatched = [i for i, (p, d) in enumerate(zip(picks, want)) if p != d.token]
    assert all(want[i].margin < NEAR for i in mismatched) and len(mismatched) <= n // 200, mismatched
    d0 = want[0]
    assert set(picks) <= set(d0.ids.tolist())
    counts = np.array([picks.count(int(i)) for i in d0.ids], np.float64)
    expected = d0.probs * n
    assert expected.min() >= 5
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df = len(expected) - 1
    # Wilson-Hilferty: the chi-square quantile at p = 1e-4 (z = 3.719).
    bound = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3 if df else 0.0
    assert chi2 <= bound, f"chi2 {chi2:.1f} > {bound:.1f} (df {df})"


def test_launch_refuses_a_vocabulary_past_the_cap(library):
    from runtime.cuda.errors import LaunchError

    kernel = library.kernel("sampling", "candidates")
    bufs = {name: 256 for name in ("logits", "bitmask", "row_i32", "pen_ids", "pen_delta", "cand_val", "cand_id")}
    with pytest.raises(LaunchError, match=f"V <= {sampling.MAX_VOCAB}"):
        kernel.bind(bufs, {"R": 1, "V": sampling.MAX_VOCAB + 1})
