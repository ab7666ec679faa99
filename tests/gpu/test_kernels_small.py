"""Each memory-bound kernel against its NumPy reference on a real GPU.

Fresh random inputs per test, outputs poisoned with NaN before the launch (an element the kernel
forgets stays NaN), odd sizes (M = 1, M not a multiple of the rows per CTA), one extra poisoned row
past M that must stay untouched, and tolerances relative to the same-precision baseline.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import embedding, rmsnorm, rope, silu_mul
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("variant", rmsnorm.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 3, 37])
def test_rmsnorm(library, mem, stream, variant, m):
    rng = np.random.default_rng(1000 + m)
    cfg = variant.config
    h, mode = cfg["H"], cfg["mode"]
    tokens = m
    if mode == "gated_x":  # rows are (token, value head); z lives in each token's projection row
        m = tokens * cfg["heads"]
    x = _bf(rng, (m, h), 3.0)
    gated = mode in ("gated", "gated_x")
    w = _bf(rng, (h,), 1.0 if gated else 0.2)
    if gated:
        w = round_bf16(1.0 + w)  # plain weights sit near 1
    kernel = library.kernel("rmsnorm", variant.key)
    out = mem.poisoned((m + 1) * h)
    bufs = {"x": mem.bf16(x), "w": mem.bf16(w), "out": out}
    res = z = None
    if mode == "add_zc":
        res = _bf(rng, (m, h), 3.0)
        bufs["residual"] = mem.bf16(res)
    if mode == "gated":
        z = _bf(rng, (m, h), 2.0)
        bufs["z"] = mem.bf16(z)
    if mode == "gated_x":
        proj = _bf(rng, (tokens, cfg["z_stride"]), 2.0)
        bufs["z"] = mem.bf16(proj)
        z = proj[:, cfg["z_off"]:cfg["z_off"] + m // tokens * h].reshape(m, h)
    kernel.launch(stream, bufs, {"M": m})
    got = mem.read_bf16(out, (m + 1, h))
    assert np.isnan(got[m]).all(), "the row past M was written"
    want, new_res = rmsnorm.reference(x, w, mode=mode, residual=res, z=z, exact=True)
    base, base_res = rmsnorm.reference(x, w, mode=mode, residual=res, z=z)
    assert_close_to_baseline(got[:m], want, base, f"{variant.name} M={m}")
    if mode == "add_zc":
        got_res = mem.read_bf16(bufs["residual"], (m, h))
        np.testing.assert_array_equal(got_res, base_res)  # one rounding of x + residual, exactly


@pytest.mark.parametrize("variant", embedding.variants(), ids=lambda v: v.key)
def test_embedding(library, mem, stream, device, variant):
    from cute_kernels.bf16 import to_bits

    rng = np.random.default_rng(7)
    vocab, h = variant.config["V"], variant.config["H"]
    # The table is zeros except the rows the ids use (a full random table would be gigabytes).
    table_ptr = mem.alloc(vocab * h * 2)
    device.memset_d8(table_ptr, 0, vocab * h * 2, stream)
    ids_ok = rng.integers(0, vocab, size=8)
    ids_ok[0], ids_ok[1] = 0, vocab - 1
    rows = {int(i): _bf(rng, (h,)) for i in ids_ok}
    for i, row in rows.items():
        device.memcpy_htod(table_ptr + i * h * 2, to_bits(row), stream)
    stream.synchronize()
    kernel = library.kernel("embedding", variant.key)
    for ids in (ids_ok[:5], np.array([ids_ok[3], -1, vocab, 2**31 - 1, ids_ok[2]])):
        m = len(ids)
        out = mem.poisoned((m + 1) * h)
        err = mem.i32(np.zeros(1))
        kernel.launch(stream, {"ids": mem.i32(ids), "table": table_ptr, "out": out, "err": err}, {"M": m})
        got = mem.read_bf16(out, (m + 1, h))
        want = np.stack([rows.get(int(i), np.zeros(h, np.float32)) if 0 <= i < vocab else np.zeros(h, np.float32)
                         for i in ids])
        np.testing.assert_array_equal(got[:m], want)
        assert np.isnan(got[m]).all()
        bad = bool(((ids < 0) | (ids >= vocab)).any())
        assert mem.read_i32(err, 1)[0] == int(bad)


@pytest.mark.parametrize("variant", rope.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 45])
def test_rope(library, mem, stream, variant, m):
    rng = np.random.default_rng(11 + m)
    heads, d, rd = variant.config["heads"], variant.config["D"], variant.config["rotary_dims"]
    p = 4096
    cos, sin = rope.tables(p, rd, 1e7)
    cos, sin = round_bf16(cos), round_bf16(sin)
    x = _bf(rng, (m, heads, d), 2.0)
    positions = rng.integers(0, p, size=m)
    if m > 2:
        positions[1] = p + 5  # out of range: the token must pass through unrotated
    buf = mem.bf16(x)
    library.kernel("rope", variant.key).launch(
        stream, {"x": buf, "positions": mem.i32(positions), "cos": mem.bf16(cos), "sin": mem.bf16(sin)}, {"M": m, "P": p}
    )
    got = mem.read_bf16(buf, (m, heads, d))
    want = rope.reference(x, positions, cos, sin, exact=True)
    base = rope.reference(x, positions, cos, sin)
    np.testing.assert_array_equal(got[..., rd:], x[..., rd:])  # untouched dims
    if m > 2:
        np.testing.assert_array_equal(got[1], x[1])
    assert_close_to_baseline(got, want, base, f"{variant.name} M={m}")


@pytest.mark.parametrize("variant", silu_mul.variants(), ids=lambda v: v.key)
@pytest.mark.parametrize("m", [1, 19])
def test_silu_mul(library, mem, stream, variant, m):
    rng = np.random.default_rng(5 + m)
    inter = variant.config["I"]
    x = _bf(rng, (m, 2 * inter), 2.0)
    out = mem.poisoned((m + 1) * inter)
    library.kernel("silu_mul", variant.key).launch(stream, {"x": mem.bf16(x), "out": out}, {"M": m})
    got = mem.read_bf16(out, (m + 1, inter))
    assert np.isnan(got[m]).all()
    assert_close_to_baseline(got[:m], silu_mul.reference(x, exact=True), silu_mul.reference(x), f"{variant.name} M={m}")


def test_launch_checks(library, mem):
    """Bad sizes and missing buffers are refused before anything reaches the GPU."""
    from runtime.cuda.errors import LaunchError

    kernel = library.kernel("rmsnorm", "zc_h5120")
    with pytest.raises(LaunchError, match="M >= 1"):
        kernel.bind({"x": 256, "w": 256, "out": 256}, {"M": 0})
    with pytest.raises(LaunchError, match="buffer 'out'"):
        kernel.bind({"x": 256, "w": 256}, {"M": 4})
