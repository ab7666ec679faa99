"""Number formats of the artifact (runtime/artifact/formats.py) against brute-force references."""

import numpy as np
import pytest

from runtime.artifact import formats


def nearest_even_reference(values, table, saturate):
    """Code of the nearest table value (ties: even code) for the positive `table`, by search."""
    table = np.asarray(table, dtype=np.float64)
    codes = []
    for v in np.asarray(values, dtype=np.float64):
        m = min(abs(v), saturate)
        distance = np.abs(table - m)
        best = np.flatnonzero(distance == distance.min())
        codes.append(best[0] if len(best) == 1 else next(b for b in best if b % 2 == 0))
    return np.array(codes)


# ---- bf16 ------------------------------------------------------------------------------------

def test_bf16_every_pattern_round_trips():
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = formats.bf16_to_f32(bits)
    back = formats.f32_to_bf16(values)
    finite_or_inf = ~np.isnan(values)
    assert np.array_equal(back[finite_or_inf], bits[finite_or_inf])
    assert np.isnan(formats.bf16_to_f32(back[~finite_or_inf])).all()


@pytest.mark.parametrize("value, expected", [
    (1.0 + 2 ** -8, 0x3F80),            # tie, lower neighbour even: down
    (1.0 + 3 * 2 ** -8, 0x3F82),        # tie, upper neighbour even: up
    (1.0 + 2 ** -8 + 2 ** -20, 0x3F81),  # just above the tie: up
    (-(1.0 + 2 ** -8), 0xBF80),
    (3.4028234663852886e38, 0x7F80),    # float32 max rounds to inf
    (float("inf"), 0x7F80),
    (1e-45, 0x0000),                    # smallest subnormal float32 rounds to zero
])
def test_bf16_rounds_to_nearest_even(value, expected):
    assert formats.f32_to_bf16(np.float32([value]))[0] == expected


def test_bf16_keeps_nan_even_with_only_low_mantissa_bits():
    nan = np.array([0x7F800001, 0xFF800001], dtype=np.uint32).view(np.float32)
    assert np.isnan(formats.bf16_to_f32(formats.f32_to_bf16(nan))).all()


# ---- fp8 e4m3 --------------------------------------------------------------------------------

def test_e4m3_known_codes():
    v = formats.E4M3_VALUES
    assert (v[0x7E], v[0x38], v[0xB8], v[0x08], v[0x01]) == (448.0, 1.0, -1.0, 2 ** -6, 2 ** -9)
    assert np.isnan(v[0x7F]) and np.isnan(v[0xFF])


def test_e4m3_every_finite_code_round_trips():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    assert np.array_equal(formats.f32_to_e4m3(formats.e4m3_to_f32(codes)), codes)


def test_e4m3_encoding_matches_brute_force_including_ties_and_saturation():
    positive = formats.E4M3_VALUES[:0x7F].astype(np.float64)
    midpoints = (positive[:-1] + positive[1:]) / 2
    rng = np.random.default_rng(0)
    values = np.concatenate([midpoints, -midpoints, rng.standard_normal(3000) * 50,
                             rng.standard_normal(1000) * 0.01, [460.0, 464.0, 1e9, -1e9, 0.0]])
    values = values.astype(np.float32)
    reference = nearest_even_reference(values, positive, 448.0)
    reference = reference | np.where(np.signbit(values), 0x80, 0)
    assert np.array_equal(formats.f32_to_e4m3(values), reference)
    assert formats.f32_to_e4m3(np.float32([np.nan]))[0] == 0x7F


# ---- e2m1 and packing ------------------------------------------------------------------------

def test_e2m1_ties_to_even_and_saturates():
    values = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.75, -5.0, -0.1])
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 7, 8 | 2, 8 | 6, 0]
    assert formats.f32_to_e2m1(values).tolist() == expected
    codes = np.arange(16, dtype=np.uint8)
    decoded = formats.e2m1_to_f32(codes)
    assert np.array_equal(formats.f32_to_e2m1(decoded)[decoded != 0], codes[decoded != 0])


