"""The FP8 decode GEMV (`gemv_fp8`) against its references on a real GPU.

The reference is float64 of the dequantised weights; the same-precision baseline is
`gemv_fp8.reference` (per-128-block fp32 partials times the fp32 scale, fp32 sum, bf16 output).
Inputs: random e4m3 codes over the whole finite range, block scales of both signs with one zero
block, NaN-poisoned outputs with an extra row that must stay untouched, odd M, the tiny model's
shapes (K = 128 leaves 7 of 8 warps idle; tails of 8 rows, fewer than a CTA's 16) and the 27B's.
Every form of the family (`gemv_fp8.FORMS`: `cvt`, `shift`, `shift_u8`, `cvt_u8_pf2`, `cvt_u8_pf4`) runs
each case against the same reference (on every output of shapes up to 2048 rows; on the first, a
middle and the last 256 rows of wider ones, every other output checked finite) and must equal the
first form's output bit for bit on every output (all
compute the same fp32 sums in the same order); a one-hot test checks every code's decode bit for
bit in every form.

The wide variants (m16 / m32 in every row-group form, `gemv_fp8.WIDE`) run verification steps'
rows in one launch, so every row must equal, bit for bit, the m8 launch over its block of 8 rows
(cute_kernels/gemv_fp8.py): checked on every output of the 27B's and the tiny model's shapes at
odd and full widths (M = 9, 13, 16; 17, 25, 32), with the row after M poisoned, and against the
float64 reference (within 2x the same-precision baseline `gemv_fp8.reference`) on the first and
last 256 FP8 rows (two scale blocks each) and the whole BF16 tail.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv_fp8
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline, assert_equals_m8_rows

pytestmark = pytest.mark.gpu


def _case(rng, m, n, nt, k):
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00  # 0x7F / 0xFF are NaN in e4m3fn
    # |code| <= 448: scales near 1 / (448 sqrt(K)) keep the outputs O(1).
    scales = (rng.uniform(-1.0, 1.0, (-(-n // 128), k // 128)) / (448 * np.sqrt(k))).astype(np.float32)
    scales[-1, 0] = 0.0
    tail = round_bf16(rng.standard_normal((nt, k)).astype(np.float32) * 0.05) if nt else None
    return x, codes, scales, tail


def _forms(name):
    """The m8 variants of shape `name`, one per decode form."""
    return [v for v in gemv_fp8.variants() if v.key.startswith(name + "_n") and v.config["MB"] == 8]


def _wide(name, mb):
    """The variants of shape `name` at width mb, one per row-group form."""
    return [v for v in gemv_fp8.variants() if v.key.startswith(name + "_n") and v.config["MB"] == mb]


def _spans(n: int) -> list[tuple[int, int]]:
    """The FP8 rows whose outputs the references check: all of them up to 2048 rows, else the
    first, a middle and the last 256 (whole scale blocks). The float64 reference of a whole 27B
    weight costs ~1.4 GB and seconds of CPU per case: the wider shapes' other outputs are checked
    finite and equal across the forms, and their decode by the one-hot test."""
    if n <= 2048:
        return [(0, n)]
    mid = n // 2 // 128 * 128
    return [(0, 256), (mid, mid + 256), (n - 256, n)]


def _references(x, codes, scales, tail, spans):
    """(float64, same-precision) references over the spans' rows, then the tail's."""
    parts = [(gemv_fp8.reference(x, codes[a:b], scales[a // 128:-(-b // 128)], exact=True),
              gemv_fp8.reference(x, codes[a:b], scales[a // 128:-(-b // 128)])) for a, b in spans]
    if tail is not None:
        parts.append((x.astype(np.float64) @ tail.astype(np.float64).T,
                      gemv_fp8.reference(x, codes[:128], scales[:1], tail)[:, min(128, codes.shape[0]):]))
    return np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name", [s[0] for s in gemv_fp8.SHAPES])
def test_gemv_fp8(library, device, mem, stream, name, m):
    _, n, nt, k = next(s for s in gemv_fp8.SHAPES if s[0] == name)
    rng = np.random.default_rng(n + 7 * m + k)
    x, codes, scales, tail = _case(rng, m, n, nt, k)
    bufs = {"x": mem.bf16(x), "w": mem.raw(codes), "scale": mem.raw(scales)}
    if nt:
        bufs["tail"] = mem.bf16(tail)
    spans = _spans(n)
    cols = np.concatenate([np.arange(a, b) for a, b in spans] + [np.arange(n, n + nt)])
    want, base = _references(x, codes, scales, tail, spans)
    forms = _forms(name)
    assert len(forms) == len(gemv_fp8.FORMS)
    first = None
    for v in forms:
        out = mem.poisoned((m + 1) * (n + nt))
        library.kernel("gemv_fp8", v.key).launch(stream, {**bufs, "out": out}, {"M": m})
        got = mem.read_bf16(out, (m + 1, n + nt))
        assert np.isnan(got[m]).all(), f"{v.key} wrote past M"
        assert np.isfinite(got[:m]).all(), f"{v.key}: an output of the first M rows was not written"
        assert_close_to_baseline(got[:m, cols], want, base, f"gemv_fp8 {v.key} M={m}")
        first = got if first is None else first
        np.testing.assert_array_equal(got, first, err_msg=f"gemv_fp8 {v.key} M={m} against {forms[0].key}")


def test_gemv_fp8_decodes_every_code_exactly(library, device, mem, stream):
    """Token t is one-hot at column t (t < 8) and the block scales are powers of two: the output
    is weight column t of every row, exact in bf16 (every e4m3 value is a bf16 value), so every
    form must equal the float64 dequantisation bit for bit. Columns 0..7 of the 256 rows run
    through all 256 codes (the NaN codes 0x7F / 0xFF replaced by zeros of both signs)."""
    name, n, nt, k = "tiny_o_proj", 256, 0, 256
    x = np.zeros((8, k), np.float32)
    x[np.arange(8), np.arange(8)] = 1.0
    codes = np.random.default_rng(13).integers(0, 256, (n, k), dtype=np.uint8)
    codes[:, :8] = (np.arange(n * 8) % 256).reshape(n, 8)
    codes[codes == 0x7F] = 0x00
    codes[codes == 0xFF] = 0x80
    scales = np.array([[0.25, 2.0], [-1.0, 8.0]], np.float32)  # [cdiv(256, 128), 256 / 128]
    bufs = {"x": mem.bf16(x), "w": mem.raw(codes), "scale": mem.raw(scales)}
    want = gemv_fp8.reference(x, codes, scales, exact=True)
    for v in _forms(name):
        out = mem.poisoned(8 * n)
        library.kernel("gemv_fp8", v.key).launch(stream, {**bufs, "out": out}, {"M": 8})
        got = mem.read_bf16(out, (8, n)).astype(np.float64)
        bad = np.argwhere(got != want)
        assert bad.size == 0, (f"{v.key}: {len(bad)} codes decoded wrong; first (token, row) {tuple(bad[0])}: got "
                               f"{got[tuple(bad[0])]}, want {want[tuple(bad[0])]}, code "
                               f"{codes[bad[0][1], bad[0][0]]:#04x}")


@pytest.mark.parametrize("form", list(gemv_fp8.FORMS))
def test_gemv_fp8_is_batch_invariant(library, device, mem, stream, form):
    """Row 0 of an M = 8 launch equals the M = 1 launch bit for bit (decode buckets and the
    8-row prefill pieces rely on it)."""
    name, n, nt, k = gemv_fp8.SHAPES[0]
    x, codes, scales, tail = _case(np.random.default_rng(5), 8, n, nt, k)
    v = next(v for v in _forms(name) if v.config["form"] == form)
    bufs = {"x": mem.bf16(x), "w": mem.raw(codes), "scale": mem.raw(scales),
            "tail": mem.bf16(tail)}
    kernel = library.kernel("gemv_fp8", v.key)
    outs = {}
    for m in (1, 8):
        outs[m] = mem.poisoned(m * (n + nt))
        kernel.launch(stream, {**bufs, "out": outs[m]}, {"M": m})
    one, eight = mem.read_bf16(outs[1], (1, n + nt)), mem.read_bf16(outs[8], (8, n + nt))
    np.testing.assert_array_equal(one[0], eight[0])


def test_gemv_fp8_rejects_large_m(library):
    from runtime.cuda.errors import LaunchError

    v = gemv_fp8.variants()[1]
    with pytest.raises(LaunchError, match="M <= 8"):
        library.kernel("gemv_fp8", v.key).bind({"x": 256, "w": 256, "scale": 256, "out": 256}, {"M": 9})


WIDE_CASES = {16: (9, 13, 16), 32: (17, 25, 32)}  # MB -> row counts M


@pytest.mark.parametrize("name", list(gemv_fp8.WIDE_SHAPES))
def test_wide_gemv_fp8_rows_equal_the_m8_rows_and_the_reference(library, device, mem, stream, name):
    _, n, nt, k = next(s for s in gemv_fp8.SHAPES if s[0] == name)
    x, codes, scales, tail = _case(np.random.default_rng(n + k + 11), 32, n, nt, k)
    bufs = {"x": mem.bf16(x), "w": mem.raw(codes), "scale": mem.raw(scales)}
    if nt:
        bufs["tail"] = mem.bf16(tail)
    width = n + nt
    # The reference's FP8 rows: the first and last 256 (whole scale blocks) or all of them, then the tail.
    spans = [(0, n)] if n <= 512 else [(0, 256), (n - 256, n)]
    cols = np.concatenate([np.arange(a, b) for a, b in spans] + [np.arange(n, width)])
    (m8_cvt,) = [v for v in _forms(name) if v.config["form"] == "cvt"]
    m8 = library.kernel("gemv_fp8", m8_cvt.key)
    for mb, counts in WIDE_CASES.items():
        variants = _wide(name, mb)
        assert [v.config["rform"] for v in variants] == [f"r{r}u{u}" for r, u in gemv_fp8.WIDE[mb]]
        for m in counts:
            # The m8 launches over the rows' blocks of 8, as the runner ran verification rows before.
            want = mem.poisoned((m + 1) * width)
            for r0 in range(0, m, 8):
                m8.launch(stream, {**bufs, "x": bufs["x"] + r0 * k * 2, "out": want + r0 * width * 2},
                          {"M": min(8, m - r0)})
            ref = mem.read_bf16(want, (m + 1, width))
            exact = np.concatenate([gemv_fp8.reference(x[:m], codes[a:b], scales[a // 128:b // 128], exact=True)
                                    for a, b in spans]
                                   + ([x[:m].astype(np.float64) @ tail.astype(np.float64).T] if nt else []), axis=1)
            base = np.concatenate([gemv_fp8.reference(x[:m], codes[a:b], scales[a // 128:b // 128]) for a, b in spans]
                                  + ([gemv_fp8.reference(x[:m], codes[:128], scales[:1], tail)[:, 128:]] if nt else []),
                                  axis=1)
            for v in variants:
                what = f"gemv_fp8 {v.key} M={m}"
                out = mem.poisoned((m + 1) * width)
                library.kernel("gemv_fp8", v.key).launch(stream, {**bufs, "out": out}, {"M": m})
                got = mem.read_bf16(out, (m + 1, width))
                assert_equals_m8_rows(got, ref, m, what)
                assert_close_to_baseline(got[:m, cols], exact, base, what)


def test_wide_gemv_fp8_rejects_more_rows_than_its_width(library):
    from runtime.cuda.errors import LaunchError

    for mb in gemv_fp8.WIDE:
        v = _wide("tiny_o_proj", mb)[0]
        kernel = library.kernel("gemv_fp8", v.key)
        kernel.bind({"x": 256, "w": 256, "scale": 256, "out": 256}, {"M": mb})
        with pytest.raises(LaunchError, match=f"M <= {mb}"):
            kernel.bind({"x": 256, "w": 256, "scale": 256, "out": 256}, {"M": mb + 1})
