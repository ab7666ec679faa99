"""The split-KV plan: a fixed split count per row, each row's split length from its own position
(`attention.split_length`, computed the same way by the split and combine kernels), and the
runner's default split count (`storage.default_decode_splits`)."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention
from runtime.model.gpu.storage import DECODE_CTAS_PER_SM, DECODE_MIN_SPLIT, PREFILL_MIN_SPLIT, PREFILL_SPLITS, \
    default_decode_splits

PAGE = attention.PAGE


@pytest.mark.parametrize("splits,min_split", [(128, 128), (256, 128), (3, 64), (1, 64), (16, 64), (1024, 64),
                                              (132, 100)])
def test_splits_cover_each_key_once_within_the_grid(splits, min_split):
    positions = np.concatenate([np.arange(0, 5000), [8191, 8192, 16383, 40000, 131071, 249999, 262143]])
    length = attention.split_length(positions, splits, min_split)
    n = positions + 1
    used = -(-n // length)
    assert (used <= splits).all()            # every split a row uses has a CTA in the grid
    assert (length >= min_split).all()
    assert ((length == min_split) | (length % PAGE == 0)).all()
    assert ((used - 1) * length < n).all()   # the last used split holds at least one key
    for pos in (0, 63, 64, 65, 999, 4096, 40000, 262143):
        ln = int(attention.split_length(pos, splits, min_split))
        covered = np.zeros(pos + 1, np.int64)
        for sp in range(splits):
            covered[sp * ln:min(sp * ln + ln, pos + 1)] += 1
        np.testing.assert_array_equal(covered, 1)


def test_split_length_values():
    # Short rows take the minimum; long rows spread over all splits, rounded up to a page.
    assert attention.split_length(0, 128, 128) == 128
    assert attention.split_length(1023, 198, 128) == 128              # 1K context: 8 splits of 128
    assert attention.split_length(32767, 198, 128) == 192             # 32K: 171 splits of 192 (of 198)
    assert attention.split_length(249999, 198, 128) == 1280           # ceil(250000 / 198) = 1263 -> 20 pages
    assert attention.split_length(262143, 128, 128) == 2048
    assert attention.split_length(262144, 128, 128) == 2112           # one key more: one page more per split
    np.testing.assert_array_equal(attention.split_length(np.array([0, 20479, 20480]), 16, 64), [64, 1280, 1344])


def test_default_decode_splits():
    # One wave at batch 1 (rows x KV heads x splits = 2 CTAs per SM of an H200's 132), no more
    # splits than the longest context fills.
    assert DECODE_CTAS_PER_SM == 2
    assert default_decode_splits(4, 262208, 132) == 66                     # 27B: 264 CTAs
    assert default_decode_splits(2, 262208, 132) == 132                    # 35B-A3B: 264 CTAs
    assert default_decode_splits(2, 2048, 132) == 2048 // DECODE_MIN_SPLIT  # the tiny model
    assert default_decode_splits(4, 1, 132) == 1
    assert default_decode_splits(3, 10 ** 6, 100) * 3 >= DECODE_CTAS_PER_SM * 100


def _split_combine(q, k, v, pos, splits, min_split):
    """The kernels' plan in float64: each used split's normalised output and log2-sum-exp, merged
    by the combine's weights (gate left out)."""
    d = q.shape[-1]
    r = q.shape[1] // k.shape[1]
    out = np.empty(q.shape)
    for i in range(q.shape[0]):
        n = int(pos[i]) + 1
        ln = int(attention.split_length(pos[i], splits, min_split))
        for h in range(q.shape[1]):
            parts, lses = [], []
            for start in range(0, n, ln):
                kk, vv = k[start:min(start + ln, n), h // r], v[start:min(start + ln, n), h // r]
                s = kk @ q[i, h] * d ** -0.5 * attention.LOG2E
                p = np.exp2(s - s.max())
                parts.append(p @ vv / p.sum())
                lses.append(s.max() + np.log2(p.sum()))
            w = np.exp2(np.array(lses) - max(lses))
            out[i, h] = (w[:, None] * np.array(parts)).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("splits,min_split", [(PREFILL_SPLITS, PREFILL_MIN_SPLIT), (3, 64), (128, 128)])
def test_the_plan_reproduces_attention(splits, min_split):
    """Merging the splits of the plan gives the reference attention (exact arithmetic; the gate
    set to a large value so sigmoid is 1 and the reference returns the attention alone)."""
    rng = np.random.default_rng(4)
    hq, hkv, d, keys = 4, 2, 16, 1500
    q = rng.standard_normal((5, hq, d))
    k, v = rng.standard_normal((keys, hkv, d)), rng.standard_normal((keys, hkv, d))
    pos = np.array([0, 64, 200, 1023, 1499])
    want = attention.reference_attention(q, k, v, pos, np.full((5, hq, d), 60.0), exact=True)
    np.testing.assert_allclose(_split_combine(q, k, v, pos, splits, min_split).reshape(5, hq * d), want,
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("max_context,chunk,split,splits", [
    (131072, 1024, 16384, 8),      # the server's 128K context: the 16K floor
    (262144, 1024, 16384, 16),
    (1 << 20, 1024, 65536, 16),    # at most PREFILL_SPLITS partials a row
    (20480, 3072, 18432, 2),       # a multiple of the chunk: no chunk straddles it
    (4096, 256, 16384, 1),
])
def test_the_prefill_key_split_is_a_multiple_of_the_chunk_with_few_partials(max_context, chunk, split, splits):
    from runtime.model.gpu.storage import prefill_kv_split

    got = prefill_kv_split(max_context, chunk)
    assert got == split and got % chunk == 0 and got % 64 == 0
    assert -(-max_context // got) == splits <= PREFILL_SPLITS
    # the combine's split length for every row of the context is the split itself
    pos = np.arange(0, max_context, 997)
    assert (attention.split_length(pos, splits, got) == got).all()
