"""The kernel families' NumPy references and variant declarations (no DSL, no GPU)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cute_kernels
from cute_kernels import bf16, embedding, gemm_sm90, gemv, gemv_fp8, rmsnorm, rope, silu_mul
from runtime.cuda.expr import names_in

FAMILIES = [importlib.import_module(f"cute_kernels.{f}") for f in cute_kernels.FAMILIES]


def test_bf16_rounding_is_nearest_even_and_keeps_nan():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, np.nan, 3.0e38], np.float32)
    got = bf16.round_bf16(x)
    assert got[0] == 1.0 and got[1] == 1.0  # tie to even (down)
    assert got[2] == 1.0 + 4 * 2**-8  # tie to even (up)
    assert got[3] == -2.5 and np.isinf(got[4]) and np.isnan(got[5])
    assert np.array_equal(bf16.from_bits(bf16.to_bits(got)), got, equal_nan=True)


@pytest.mark.parametrize("module", FAMILIES, ids=lambda m: m.FAMILY)
def test_variant_declarations_are_consistent(module):
    keys = set()
    for v in module.variants():
        assert v.family == module.FAMILY and v.key not in keys
        keys.add(v.key)
        for p in v.params:
            assert p.buffer is None or p.buffer in v.tensors, (v.name, p)
            if isinstance(p.value, str):
                assert names_in(p.value) <= set(v.sizes), (v.name, p)
        for rule in [*v.grid, *v.requires]:
            assert names_in(rule) <= set(v.sizes), (v.name, rule)
        ptr_buffers = {p.buffer for p in v.params if p.kind in ("ptr", "tma")}
        assert ptr_buffers == set(v.tensors), f"{v.name}: every buffer is passed exactly as declared"
        assert 32 <= v.block[0] * v.block[1] * v.block[2] <= 1024


def test_rmsnorm_reference_uses_one_plus_w_and_plain_w_for_gated():
    rng = np.random.default_rng(0)
    x = bf16.round_bf16(rng.standard_normal((3, 256)).astype(np.float32))
    zeros = np.zeros(256, np.float32)
    y, _ = rmsnorm.reference(x, zeros, exact=True)
    rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y, x / rms, rtol=1e-12)  # w = 0 means weight 1
    z = np.full_like(x, 30.0)  # silu(30) == 30 to double precision
    g, _ = rmsnorm.reference(x, np.ones(256, np.float32), mode="gated", z=z, exact=True)
    np.testing.assert_allclose(g, 30 * x / rms, rtol=1e-9)
    res = bf16.round_bf16(rng.standard_normal((3, 256)).astype(np.float32))
    y2, new_res = rmsnorm.reference(x, zeros, mode="add_zc", residual=res)
    np.testing.assert_array_equal(new_res, bf16.round_bf16(x + res))
    base, _ = rmsnorm.reference(new_res, zeros)
    np.testing.assert_array_equal(y2, base)


def test_rope_reference_rotates_pairs_and_passes_the_rest():
    rng = np.random.default_rng(1)
    cos, sin = rope.tables(64, 64, 1e7)
    x = rng.standard_normal((4, 2, 256)).astype(np.float32)
    pos = np.array([0, 5, 63, 64])
    y = rope.reference(x, pos, cos, sin, exact=True)
    np.testing.assert_allclose(y[0], x[0], rtol=1e-12)  # position 0 is the identity
    np.testing.assert_array_equal(y[3], x[3])  # out of range: untouched
    np.testing.assert_array_equal(y[..., 64:], x[..., 64:])
    pair_norm = lambda a: a[..., :32] ** 2 + a[..., 32:64] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(y[1]), pair_norm(x[1].astype(np.float64)), rtol=1e-6)


def test_embedding_and_silu_mul_references():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    out, bad = embedding.reference(np.array([2, -1, 4, 0]), table)
    np.testing.assert_array_equal(out, [[6, 7, 8], [0, 0, 0], [0, 0, 0], [0, 1, 2]])
    assert bad and not embedding.reference(np.array([0, 3]), table)[1]
    x = np.array([[0.0, 2.0, 3.0, 4.0]], np.float32)
    np.testing.assert_allclose(silu_mul.reference(x, exact=True), [[0.0, 2.0 / (1 + np.exp(-2.0)) * 4.0]])


def test_matmul_references_agree():
    rng = np.random.default_rng(2)
    x = bf16.round_bf16(rng.standard_normal((3, 64)).astype(np.float32))
    w = bf16.round_bf16(rng.standard_normal((16, 64)).astype(np.float32))
    exact = gemv.reference(x, w, exact=True)
    np.testing.assert_allclose(gemm_sm90.reference(x, w), exact, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(gemv.reference(x, w), gemm_sm90.reference(x, w))


@pytest.mark.parametrize("m, n, nt, k", [(1, 16, 0, 256), (3, 200, 0, 384), (7, 272, 5, 640), (8, 48, 37, 1152)])
def test_fp8_gemv_reference_against_dequantize_then_matmul(m, n, nt, k):
    """gemv_fp8.reference against an independent float64 dequantize-then-matmul (the artifact
    reader's e4m3 table, block scales expanded by np.kron) at odd sizes: partial 128-row scale
    blocks (N = 200, 272), tails, negative and zero scales, every code but NaN."""
    from runtime.artifact import formats

    rng = np.random.default_rng(m * 1000 + n)
    x = bf16.round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00  # e4m3fn has no infinities; 0x7F / 0xFF are NaN
    scales = rng.uniform(-2e-3, 2e-3, (-(-n // 128), k // 128)).astype(np.float32)
    scales[-1, 0] = 0.0
    tail = bf16.round_bf16(rng.standard_normal((nt, k)).astype(np.float32)) if nt else None
    # float64: an e4m3 value times an fp32 scale needs 28 significand bits (fp8_block_dequantize
    # rounds it to float32).
    w = formats.e4m3_to_f32(codes).astype(np.float64) * np.kron(scales.astype(np.float64), np.ones((128, 128)))[:n]
    want = x.astype(np.float64) @ w.T
    if nt:
        want = np.concatenate([want, x.astype(np.float64) @ tail.astype(np.float64).T], axis=1)
    exact = gemv_fp8.reference(x, codes, scales, tail, exact=True)
    assert exact.shape == (m, n + nt)
    np.testing.assert_allclose(exact, want, rtol=1e-12, atol=1e-12)
    # The kernel's roundings: fp32 sums (K * 2^-24 of the absolute sum, far below bf16's half ulp)
    # plus one bf16 rounding of the result.
    same = gemv_fp8.reference(x, codes, scales, tail)
    assert np.array_equal(same, bf16.round_bf16(same))
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(np.concatenate([w, tail.astype(np.float64)]) if nt else
                                                      np.abs(w)).T
    bound = 2.0 ** -8 * np.abs(want) + k * 2.0 ** -23 * magnitude + 1e-30
    assert np.all(np.abs(same - want) <= bound)
    assert np.abs(same - want).max() > 0  # the bf16 rounding is really there
