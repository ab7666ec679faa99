"""The wide decode GEMV variants (`m16`, `m32`, `m64`, each in every row-group form: the plain key
and its `_rRuU` forms) against the `m8` variant and the reference.

Verification steps (k + 1 tokens of up to 8 sequences) and MTP rounds run their projections as
one wide GEMV launch per weight (`KernelChoice.exact_block`) instead of one `m8` launch per 8
rows, so every row must get exactly the numbers the `m8` launch over its block of 8 rows gives:
the same weight fragments in the same K order for its MMA column group, the token in the same
MMA column, the warps' partials added in the same order (cute_kernels/gemv.py). Checked bit for
bit on every row at the Qwen3.6-27B shapes, its lm_head and MTP fc, the 35B-A3B shapes and a test
shape whose last CTA owns fewer row groups than the others at every count (1040 rows; the 27B's
gdn_in, attn_qkv and lm_head have such a CTA at 3 or 4 row groups), at full and partial widths
(M = 9, 16; 17, 32; 33, 45, 63, 64), with the row after M poisoned (it must stay NaN); and against
the float64 reference on a sample of the output columns (the last 64 always: the short CTA's)
within 2x the error of the same-precision baseline, as tests/gpu/test_kernels_gemm.py checks the
`m8` variant.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv
from cute_kernels.bf16 import round_bf16, to_bits

from .conftest import assert_close_to_baseline, assert_equals_m8_rows

pytestmark = pytest.mark.gpu

CASES = {16: (9, 16), 32: (17, 32), 64: (33, 45, 63, 64)}  # MB -> row counts M
PERIOD = 4099  # distinct weight rows (then repeated on the device): the 248320-row heads without 5 GB of draws


def _keys(n: int, k: int, mb: int) -> list[str]:
    """Every variant of the shape and width: one per row-group form, the plain one first."""
    return [v.key for v in gemv.variants() if (v.config["N"], v.config["K"], v.config["MB"]) == (n, k, mb)]


def _repeated_rows(mem, rows: np.ndarray, n: int) -> int:
    """A device copy (bf16) of `rows` [P, K] repeated to n rows (row i is rows[i % P]), built on
    the device: the distinct rows uploaded once, then the filled part copied after itself. On the
    host the 248320-row heads were 5 GB of fp32 and seconds of bf16 conversion per test."""
    p, k = rows.shape
    ptr = mem.alloc(n * k * 2)
    bits = to_bits(rows)
    mem.device.memcpy_htod(ptr, bits, mem.stream)
    filled = p  # always a multiple of p: the copies keep row i at rows[i % p]
    while filled < n:
        count = min(filled, n - filled)
        mem.device.memcpy_dtod(ptr + filled * k * 2, ptr, count * k * 2, mem.stream)
        filled += count
    mem.stream.synchronize()
    return ptr


@pytest.mark.parametrize("name", [name for name, _, _ in gemv.SHAPES])
def test_wide_gemv_rows_equal_the_m8_rows_and_the_reference(library, mem, stream, name):
    n, k = next((n, k) for nm, n, k in gemv.SHAPES if nm == name)
    rng = np.random.default_rng(n + k)
    distinct = round_bf16((rng.standard_normal((min(n, PERIOD), k)) * 0.05).astype(np.float32))
    x = round_bf16(rng.standard_normal((64, k)).astype(np.float32))
    w_buf, x_buf = _repeated_rows(mem, distinct, n), mem.bf16(x)
    cols = np.unique(np.concatenate([np.arange(0, n, max(1, n // 1500)), np.arange(n - 64, n)]))
    w_cols = distinct[cols % len(distinct)]  # the weight's rows at cols
    # The references of all 64 rows once: each row's numbers are its own dot products, the same
    # as over the first M rows alone (checked equal on the CPU), and a float64 product over up
    # to 17408 x 1771 weights per M was seconds of CPU per shape.
    exact, base = gemv.reference(x, w_cols, exact=True), gemv.reference(x, w_cols)
    (m8_key,) = _keys(n, k, 8)
    m8 = library.kernel("gemv", m8_key)
    for mb, counts in CASES.items():
        for m in counts:
            # The m8 launches over the rows' blocks of 8, as the runner ran them before.
            want = mem.poisoned((m + 1) * n)
            for r0 in range(0, m, 8):
                m8.launch(stream, {"x": x_buf + r0 * k * 2, "w": w_buf, "out": want + r0 * n * 2},
                          {"M": min(8, m - r0)})
            ref = mem.read_bf16(want, (m + 1, n))
            for key in _keys(n, k, mb):
                what = f"gemv {key} M={m}"
                out = mem.poisoned((m + 1) * n)
                library.kernel("gemv", key).launch(stream, {"x": x_buf, "w": w_buf, "out": out}, {"M": m})
                got = mem.read_bf16(out, (m + 1, n))
                assert_equals_m8_rows(got, ref, m, what)
                assert_close_to_baseline(got[:m, cols], exact[:m], base[:m], what)
