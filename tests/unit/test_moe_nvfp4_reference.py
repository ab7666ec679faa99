"""The NVFP4 expert kernels' NumPy references (cute_kernels/moe_nvfp4.py) against a direct float64
computation on weights quantised and dequantised by the artifact's own NVFP4 code
(`runtime.artifact.formats`), and against the BF16 references where the roundings coincide."""

from __future__ import annotations

import numpy as np

from cute_kernels import moe, moe_nvfp4
from cute_kernels.bf16 import round_bf16
from runtime.artifact.formats import nvfp4_dequantize, nvfp4_quantize

E, H, INTER, K = 8, 256, 64, 2  # the tiny MoE shape (moe.SHAPES "tiny")


def _stack(rng, rows_per_expert, k, row_groups):
    """(codes [(E + 1) rows, K / 2], scales [.., K / 16], per-row globals, float64 weights
    [E + 1, rows, K]) of random experts, each tensor's globals per row group as the artifact keeps
    them, repeated over the group's rows as the runner uploads them."""
    w = (rng.standard_normal((E + 1, rows_per_expert, k)) / np.sqrt(k)).astype(np.float32)
    w[3] *= 8.0  # one expert with a larger global scale
    codes, scales, globals_ = nvfp4_quantize(w, row_groups)
    per_row = np.repeat(globals_.reshape(-1), rows_per_expert // row_groups).astype(np.float32)
    exact = nvfp4_dequantize(codes, scales, globals_, row_groups).astype(np.float64)
    return (codes.reshape(-1, k // 2), scales.reshape(-1, k // 16), per_row, exact)


def _ids(rng, m):
    return np.concatenate([np.stack([rng.permutation(E)[:K] for _ in range(m)]), np.full((m, 1), E)], 1)


def test_dequantise_equals_the_artifact_values():
    rng = np.random.default_rng(0)
    codes, scales, gscale, exact = _stack(rng, 2 * INTER, H, 2)
    got = moe_nvfp4.dequantise(codes, scales, gscale, 2 * INTER, np.arange(E + 1))
    # The artifact's float32 product (code x scale rounded with the global) and the exact one.
    np.testing.assert_allclose(got, exact, rtol=2 ** -23, atol=0)


def test_up_reference_is_the_float64_swiglu_within_its_bf16_roundings():
    rng = np.random.default_rng(1)
    codes, scales, gscale, exact = _stack(rng, 2 * INTER, H, 2)
    x = round_bf16(rng.standard_normal((7, H)).astype(np.float32))
    ids = _ids(rng, 7)
    got = moe_nvfp4.reference_up(x, codes, scales, gscale, ids, INTER)
    gu = np.einsum("rsih,rh->rsi", exact[ids], x.astype(np.float64))
    g, u = gu[..., :INTER], gu[..., INTER:]
    want = g / (1.0 + np.exp(-g)) * u
    # g and u rounded to bf16 (2^-9 relative each; silu's slope is at most 1.1), then silu(g) and
    # the product rounded again.
    scale = (np.abs(g / (1.0 + np.exp(-g))) + 1.1 * np.abs(g)) * np.abs(u) + 1e-30
    assert np.all(np.abs(got - want) <= 4 * 2.0 ** -8 * scale + 1e-6), np.max(np.abs(got - want) / scale)
    assert np.abs(got - want).max() > 0  # it does round (the bound above is not vacuous)


def test_up_reference_with_power_of_two_globals_is_the_bf16_reference_bit_for_bit():
    """With every global a power of two the rounding model is `moe.reference_up`'s on the
    dequantised weights (then exact in fp32: the same fp32 dot products scaled exactly, then the
    same bf16 roundings)."""
    rng = np.random.default_rng(2)
    codes, scales, _, _ = _stack(rng, 2 * INTER, H, 2)
    pow2 = np.full(codes.shape[0], 2.0 ** -12, np.float32)
    x = round_bf16(rng.standard_normal((5, H)).astype(np.float32))
    ids = _ids(rng, 5)
    weights = moe_nvfp4.dequantise(codes, scales, pow2, 2 * INTER, np.arange(E + 1)).astype(np.float32)
    np.testing.assert_array_equal(moe_nvfp4.reference_up(x, codes, scales, pow2, ids, INTER),
                                  moe.reference_up(x, weights, ids))


def test_down_reference_is_the_float64_weighted_sum_within_one_bf16_rounding():
    rng = np.random.default_rng(3)
    codes, scales, gscale, exact = _stack(rng, H, INTER, 1)
    act = round_bf16(rng.standard_normal((6, K + 1, INTER)).astype(np.float32))
    ids = _ids(rng, 6)
    wts = rng.uniform(0.05, 1.0, ids.shape).astype(np.float32)
    got = moe_nvfp4.reference_down(act, codes, scales, gscale, ids, wts, H)
    want = np.einsum("rs,rshi,rsi->rh", wts.astype(np.float64), exact[ids], act.astype(np.float64))
    terms = np.einsum("rs,rshi,rsi->rh", wts.astype(np.float64), np.abs(exact[ids]), np.abs(act.astype(np.float64)))
    # One bf16 rounding of the result, and fp32 sums (2^-24 per addition) over INTER x P terms.
    assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want) + 2.0 ** -17 * terms)
    np.testing.assert_array_equal(got, round_bf16(got))
