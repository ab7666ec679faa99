"""The FP8 prefill path's kernels on a real GPU: `quantize_act` bit for bit against its reference,
`gemm_fp8_sm90` (with gemm_sm90 writing a BF16 tail beside it) against float64.

quantize_act's reference does the kernel's fp32 operations (an IEEE division for the scale and
for each quotient, round-to-nearest-even saturating e4m3), so codes and scales must be equal.

The FP8 GEMM's exact reference is float64 of the dequantised operands (`gemm_fp8_sm90.reference(
exact=True)`); the same-precision baseline is the kernel's order in fp32 (per-block partial times
both scales, fp32 sum, bf16). Both must hold:
- the relative (Frobenius) error at most 2x the baseline's plus 2^-11 (`assert_close_to_baseline`;
  the floor for the FP8 WGMMA's reduced-precision block sums, which the baseline does not model);
- elementwise |got - exact| <= 2^-8 |exact| + 2^-10 mag, mag = sum_k |x_k w_k| (dequantised): the
  bf16 output rounding is at most 2^-9 |result| and the FP8 WGMMA's accumulation keeps the top
  ~14 bits of each 128-term block sum (DeepSeek-V3 section 3.3: at most ~2^-13 of its magnitude;
  the fp32 promotion adds ~2^-23), so the bound has 2x and 8x margins; a wrong scale, row or
  column is off by O(1) of mag.
Inputs: e4m3 codes over the whole finite range, weight block scales of both signs with a zero
block, activation scales with a zero group, outputs poisoned with NaN and one extra row that must
stay untouched; odd M (1 row, partial tiles), the ragged test shape (N = 328, K = 320: partial
scale blocks at both edges), the tiny model's gdn_in with its 8-row BF16 tail, and the 27B's
shapes (their exact products checked on a few rows and three 128-column blocks, to stay fast).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_fp8_sm90, gemm_sm90, quantize_act
from cute_kernels.bf16 import round_bf16, to_bits
from runtime.artifact.formats import e4m3_to_f32

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu


def _read(device, stream, ptr, like):
    out = np.empty_like(like)
    stream.synchronize()
    device.memcpy_dtoh(out, ptr, stream)
    stream.synchronize()
    return out


def _codes(rng, *shape):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x00  # 0x7F / 0xFF are NaN in e4m3fn
    return codes


# ---------------------------------------------------------------------------- quantize_act


@pytest.mark.parametrize("form", list(quantize_act.FORMS))
@pytest.mark.parametrize("k,m", [(320, 1), (320, 37), (5120, 200), (17408, 3), (2048, 129), (4096, 5)])
def test_quantize_act_matches_reference_bit_for_bit(library, device, mem, stream, k, m, form):
    """Every form (v8: two groups per warp, so with K = 320, 3 groups a row, half warps straddle
    rows, and 37 x 3 items leave the last CTA partly empty)."""
    key = next(v.key for v in quantize_act.variants() if v.config["K"] == k and v.config["form"] == form)
    rng = np.random.default_rng(k + m)
    # Magnitudes spread over 2^-12 .. 2^12 (per-group amax differ), one all-zero group, and a
    # row with one huge and otherwise tiny values (codes that flush to zero).
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-12, 13, (m, 1)))
    x[0, :128] = 0.0
    if m > 1:
        x[1] = 1e-6
        x[1, 5] = 3e3
    x = round_bf16(x.astype(np.float32))
    kb = quantize_act.groups(k)
    q = mem.alloc((m + 1) * k)
    scale = mem.alloc((m + 1) * kb * 4)
    device.memset_d8(q, 0xAB, (m + 1) * k, stream)
    device.memset_d8(scale, 0xAB, (m + 1) * kb * 4, stream)
    library.kernel("quantize_act", key).launch(stream, {"x": mem.bf16(x), "q": q, "scale": scale}, {"M": m})
    got_q = _read(device, stream, q, np.empty((m + 1, k), np.uint8))
    got_s = _read(device, stream, scale, np.empty((m + 1, kb), np.float32))
    want_q, want_s = quantize_act.reference(x)
    assert (got_q[m] == 0xAB).all() and (got_s[m].view(np.uint32) == 0xABABABAB).all(), "wrote past M"
    np.testing.assert_array_equal(got_s[:m].view(np.uint32), want_s.view(np.uint32))
    np.testing.assert_array_equal(got_q[:m], want_q)
    assert (want_s[0, 0] == 0.0) and (want_q[0, :128] == 0).all()  # the zero group
    # The codes are the values' nearest e4m3 at the group's scale (the reference is what it says).
    back = e4m3_to_f32(want_q) * np.repeat(want_s, 128, axis=1)[:, :k]
    assert np.all(np.abs(back - x) <= np.abs(x) * 2.0**-4 + np.repeat(want_s, 128, axis=1)[:, :k] * 2.0**-9)


# ---------------------------------------------------------------------------- gemm_fp8_sm90


def _fp8_case(rng, m, n, k):
    xq, wq = _codes(rng, m, k), _codes(rng, n, k)
    kb = -(-k // 128)
    # |code| <= 448: scales near 1 / (448 sqrt(K)) per operand keep the outputs O(1).
    x_scale = rng.uniform(0.5, 1.5, (m, kb)).astype(np.float32) / np.float32(448 * k**0.25)
    w_scale = (rng.uniform(-1.5, 1.5, (-(-n // 128), kb)) / (448 * k**0.25)).astype(np.float32)
    x_scale[0, -1] = 0.0
    w_scale[-1, 0] = 0.0
    return xq, x_scale, wq, w_scale


def _magnitude(xq, x_scale, wq, w_scale):
    """sum_k |x_k w_k| of the dequantised operands (the codes with their sign bits cleared)."""
    return gemm_fp8_sm90.reference(xq & 0x7F, np.abs(x_scale), wq & 0x7F, np.abs(w_scale), exact=True)


def _check(got, xq, x_scale, wq, w_scale, what):
    exact = gemm_fp8_sm90.reference(xq, x_scale, wq, w_scale, exact=True)
    base = gemm_fp8_sm90.reference(xq, x_scale, wq, w_scale)
    # floor 2^-11: the FP8 WGMMA's block sums (not modelled by the fp32 baseline) keep ~14 bits of
    # their running sum per addition, ~sqrt(128) 2^-14 = 2^-10.5 of a block sum at most (before
    # the errors of the blocks average out), small against the baseline's bf16 rounding (~2^-10).
    assert_close_to_baseline(got, exact, base, what, floor=2.0**-11)
    bound = 2.0**-8 * np.abs(exact) + 2.0**-10 * _magnitude(xq, x_scale, wq, w_scale)
    worst = np.unravel_index(np.argmax(np.abs(got - exact) - bound), got.shape)
    assert np.all(np.abs(got - exact) <= bound), f"{what}: at {worst} got {got[worst]} want {exact[worst]}"


def _run_fp8(library, device, mem, stream, key, xq, x_scale, wq, w_scale, ld):
    m = xq.shape[0]
    out = mem.poisoned((m + 1) * ld)
    bufs = {"x": mem.raw(xq), "w": mem.raw(wq),
            "x_scale": mem.raw(x_scale), "w_scale": mem.raw(w_scale),
            "out": out}
    library.kernel("gemm_fp8_sm90", key).launch(stream, bufs, {"M": m})
    return out


@pytest.mark.parametrize("m", [1, 129, 300])
def test_gemm_fp8_ragged(library, device, mem, stream, m):
    v = next(v for v in gemm_fp8_sm90.variants() if v.key.startswith("test_"))
    n, k = v.config["N"], v.config["K"]
    rng = np.random.default_rng(m)
    xq, x_scale, wq, w_scale = _fp8_case(rng, m, n, k)
    out = _run_fp8(library, device, mem, stream, v.key, xq, x_scale, wq, w_scale, n)
    got = mem.read_bf16(out, (m + 1, n))
    assert np.isnan(got[m]).all(), "wrote past M"
    _check(got[:m], xq, x_scale, wq, w_scale, f"gemm_fp8 {v.key} M={m}")


def test_gemm_fp8_with_bf16_tail(library, device, mem, stream):
    """The tiny gdn_in: FP8 columns 0..383 by gemm_fp8_sm90, BF16 tail columns 384..391 by
    gemm_sm90 with the 392-element row stride, as `layers.Forward.fp8_gemm` launches them."""
    m, n, nt, k = 77, 384, 8, 256
    rng = np.random.default_rng(77)
    xq, x_scale, wq, w_scale = _fp8_case(rng, m, n, k)
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    tail = round_bf16(rng.standard_normal((nt, k)).astype(np.float32) * 0.05)
    out = _run_fp8(library, device, mem, stream, f"tiny_gdn_in_n{n}_t{nt}_k{k}", xq, x_scale, wq, w_scale, n + nt)
    library.kernel("gemm_sm90", f"tiny_gdn_in_tail_n{nt}_k{k}_ld{n + nt}").launch(
        stream, {"x": mem.bf16(x), "w": mem.bf16(tail), "out": out + n * 2}, {"M": m})
    got = mem.read_bf16(out, (m + 1, n + nt))
    assert np.isnan(got[m]).all(), "wrote past M"
    _check(got[:m, :n], xq, x_scale, wq, w_scale, "gemm_fp8 tiny_gdn_in")
    assert_close_to_baseline(got[:m, n:], gemm_sm90.reference(x, tail, exact=True), gemm_sm90.reference(x, tail),
                             "gemm_sm90 tail")


@pytest.mark.parametrize("name,m", [("gdn_in", 1000), ("o_proj", 8192), ("attn_qkv", 300), ("gate_up", 300),
                                    ("down", 300), ("a3b_gdn_in", 1000), ("a3b_o_proj", 300),
                                    ("a3b_attn_qkv", 8192)])
def test_gemm_fp8_model_shapes(library, device, mem, stream, name, m):
    """Every output is checked for being finite and written; the exact products on 9 rows (first,
    last, a tile edge) and three 128-column blocks (first, middle, last)."""
    _, n, nt, k = next(s for s in gemm_fp8_sm90.SHAPES if s[0] == name)
    rng = np.random.default_rng(n + m)
    xq, x_scale, wq, w_scale = _fp8_case(rng, m, n, k)
    out = _run_fp8(library, device, mem, stream, f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}",
                   xq, x_scale, wq, w_scale, n + nt)
    got = mem.read_bf16(out, (m + 1, n + nt))
    assert np.isfinite(got[:m, :n]).all() and np.isnan(got[m]).all() and np.isnan(got[:, n:]).all()
    rows = np.array([0, 1, 127, 128, m // 2, m - 129, m - 2, m - 1, 255])
    blocks = [0, n // 256, -(-n // 128) - 1]
    cols = np.concatenate([np.arange(b * 128, min(n, b * 128 + 128)) for b in blocks])
    _check(got[rows][:, cols], xq[rows], x_scale[rows], wq[cols], w_scale[blocks], f"gemm_fp8 {name} M={m}")


def test_gemm_fp8_agrees_with_torch_scaled_mm(library, device, stream):
    """At the 27B's o_proj shape and M = 8192, against torch._scaled_mm's blockwise form (1x128
    activation and 128x128 weight scales) where this torch supports it: both are the same
    block-scaled product with fp32 promotion, so they differ by the bf16 rounding of each (a
    few outputs one bf16 ulp apart)."""
    torch = pytest.importorskip("torch")
    m, n, k = 8192, 5120, 6144
    gen = torch.Generator(device="cuda").manual_seed(5)
    # Clamped: torch's cast to e4m3fn does not saturate (past 448 gives NaN).
    xq = (torch.randn(m, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.rand(m, k // 128, device="cuda", generator=gen) * 1e-4 + 1e-5
    ws = torch.rand(n // 128, k // 128, device="cuda", generator=gen) * 1e-4 + 1e-5
    # Blockwise scales must be outer-dim major in the torch versions that take them; try both layouts.
    peer = None
    for a_scale, b_scale in ((xs.t().contiguous().t(), ws.t()), (xs, ws.t().contiguous())):
        try:
            peer = torch._scaled_mm(xq, wq.T, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)
            break
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            reason = exc
    if peer is None:
        pytest.skip(f"this torch has no blockwise _scaled_mm: {reason}")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    library.kernel("gemm_fp8_sm90", f"o_proj_n{n}_k{k}").launch(
        stream, {"x": xq.data_ptr(), "w": wq.data_ptr(), "x_scale": xs.contiguous().data_ptr(),
                 "w_scale": ws.contiguous().data_ptr(), "out": out.data_ptr()}, {"M": m})
    stream.synchronize()
    got, want = out.float(), peer.float()
    assert torch.isfinite(got).all()
    # One bf16 rounding each (2^-9 relative) plus accumulation-order differences near cancellation.
    bad = (got - want).abs() > want.abs() * 2.0**-7 + want.abs().mean() * 2.0**-10
    assert int(bad.sum()) == 0, f"{int(bad.sum())} of {m * n} outputs differ from torch._scaled_mm"


# ---------------------------------------------------------------------------- gemm_fp8_sm90 tile forms
# Every form (gemm_fp8_sm90.FORMS: 128 x 128 tiles, today's, and the 160- / 192-column ones whose N
# tiles span two weight-scale blocks) runs the same 4 WGMMAs per k-tile for each output and the same
# fp32 promotion in the same k order, so each must equal today's form bit for bit, besides the
# float64 bounds above.
WIDE_FORMS = [form for form in gemm_fp8_sm90.FORMS if form != gemm_fp8_sm90.DEFAULT_FORM]


def _run_forms(library, device, mem, stream, name, n, nt, k, xq, x_scale, wq, w_scale):
    """{form: the [M + 1, N + NT] output read back} of every form on the same inputs."""
    m = xq.shape[0]
    got = {}
    for form in gemm_fp8_sm90.FORMS:
        out = _run_fp8(library, device, mem, stream, gemm_fp8_sm90.key(name, n, nt, k, form),
                       xq, x_scale, wq, w_scale, n + nt)
        got[form] = mem.read_bf16(out, (m + 1, n + nt))
    return got


@pytest.mark.parametrize("name", ["test", "test_wide"])
@pytest.mark.parametrize("m", [1, 127, 129, 1000])
def test_gemm_fp8_forms_ragged(library, device, mem, stream, name, m):
    """The ragged shapes (N = 328 / 680, K = 320: partial blocks at both edges; test_wide's tiles
    start at every offset of both wide forms and its last 160-column tile's second block lies
    past N) at odd M, every form against float64 and bit for bit against today's."""
    _, n, nt, k = next(s for s in gemm_fp8_sm90.SHAPES if s[0] == name)
    rng = np.random.default_rng(1000 * m + n)
    xq, x_scale, wq, w_scale = _fp8_case(rng, m, n, k)
    got = _run_forms(library, device, mem, stream, name, n, nt, k, xq, x_scale, wq, w_scale)
    base = got[gemm_fp8_sm90.DEFAULT_FORM]
    for form, out in got.items():
        assert np.isnan(out[m]).all(), f"{form} wrote past M"
        _check(out[:m], xq, x_scale, wq, w_scale, f"gemm_fp8 {name} {form} M={m}")
        np.testing.assert_array_equal(to_bits(out[:m]), to_bits(base[:m]), err_msg=f"{form} vs today's")


