"""The kernel families' NumPy references and variant declarations (no DSL, no GPU)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import cute_kernels
from cute_kernels import bf16, embedding, gemm_sm90, gemv, rmsnorm, rope, silu_mul
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
