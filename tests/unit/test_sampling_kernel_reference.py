"""The sampling kernels' NumPy reference (`cute_kernels.sampling`) on hand-computed cases, the
draw hash of the contract (`runtime.model.sampling`), and the buffers the kernels read."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cute_kernels import sampling
from cute_kernels.bf16 import round_bf16
from runtime.model.sampling import (
    DEAD_END,
    DRAW_INDEX,
    GREEDY,
    PEN_END,
    PEN_START,
    SEED_KEY,
    TOP_K_CAP,
    USE_MASK,
    RowSampling,
    decide,
    draw_bits,
    draw_uniform,
    masked_scores,
    mix32,
    pack_mask,
    seed_key,
    top_ids,
    unpack_mask,
)

NEG = -np.inf


def _row(**kw) -> RowSampling:
    return RowSampling(greedy=kw.pop("greedy", False), **kw)


def _logits_for(probs: list[float], vocab: int = 8) -> np.ndarray:
    """float32 logits whose softmax over the first len(probs) ids is `probs` (the rest -inf)."""
    x = np.full(vocab, NEG, np.float32)
    x[:len(probs)] = np.log(np.asarray(probs, np.float64)).astype(np.float32)
    return x


# --------------------------------------------------------------------------- the hash


def _lowbias32(x: int) -> int:
    """lowbias32 written out again here, independently of the code under test."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def test_known_uniform_from_the_hash_steps():
    seed, index = 12345, 7
    # seed_key: mix(low word ^ mix(high word ^ SEED_SALT)); the high word of 12345 is 0.
    inner = _lowbias32(0 ^ 0x9E3779B9)
    key = _lowbias32((seed & 0xFFFFFFFF) ^ inner)
    assert key == 0xF5C2B9FA == seed_key(seed)
    # draw_bits: mix(key ^ mix(index + DRAW_SALT)).
    bits = _lowbias32(key ^ _lowbias32(index + 0x6A09E667))
    assert bits == 0xD253F3C0 == draw_bits(key, index)
    assert bits >> 8 == 13784051
    assert draw_uniform(seed, index) == 13784051 / 2**24
    assert sampling.draw_uniform_from_key(key, index) == 13784051 / 2**24


def test_vectorised_mix32_equals_the_scalar_one():
    words = np.random.default_rng(0).integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    words[:4] = [0, 1, 0x7FFFFFFF, 0xFFFFFFFF]
    got = mix32(words)
    assert got.dtype == np.uint32
    assert [int(g) for g in got] == [mix32(int(w)) for w in words]
    assert [int(g) for g in got[:64]] == [_lowbias32(int(w)) for w in words[:64]]


def test_uniforms_are_24_bit_and_spread():
    us = np.array([draw_uniform(3, i) for i in range(20000)])
    assert ((us >= 0) & (us < 1)).all()
    np.testing.assert_array_equal(us * 2**24, np.round(us * 2**24))
    counts = np.histogram(us, bins=20, range=(0, 1))[0]
    chi2 = float(((counts - 1000) ** 2 / 1000).sum())
    assert chi2 < 60, chi2  # df = 19: p ~ 3e-6


# --------------------------------------------------------------------------- decisions


def test_greedy_ties_go_to_the_lowest_id():
    x = np.array([0.5, 2.0, -1.0, 2.0, 2.0], np.float32)
    assert sampling.reference(x[None], [_row(greedy=True)])[0] == 1
    x[1] = np.nan  # NaN counts as -inf
    assert sampling.reference(x[None], [_row(greedy=True)])[0] == 3