@pytest.mark.parametrize("name", ["gdn_in", "o_proj", "attn_qkv", "gate_up", "down", "a3b_gdn_in"])
def test_gemm_fp8_forms_model_shapes(library, device, mem, stream, name):
    """The 27B's shapes (and the A3B GDN's) at M = 8192 (the prefill chunk of the issue's target):
    every form's whole output equal to today's bit for bit and finite, the BF16 tail columns untouched, the row past
    M untouched; the exact products of each form on rows at tile edges and on the 128-column
    blocks around a 160- and a 192-column tile edge and at both ends."""
    m = 8192
    _, n, nt, k = next(s for s in gemm_fp8_sm90.SHAPES if s[0] == name)
    rng = np.random.default_rng(n + k)
    xq, x_scale, wq, w_scale = _fp8_case(rng, m, n, k)
    got = _run_forms(library, device, mem, stream, name, n, nt, k, xq, x_scale, wq, w_scale)
    base = got[gemm_fp8_sm90.DEFAULT_FORM]
    rows = np.array([0, 1, 127, 128, 4095, 4096, m - 129, m - 2, m - 1])
    # Column blocks 0, 1 (tile edges at 160 and 192 inside block 1), 2 and 3 (edges at 320 and 384),
    # the middle and the last (where a 192-column tile ends past N on N = 5120).
    blocks = sorted({0, 1, 2, 3, n // 256, -(-n // 128) - 1})
    cols = np.concatenate([np.arange(b * 128, min(n, b * 128 + 128)) for b in blocks])
    for form, out in got.items():
        assert np.isfinite(out[:m, :n]).all() and np.isnan(out[m]).all() and np.isnan(out[:, n:]).all(), form
        np.testing.assert_array_equal(to_bits(out[:m, :n]), to_bits(base[:m, :n]), err_msg=f"{form} vs today's")
        _check(out[rows][:, cols], xq[rows], x_scale[rows], wq[cols], w_scale[blocks], f"gemm_fp8 {name} {form}")
