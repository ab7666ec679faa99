"""The decode GEMVs' gate/up + SiLU epilogue (the `..._m8_silu` variants of `gemv` and `gemv_fp8`,
cute_kernels/_gemv_silu.py) against the two launches it replaces in a decode step: the plain m8
GEMV of the fused [gate | up] weight, then `silu_mul`. Every output must be the same bits at
M = 1, 3 and 8 (the runner mixes both: verification rows past 8 keep the two launches), the row
after M untouched; the tiny FP8 shape is also checked against NumPy (the GEMV's reference, then
silu_mul's, within a few bf16 steps: the device's exp is not NumPy's).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv, gemv_fp8, silu_mul
from cute_kernels.bf16 import round_bf16, to_bits

pytestmark = pytest.mark.gpu

FUSED = [("gemv", "gate_up_n34816_k5120_m8_silu"), ("gemv_fp8", "gate_up_n34816_k5120_m8_silu"),
         ("gemv_fp8", "tiny_gate_up_n1024_k256_m8_silu")]


def _weights(rng, family, n, k):
    """The family's weight buffers as host arrays: bf16 values [n, k], or e4m3 codes [n, k] (no
    NaN codes) and fp32 block scales of both signs."""
    if family == "gemv":
        return {"w": round_bf16((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))}
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = (rng.uniform(-1.0, 1.0, (n // 128, k // 128)) / (448 * np.sqrt(k) / 8)).astype(np.float32)
    return {"w": codes, "scale": scales}


def _upload(mem, family, host):
    if family == "gemv":
        return {"w": mem.bf16(host["w"])}
    return {"w": mem.raw(host["w"]), "scale": mem.raw(host["scale"])}


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("family,key", FUSED)
def test_the_fused_gemv_equals_the_gemv_then_silu_mul(library, device, mem, stream, family, key, m):
    module = gemv if family == "gemv" else gemv_fp8
    v = next(v for v in module.variants() if v.key == key)
    n, k, inter = v.config["N"], v.config["K"], v.config["N"] // 2
    assert v.config["silu"] and v.tensors["out"].shape == ("M", inter)
    rng = np.random.default_rng(n + 31 * m + (family == "gemv"))
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    host = _weights(rng, family, n, k)
    bufs = {"x": mem.bf16(x), **_upload(mem, family, host)}

    proj = mem.poisoned((m + 1) * n)
    library.kernel(family, key.removesuffix("_silu")).launch(stream, {**bufs, "out": proj}, {"M": m})
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

    if n <= 2048:  # the tiny shape: NumPy's GEMV and silu_mul references
        ref = silu_mul.reference(gemv_fp8.reference(x, host["w"], host["scale"]))
        np.testing.assert_allclose(got_v[:m], ref, rtol=2 ** -6, atol=2 ** -10)
