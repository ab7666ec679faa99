"""`gemm_bs_sm120` (NVFP4 and FP8 block-scaled mma.sync GEMMs) on an sm_120a GPU (RTX 50-series)
against its NumPy references. Every test skips on any other device: the family is built for
sm_120a only (on an H200 its kernels are not in the library at all).

Both kinds are checked against float64 of the dequantised operands with the same-precision
baseline (`reference(exact=False)`: the kernel's order of fp32 roundings) as the yardstick
(`assert_close_to_baseline`), plus an elementwise bound |got - exact| <= 2^-8 |exact| + 2^-10 mag
(mag = the sum of |products|: room for the bf16 output rounding and the MMA's accumulation; a
wrong row, column, scale or nibble order is off by O(1) of mag). Outputs are poisoned with NaN and
one extra row must stay untouched. M runs odd (1, 65: a partial 64-row tile, 300) on the test
shape, and the 27B's shapes are checked on a few rows and columns."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_bs_sm120 as fam

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm120_only(device):
    if device.arch not in fam.ARCHES:
        pytest.skip(f"gemm_bs_sm120 is built for {', '.join(fam.ARCHES)} only; this device is {device.arch}")


def _e4m3(rng, *shape, low=0x00, high=0x7F):
    """e4m3 codes of both signs in [low, high) (no NaN: 0x7F / 0xFF)."""
    return (rng.integers(low, high, shape, dtype=np.uint8) | (rng.integers(0, 2, shape, dtype=np.uint8) << 7))


def _nvfp4_case(rng, m, n, k):
    x, w = rng.integers(0, 256, (m, k // 2), dtype=np.uint8), rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    # Block scales 2^-3 .. 2^3 or so (e4m3 codes 0x20..0x4F), a zero block on each side.
    xs, ws = _e4m3(rng, m, k // 16, low=0x20, high=0x50), _e4m3(rng, n, k // 16, low=0x20, high=0x50)
    xs[0, 0] = 0x00
    ws[-1, -1] = 0x80
    x_g = np.array([rng.uniform(0.5, 2.0)], np.float32) / np.float32(k**0.5)
    w_g = rng.uniform(-1.0, 1.0, n).astype(np.float32) / np.float32(36.0)
    return {"x": x, "x_scale": xs, "x_gscale": x_g, "w": w, "w_scale": ws, "w_gscale": w_g}


def _fp8_case(rng, m, n, k):
    kb = k // 128
    x_scale = rng.uniform(0.5, 1.5, (m, kb)).astype(np.float32) / np.float32(448 * k**0.25)
    w_scale = (rng.uniform(-1.5, 1.5, (n // 128, kb)) / (448 * k**0.25)).astype(np.float32)
    x_scale[0, -1] = 0.0
    w_scale[-1, 0] = 0.0
    return {"x": _e4m3(rng, m, k), "x_scale": x_scale, "w": _e4m3(rng, n, k), "w_scale": w_scale}


def _reference(kind, ops, rows=slice(None), cols=slice(None), exact=False):
    """The reference on a subset of rows and output columns (whole 128-row weight blocks for FP8)."""
    if kind == "nvfp4":
        return fam.reference_nvfp4(ops["x"][rows], ops["x_scale"][rows], ops["x_gscale"], ops["w"][cols],
                                   ops["w_scale"][cols], ops["w_gscale"][cols], exact=exact)
    blocks = np.unique(np.arange(ops["w"].shape[0])[cols] // 128)
    return fam.reference_fp8(ops["x"][rows], ops["x_scale"][rows], ops["w"][cols], ops["w_scale"][blocks],
                             exact=exact)


def _magnitude(kind, ops, rows, cols):
    """sum_k |x_k w_k| of the dequantised operands (codes and scales with their sign bits cleared)."""
    pos = {name: (a & 0x77 if name in ("x", "w") and kind == "nvfp4" else a & 0x7F) if a.dtype == np.uint8
           else np.abs(a) for name, a in ops.items()}
    return _reference(kind, pos, rows, cols, exact=True)


def _run(library, device, mem, stream, kind, key, ops, m, n):
    out = mem.poisoned((m + 1) * n)
    bufs = {name: mem.raw(a) for name, a in ops.items()}
    library.kernel(fam.FAMILY, key).launch(stream, {**bufs, "out": out}, {"M": m})
    return mem.read_bf16(out, (m + 1, n))


def _check(got, kind, ops, rows, cols, what):
    exact = _reference(kind, ops, rows, cols, exact=True)
    assert_close_to_baseline(got, exact, _reference(kind, ops, rows, cols), what, floor=2.0**-11)
    bound = 2.0**-8 * np.abs(exact) + 2.0**-10 * _magnitude(kind, ops, rows, cols)
    worst = np.unravel_index(np.argmax(np.abs(got - exact) - bound), got.shape)
    assert np.all(np.abs(got - exact) <= bound), f"{what}: at {worst} got {got[worst]} want {exact[worst]}"


@pytest.mark.parametrize("kind", fam.KINDS)
@pytest.mark.parametrize("m", [1, 65, 300])
def test_small_shape_at_odd_m(library, device, mem, stream, kind, m):
    v = next(v for v in fam.variants() if v.config["kind"] == kind and "_test_" in v.key)
    n, k = v.config["N"], v.config["K"]
    rng = np.random.default_rng(m)
    ops = (_nvfp4_case if kind == "nvfp4" else _fp8_case)(rng, m, n, k)
    got = _run(library, device, mem, stream, kind, v.key, ops, m, n)
    assert np.isnan(got[m]).all(), "wrote past M"
    _check(got[:m], kind, ops, slice(None), slice(None), f"{v.key} M={m}")


@pytest.mark.parametrize("kind", fam.KINDS)
@pytest.mark.parametrize("name,m", [("gdn_in", 1000), ("o_proj", 4096), ("attn_qkv", 300), ("gate_up", 129),
                                    ("down", 300)])
def test_model_shapes(library, device, mem, stream, kind, name, m):
    """All outputs finite and written; the exact products on 9 rows (first, last, tile edges) and
    three 128-column blocks (first, middle, last)."""
    _, n, k = next(s for s in fam.SHAPES if s[0] == name)
    key = f"{kind}_{name}_n{n}_k{k}"
    rng = np.random.default_rng(n + m)
    ops = (_nvfp4_case if kind == "nvfp4" else _fp8_case)(rng, m, n, k)
    got = _run(library, device, mem, stream, kind, key, ops, m, n)
    assert np.isfinite(got[:m]).all() and np.isnan(got[m]).all()
    rows = np.unique(np.clip([0, 1, 63, 64, m // 2, m - 65, m - 2, m - 1, 127], 0, m - 1))
    cols = np.concatenate([np.arange(b * 128, b * 128 + 128) for b in (0, n // 256, n // 128 - 1)])
    _check(got[rows][:, cols], kind, ops, rows, cols, f"{key} M={m}")