def test_mask_and_dead_ends():
    x = np.array([5.0, 4.0, 3.0, 2.0, 1.0], np.float32)
    allowed = np.array([False, False, True, False, True])
    mask = pack_mask(allowed)
    assert sampling.reference(x[None], [_row(greedy=True, bitmask=mask)])[0] == 2
    # top_k = 20 over two allowed ids: only 2 and 4 can come out.
    rows = [_row(bitmask=mask, seed=s) for s in range(50)]
    got = sampling.reference(np.tile(x, (50, 1)), rows)
    assert set(got.tolist()) == {2, 4}
    none = pack_mask(np.zeros(5, bool))
    assert sampling.reference(np.tile(x, (2, 1)), [_row(greedy=True, bitmask=none),
                                                   _row(bitmask=none)]).tolist() == [DEAD_END, DEAD_END]
    all_neg = np.full((1, 5), NEG, np.float32)
    assert sampling.reference(all_neg, [_row()])[0] == DEAD_END


def test_penalties_change_the_winner_of_a_sampled_row_only():
    x = np.array([1.0, 3.0, 2.5, 0.0], np.float32)
    pen = {"penalty_ids": np.array([1], np.int32), "penalty_deltas": np.array([0.75], np.float32)}
    assert sampling.reference(x[None], [_row(top_k=1, **pen)])[0] == 2  # 3.0 - 0.75 < 2.5
    assert sampling.reference(x[None], [_row(greedy=True, **pen)])[0] == 1  # greedy: no penalties
    # The subtraction is float32 logit minus float32 delta.
    s = masked_scores(x, _row(**pen))
    assert s.dtype == np.float32 and s[1] == np.float32(3.0) - np.float32(0.75)
    # Ids outside the vocabulary are ignored; a penalty never revives a masked id.
    s = masked_scores(x, _row(penalty_ids=np.array([7, 0], np.int32), penalty_deltas=np.array([1, -5], np.float32),
                                bitmask=pack_mask(np.array([False, True, True, True]))))
    assert s[0] == NEG and s[1] == 3.0


def test_top_k_one_is_the_argmax_whatever_the_draw():
    x = np.array([0.0, 1.0, 1.0, 0.9], np.float32)
    rows = [_row(top_k=1, temperature=1.5, seed=s, draw_index=s * 3) for s in range(40)]
    assert (sampling.reference(np.tile(x, (40, 1)), rows) == 1).all()


def test_top_p_keeps_the_prefix_that_reaches_the_mass():
    x = _logits_for([0.5, 0.3, 0.2])
    # 0.5 + 0.3 reaches 0.8 up to rounding: the 1e-9 slack keeps two candidates.
    assert decide(x, _row(top_p=0.8)).ids.tolist() == [0, 1]
    assert decide(x, _row(top_p=0.81)).ids.tolist() == [0, 1, 2]
    assert decide(x, _row(top_p=0.5)).ids.tolist() == [0]
    assert decide(x, _row(top_p=0.49)).ids.tolist() == [0]
    d = decide(x, _row(top_p=0.8))
    np.testing.assert_allclose(d.probs, [0.625, 0.375], rtol=1e-6)
    assert d.margin < 1e-6  # the cut sat on its threshold: a float32 sampler may cut elsewhere


def test_min_p_drops_the_unlikely_tail():
    x = _logits_for([0.6, 0.3, 0.1])
    assert decide(x, _row(min_p=0.2)).ids.tolist() == [0, 1]  # 0.1 < 0.12
    assert decide(x, _row(min_p=0.1)).ids.tolist() == [0, 1, 2]  # 0.1 >= 0.06
    assert decide(x, _row(min_p=0.6)).ids.tolist() == [0]
    np.testing.assert_allclose(decide(x, _row(min_p=0.2)).probs, [2 / 3, 1 / 3], rtol=1e-6)


def test_temperature_scales_the_logits():
    x = _logits_for([0.6, 0.3, 0.1])
    d = decide(x, _row(temperature=0.5))
    want = np.array([0.36, 0.09, 0.01]) / 0.46
    np.testing.assert_allclose(d.probs, want, rtol=1e-6)


