"""The quantised prefill kernels' references and variant lists, on the CPU: `quantize_act`,
`gemm_fp8_sm90`, `dequant_nvfp4` (the GPU tests compare the kernels with these), checked against
hand-computed codes and the artifact reader's independent dequantisers."""

from __future__ import annotations

import numpy as np

from cute_kernels import dequant_nvfp4, gemm_fp8_sm90, gemm_sm90, gemv_fp8, quantize_act
from cute_kernels.bf16 import round_bf16, to_bits
from runtime.artifact.formats import e4m3_to_f32, f32_to_e4m3, fp8_block_dequantize, nvfp4_dequantize


def test_e4m3_rounding_matches_the_artifact_quantiser():
    """quantize_act's encoder (nearest, ties to even, saturating, signed zeros) against the
    converter's independent bit-twiddling one, on random values over the whole range, every
    e4m3 value and every midpoint between neighbours (the ties), both signs."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(100_000) * np.exp2(rng.integers(-14, 10, 100_000))).astype(np.float32)
    table = e4m3_to_f32(np.arange(0x7F, dtype=np.uint8))
    mids = ((table[1:].astype(np.float64) + table[:-1]) / 2).astype(np.float32)
    edges = np.float32([0.0, 448.0, 449.0, 464.0, 465.0, 1e9, 2.0**-10, 3 * 2.0**-11])
    both = np.concatenate([values, table, mids, edges])
    both = np.concatenate([both, -both])
    np.testing.assert_array_equal(quantize_act.e4m3_codes(both), f32_to_e4m3(both))
    assert quantize_act.e4m3_codes(np.float32([-0.0, -1e-9]))[0] == 0x80


def test_quantize_act_codes_and_scales_by_hand():
    x = np.zeros((2, 320), np.float32)  # groups: columns 0..127, 128..255, 256..319 (partial)
    x[0, :4] = [896.0, -448.0, 1.0, 3.0]  # amax 896: scale 2, codes 448, -224, 0.5, 1.5
    x[0, 256] = -0.75  # the partial group: scale 0.75 / 448, code -448
    x[1] = 1.0  # every group 1.0: scale 1 / 448, codes 448
    codes, scale = quantize_act.reference(x)
    assert codes.shape == (2, 320) and scale.shape == (2, 3)
    np.testing.assert_array_equal(scale[0], np.float32([2.0, 0.0, 0.75 / 448]))
    np.testing.assert_array_equal(scale[1], np.full(3, np.float32(1.0) / np.float32(448.0)))
    # e4m3: 448 = 0x7E, -224 = 0xF6 (sign, exponent 14, mantissa 6), 0.5 = 0x30, 1.5 = 0x3C.
    np.testing.assert_array_equal(codes[0, :4], [0x7E, 0xF6, 0x30, 0x3C])
    assert codes[0, 256] == 0xFE and not codes[0, 4:256].any() and not codes[0, 257:].any()
    assert (codes[1] == 0x7E).all()


def test_quantize_act_round_trip_is_within_half_an_e4m3_step():
    rng = np.random.default_rng(1)
    x = round_bf16((rng.standard_normal((5, 5120)) * np.exp2(rng.integers(-10, 10, (5, 1)))).astype(np.float32))
    codes, scale = quantize_act.reference(x)
    back = e4m3_to_f32(codes) * np.repeat(scale, 128, axis=1)
    # Normal e4m3 values: half a step is 2^-4 relative; below 2^-6 (subnormal) a fixed 2^-10.
    step = np.repeat(scale, 128, axis=1)
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-4 + step * 2.0**-10 + 1e-30)
    assert np.all(np.abs(e4m3_to_f32(codes)) <= 448.0)
    assert np.all(np.max(np.abs(e4m3_to_f32(codes)).reshape(5, 40, 128), axis=2) == 448.0)


def test_gemm_fp8_reference_is_the_dequantised_product():
    rng = np.random.default_rng(2)
    m, n, k = 5, 328, 320  # partial scale blocks at both edges
    xq = rng.integers(0, 256, (m, k), dtype=np.uint8)
    wq = rng.integers(0, 256, (n, k), dtype=np.uint8)
    xq[(xq & 0x7F) == 0x7F] = 0
    wq[(wq & 0x7F) == 0x7F] = 0
    x_scale = rng.uniform(0.5, 2.0, (m, 3)).astype(np.float32) * 1e-3
    w_scale = rng.uniform(-2.0, 2.0, (3, 3)).astype(np.float32) * 1e-3
    w_scale[2, 1] = 0.0
    # Independent: the artifact reader's 128 x 128 block dequantiser for W, a per-row repeat for x.
    x = e4m3_to_f32(xq).astype(np.float64) * np.repeat(x_scale, 128, axis=1)[:, :k]
    w = fp8_block_dequantize(wq, w_scale).astype(np.float64)
    exact = gemm_fp8_sm90.reference(xq, x_scale, wq, w_scale, exact=True)
    mag = np.abs(x) @ np.abs(w).T
    # The reader's W went through float32 (code x scale rounded once, 2^-24 relative).
    assert np.all(np.abs(exact - x @ w.T) <= mag * 2.0**-23)
    assert np.abs(exact).max() > 0.1  # the scales keep the products O(0.1 .. 1)
    fast = gemm_fp8_sm90.reference(xq, x_scale, wq, w_scale)
    assert np.array_equal(to_bits(fast), to_bits(round_bf16(fast)))  # bf16 values
    assert np.all(np.abs(fast - exact) <= np.abs(exact) * 2.0**-8 + mag * 2.0**-20)


def test_dequant_nvfp4_reference_rounds_each_weight_once():
    rng = np.random.default_rng(3)
    n, k = 6, 256
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, (n, k // 16), dtype=np.uint8) | (rng.integers(0, 2, (n, k // 16)) << 7).astype(
        np.uint8)
    gscale = np.float32([1.0, 0.25, 2.0**-12, 3e-4, -7.1e-3, 1.3])  # powers of two, then not
    got = dequant_nvfp4.reference(packed, scales, gscale)
    want = nvfp4_dequantize(packed, scales, gscale, row_groups=n)  # code * (scale * global) in fp32
    # Rows with a power-of-two global: exact (code * scale is a bf16 value; times 2^j stays one).
    np.testing.assert_array_equal(got[:3], want[:3])
    # The others: within one bf16 rounding of the fp32 value.
    assert np.all(np.abs(got[3:] - want[3:]) <= np.abs(want[3:]) * 2.0**-8)
    assert np.array_equal(to_bits(got), to_bits(round_bf16(got)))


def test_the_variants_cover_every_fp8_and_nvfp4_prefill_shape():
    # The quantised shapes the runner has GEMVs for, but the hidden-2048 models' (a3b_*: their FP8
    # projections prefill through the GEMV, 8 rows a launch, until their GEMMs are added).
    fp8 = {(n, nt, k) for name, n, nt, k in gemv_fp8.SHAPES if not name.startswith("a3b")}
    gemm = {(v.config["N"], v.config["NT"], v.config["K"]) for v in gemm_fp8_sm90.variants()}
    assert fp8 <= gemm
    assert {k for _, _, k in fp8} <= {v.config["K"] for v in quantize_act.variants()}
    assert {k for _, _, k in fp8} <= {v.config["K"] for v in dequant_nvfp4.variants()}
    strided = {(v.config["N"], v.config["K"], v.config["ld"]) for v in gemm_sm90.variants()}
    for n, nt, k in fp8:
        assert (n, k, n + nt) in strided  # the NVFP4 head, written with the tail's row stride
        if nt:
            assert (nt, k, n + nt) in strided  # the BF16 tail
    quantised = next(v for v in gemm_fp8_sm90.variants() if v.key == "gdn_in_n16384_t96_k5120")
    assert quantised.config["ld"] == 16480 and quantised.tensors["out"].shape == ("M", 16480)
    assert quantised.tensors["w_scale"].shape == (128, 40) and quantised.tensors["x_scale"].shape == ("M", 40)
