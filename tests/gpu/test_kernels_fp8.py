"""The FP8 decode GEMV (`gemv_fp8`) against its references on a real GPU.

The reference is float64 of the dequantised weights; the same-precision baseline is
`gemv_fp8.reference` (per-128-block fp32 partials times the fp32 scale, fp32 sum, bf16 output).
Inputs: random e4m3 codes over the whole finite range, block scales of both signs with one zero
block, NaN-poisoned outputs with an extra row that must stay untouched, odd M, the tiny model's
shapes (K = 128 leaves 7 of 8 warps idle; tails of 8 rows, fewer than a CTA's 16) and the 27B's.
Written without a GPU at hand: not run yet.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv_fp8
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


def _case(rng, m, n, nt, k):
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00  # 0x7F / 0xFF are NaN in e4m3fn
    # |code| <= 448: scales near 1 / (448 sqrt(K)) keep the outputs O(1).
    scales = (rng.uniform(-1.0, 1.0, (-(-n // 128), k // 128)) / (448 * np.sqrt(k))).astype(np.float32)
    scales[-1, 0] = 0.0
    tail = round_bf16(rng.standard_normal((nt, k)).astype(np.float32) * 0.05) if nt else None
    return x, codes, scales, tail


def _upload(mem, device, stream, array):
    ptr = mem.alloc(max(array.nbytes, 16))
    device.memcpy_htod(ptr, np.ascontiguousarray(array), stream)
    stream.synchronize()
    return ptr


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name", [s[0] for s in gemv_fp8.SHAPES])
def test_gemv_fp8(library, device, mem, stream, name, m):
    _, n, nt, k = next(s for s in gemv_fp8.SHAPES if s[0] == name)
    rng = np.random.default_rng(n + 7 * m + k)
    x, codes, scales, tail = _case(rng, m, n, nt, k)
    v = next(v for v in gemv_fp8.variants() if v.key.startswith(name + "_"))
    bufs = {"x": mem.bf16(x), "w": _upload(mem, device, stream, codes), "scale": _upload(mem, device, stream, scales),
            "out": mem.poisoned((m + 1) * (n + nt))}
    if nt:
        bufs["tail"] = mem.bf16(tail)
    library.kernel("gemv_fp8", v.key).launch(stream, bufs, {"M": m})
    got = mem.read_bf16(bufs["out"], (m + 1, n + nt))
    assert np.isnan(got[m]).all(), f"{v.key} wrote past M"
    want = gemv_fp8.reference(x, codes, scales, tail, exact=True)
    base = gemv_fp8.reference(x, codes, scales, tail)
    assert_close_to_baseline(got[:m], want, base, f"gemv_fp8 {v.key} M={m}")


def test_gemv_fp8_is_batch_invariant(library, device, mem, stream):
    """Row 0 of an M = 8 launch equals the M = 1 launch bit for bit (decode buckets and the
    8-row prefill pieces rely on it)."""
    name, n, nt, k = gemv_fp8.SHAPES[0]
    x, codes, scales, tail = _case(np.random.default_rng(5), 8, n, nt, k)
    v = next(v for v in gemv_fp8.variants() if v.key.startswith(name + "_"))
    bufs = {"x": mem.bf16(x), "w": _upload(mem, device, stream, codes), "scale": _upload(mem, device, stream, scales),
            "tail": mem.bf16(tail)}
    kernel = library.kernel("gemv_fp8", v.key)
    outs = {}
    for m in (1, 8):
        outs[m] = mem.poisoned(m * (n + nt))
        kernel.launch(stream, {**bufs, "out": outs[m]}, {"M": m})
    one, eight = mem.read_bf16(outs[1], (1, n + nt)), mem.read_bf16(outs[8], (8, n + nt))
    np.testing.assert_array_equal(one[0], eight[0])


def test_gemv_fp8_rejects_large_m(library):
    from runtime.cuda.errors import LaunchError

    v = gemv_fp8.variants()[1]
    with pytest.raises(LaunchError, match="M <= 8"):
        library.kernel("gemv_fp8", v.key).bind({"x": 256, "w": 256, "scale": 256, "out": 256}, {"M": 9})
