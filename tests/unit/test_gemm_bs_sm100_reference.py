"""gemm_bs_sm100 on the CPU: its scale-factor layout, converters, NumPy reference and variant table
(the kernels themselves only compile here: tests/gpu/test_gemm_bs_sm100.py runs them on sm_100a)."""

from __future__ import annotations

import numpy as np
import pytest

from build_kernels import plan
from cute_kernels import gemm_bs_sm100 as bs
from cute_kernels.bf16 import round_bf16
from runtime.artifact.formats import e4m3_to_f32, f32_to_e4m3, nvfp4_dequantize, nvfp4_quantize

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1[code & 7]


# ----------------------------------------------------------------------------- scale layout


def test_tile_scales_puts_each_scale_where_the_docstring_says():
    rng = np.random.default_rng(0)
    rows, cols = 300, 12  # a partial 128-row block; 3 column groups
    sf = rng.integers(1, 256, (rows, cols), dtype=np.uint8)
    tiled = bs.tile_scales(sf)
    assert tiled.shape == (384 * cols,)
    for r in range(rows):
        for c in range(cols):
            rb, i, j, g, cc = r // 128, (r % 128) // 32, r % 32, c // 4, c % 4
            assert tiled[(rb * cols // 4 + g) * 512 + 16 * j + 4 * i + cc] == sf[r, c]
    # The padding rows (300..383) are zero, and nothing else is.
    assert np.count_nonzero(tiled) == rows * cols
    np.testing.assert_array_equal(bs.untile_scales(tiled, rows, cols), sf)


def test_tile_scales_k_tile_is_one_contiguous_run():
    """What the kernel's bulk copy relies on: the scales of 128 rows x one k-tile (BK / V
    columns) are one run of 128 * BK / V bytes at (row block * K / BK + k-tile) * run."""
    for fmt in bs.FORMATS.values():
        k = 4 * fmt.bk
        cols = k // fmt.vec
        per_tile = fmt.bk // fmt.vec
        sf = (np.arange(256 * cols).reshape(256, cols) % 251 + 1).astype(np.uint8)
        tiled = bs.tile_scales(sf)
        run = 128 * per_tile
        for rb in range(2):
            for kt in range(4):
                # ... laid out as the tiled scales of that 128 x BK / V block alone (what the
                # stage's shared memory holds for tcgen05.cp).
                block = sf[rb * 128:(rb + 1) * 128, kt * per_tile:(kt + 1) * per_tile]
                np.testing.assert_array_equal(tiled[(rb * 4 + kt) * run:(rb * 4 + kt + 1) * run],
                                              bs.tile_scales(block))


def test_tile_scales_needs_whole_column_groups():
    with pytest.raises(ValueError, match="multiple of 4"):
        bs.tile_scales(np.zeros((128, 6), np.uint8))


# ----------------------------------------------------------------------------- converters


def test_nvfp4_operand_keeps_codes_and_expands_the_global():
    rng = np.random.default_rng(1)
    codes, sf, g = nvfp4_quantize(rng.standard_normal((256, 64)).astype(np.float32), row_groups=2)
    c2, tiled, g2 = bs.nvfp4_operand(codes, sf, g.repeat(128))
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(bs.untile_scales(tiled, 256, 4), sf)
    np.testing.assert_array_equal(g2, g.repeat(128))
    _, _, g1 = bs.nvfp4_operand(codes, sf, np.float32(0.25))
    assert g1.shape == (256,) and (g1 == 0.25).all()


def test_mxfp8_quantize_uses_power_of_two_scales_and_rounds_to_e4m3():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 96)) * np.exp2(rng.integers(-20, 20, (5, 1)))
    x[1, :32] = 0.0
    codes, sf = bs.mxfp8_quantize(x)
    scale = np.repeat(bs.ue8m0_values(sf), 32, axis=1)
    values = e4m3_to_f32(codes).astype(np.float64)
    assert np.all(np.abs(values) <= 448) and sf[1, 0] == 127  # a zero block gets scale 1
    # Each block's absmax lands in (224, 448] (the smallest power of two), and every value is its
    # nearest e4m3 (relative 2^-4, or half the subnormal step 2^-9 of the block's scale).
    amax = np.abs(values).reshape(5, 3, 32).max(axis=-1)
    assert np.all((amax > 224) | (amax == 0))
    assert np.all(np.abs(values * scale - x) <= np.abs(x) * 2.0**-4 + scale * 2.0**-10)
    np.testing.assert_array_equal(codes, f32_to_e4m3((x / scale).astype(np.float32)))


