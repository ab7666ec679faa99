"""The KV page formats' NumPy contract (`runtime.model.kv_format`): page sizes, the e4m3 rounding
(nearest-even, saturation, subnormals, signed zero), per token-head quantisation and the page
byte layout the GPU kernels follow. Expected values are written out by hand from the formats'
definitions (e4m3: sign, 4 exponent bits of bias 7, 3 mantissa bits)."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels.gemv_fp8 import e4m3_values
from runtime.model import kv_format as kf


def test_bytes_per_token_and_page():
    # K + V per token and KV head at D = 256 (docs/serving.md's table).
    assert [kf.token_head_bytes(f, 256) for f in kf.FORMATS] == [1024, 520, 520]
    # One layer's K page of the 27B (Hkv 4): 64 * 4 * 256 codes + 64 * 4 fp32 scales.
    assert kf.page_bytes("fp8", 4, 256) == 65536 + 1024 == kf.page_bytes("int8", 4, 256)
    assert kf.page_bytes("bf16", 4, 256) == 131072
    assert kf.scale_offset(4, 256) == 65536
    with pytest.raises(ValueError, match="'fp4' is not one of bf16, fp8, int8"):
        kf.page_bytes("fp4", 4, 256)


def test_e4m3_decode_matches_the_fp8_gemv_reference():
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(kf.e4m3_decode(codes), e4m3_values(codes))
    assert kf.e4m3_decode(np.array([0x38, 0x7E, 0x01, 0x08, 0xFE], np.uint8)).tolist() == \
        [1.0, 448.0, 2.0 ** -9, 2.0 ** -6, -448.0]


@pytest.mark.parametrize("value, code", [
    (1.0, 0x38), (448.0, 0x7E), (-448.0, 0xFE),
    (464.0, 0x7E), (500.0, 0x7E), (1e30, 0x7E), (-1e30, 0xFE),   # saturated, never NaN
    (1.0625, 0x38),          # halfway 1 and 1.125: the even code
    (1.1875, 0x3A),          # halfway 1.125 and 1.25: the even code
    (1.07, 0x39),
    (2.0 ** -9, 0x01), (3 * 2.0 ** -9, 0x03),                       # subnormals
    (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02),                     # ties among subnormals
    (0.9375 * 2.0 ** -6, 0x08),                                     # tie at the first normal
    (2.0 ** -6, 0x08), (0.875 * 2.0 ** -6, 0x07),
    (0.0, 0x00), (-0.0, 0x80), (-2.0 ** -11, 0x80),                # zero keeps its sign
    (240.0, 0x77), (256.0, 0x78),
])
def test_e4m3_encode(value, code):
    assert int(kf.e4m3_encode(np.array([value], np.float32))[0]) == code


def test_e4m3_encode_round_trips_every_finite_code():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    np.testing.assert_array_equal(kf.e4m3_encode(kf.e4m3_decode(codes).astype(np.float32)), codes)


def test_quantise_exact_rows():
    # amax 448 (fp8) and 127 (int8) make the scale exactly 1: the codes are the rounded values.
    fp8 = np.array([[448.0, 1.0625, -3 * 2.0 ** -10, 2.0 ** -10, -240.0, 0.0, -0.0, 2.5]], np.float32)
    codes, scale = kf.quantise(fp8, "fp8")
    assert scale.tolist() == [1.0]
    assert codes[0].tolist() == [0x7E, 0x38, 0x82, 0x00, 0xF7, 0x00, 0x00, 0x42]
    i8 = np.array([[127.0, -2.5, 0.5, 3.5, -127.0, -0.0, 1.49, -126.6]], np.float32)
    codes, scale = kf.quantise(i8, "int8")
    assert scale.tolist() == [1.0]
    assert codes[0].view(np.int8).tolist() == [127, -2, 0, 4, -127, 0, 1, -127]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_zero_rows_get_scale_zero_and_code_zero(fmt):
    x = np.zeros((3, 16), np.float32)
    x[1, 5] = -0.0
    x[2] = 0.5
    codes, scale = kf.quantise(x, fmt)
    assert scale[:2].tolist() == [0.0, 0.0] and not codes[:2].any()
    assert scale[2] == np.float32(0.5) / np.float32(kf.QMAX[fmt])
    np.testing.assert_array_equal(kf.dequantise(codes, scale, fmt)[:2], 0.0)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantisation_error_within_half_a_step(fmt):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((200, 256)) * np.exp(rng.uniform(-8, 8, (200, 1)))).astype(np.float32)
    codes, scale = kf.quantise(x, fmt)
    err = np.abs(kf.dequantise(codes, scale, fmt) - x)
    s = scale.astype(np.float64)[:, None]
    if fmt == "int8":
        bound = 0.5 * s  # half an integer step (plus fp32 division rounding)
    else:  # half an e4m3 step: 2^-4 relative for normals, 2^-10 absolute (times scale) below 2^-6
        bound = np.maximum(np.abs(x) / s * 2.0 ** -4, 2.0 ** -10) * s
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    # Each row's amax is represented to within its rounding: it takes the largest code.
    top = np.abs(kf.dequantise(codes, scale, fmt)).max(axis=1)
    np.testing.assert_allclose(top, np.abs(x).max(axis=1), rtol=2.0 ** -4)


def test_page_layout_bytes():
    hkv, d, pages = 2, 8, 3
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 256, (pages * 64, hkv, d), dtype=np.uint8)
    scales = rng.standard_normal((pages * 64, hkv)).astype(np.float32)
    pool = kf.pack_pages(codes, scales)
    pb = kf.page_bytes("fp8", hkv, d)
    assert pool.shape == (pages * pb,) and pb == 64 * hkv * (d + 4)
    for r, h, dim in [(0, 0, 0), (63, 1, 7), (64, 0, 3), (130, 1, 5)]:
        assert pool[(r // 64) * pb + ((r % 64) * hkv + h) * d + dim] == codes[r, h, dim]
        at = (r // 64) * pb + 64 * hkv * d + ((r % 64) * hkv + h) * 4
        assert pool[at:at + 4].view(np.float32)[0] == scales[r, h]
    back_codes, back_scales = kf.unpack_pages(pool, hkv, d)
    np.testing.assert_array_equal(back_codes, codes)
    np.testing.assert_array_equal(back_scales, scales)
    with pytest.raises(ValueError, match="not whole pages"):
        kf.unpack_pages(pool[:-1], hkv, d)
