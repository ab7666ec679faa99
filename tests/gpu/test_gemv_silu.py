"""The decode GEMVs' gate/up + SiLU epilogue (the `..._m8_silu` variants of `gemv`, `gemv_fp8` and
`gemv_nvfp4`, cute_kernels/_gemv_silu.py) against the two launches it replaces in a decode step:
the plain m8 GEMV of the fused [gate | up] weight (NVFP4: the runner's `shift_u8` form), then
`silu_mul`. Every output must be the same bits at
M = 1, 3 and 8 (the runner mixes both: verification rows past 8 keep the two launches), the row
after M untouched; the tiny shapes are also checked against NumPy (the GEMV's reference, then
silu_mul's, within a few bf16 steps: the device's exp is not NumPy's).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv, gemv_fp8, gemv_nvfp4, silu_mul
from cute_kernels.bf16 import round_bf16, to_bits

pytestmark = pytest.mark.gpu

FUSED = [("gemv", "gate_up_n34816_k5120_m8_silu"), ("gemv_fp8", "gate_up_n34816_k5120_m8_silu"),
         ("gemv_fp8", "tiny_gate_up_n1024_k256_m8_silu"), ("gemv_nvfp4", "gate_up_n34816_k5120_m8_silu"),
         ("gemv_nvfp4", "tiny_gate_up_n1024_k256_m8_silu")]


def _weights(rng, family, n, k):
    """The family's weight buffers as host arrays: bf16 values [n, k]; e4m3 codes [n, k] (no NaN
    codes) and fp32 block scales of both signs; or packed e2m1 codes [n, k / 2], e4m3 scale codes
    per 16 columns (no NaN, 2^-3 .. 2^3) and an fp32 global per row of both signs."""
    if family == "gemv":
        return {"w": round_bf16((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))}
    if family == "gemv_nvfp4":
        scales = rng.integers(0x20, 0x51, (n, k // 16), dtype=np.uint8)  # e4m3 exponents 4..10
        gscale = (rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n) / np.sqrt(k)).astype(np.float32)
        return {"w": rng.integers(0, 256, (n, k // 2), dtype=np.uint8), "scale": scales, "gscale": gscale}
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = (rng.uniform(-1.0, 1.0, (n // 128, k // 128)) / (448 * np.sqrt(k) / 8)).astype(np.float32)
    return {"w": codes, "scale": scales}


def _upload(mem, family, host):
    if family == "gemv":
        return {"w": mem.bf16(host["w"])}
    return {name: mem.raw(value) for name, value in host.items()}


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("family,key", FUSED)
def test_the_fused_gemv_equals_the_gemv_then_silu_mul(library, device, mem, stream, family, key, m):
    module = {"gemv": gemv, "gemv_fp8": gemv_fp8, "gemv_nvfp4": gemv_nvfp4}[family]
    v = next(v for v in module.variants() if v.key == key)
    n, k, inter = v.config["N"], v.config["K"], v.config["N"] // 2
    assert v.config["silu"] and v.tensors["out"].shape == ("M", inter)
    rng = np.random.default_rng(n + 31 * m + (family == "gemv"))
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    host = _weights(rng, family, n, k)
    bufs = {"x": mem.bf16(x), **_upload(mem, family, host)}

    proj = mem.poisoned((m + 1) * n)
    plain = key.removesuffix("_silu") + ("_shift_u8" if family == "gemv_nvfp4" else "")  # the runner's forms
    library.kernel(family, plain).launch(stream, {**bufs, "out": proj}, {"M": m})
    want = mem.poisoned((m + 1) * inter)
    library.kernel("silu_mul", f"i{inter}").launch(stream, {"x": proj, "out": want}, {"M": m})
    got = mem.poisoned((m + 1) * inter)
    library.kernel(family, key).launch(stream, {**bufs, "out": got}, {"M": m})

    got_v, want_v = mem.read_bf16(got, (m + 1, inter)), mem.read_bf16(want, (m + 1, inter))
    assert np.isnan(got_v[m]).all(), f"{key} wrote past M"
    assert np.isfinite(got_v[:m]).all(), f"{key}: an output of the first M rows was not written"
    diff = np.argwhere(to_bits(got_v[:m]) != to_bits(want_v[:m]))
    assert diff.size == 0, (f"{key} M={m}: {len(diff)} outputs differ from gemv + silu_mul; first (token, i) "
                            f"{tuple(diff[0])}: {got_v[tuple(diff[0])]} against {want_v[tuple(diff[0])]}")
    assert np.abs(got_v[:m]).max() > 0.1  # outputs of a useful magnitude, not all flushed to zero

    if n <= 2048:  # the tiny shapes: NumPy's GEMV and silu_mul references
        ref = silu_mul.reference(module.reference(x, *host.values()))
        np.testing.assert_allclose(got_v[:m], ref, rtol=2 ** -6, atol=2 ** -10)
