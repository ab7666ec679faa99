"""The chunked (WY) Gated DeltaNet reference equals the token recurrence in float64 (odd lengths,
several chunks, a non-zero initial state), and its kernel-rounding model stays close to it."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gdn, gdn_chunked


def _inputs(seed: int, t: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 12):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((t, 2 * hk * dk + hv * dv))
    b, a = rng.standard_normal((t, hv)), rng.standard_normal((t, hv)) * 1.5
    a_log, dt_bias = rng.standard_normal(hv) * 0.5, rng.standard_normal(hv) * 0.5
    state = rng.standard_normal((hv, dv, dk)) * 0.3
    return (qkv, b, a, a_log, dt_bias, state), hk


@pytest.mark.parametrize("t", [1, 7, 16, 17, 40])
@pytest.mark.parametrize("chunk", [8, 16])
def test_chunked_matches_recurrence_small_chunks(t, chunk):
    args, hk = _inputs(t * 31 + chunk, t)
    o_want, s_want = gdn.reference_core(*args, hk=hk, exact=True)
    o_got, s_got = gdn_chunked.reference_core(*args, hk=hk, chunk=chunk)
    np.testing.assert_allclose(o_got, o_want, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(s_got, s_want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_chunked_matches_recurrence_c64(t):
    args, hk = _inputs(t, t, hk=1, hv=2, dk=32, dv=16)
    o_want, s_want = gdn.reference_core(*args, hk=hk, exact=True)
    o_got, s_got = gdn_chunked.reference_core(*args, hk=hk)
    np.testing.assert_allclose(o_got, o_want, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(s_got, s_want, rtol=1e-8, atol=1e-9)


def test_kernel_rounding_model_is_close():
    args, hk = _inputs(5, 130, hk=1, hv=2, dk=32, dv=32)
    o_want, s_want = gdn.reference_core(*args, hk=hk, exact=True)
    o_got, s_got = gdn_chunked.reference_core(*args, hk=hk, kernel_rounding=True)
    rel = lambda x, y: np.linalg.norm(x - y) / np.linalg.norm(y)
    assert rel(o_got, o_want) < 3e-2
    assert rel(s_got, s_want) < 3e-2
