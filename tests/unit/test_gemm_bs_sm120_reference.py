"""`cute_kernels/gemm_bs_sm120.py` on the CPU: its NumPy references against an independent
float64 dequantise-then-matmul (the artifact reader's decoding), the operand conversions from
the artifact's storage, and the variant table (keys, shapes, ABI, arches: built for sm_120a only,
never in the sm_90a plan)."""

from __future__ import annotations

import numpy as np
import pytest

import build_kernels as bk
from cute_kernels import gemm_bs_sm120 as fam
from cute_kernels import quantize_act
from cute_kernels.bf16 import round_bf16
from runtime.artifact import formats

TOOLS = {"nvidia-cutlass-dsl": "test"}


def _nvfp4_case(rng, m, n, k):
    x = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)  # every byte is two valid e2m1 codes
    w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    xs, ws = (rng.integers(0, 0x7F, (rows, k // 16), dtype=np.uint8) | (rng.integers(0, 2, (rows, k // 16),
              dtype=np.uint8) << 7) for rows in (m, n))  # e4m3 codes of both signs, no NaN (0x7F, 0xFF)
    ws[0, :2] = 0x80  # negative zero
    x_g = np.array([rng.uniform(0.5, 2.0)], np.float32)
    w_g = rng.uniform(-1e-3, 1e-3, n).astype(np.float32)
    w_g[-1] = 0.0
    return x, xs.astype(np.uint8), x_g, w, ws.astype(np.uint8), w_g


def _nvfp4_values(codes, scales):
    """float64 [rows, K] through the artifact reader's tables."""
    values = formats.e2m1_to_f32(formats.unpack_nibbles(codes)).astype(np.float64)
    return values * np.repeat(formats.e4m3_to_f32(scales).astype(np.float64), 16, axis=1)


@pytest.mark.parametrize("m, n, k", [(1, 8, 64), (5, 24, 256), (37, 40, 512)])
def test_nvfp4_reference_against_dequantize_then_matmul(m, n, k):
    x, xs, x_g, w, ws, w_g = _nvfp4_case(np.random.default_rng(m * 100 + n), m, n, k)
    want = (_nvfp4_values(x, xs) @ _nvfp4_values(w, ws).T) * (np.float64(x_g[0]) * w_g.astype(np.float64))
    exact = fam.reference_nvfp4(x, xs, x_g, w, ws, w_g, exact=True)
    assert exact.shape == (m, n)
    np.testing.assert_allclose(exact, want, rtol=1e-12, atol=1e-300)
    # The kernel's roundings: fp32 sums of exact products (K 2^-24 of the absolute sum, taken as
    # K 2^-23 with the global's multiply), then one bf16 rounding (2^-8 relative at most).
    same = fam.reference_nvfp4(x, xs, x_g, w, ws, w_g)
    assert np.array_equal(same, round_bf16(same))
    mag = (np.abs(_nvfp4_values(x, xs)) @ np.abs(_nvfp4_values(w, ws)).T) * np.abs(np.float64(x_g[0]) * w_g)
    excess = np.abs(same - want) - (2.0**-8 * np.abs(want) + k * 2.0**-23 * mag + 1e-30)
    assert np.all(excess <= 0), f"worst excess {excess.max():.3g}"
    assert np.abs(same - want).max() > 0  # the bf16 rounding is really there
    assert np.all(same[:, -1] == 0)  # the zero global
    ops = {"x": x, "x_scale": xs, "x_gscale": x_g, "w": w, "w_scale": ws, "w_gscale": w_g}
    assert np.array_equal(fam.reference("nvfp4", ops), same)


def test_nvfp4_reference_rejects_mismatched_buffers():
    x, xs, x_g, w, ws, w_g = _nvfp4_case(np.random.default_rng(0), 3, 8, 64)
    with pytest.raises(ValueError, match="do not describe"):
        fam.reference_nvfp4(x, xs[:, :2], x_g, w, ws, w_g)
    with pytest.raises(ValueError, match="globals"):
        fam.reference_nvfp4(x, xs, x_g, w, ws, w_g[:4])
    with pytest.raises(ValueError, match="unknown kind"):
        fam.reference("mxfp8", {})


@pytest.mark.parametrize("m, n, k", [(1, 128, 256), (9, 256, 512)])
def test_fp8_reference_against_dequantize_then_matmul(m, n, k):
    rng = np.random.default_rng(m + n)
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    wf = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    ops = {**fam.fp8_activation_operands(x), **fam.fp8_weight_operands(*formats.fp8_block_quantize(wf))}
    a = formats.e4m3_to_f32(ops["x"]).astype(np.float64) * np.repeat(ops["x_scale"], 128, axis=1)
    b = formats.e4m3_to_f32(ops["w"]).astype(np.float64) * np.repeat(np.repeat(ops["w_scale"], 128, axis=0), 128,
                                                                     axis=1)
    np.testing.assert_allclose(b, formats.fp8_block_dequantize(ops["w"], ops["w_scale"]), rtol=2.0**-23)
    exact = fam.reference_fp8(ops["x"], ops["x_scale"], ops["w"], ops["w_scale"], exact=True)
    np.testing.assert_allclose(exact, a @ b.T, rtol=1e-12, atol=1e-12)
    same = fam.reference_fp8(ops["x"], ops["x_scale"], ops["w"], ops["w_scale"])
    assert np.array_equal(fam.reference("fp8", ops), same)
    assert np.array_equal(same, round_bf16(same))
    mag = np.abs(a) @ np.abs(b).T
    assert np.all(np.abs(same - exact) <= 2.0**-8 * np.abs(exact) + k * 2.0**-22 * mag)
    # The quantised product is close to the unquantised one (e4m3 on both sides: ~2^-4 each).
    assert np.abs(same - x.astype(np.float64) @ wf.T.astype(np.float64)).max() <= 2.0**-3 * mag.max()


