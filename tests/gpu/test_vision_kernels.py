"""The vision tower's kernels against their NumPy references on a real GPU (the tower as a whole:
`test_vision_cuda.py`).

Fresh random inputs per test, outputs poisoned with NaN before the launch, odd sizes (M = 1, M not
a multiple of the rows per CTA, a ragged last group), a poisoned row past M (or past the last group)
that must stay untouched, and errors bounded by twice those of the same-precision baseline.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_sm90, vision_attention, vision_bias, vision_norm, vision_pos, vision_rope
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


def _bf(rng, shape, scale=1.0, shift=0.0):
    return round_bf16((rng.standard_normal(shape) * scale + shift).astype(np.float32))


@pytest.mark.parametrize("variant", vision_bias.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 37, 300])
def test_vision_bias(library, mem, stream, variant, m):
    rng = np.random.default_rng(m)
    mode, n = variant.config["mode"], variant.config["N"]
    x, b = _bf(rng, (m, n), 2.0), _bf(rng, (n,), 0.5)
    bufs = {"x": mem.bf16(x), "b": mem.bf16(b)}
    res = None
    if mode == "residual":
        res = _bf(rng, (m + 1, n), 3.0)
        res[m] = np.nan
        bufs["res"] = target = mem.bf16(res)
        res = res[:m]
    else:
        bufs["out"] = target = mem.poisoned((m + 1) * n)
    library.kernel("vision_bias", variant.key).launch(stream, bufs, {"M": m})
    got = mem.read_bf16(target, (m + 1, n))
    assert np.isnan(got[m]).all(), "the row past M was written"
    assert_close_to_baseline(got[:m], vision_bias.reference(x, b, mode=mode, res=res, exact=True),
                             vision_bias.reference(x, b, mode=mode, res=res), f"{variant.name} M={m}")


def test_vision_bias_in_place(library, mem, stream):
    """The tower runs the qkv bias and the MLP activation in place (out = x): the same numbers as
    the kernel writing to another buffer, bit for bit (the device tanh is not NumPy's, so the
    reference is checked within tolerance, by test_vision_bias, not bit for bit)."""
    rng = np.random.default_rng(7)
    v = next(v for v in vision_bias.variants() if v.config["mode"] == "gelu_tanh")
    n, m = v.config["N"], 129
    x, b = _bf(rng, (m, n), 2.0), _bf(rng, (n,), 0.5)
    bias, ptr, out = mem.bf16(b), mem.bf16(x), mem.poisoned(m * n)
    library.kernel("vision_bias", v.key).launch(stream, {"x": ptr, "b": bias, "out": out}, {"M": m})
    library.kernel("vision_bias", v.key).launch(stream, {"x": ptr, "b": bias, "out": ptr}, {"M": m})
    apart = mem.read_bf16(out, (m, n))
    assert not np.isnan(apart).any()
    np.testing.assert_array_equal(mem.read_bf16(ptr, (m, n)), apart)


@pytest.mark.parametrize("variant", vision_norm.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 9, 301])
def test_vision_norm(library, mem, stream, variant, m):
    rng = np.random.default_rng(100 + m)
    width = variant.config["W"]
    x = _bf(rng, (m, width), 3.0, shift=20.0)  # a mean large against the spread: the two-pass variance
    w, b = round_bf16(1 + _bf(rng, (width,), 0.1)), _bf(rng, (width,), 0.1)
    out = mem.poisoned((m + 1) * width)
    library.kernel("vision_norm", variant.key).launch(
        stream, {"x": mem.bf16(x), "w": mem.bf16(w), "b": mem.bf16(b), "out": out}, {"M": m})
    got = mem.read_bf16(out, (m + 1, width))
    assert np.isnan(got[m]).all(), "the row past M was written"
    assert_close_to_baseline(got[:m], vision_norm.reference(x, w, b, exact=True), vision_norm.reference(x, w, b),
                             f"{variant.name} M={m}")


@pytest.mark.parametrize("variant", vision_rope.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 37])
def test_vision_rope(library, mem, stream, variant, m):
    rng = np.random.default_rng(200 + m)
    heads, d = variant.config["heads"], variant.config["D"]
    qkv = _bf(rng, (m + 1, 3 * heads * d), 2.0)
    angles = rng.uniform(0, 40, (m, d // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    ptr = mem.bf16(qkv)
    library.kernel("vision_rope", variant.key).launch(
        stream, {"qkv": ptr, "cos": mem.i32(cos.view(np.int32)), "sin": mem.i32(sin.view(np.int32))}, {"M": m})
    got = mem.read_bf16(ptr, (m + 1, 3 * heads * d))
    np.testing.assert_array_equal(got[m], qkv[m])   # the row past M
    width = heads * d
    np.testing.assert_array_equal(got[:m, 2 * width:], qkv[:m, 2 * width:])   # v untouched
    assert_close_to_baseline(got[:m], vision_rope.reference(qkv[:m], cos, sin, heads=heads, exact=True),
                             vision_rope.reference(qkv[:m], cos, sin, heads=heads), f"{variant.name} M={m}")


@pytest.mark.parametrize("variant", vision_attention.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("cu", [[0, 1], [0, 37], [0, 130, 265], [0, 64, 128, 192, 256], [0, 300]],
                         ids=lambda cu: "_".join(map(str, cu)))
def test_vision_attention(library, mem, stream, variant, cu):
    rng = np.random.default_rng(300 + len(cu) + cu[-1])
    heads, d = variant.config["heads"], variant.config["D"]
    width, rows = heads * d, cu[-1]
    qkv = _bf(rng, (rows, 3 * width), 1.5)
    out = mem.poisoned((rows + 1) * width)
    bounds = np.asarray(cu, np.int32)
    library.kernel("vision_attention", variant.key).launch(
        stream, {"qkv": mem.bf16(qkv), "cu": mem.i32(bounds), "out": out},
        {"M": rows, "G": len(cu) - 1, "S": int(np.diff(bounds).max())})
    got = mem.read_bf16(out, (rows + 1, width))
    assert np.isnan(got[rows]).all(), "a row past the last group was written"
    assert_close_to_baseline(got[:rows], vision_attention.reference(qkv, bounds, heads=heads, exact=True),
                             vision_attention.reference(qkv, bounds, heads=heads), f"{variant.name} cu={cu}")


@pytest.mark.parametrize("variant", vision_pos.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 37, 300])
def test_vision_pos(library, mem, stream, variant, m):
    rng = np.random.default_rng(500 + m)
    width, rows = variant.config["W"], variant.config["P"]
    table = _bf(rng, (rows, width), 0.3)
    idx = rng.integers(0, rows, (m, 4)).astype(np.int32)
    wts = rng.dirichlet(np.ones(4), m).astype(np.float32)  # bilinear weights: non-negative, sum 1
    out = mem.poisoned((m + 1) * width)
    library.kernel("vision_pos", variant.key).launch(
        stream, {"table": mem.bf16(table), "idx": mem.i32(idx), "wts": mem.i32(wts.view(np.int32)), "out": out},
        {"M": m})
    got = mem.read_bf16(out, (m + 1, width))
    assert np.isnan(got[m]).all(), "the row past M was written"
    assert_close_to_baseline(got[:m], vision_pos.reference(table, idx, wts, exact=True),
                             vision_pos.reference(table, idx, wts), f"{variant.name} M={m}")


VIT_GEMMS = [v for v in gemm_sm90.variants() if "vit_" in v.key]


@pytest.mark.parametrize("variant", VIT_GEMMS, ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 257])
def test_vision_gemm_shapes(library, mem, stream, variant, m):
    """The tower's projections (K = 4304 is the first K that is not a multiple of the 64-deep k-tile)."""
    rng = np.random.default_rng(400 + m)
    n, k = variant.config["N"], variant.config["K"]
    x, w = _bf(rng, (m, k)), _bf(rng, (n, k), 1.0 / np.sqrt(k))
    out = mem.poisoned((m + 1) * n)
    library.kernel("gemm_sm90", variant.key).launch(stream, {"x": mem.bf16(x), "w": mem.bf16(w), "out": out},
                                                    {"M": m})
    got = mem.read_bf16(out, (m + 1, n))
    assert np.isnan(got[m]).all(), "wrote past M"
    assert_close_to_baseline(got[:m], gemm_sm90.reference(x, w, exact=True), gemm_sm90.reference(x, w),
                             f"{variant.name} M={m}")