def test_mxfp8_from_block128_approximates_qwens_fp8_weight():
    rng = np.random.default_rng(3)
    n, k = 200, 320  # partial 128-blocks at both edges
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    block = rng.uniform(0.5, 1.5, (2, 3)) * 1e-3
    new, sf = bs.mxfp8_from_block128(codes, block)
    old = e4m3_to_f32(codes) * np.repeat(np.repeat(block, 128, 0), 128, 1)[:n, :k]
    got = bs.dequant("mxfp8", new, sf)
    scale = np.repeat(bs.ue8m0_values(sf), 32, axis=1)
    assert np.all(np.abs(got - old) <= np.abs(old) * 2.0**-4 + scale * 2.0**-10)
    assert np.abs(got - old).max() > 0  # it is a requantisation, not a copy


# ----------------------------------------------------------------------------- reference


def _direct(fmt, a, a_sf, b, b_sf, a_g, b_g):
    """out[m, n] term by term from the codes, in Python floats."""
    vec = bs.FORMATS[fmt].vec
    m, n = a.shape[0], b.shape[0]
    k = a.shape[1] * (2 if fmt == "nvfp4" else 1)

    def value(codes, sf, r, c):
        if fmt == "nvfp4":
            byte = int(codes[r, c // 2])
            v = _e2m1(byte & 0xF if c % 2 == 0 else byte >> 4)
            s = float(e4m3_to_f32(sf[r, c // vec]))
        else:
            v = float(e4m3_to_f32(codes[r, c]))
            s = 2.0 ** (int(sf[r, c // vec]) - 127)
        return v * s

    out = np.zeros((m, n))
    for i in range(m):
        for j in range(n):
            out[i, j] = sum(value(a, a_sf, i, c) * value(b, b_sf, j, c) for c in range(k)) * a_g * float(b_g[j])
    return out


def test_reference_nvfp4_against_direct_and_the_artifact_dequantiser():
    rng = np.random.default_rng(4)
    a, a_sf, a_g = nvfp4_quantize(rng.standard_normal((3, 64)).astype(np.float32))
    b, b_sf, b_g = nvfp4_quantize(rng.standard_normal((4, 64)).astype(np.float32), row_groups=2)
    b_rows = np.repeat(b_g, 2)
    exact = bs.reference("nvfp4", a, a_sf, b, b_sf, float(a_g[0]), b_rows, exact=True)
    np.testing.assert_allclose(exact, _direct("nvfp4", a, a_sf, b, b_sf, float(a_g[0]), b_rows), rtol=1e-12)
    da = nvfp4_dequantize(a, a_sf, a_g).astype(np.float64)
    db = nvfp4_dequantize(b, b_sf, b_g, row_groups=2).astype(np.float64)
    np.testing.assert_allclose(exact, da @ db.T, rtol=1e-5, atol=1e-6)
    kernel = bs.reference("nvfp4", a, a_sf, b, b_sf, float(a_g[0]), b_rows)
    acc = (bs.dequant("nvfp4", a, a_sf) @ bs.dequant("nvfp4", b, b_sf).T).astype(np.float32)
    np.testing.assert_array_equal(kernel, round_bf16(acc * np.float32(a_g[0]) * b_rows[None, :].astype(np.float32)))
    assert np.all(np.abs(kernel - exact) <= np.abs(exact) * 2.0**-8 + 1e-30)


def test_reference_mxfp8_against_direct():
    rng = np.random.default_rng(5)
    a, a_sf = bs.mxfp8_quantize(rng.standard_normal((2, 64)) * 30)
    b, b_sf = bs.mxfp8_quantize(rng.standard_normal((3, 64)) * 1e-3)
    b_g = np.array([1.0, 0.5, 2.0], np.float32)
    exact = bs.reference("mxfp8", a, a_sf, b, b_sf, 0.75, b_g, exact=True)
    np.testing.assert_allclose(exact, _direct("mxfp8", a, a_sf, b, b_sf, 0.75, b_g), rtol=1e-12)
    kernel = bs.reference("mxfp8", a, a_sf, b, b_sf, 0.75, b_g)
    assert np.all(np.abs(kernel - exact) <= np.abs(exact) * 2.0**-8)
    np.testing.assert_array_equal(kernel, round_bf16(kernel))  # bf16 values


# ----------------------------------------------------------------------------- variants


def test_variant_table():
    vs = {v.key: v for v in bs.variants()}
    shapes = {"gdn_in": (16384, 5120), "o_proj": (5120, 6144), "attn_qkv": (14336, 5120),
              "gate_up": (34816, 5120), "down": (5120, 17408), "test": (256, 512)}
    assert set(vs) == {f"{f}_{name}_n{n}_k{k}" for f in ("nvfp4", "mxfp8") for name, (n, k) in shapes.items()}
    for v in vs.values():
        fmt = bs.FORMATS[v.config["format"]]
        n, k = v.config["N"], v.config["K"]
        kbytes = k // fmt.per_byte
        assert v.arches == ("sm_100a",) and v.family == "gemm_bs_sm100"
        assert v.config["tile"] == [128, 256, fmt.bk] and v.config["scale_vec"] == fmt.vec
        assert [(p.kind, p.name) for p in v.params] == [
            ("tma", "a_desc"), ("i32", "a_rows"), ("tma", "b_desc"), ("ptr", "a_scale"), ("ptr", "b_scale"),
            ("ptr", "a_gscale"), ("ptr", "b_gscale"), ("ptr", "out"), ("i32", "M")]
        enc_a, enc_b = v.params[0].encode, v.params[2].encode
        assert enc_a.dtype == enc_b.dtype == "UINT8" and enc_a.swizzle == "128B"
        assert enc_a.dims == (kbytes, "M") and enc_b.dims == (kbytes, n)
        assert enc_a.box == (128, 128) and enc_b.box == (128, 256)
        assert v.tensors["a"].shape == ("M", kbytes) and v.tensors["b"].shape == (n, kbytes)
        assert v.tensors["a_scale"].shape == ("cdiv(M, 128) * 128", k // fmt.vec)
        assert v.tensors["b_scale"].shape == (n, k // fmt.vec) and v.tensors["b_gscale"].shape == (n,)
        assert v.tensors["out"].shape == ("M", n) and v.tensors["out"].dtype == "bf16"
        assert v.block == (192, 1, 1) and v.grid == (n // 256, "cdiv(M, 128)", 1) and v.sizes == ("M",)
    with pytest.raises(ValueError, match="multiple of 256"):
        bs._variant(bs.FORMATS["nvfp4"], "bad", 300, 512)


def test_only_the_sm100a_build_plans_the_family():
    assert plan(["sm_90a"], ["gemm_bs_sm100*"], {}) == []
    jobs = plan(["sm_90a", "sm_100a", "sm_120a"], ["gemm_bs_sm100*"], {})
    assert len(jobs) == 12 and {j.arch for j in jobs} == {"sm_100a"}
    assert all("cute_kernels/_gemm_bs_sm100_kernel.py" in j.sources for j in jobs)