def test_seeded_draws_are_the_inverse_cdf_at_draw_uniform():
    x = _logits_for([0.4, 0.3, 0.2, 0.1])
    cdf = np.cumsum([0.4, 0.3, 0.2, 0.1])
    seen = set()
    for index in range(200):
        u = draw_uniform(99, index)
        d = decide(x, _row(seed=99, draw_index=index))
        assert d.u == u
        if np.abs(cdf - u).min() > 1e-6:
            assert d.token == int(np.searchsorted(cdf, u, side="right"))
        seen.add(d.token)
    assert seen == {0, 1, 2, 3}


def test_the_draw_picks_from_the_renormalised_cut():
    x = _logits_for([0.5, 0.3, 0.2])
    for index in range(100):
        u = draw_uniform(5, index)
        d = decide(x, _row(seed=5, draw_index=index, top_p=0.8))
        assert d.token == (0 if u < 0.625 else 1)


def test_reference_decides_as_the_host_sampler():
    """The reference picks the host sampler's token (`sample_token`) from the `RowSampling` the
    host hands a device sampler (`SamplerState.row_sampling`): masks, penalties, ties, cuts."""
    from runtime.engine.api import SamplingParams
    from runtime.engine.sampler import DeadEndError, SamplerState, sample_token

    rng = np.random.default_rng(3)
    for trial in range(150):
        vocab = int(rng.choice([7, 50, 3000]))
        x = round_bf16((rng.standard_normal(vocab) * 2).astype(np.float32))
        if trial % 3 == 0:
            x[rng.integers(0, vocab, size=vocab // 4)] = x.max()  # ties at the top
        params = SamplingParams(temperature=float(rng.choice([0.6, 1.0, 1.5])), top_p=float(rng.choice([0.8, 1.0])),
                                top_k=int(rng.choice([0, 1, 5, 20])), min_p=float(rng.choice([0.0, 0.05])),
                                presence_penalty=float(rng.choice([0.0, 0.5])),
                                frequency_penalty=float(rng.choice([0.0, 0.3])), seed=int(rng.integers(0, 2**63)),
                                greedy=bool(trial % 5 == 0))
        state = SamplerState(params)
        for token in rng.integers(0, vocab + 3, size=int(rng.integers(0, 6))):  # ids past V are ignored
            state.observe(int(token))
        state.num_draws = int(rng.integers(0, 1000))
        mask = None
        if trial % 4 == 1:
            mask = pack_mask(rng.random(vocab) < (0.0 if trial % 16 == 1 else 0.2))
        row = state.row_sampling(vocab, mask)
        want = sampling.reference(x[None], [row])[0]
        try:
            got = sample_token(x.copy(), state, mask)
        except DeadEndError:
            got = DEAD_END
        assert want == got, (trial, params)


# --------------------------------------------------------------------------- kernel buffers


def test_pack_rows_lays_out_the_kernel_buffers():
    mask = pack_mask(np.arange(70) % 3 == 0)
    rows = [
        _row(greedy=True),
        _row(top_k=5, temperature=0.7, top_p=0.9, min_p=0.05, seed=2**63 + 5, draw_index=2**31 + 1,
             penalty_ids=np.array([3, 9], np.int32), penalty_deltas=np.array([0.5, 1.25], np.float32), bitmask=mask),
        _row(penalty_ids=np.array([4], np.int32), penalty_deltas=np.array([2.0], np.float32)),
    ]
    p = sampling.pack_rows(rows, 70)
    assert p.row_i32.dtype == np.int32 and p.row_i32.shape == (3, sampling.ROW_I32)
    assert p.bitmask.shape == (3, 3) and p.num_penalties == 3
    assert p.row_i32[:, GREEDY].tolist() == [1, 0, 0]
    assert p.row_i32[:, USE_MASK].tolist() == [0, 1, 0]
    assert p.row_i32[:, PEN_START].tolist() == [0, 0, 2]
    assert p.row_i32[:, PEN_END].tolist() == [0, 2, 3]
    assert p.pen_ids.tolist() == [3, 9, 4] and p.pen_delta.tolist() == [0.5, 1.25, 2.0]
    np.testing.assert_array_equal(p.bitmask[1].view(np.uint32), mask)
    np.testing.assert_allclose(p.row_f32[1, :3], [0.7, 0.9, 0.05], rtol=1e-7)
    key = int(p.row_i32[1, SEED_KEY]) & 0xFFFFFFFF
    index = int(p.row_i32[1, DRAW_INDEX]) & 0xFFFFFFFF
    assert key == seed_key(2**63 + 5)
    assert sampling.draw_uniform_from_key(key, index) == draw_uniform(2**63 + 5, 2**31 + 1)
    empty = sampling.pack_rows([_row(greedy=True)], 5)
    assert empty.num_penalties == 0 and empty.pen_ids.shape == (1,)  # a 4-byte dummy


def test_mask_packing_round_trips():
    allowed = np.random.default_rng(1).random(1000) < 0.3
    words = pack_mask(allowed)
    assert words.dtype == np.uint32 and words.shape == (32,)
    np.testing.assert_array_equal(unpack_mask(words, 1000), allowed)
    assert pack_mask(np.array([True] + [False] * 30 + [True]))[0] == 0x80000001


@pytest.mark.parametrize("vocab", [1, 5, 1000, 4099])
def test_reference_candidates_hold_each_slice_top_and_merge_to_the_row_top(vocab):
    rng = np.random.default_rng(vocab)
    x = round_bf16(rng.standard_normal((2, vocab)).astype(np.float32))
    x[0, ::3] = x[0].max()  # many ties
    rows = [_row(greedy=True), _row(penalty_ids=np.array([0], np.int32), penalty_deltas=np.array([1], np.float32),
                                    bitmask=pack_mask(rng.random(vocab) < 0.5))]
    vals, ids = sampling.reference_candidates(x, rows)
    ctas = sampling.CTAS_PER_ROW
    assert vals.shape == ids.shape == (2, ctas, TOP_K_CAP)
    span = math.ceil(vocab / ctas)
    for r in range(2):
        s = masked_scores(x[r], rows[r])
        for c in range(ctas):
            lo, hi = c * span, min((c + 1) * span, vocab)
            finite = vals[r, c] > NEG
            assert (ids[r, c][~finite] == sampling.NO_ID).all()
            assert ((ids[r, c][finite] >= lo) & (ids[r, c][finite] < hi)).all()
            np.testing.assert_array_equal(vals[r, c][finite], s[ids[r, c][finite]])
            assert finite.sum() == min(TOP_K_CAP, int((s[lo:hi] > NEG).sum())) if lo < hi else not finite.any()
        # Merging the slices' lists gives the row's own top 20.
        flat_v, flat_i = vals[r].ravel(), ids[r].ravel().astype(np.int64)
        order = np.lexsort((flat_i, -flat_v.astype(np.float64)))[:TOP_K_CAP]
        keep = flat_v[order] > NEG
        want_i = top_ids(s, TOP_K_CAP)
        assert flat_i[order][keep].tolist() == want_i.tolist()


def test_variants_cover_the_largest_vocabulary():
    cand, pick = sampling.variants()
    assert cand.key == "candidates" and pick.key == "pick"
    assert [p.name for p in cand.params] == ["logits", "bitmask", "row_i32", "pen_ids", "pen_delta", "cand_val",
                                             "cand_id", "R", "V"]
    assert [p.name for p in pick.params] == ["cand_val", "cand_id", "row_i32", "row_f32", "ids", "R"]
    assert sampling.MAX_VOCAB >= 248320 and f"V <= {sampling.MAX_VOCAB}" in cand.requires
    assert cand.grid == (sampling.CTAS_PER_ROW, "R", 1) and pick.grid == ("R", 1, 1)
