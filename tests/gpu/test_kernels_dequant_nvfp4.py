"""`dequant_nvfp4` (NVFP4 weights to bf16 for the prefill GEMM) on a real GPU, bit for bit.

The reference (`dequant_nvfp4.reference`) does the kernel's arithmetic: e2m1 code times e4m3
block scale (exact in bf16), times the row's fp32 global scale in fp32, rounded once to bf16; so
every output must equal it. Inputs: every e2m1 code in both nibbles, e4m3 scale codes over the
finite range (the NaN codes 0x7F / 0xFF replaced), globals of both signs and magnitudes from
2^-20 to 2^4, an odd row count, and an output poisoned with NaN past the last row.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import dequant_nvfp4

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k,n", [(256, 37), (128, 1), (5120, 300), (17408, 9)])
def test_dequant_nvfp4_matches_reference_bit_for_bit(library, device, mem, stream, k, n):
    rng = np.random.default_rng(k + n)
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    flat = codes.reshape(-1)  # every code byte (both nibbles over all 16 codes) where there is room
    flat[:min(256, flat.size)] = np.arange(min(256, flat.size), dtype=np.uint8)
    scales = rng.integers(0, 256, (n, k // 16), dtype=np.uint8)
    scales[(scales & 0x7F) == 0x7F] = 0x00
    gscale = (rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-20, 4, n))).astype(np.float32)
    out = mem.poisoned((n + 1) * k)
    library.kernel("dequant_nvfp4", f"k{k}").launch(
        stream, {"w": mem.raw(codes), "scale": mem.raw(scales),
                 "gscale": mem.raw(gscale), "out": out}, {"N": n})
    got = mem.read_bf16(out, (n + 1, k))
    assert np.isnan(got[n]).all(), "wrote past N"
    want = dequant_nvfp4.reference(codes, scales, gscale)
    np.testing.assert_array_equal(got[:n].view(np.uint32), want.view(np.uint32))
