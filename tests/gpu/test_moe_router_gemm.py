"""The MoE router logits of a prefill chunk by the FP32-out GEMM (`gemm_sm90` SHAPES_F32) on a
real GPU: against the float64 reference and the `moe` logits kernel, at odd row counts and the
served shapes, and routed by the `route` kernel exactly as the NumPy routing routes the same
logits (ties broken by the lowest id).

Tolerance. Both kernels sum the same H bf16 products in fp32 (exact products, then fp32 adds in
different orders), so each is within a few fp32 ulps of the row's magnitude of the float64 sums:
the same 1e-5 relative bound test_moe_kernels.py holds the logits kernel to.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_sm90, moe
from cute_kernels.bf16 import round_bf16

from .conftest import rel_err
from .test_moe_kernels import SHAPES, _f32_poisoned, _key, _route

pytestmark = pytest.mark.gpu

ROUTERS = {"tiny": "tiny_router", "a3b": "a3b_router"}  # moe.SHAPES name -> gemm_sm90 SHAPES_F32 name


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _gemm(library, mem, stream, name: str, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """fp32 out [M, N] of the FP32-out GEMM variant `name`; checks the poisoned row past M."""
    key = next(v.key for v in gemm_sm90.variants() if v.key.startswith(name + "_"))
    kernel = library.kernel("gemm_sm90", key)
    assert kernel.entry.config["out"] == "f32"
    m, n = x.shape[0], w.shape[0]
    out = _f32_poisoned(mem, (m + 1) * n)
    kernel.launch(stream, {"x": mem.bf16(x), "w": mem.bf16(w), "out": out}, {"M": m})
    got = mem.read_f32(out, np.empty((m + 1, n)))
    assert np.isnan(got[m]).all(), f"{key} wrote past M"
    assert np.isfinite(got[:m]).all(), f"{key} left elements unwritten"
    return got[:m]


@pytest.mark.parametrize("m", [1, 77, 300])
def test_f32_gemm_small_and_ragged(library, mem, stream, m):
    """N = 328 (a partial 256-wide tile), K = 192 (three k-tiles), M past one 128-row tile."""
    _, n, k = next(s for s in gemm_sm90.SHAPES_F32 if s[0] == "test_f32")
    rng = np.random.default_rng(m)
    x, w = _bf(rng, (m, k)), _bf(rng, (n, k), 0.1)
    got = _gemm(library, mem, stream, "test_f32", x, w)
    want = gemm_sm90.reference(x, w, exact=True)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)


@pytest.mark.parametrize("name", ROUTERS)
@pytest.mark.parametrize("m", [9, 300])
def test_router_logits_match_the_logits_kernel_and_route_the_same(library, mem, stream, name, m):
    """The served router shapes at a chunk past the decode rows: the GEMM's logits within 1e-5 of
    float64 (as the logits kernel's), and the route kernel over them picks the ids the NumPy
    routing picks from the same logits; rows whose router rows are equal tie exactly (the GEMM
    sums every column in the same order), and the tie goes to the lowest id."""
    _, h, e, k, _, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(m + e)
    x = _bf(rng, (m, h))
    router = _bf(rng, (e, h), h ** -0.5)
    router[e - 1] = router[1]  # experts 1 and E - 1 always tie
    router[3] = router[2] * 16  # expert 2's logit x 16: in the top k wherever positive; tied below
    router[e // 2] = router[3]
    w_sg = _bf(rng, (h,), h ** -0.5)
    got = _gemm(library, mem, stream, ROUTERS[name], x, router)
    want = moe.reference_logits(x, router)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
    np.testing.assert_array_equal(got[:, 1], got[:, e - 1])
    np.testing.assert_array_equal(got[:, 3], got[:, e // 2])
    ref = _f32_poisoned(mem, (m + 1) * e)
    library.kernel("moe", _key("logits", name)).launch(stream, {"x": mem.bf16(x), "w": mem.bf16(router), "out": ref},
                                                    {"M": m})
    kernel_logits = mem.read_f32(ref, np.empty((m + 1, e)))[:m]
    assert rel_err(got, kernel_logits) < 2e-5
    ids, wts = _route(library, mem, stream, name, got, x, w_sg)
    want_ids, want_wts = moe.reference_route(got, x, w_sg, k, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    top = ids[:, :k]
    # Where a tied pair is picked, the lower id comes first (both picked) or alone.
    for lo, hi in ((1, e - 1), (3, e // 2)):
        rows = np.isin(top, [lo, hi]).any(axis=1)
        assert all(lo in row for row in top[rows]), f"expert {hi} picked over its tie {lo}"
    assert np.isin(top, [3]).any(), "expert 3 (a scaled logit) was never picked: the tie checked nothing"
    np.testing.assert_allclose(wts, want_wts, rtol=1e-5, atol=1e-7)
