"""The sampler: greedy, temperature, top-k (with the 20 cap), top-p, min-p, penalties, masks,
seeded reproducibility and the sampled distribution itself."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import SamplingParams
from runtime.engine.sampler import (DeadEndError, SamplerState, apply_penalties,
                                    candidate_distribution, sample_token, token_logprobs)
from runtime.model.sampling import DEAD_END, draw_uniform, top_ids, unpack_mask


def state(**kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw))


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert sample_token(logits, state(greedy=True)) == 1
    assert sample_token(logits, state(temperature=0.0)) == 1


def test_greedy_ignores_penalties_but_honours_the_mask():
    logits = np.array([0.0, 3.0, 1.0, 2.0], dtype=np.float32)
    s = state(greedy=True, presence_penalty=2.0)
    s.observe(1)
    assert sample_token(logits, s) == 1
    mask = np.array([True, False, True, True])
    assert sample_token(logits, s, mask) == 3


def test_greedy_draws_nothing_from_the_generator():
    s = state(greedy=True, seed=5)
    sample_token(np.arange(10, dtype=np.float32), s)
    assert s.num_draws == 0


def test_top_k_limits_the_candidates_and_zero_means_twenty():
    logits = np.arange(100, dtype=np.float32) / 10
    ids, probs = candidate_distribution(logits, state(top_k=3))
    assert list(ids) == [99, 98, 97]
    ids, _ = candidate_distribution(logits, state(top_k=0))
    assert len(ids) == 20 and ids[0] == 99
    ids, _ = candidate_distribution(logits, state(top_k=50))
    assert len(ids) == 20


def test_candidates_are_ordered_by_logit_then_id():
    logits = np.array([1.0, 2.0, 2.0, 0.5, 2.0], dtype=np.float32)
    ids, _ = candidate_distribution(logits, state(top_k=2))
    assert list(ids) == [1, 2]


def test_temperature_then_softmax():
    logits = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    ids, probs = candidate_distribution(logits, state(temperature=0.5, top_k=3))
    expected = np.exp(np.array([2.0, 0.0, -2.0]))
    np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-12)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    ids, probs = candidate_distribution(logits, state(top_p=0.8))
    assert list(ids) == [0, 1]
    np.testing.assert_allclose(probs, [0.625, 0.375])
    ids, _ = candidate_distribution(logits, state(top_p=0.81))
    assert list(ids) == [0, 1, 2]
    ids, _ = candidate_distribution(logits, state(top_p=0.0))
    assert list(ids) == [0]


def test_min_p_drops_tokens_below_a_share_of_the_best():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    ids, _ = candidate_distribution(logits, state(min_p=0.3))
    assert list(ids) == [0, 1, 2]
    ids, _ = candidate_distribution(logits, state(min_p=0.61))
    assert list(ids) == [0]


def test_presence_and_frequency_penalties():
    logits = np.zeros(5, dtype=np.float32)
    s = state(presence_penalty=1.5, frequency_penalty=0.25)
    for token in (1, 3, 3, 3, 3):
        s.observe(token)
    out = apply_penalties(logits, s)
    np.testing.assert_allclose(out, [0, -1.75, 0, -2.5, 0])
    assert logits.sum() == 0                                     # input untouched
    s = state(presence_penalty=-1.0)
    for token in (2, 2, 2):
        s.observe(token)
    assert apply_penalties(logits, s)[2] == 1.0                  # negative = encourage


def test_penalties_change_the_sample():
    logits = np.array([5.0, 4.9, 0.0, 0.0], dtype=np.float32)
    s = state(temperature=0.01, top_k=20, presence_penalty=2.0, seed=1)
    s.observe(0)
    assert sample_token(logits, s) == 1


def test_mask_restricts_sampling_and_an_empty_mask_is_a_dead_end():
    logits = np.zeros(8, dtype=np.float32)
    mask = np.zeros(8, dtype=bool)
    mask[[2, 5]] = True
    s = state(seed=0)
    assert {sample_token(logits, s, mask) for _ in range(50)} == {2, 5}
    with pytest.raises(DeadEndError):
        sample_token(logits, s, np.zeros(8, dtype=bool))


def test_a_mask_narrower_than_the_padded_vocab_forbids_the_padding():
    logits = np.zeros(10, dtype=np.float32)
    logits[9] = 100.0                                            # a padding id
    mask = np.ones(8, dtype=bool)
    assert sample_token(logits, state(greedy=True), mask) < 8


def test_same_seed_same_tokens_other_seed_other_tokens():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(64, 200)).astype(np.float32)

    def run(seed):
        s = state(temperature=1.0, top_p=0.95, seed=seed)
        return [sample_token(row, s) for row in rows]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_draws_are_the_counter_based_uniforms_of_the_contract():
    # Candidates 0..3 with probabilities 0.4, 0.3, 0.2, 0.1: draw n picks the id whose CDF
    # interval holds draw_uniform(seed, n), whatever happened before draw n.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    cdf = np.cumsum([0.4, 0.3, 0.2, 0.1])
    s = state(temperature=1.0, seed=2**40 + 17)
    for n in range(200):
        want = int(np.searchsorted(cdf, draw_uniform(2**40 + 17, n), side="right"))
        assert sample_token(logits, s) == want
    assert s.num_draws == 200


def test_row_sampling_carries_the_host_decision():
    s = state(temperature=0.7, top_k=0, top_p=0.9, min_p=0.05, presence_penalty=1.5,
              frequency_penalty=0.5, seed=11)
    for token in (4, 4, 9):
        s.observe(token)
    s.num_draws = 6
    bitmask = np.array([0xFFFFFFFF], np.uint32)
    row = s.row_sampling(32, bitmask)
    assert (row.greedy, row.temperature, row.top_k, row.top_p, row.min_p, row.seed, row.draw_index) == \
        (False, 0.7, 20, 0.9, 0.05, 11, 6)
    assert dict(zip(row.penalty_ids.tolist(), row.penalty_deltas.tolist())) == {4: 2.5, 9: 2.0}
    assert row.bitmask is bitmask
    assert s.took(3) == 3 and s.num_draws == 7
    greedy = state(greedy=True, presence_penalty=1.0)
    greedy.observe(1)
    row = greedy.row_sampling(32, None)
    assert row.greedy and row.penalty_ids.shape == (0,) and row.bitmask is None
    assert greedy.took(5) == 5 and greedy.num_draws == 0
    with pytest.raises(DeadEndError):
        greedy.took(DEAD_END)


def test_a_packed_bitmask_masks_like_the_bool_mask():
    logits = np.arange(40, dtype=np.float32)
    packed = np.array([1 << 3, 1 << (33 - 32)], np.uint32)          # ids 3 and 33
    assert sample_token(logits, state(greedy=True), packed) == 33
    np.testing.assert_array_equal(np.flatnonzero(unpack_mask(packed, 40)), [3, 33])


def test_sampled_frequencies_follow_the_distribution():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    s = state(temperature=1.0, seed=42)
    draws = np.bincount([sample_token(logits, s) for _ in range(8000)], minlength=4) / 8000
    np.testing.assert_allclose(draws, [0.4, 0.3, 0.2, 0.1], atol=0.02)


def test_logprobs_are_the_raw_log_softmax():
    logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    ref = logits - np.log(np.exp(logits).sum())
    lp = token_logprobs(logits, 2, top=2)
    assert lp.logprob == pytest.approx(ref[2])
    assert [i for i, _ in lp.top] == [0, 1]
    assert lp.top[0][1] == pytest.approx(ref[0])


def test_sampling_cost_on_a_real_vocabulary_is_small():
    import time

    logits = np.random.default_rng(1).normal(size=248_320).astype(np.float32)
    s = state(temperature=0.7, top_p=0.8, presence_penalty=1.5, seed=3)
    for t in range(50):
        s.observe(t)
    start = time.perf_counter()
    for _ in range(20):
        sample_token(logits, s)
    per_token = (time.perf_counter() - start) / 20
    assert per_token < 0.05, per_token        # generous: CI boxes are slow; typical ~2 ms


def _brute_top(scores, k):
    ids = np.flatnonzero(scores > -np.inf)
    return list(ids[np.lexsort((ids, -scores[ids]))][:k])


@pytest.mark.parametrize("case", ["normal", "ties", "flat", "masked", "few_allowed", "peaked"])
def test_top_ids_is_exact_on_a_large_vocabulary(case):
    rng = np.random.default_rng(hash(case) % 1000)
    n = 248_320
    if case == "normal":
        scores = rng.normal(size=n).astype(np.float32)
    elif case == "ties":
        scores = rng.integers(0, 50, size=n).astype(np.float32)
    elif case == "flat":
        scores = np.zeros(n, dtype=np.float32)
    elif case == "masked":
        scores = rng.normal(size=n).astype(np.float32)
        scores[rng.random(n) < 0.9] = -np.inf
    elif case == "few_allowed":
        scores = np.full(n, -np.inf, dtype=np.float32)
        scores[[5, 70_000, 248_000]] = [1.0, 3.0, 1.0]
    else:
        scores = rng.normal(size=n).astype(np.float32)
        scores[12345] = 40.0
    for k in (1, 7, 20):
        assert list(top_ids(scores, k)) == _brute_top(scores, k), (case, k)
