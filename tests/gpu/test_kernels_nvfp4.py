"""The NVFP4 decode GEMV (`gemv_nvfp4`) against its references on a real GPU.

The reference is float64 of the dequantised weights; the same-precision baseline is
`gemv_nvfp4.reference` (code times block scale exactly, fp32 dot product, times the row's fp32
global, bf16 output). The kernel's only roundings are the fp32 accumulation (in the MMA's order
rather than NumPy's) and the final bf16 rounding, so its error against float64 must stay within
2x the baseline's (`assert_close_to_baseline`, as for gemv_fp8). Inputs: every code byte (both
nibbles over all 16 e2m1 codes, signed zeros included), e4m3 block scales over the finite range
with negative and zero ones, per-row globals of both signs and a zero row, NaN-poisoned outputs
with an extra row that must stay untouched, M = 1, 3, 8, the tiny model's shapes (K = 128 leaves
7 of 8 warps idle; a tail of 8 rows, fewer than a CTA's 16) and the 27B's. A second test checks
the decode bit for bit: one-hot activations read single weights back (each exact in bf16).
The wide variants (m16 / m32 in every row-group form and each of `gemv_nvfp4.WIDE_FORMS`) must
give every row the m8 launch's numbers over its block of 8 rows bit for bit (odd and full widths,
the row after M poisoned) and stay within 2x the baseline's error on the first and last 256 NVFP4
rows and the BF16 tail.
Every form of the family (`gemv_nvfp4.FORMS`: `lut`, `shift`, `shift_u8`, `shift_x`, `shift_h`,
`pf2`, `pf4`, `pf8`, `pf4_h`) runs each case against the same references (every output of shapes
up to 2048 rows; the first, a middle and the last 256 rows of wider ones, every other output checked
finite), and every form but
`shift_x` (which reorders the K slots inside each MMA) must equal the first form's output bit for
bit (the same fp32 sums in the same order); the one-hot test also covers subnormal block scales.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv_nvfp4
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline, assert_equals_m8_rows

pytestmark = pytest.mark.gpu


def _case(rng, m, n, nt, k):
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, k // 16), dtype=np.uint8)
    scales[(scales & 0x7F) == 0x7F] = 0x38  # 0x7F / 0xFF are NaN in e4m3fn; 0x38 is 1.0
    scales[0, 0] = 0x00
    # |code * scale| <= 6 * 448 (mean square ~8.6 * ~1e4): globals near 1 / (300 sqrt(K)) keep the outputs O(1).
    gscale = (rng.uniform(-1.0, 1.0, n) / (300 * np.sqrt(k))).astype(np.float32)
    gscale[-1] = 0.0
    tail = round_bf16(rng.standard_normal((nt, k)).astype(np.float32) * 0.05) if nt else None
    return x, codes, scales, gscale, tail


def _bufs(mem, device, stream, x, codes, scales, gscale, tail, out_rows):
    def upload(array):
        ptr = mem.alloc(max(array.nbytes, 16))
        device.memcpy_htod(ptr, np.ascontiguousarray(array), stream)
        stream.synchronize()
        return ptr

    n, nt = codes.shape[0], 0 if tail is None else tail.shape[0]
    bufs = {"x": mem.bf16(x), "w": upload(codes), "scale": upload(scales), "gscale": upload(gscale),
            "out": mem.poisoned(out_rows * (n + nt))}
    if nt:
        bufs["tail"] = mem.bf16(tail)
    return bufs


def _forms(name):
    """The m8 variants of shape `name`, one per form."""
    return [v for v in gemv_nvfp4.variants() if v.key.startswith(name + "_n") and v.config["MB"] == 8]


def _wide(name, mb, form):
    """The variants of shape `name` at width mb in decode form `form`, one per row-group form."""
    return [v for v in gemv_nvfp4.variants()
            if v.key.startswith(name + "_n") and v.config["MB"] == mb and v.config["form"] == form]


def _spans(n: int) -> list[tuple[int, int]]:
    """The NVFP4 rows whose outputs the references check: all of them up to 2048 rows, else the
    first, a middle and the last 256 (the float64 reference of a whole 27B weight costs seconds of
    CPU per case; the other outputs are checked finite and equal across the forms, and the decode
    of every code by the one-hot test)."""
    if n <= 2048:
        return [(0, n)]
    mid = n // 2 // 128 * 128
    return [(0, 256), (mid, mid + 256), (n - 256, n)]


def _references(x, codes, scales, gscale, tail, spans):
    """(float64, same-precision) references over the spans' rows, then the tail's."""
    parts = [(gemv_nvfp4.reference(x, codes[a:b], scales[a:b], gscale[a:b], exact=True),
              gemv_nvfp4.reference(x, codes[a:b], scales[a:b], gscale[a:b])) for a, b in spans]
    if tail is not None:
        parts.append((x.astype(np.float64) @ tail.astype(np.float64).T,
                      gemv_nvfp4.reference(x, codes[:1], scales[:1], gscale[:1], tail)[:, 1:]))
    return np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name", [s[0] for s in gemv_nvfp4.SHAPES])
def test_gemv_nvfp4(library, device, mem, stream, name, m):
    _, n, nt, k = next(s for s in gemv_nvfp4.SHAPES if s[0] == name)
    x, codes, scales, gscale, tail = _case(np.random.default_rng(n + 7 * m + k), m, n, nt, k)
    bufs = _bufs(mem, device, stream, x, codes, scales, gscale, tail, m + 1)
    spans = _spans(n)
    cols = np.concatenate([np.arange(a, b) for a, b in spans] + [np.arange(n, n + nt)])
    want, base = _references(x, codes, scales, gscale, tail, spans)
    forms = _forms(name)
    assert len(forms) == len(gemv_nvfp4.FORMS)
    first = None
    for v in forms:
        out = mem.poisoned((m + 1) * (n + nt))
        library.kernel("gemv_nvfp4", v.key).launch(stream, {**bufs, "out": out}, {"M": m})
        got = mem.read_bf16(out, (m + 1, n + nt))
        assert np.isnan(got[m]).all(), f"{v.key} wrote past M"
        assert np.all(got[:m, n - 1] == 0), f"{v.key}: the zero global's row"
        assert np.isfinite(got[:m]).all(), f"{v.key}: an output of the first M rows was not written"
        assert_close_to_baseline(got[:m, cols], want, base, f"gemv_nvfp4 {v.key} M={m}")
        first = got if first is None else first
        if v.config["decode"] != "shift_x":
            np.testing.assert_array_equal(got, first, err_msg=f"gemv_nvfp4 {v.key} M={m} against {forms[0].key}")


def test_gemv_nvfp4_decodes_every_weight_exactly(library, device, mem, stream):
    """Token t is one-hot at column t (t < 8): the output is weight column t of every row, which
    is exact in bf16 (code x scale has 6 significand bits; a global of 1 or a power of two adds
    none), so it must equal the float64 dequantisation bit for bit. Columns 0..7 cover all eight
    positions of a code word, whose four bytes run through 0..255 over every 64 rows."""
    name, n, nt, k = "tiny_o_proj", 256, 0, 256
    rng = np.random.default_rng(11)
    x = np.zeros((8, k), np.float32)
    x[np.arange(8), np.arange(8)] = 1.0
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    codes[:, :4] = np.arange(n * 4, dtype=np.int64).reshape(n, 4) % 256  # every byte in columns 0..7
    signs = rng.integers(0, 2, (n, k // 16), dtype=np.uint8) << 7
    # Finite e4m3 of both signs, subnormals (0x01..0x07) included: code * scale >= 2^-10 stays exact.
    scales = rng.integers(0x01, 0x7F, (n, k // 16), dtype=np.uint8) | signs
    gscale = np.exp2(rng.integers(-4, 5, n)).astype(np.float32)
    bufs = _bufs(mem, device, stream, x, codes, scales, gscale, None, 8)
    want = gemv_nvfp4.reference(x, codes, scales, gscale, exact=True)
    for v in _forms(name):
        out = mem.poisoned(8 * n)
        library.kernel("gemv_nvfp4", v.key).launch(stream, {**bufs, "out": out}, {"M": 8})
        got = mem.read_bf16(out, (8, n)).astype(np.float64)
        bad = np.argwhere(got != want)
        assert bad.size == 0, (f"{v.key}: {len(bad)} weights decoded wrong; first (token, row) {tuple(bad[0])}: "
                               f"got {got[tuple(bad[0])]}, want {want[tuple(bad[0])]}, code byte "
                               f"{codes[bad[0][1], bad[0][0] // 2]:#04x}, scale {scales[bad[0][1], 0]:#04x}")


@pytest.mark.parametrize("form", list(gemv_nvfp4.FORMS))
def test_gemv_nvfp4_is_batch_invariant(library, device, mem, stream, form):
    """Row 0 of an M = 8 launch equals the M = 1 launch bit for bit (decode buckets and the
    8-row prefill pieces rely on it)."""
    name, n, nt, k = gemv_nvfp4.SHAPES[0]
    x, codes, scales, gscale, tail = _case(np.random.default_rng(5), 8, n, nt, k)
    bufs = _bufs(mem, device, stream, x, codes, scales, gscale, tail, 1)
    kernel = library.kernel("gemv_nvfp4", next(v.key for v in _forms(name) if v.config["form"] == form))
    outs = {}
    for m in (1, 8):
        outs[m] = mem.poisoned(m * (n + nt))
        kernel.launch(stream, {**bufs, "out": outs[m]}, {"M": m})
    one, eight = mem.read_bf16(outs[1], (1, n + nt)), mem.read_bf16(outs[8], (8, n + nt))
    np.testing.assert_array_equal(one[0], eight[0])


def test_gemv_nvfp4_rejects_large_m(library):
    from runtime.cuda.errors import LaunchError

    v = gemv_nvfp4.variants()[1]
    with pytest.raises(LaunchError, match="M <= 8"):
        library.kernel("gemv_nvfp4", v.key).bind({"x": 256, "w": 256, "scale": 256, "gscale": 256, "out": 256},
                                                 {"M": 9})


WIDE_CASES = {16: (9, 13, 16), 32: (17, 25, 32)}  # MB -> row counts M


@pytest.mark.parametrize("name", list(gemv_nvfp4.WIDE_SHAPES))
def test_wide_gemv_nvfp4_rows_equal_the_m8_rows_and_the_reference(library, device, mem, stream, name):
    _, n, nt, k = next(s for s in gemv_nvfp4.SHAPES if s[0] == name)
    x, codes, scales, gscale, tail = _case(np.random.default_rng(n + k + 11), 32, n, nt, k)
    bufs = _bufs(mem, device, stream, x, codes, scales, gscale, tail, 33)
    width = n + nt
    spans = [(0, n)] if n <= 512 else [(0, 256), (n - 256, n)]  # the reference's NVFP4 rows, then the tail
    cols = np.concatenate([np.arange(a, b) for a, b in spans] + [np.arange(n, width)])
    for form in gemv_nvfp4.WIDE_FORMS:
        (m8_form,) = [v for v in _forms(name) if v.config["form"] == form]
        m8 = library.kernel("gemv_nvfp4", m8_form.key)
        for mb, counts in WIDE_CASES.items():
            variants = _wide(name, mb, form)
            assert [v.config["rform"] for v in variants] == [f"r{r}u{u}" for r, u in gemv_nvfp4.WIDE[mb]]
            for m in counts:
                # The m8 launches over the rows' blocks of 8, as the runner ran verification rows before.
                want = mem.poisoned((m + 1) * width)
                for r0 in range(0, m, 8):
                    m8.launch(stream, {**bufs, "x": bufs["x"] + r0 * k * 2, "out": want + r0 * width * 2},
                              {"M": min(8, m - r0)})
                ref = mem.read_bf16(want, (m + 1, width))
                parts = [(codes[a:b], scales[a:b], gscale[a:b]) for a, b in spans]
                exact = np.concatenate([gemv_nvfp4.reference(x[:m], *p, exact=True) for p in parts]
                                       + ([x[:m].astype(np.float64) @ tail.astype(np.float64).T] if nt else []), axis=1)
                base = np.concatenate([gemv_nvfp4.reference(x[:m], *p) for p in parts]
                                      + ([gemv_nvfp4.reference(x[:m], *parts[0], tail)[:, spans[0][1]:]] if nt else []),
                                      axis=1)
                for v in variants:
                    what = f"gemv_nvfp4 {v.key} M={m}"
                    out = mem.poisoned((m + 1) * width)
                    library.kernel("gemv_nvfp4", v.key).launch(stream, {**bufs, "out": out}, {"M": m})
                    got = mem.read_bf16(out, (m + 1, width))
                    assert_equals_m8_rows(got, ref, m, what)
                    assert_close_to_baseline(got[:m, cols], exact, base, what)


def test_wide_gemv_nvfp4_rejects_more_rows_than_its_width(library):
    from runtime.cuda.errors import LaunchError

    for mb in gemv_nvfp4.WIDE:
        v = _wide("tiny_o_proj", mb, gemv_nvfp4.WIDE_FORMS[0])[0]
        kernel = library.kernel("gemv_nvfp4", v.key)
        bufs = {"x": 256, "w": 256, "scale": 256, "gscale": 256, "out": 256}
        kernel.bind(bufs, {"M": mb})
        with pytest.raises(LaunchError, match=f"M <= {mb}"):
            kernel.bind(bufs, {"M": mb + 1})
