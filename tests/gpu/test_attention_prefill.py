"""The tensor-core prefill attention kernel (`attention_prefill`) against NumPy.

A chunk of query rows at positions start..start+t-1 attends causally to keys 0..pos[m] stored in
shuffled pages; rows of the pages outside the sequence (and past its end inside the last page) hold
NaN, which must never reach an output. Query counts that leave the last 64-row tile partial, a
chunk starting mid-page, and a chunk at position 0 are covered; the row after the last one must
stay unwritten.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention_prefill as ap
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu
PAGE = 64


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _cfg(name):
    return next(v for v in ap.variants() if v.key == f"fwd_{name}").config


@pytest.mark.parametrize("name,start,t", [("q4_kv2_d64", 0, 130), ("q4_kv2_d64", 100, 90),
                                          ("q24_kv4_d256", 70, 150), ("q16_kv2_d256", 0, 64),
                                          ("q16_kv2_d256", 200, 75)])
def test_prefill_attention_kernel(library, mem, stream, name, start, t):
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(start + t)
    n = start + t
    used = -(-n // PAGE)
    npages = used + 3
    table = np.full((2, used + 2), npages - 1, np.int64)  # row 1 is another sequence's
    table[0, :used] = rng.permutation(npages)[:used]
    pages_k = np.full((npages * PAGE, hkv, d), np.nan, np.float32)
    pages_v = np.full((npages * PAGE, hkv, d), np.nan, np.float32)
    rows = table[0, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
    pages_k[rows] = _bf(rng, (n, hkv, d))
    pages_v[rows] = _bf(rng, (n, hkv, d))
    q = _bf(rng, (t, hq, d), 2.0)
    x = _bf(rng, (t, stride))
    pos = start + np.arange(t)
    out = mem.poisoned((t + 1) * hq * d)
    library.kernel("attention_prefill", f"fwd_{name}").launch(stream, {
        "q": mem.bf16(q), "k_pages": mem.bf16(pages_k), "v_pages": mem.bf16(pages_v), "table": mem.i32(table),
        "qseq": mem.i32(np.zeros(t)), "pos": mem.i32(pos), "x": mem.bf16(x), "out": out},
        {"M": t, "maxp": table.shape[1], "R": table.shape[0], "NP": npages})
    got = mem.read_bf16(out, (t + 1, hq * d))
    assert np.isnan(got[t]).all()
    got = got[:t]
    args = (q, pages_k, pages_v, table[0], pos, x)
    assert_close_to_baseline(got, ap.reference(*args, exact=True), ap.reference(*args),
                             f"prefill attention {name} start={start} t={t}", slack=2.5)
