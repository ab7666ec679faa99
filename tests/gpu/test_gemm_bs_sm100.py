"""`gemm_bs_sm100` (tcgen05 block-scaled GEMMs, NVFP4 and MX-FP8) on a Blackwell sm_100a GPU.

NEVER RUN YET: written with the kernels, which have only been compiled (no Blackwell GPU here).
Every test skips, saying so, on a device of another arch (the kernels are built for sm_100a only).

Operands come from this repo's formats through the family's converters: NVFP4 from the
artifact's quantiser (`nvfp4_quantize`, packed codes + e4m3 scales + fp32 global) via
`nvfp4_operand`, MX-FP8 weights from Qwen's FP8 form (e4m3 + 128 x 128 fp32 scales) via
`mxfp8_from_block128` and activations from `mxfp8_quantize`. Exact = float64 of the dequantised
operands times the globals (`reference(exact=True)`); baseline = the fp32-accumulator model. Both
must hold: the relative error at most 2x the baseline's plus 2^-16, and elementwise
|got - exact| <= 2^-8 |exact| + 2^-16 mag (mag = sum_k |a_k b_k| of the dequantised operands): bf16
rounding is 2^-9 of the result and the tensor core's fp32 accumulation ~K 2^-24 of mag; a wrong
scale position, row or column is off by O(1) of mag. Outputs are poisoned with NaN and one row
past M must stay untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_bs_sm100 as bs
from runtime.artifact.formats import nvfp4_quantize

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


@pytest.fixture
def lib(device, request):
    if device.arch != bs.ARCH:
        pytest.skip(f"gemm_bs_sm100 is built for {bs.ARCH} only; this device is {device.arch}")
    return request.getfixturevalue("library")


def _nvfp4_case(rng, m, n, k):
    """(a, a_sf, b, b_sf, a_g, b_g): row-major scale bytes, per-row weight globals."""
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-3, 4, (m, 1)))
    x[0, :16] = 0.0  # an all-zero scale block
    a, a_sf, a_g = nvfp4_quantize(x.astype(np.float32))
    w = rng.standard_normal((n, k)) * 0.05
    # Two row groups with their own globals, like a fused projection's parts.
    b, b_sf, b_g = nvfp4_quantize(w.astype(np.float32), row_groups=2)
    return a, a_sf, float(a_g[0]), b, b_sf, np.repeat(b_g, n // 2).astype(np.float32)


def _mxfp8_case(rng, m, n, k):
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-6, 7, (m, 1)))
    a, a_sf = bs.mxfp8_quantize(x)
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # NaN codes
    block = rng.uniform(0.5, 1.5, (-(-n // 128), -(-k // 128))) * 1e-4
    b, b_sf = bs.mxfp8_from_block128(codes, block)
    return a, a_sf, 1.0, b, b_sf, np.full(n, 0.5, np.float32)


CASES = {"nvfp4": _nvfp4_case, "mxfp8": _mxfp8_case}


def _run(lib, device, mem, stream, key, fmt, a, a_sf, a_g, b, b_sf, b_g):
    m, n = a.shape[0], b.shape[0]
    out = mem.poisoned((m + 1) * n)
    bufs = {"a": mem.raw(a), "b": mem.raw(b),
            "a_scale": mem.raw(bs.tile_scales(a_sf)),
            "b_scale": mem.raw(bs.tile_scales(b_sf)),
            "a_gscale": mem.raw(np.array([a_g], np.float32)),
            "b_gscale": mem.raw(b_g), "out": out}
    lib.kernel(bs.FAMILY, key).launch(stream, bufs, {"M": m})
    return mem.read_bf16(out, (m + 1, n))


def _check(got, fmt, a, a_sf, a_g, b, b_sf, b_g, what):
    exact = bs.reference(fmt, a, a_sf, b, b_sf, a_g, b_g, exact=True)
    base = bs.reference(fmt, a, a_sf, b, b_sf, a_g, b_g)
    assert_close_to_baseline(got, exact, base, what, floor=2.0**-16)
    mag = np.abs(bs.dequant(fmt, a, a_sf)) @ np.abs(bs.dequant(fmt, b, b_sf)).T * abs(a_g) * np.abs(b_g)[None, :]
    bound = 2.0**-8 * np.abs(exact) + 2.0**-16 * mag
    worst = np.unravel_index(np.argmax(np.abs(got - exact) - bound), got.shape)
    assert np.all(np.abs(got - exact) <= bound), f"{what}: at {worst} got {got[worst]} want {exact[worst]}"


@pytest.mark.parametrize("fmt", list(bs.FORMATS))
@pytest.mark.parametrize("m", [1, 129, 300])
def test_small_shape_at_odd_m(lib, device, mem, stream, fmt, m):
    v = next(v for v in bs.variants() if v.config["format"] == fmt and v.key.startswith(f"{fmt}_test_"))
    n, k = v.config["N"], v.config["K"]
    case = CASES[fmt](np.random.default_rng(m), m, n, k)
    got = _run(lib, device, mem, stream, v.key, fmt, *case)
    assert np.isnan(got[m]).all(), "wrote past M"
    _check(got[:m], fmt, *case, f"{v.key} M={m}")


@pytest.mark.parametrize("fmt", list(bs.FORMATS))
@pytest.mark.parametrize("name,m", [("gdn_in", 1000), ("o_proj", 4096), ("attn_qkv", 300), ("gate_up", 300),
                                    ("down", 300)])
def test_model_shapes(lib, device, mem, stream, fmt, name, m):
    """Every output finite and written; exact products on 9 rows (first, last, tile edges) and
    three 256-column tiles (first, middle, last)."""
    _, n, k = next(s for s in bs.SHAPES if s[0] == name)
    a, a_sf, a_g, b, b_sf, b_g = CASES[fmt](np.random.default_rng(n + m), m, n, k)
    got = _run(lib, device, mem, stream, f"{fmt}_{name}_n{n}_k{k}", fmt, a, a_sf, a_g, b, b_sf, b_g)
    assert np.isfinite(got[:m]).all() and np.isnan(got[m]).all()
    rows = np.array([0, 1, 127, 128, m // 2, m - 129, m - 2, m - 1, 255]) % m
    tiles = [0, n // 512, n // 256 - 1]
    cols = np.concatenate([np.arange(t * 256, t * 256 + 256) for t in tiles])
    _check(got[rows][:, cols], fmt, a[rows], a_sf[rows], a_g, b[cols], b_sf[cols], b_g[cols], f"{fmt} {name} M={m}")