def test_nibbles_low_first():
    assert formats.pack_nibbles(np.uint8([[1, 2, 3, 4]])).tolist() == [[0x21, 0x43]]
    codes = np.random.default_rng(1).integers(0, 16, (3, 5, 32)).astype(np.uint8)
    assert np.array_equal(formats.unpack_nibbles(formats.pack_nibbles(codes)), codes)


# ---- block quantisation ----------------------------------------------------------------------

def block_max(w, rows, cols):
    """Per-element absmax of its (rows x cols) block, for error bounds."""
    *lead, n, k = w.shape
    out = np.empty_like(w)
    for r in range(0, n, rows):
        for c in range(0, k, cols):
            block = np.abs(w[..., r:r + rows, c:c + cols])
            out[..., r:r + rows, c:c + cols] = block.max(axis=(-2, -1), keepdims=True)
    return out


def test_fp8_block_error_bound_on_ragged_shapes():
    w = np.random.default_rng(2).standard_normal((2, 200, 300)).astype(np.float32)
    codes, scales = formats.fp8_block_quantize(w)
    assert codes.shape == w.shape and scales.shape == (2, 2, 3)
    restored = formats.fp8_block_dequantize(codes, scales)
    scale_of = block_max(w, 128, 128) / 448.0
    # Half an ulp of a 3-bit mantissa (1/16 relative) or, in the subnormal range, of 2^-9.
    assert (np.abs(restored - w) <= np.abs(w) / 16 + scale_of * 2 ** -10 + 1e-12).all()
    assert (np.abs(formats.e4m3_to_f32(codes)).reshape(2, -1).max(axis=1) == 448).all()


@pytest.mark.parametrize("quantize", ["fp8", "nvfp4"])
def test_row_groups_are_quantized_independently(quantize):
    """A fused gate|up matrix with row_groups=2 encodes exactly like its halves separately,
    which is what makes fusing per-expert checkpoint tensors bit-exact."""
    rng = np.random.default_rng(3)
    gate, up = rng.standard_normal((64, 96)), rng.standard_normal((64, 96)) * 10
    fq = formats.fp8_block_quantize if quantize == "fp8" else formats.nvfp4_quantize
    fused = fq(np.concatenate([gate, up]), row_groups=2)
    halves = [fq(gate), fq(up)]
    axes = (-2, -2, -1)
    for i, part in enumerate(fused):
        assert np.array_equal(part, np.concatenate([h[i] for h in halves], axis=axes[i]))


def test_nvfp4_error_bound_and_global_scale():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((3, 64, 128)) * np.exp(rng.uniform(-3, 3, (3, 64, 1)))).astype(np.float32)
    packed, scales, global_scale = formats.nvfp4_quantize(w, row_groups=2)
    assert (packed.shape, scales.shape, global_scale.shape) == ((3, 64, 64), (3, 64, 8), (3, 2))
    amax = np.abs(w.reshape(3, 2, 32, 128)).max(axis=(-2, -1))
    assert np.allclose(global_scale, amax / (6 * 448), rtol=1e-6)
    restored = formats.nvfp4_dequantize(packed, scales, global_scale, row_groups=2)
    # Largest e2m1 gap is 2 (between 4 and 6), the block scale is within 1/16 of absmax/6.
    assert (np.abs(restored - w) <= 0.18 * block_max(w, 1, 16) + 1e-12).all()
    assert np.sqrt(np.mean((restored - w) ** 2) / np.mean(w ** 2)) < 0.12


def test_nvfp4_zero_and_bad_shapes():
    packed, scales, global_scale = formats.nvfp4_quantize(np.zeros((4, 32)))
    assert not packed.any() and np.isfinite(global_scale).all()
    assert not formats.nvfp4_dequantize(packed, scales, global_scale).any()
    with pytest.raises(ValueError, match="multiple of 16"):
        formats.nvfp4_quantize(np.ones((4, 24)))
    with pytest.raises(ValueError, match="row groups"):
        formats.fp8_block_quantize(np.ones((5, 24)), row_groups=2)