def test_nvfp4_operands_from_storage():
    rng = np.random.default_rng(3)
    wf = rng.standard_normal((64, 128)).astype(np.float32)
    wf[32:] *= 100.0  # the second row group has its own global
    codes, scales, g = formats.nvfp4_quantize(wf, row_groups=2)
    ops = fam.nvfp4_weight_operands(codes, scales, g, row_groups=2)
    assert ops["w"] is not None and ops["w"].dtype == np.uint8 and ops["w"].shape == (64, 64)
    np.testing.assert_array_equal(ops["w_gscale"], np.repeat(g, 32))
    assert ops["w_gscale"][0] != ops["w_gscale"][-1]
    # Per-row globals reproduce the artifact's dequantisation.
    back = _nvfp4_values(ops["w"], ops["w_scale"]) * ops["w_gscale"][:, None]
    np.testing.assert_allclose(back, formats.nvfp4_dequantize(codes, scales, g, row_groups=2), rtol=1e-6)
    with pytest.raises(ValueError, match="row groups"):
        fam.nvfp4_weight_operands(codes, scales, g, row_groups=1)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    xo = fam.nvfp4_activation_operands(*formats.nvfp4_quantize(x))
    assert xo["x"].shape == (5, 64) and xo["x_scale"].shape == (5, 8) and xo["x_gscale"].shape == (1,)
    xb = _nvfp4_values(xo["x"], xo["x_scale"]) * xo["x_gscale"][0]
    assert np.abs(xb - x).max() <= 0.25 * np.abs(x).max()  # e2m1: 1 significand bit past the leading one
    with pytest.raises(ValueError, match="one global"):
        fam.nvfp4_activation_operands(codes, scales, g)  # a weight's two row groups


def test_fp8_weight_operands_need_one_scale_row_per_128_rows():
    codes = np.zeros((256, 256), np.uint8)
    assert fam.fp8_weight_operands(codes, np.ones((2, 2), np.float32))["w_scale"].shape == (2, 2)
    with pytest.raises(ValueError, match="128 x 128"):
        fam.fp8_weight_operands(codes, np.ones((3, 2), np.float32))  # a 2-group weight of 128 + 128 rows padded
    with pytest.raises(ValueError, match="multiples"):
        fam.fp8_weight_operands(np.zeros((200, 256), np.uint8), np.ones((2, 2), np.float32))


def test_fp8_activation_operands_are_quantize_act():
    x = round_bf16(np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32))
    ops = fam.fp8_activation_operands(x)
    want_q, want_s = quantize_act.reference(x)
    np.testing.assert_array_equal(ops["x"], want_q)
    np.testing.assert_array_equal(ops["x_scale"], want_s)


# ---------------------------------------------------------------------------- variant table


def test_variant_table():
    vs = {v.key: v for v in fam.variants()}
    shapes = {"gdn_in": (16384, 5120), "o_proj": (5120, 6144), "attn_qkv": (14336, 5120), "gate_up": (34816, 5120),
              "down": (5120, 17408), "test": (256, 512)}
    assert set(vs) == {f"{kind}_{name}_n{n}_k{k}" for kind in ("nvfp4", "fp8") for name, (n, k) in shapes.items()}
    for v in vs.values():
        kind, n, k = v.config["kind"], v.config["N"], v.config["K"]
        assert v.family == "gemm_bs_sm120" and tuple(v.arches) == ("sm_120a",)
        assert (v.config["BM"], v.config["BN"], v.config["stages"], v.config["threads"]) == (64, 128, 3, 128)
        assert v.block == (128, 1, 1) and v.grid == (n // 128, "cdiv(M, 64)", 1) and v.sizes == ("M",)
        assert v.config["smem"] == (82944 if kind == "nvfp4" else 73728) <= 99 * 1024  # an RTX 5090 block
        assert v.tensors["out"].shape == ("M", n) and v.tensors["out"].dtype == "bf16"
        names = [p.name for p in v.params]
        if kind == "nvfp4":
            assert names == ["x", "x_scale", "x_gscale", "w", "w_scale", "w_gscale", "out", "M"]
            assert v.tensors["x"].shape == ("M", k // 2) and v.tensors["x"].dtype == "u8"
            assert v.tensors["w_scale"].shape == (n, k // 16) and v.tensors["w_scale"].dtype == "e4m3"
            assert v.tensors["x_gscale"].shape == (1,) and v.tensors["w_gscale"].shape == (n,)
        else:
            assert names == ["x", "x_scale", "w", "w_scale", "out", "M"]
            assert v.tensors["w"].shape == (n, k) and v.tensors["w"].dtype == "e4m3"
            assert v.tensors["x_scale"].shape == ("M", k // 128)
            assert v.tensors["w_scale"].shape == (n // 128, k // 128)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        fam._variant("fp8", "odd", 200, 512)
    with pytest.raises(ValueError, match="k-tiles"):
        fam._variant("nvfp4", "short", 256, 256)  # one 128-byte k-tile: the ring needs two


def test_built_for_sm120a_only():
    assert not bk.plan(["sm_90a", "sm_100a"], ["gemm_bs_sm120"], TOOLS)
    jobs = bk.plan(["sm_120a"], ["gemm_bs_sm120"], TOOLS)
    assert len(jobs) == 12 and {j.arch for j in jobs} == {"sm_120a"}
    assert all("cute_kernels/_gemm_bs_sm120_kernel.py" in j.sources for j in jobs)
