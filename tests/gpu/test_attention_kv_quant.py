"""FP8 / INT8 KV pages (`runtime.model.kv_format`) in the attention kernels, against NumPy.

- prep: the quantised prep kernel writes exactly the codes and scales that `kv_format.quantise`
  gives for the K / V rows the bf16 prep kernel writes from the same inputs (the bf16 rows
  themselves are checked against NumPy in test_attention.py); nothing else of the pool changes.
- split + combine (decode, MTP catch-up, prefill fallback) and the WGMMA prefill kernel over
  quantised pools: against the float64 reference over the dequantised K/V, within the error of
  the same-precision baseline (the reference in fp32 over the same dequantised values; for the
  WGMMA kernel, which rounds code * scale to bf16 into its tiles, over those bf16 values).
Contexts cross page and split boundaries; prefill chunks take 1..300 query rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention_wgmma
from cute_kernels.bf16 import round_bf16, to_bits
from cute_kernels.rope import tables
from runtime.model import kv_format as kf
from runtime.model.gpu.storage import DECODE_MIN_SPLIT, default_decode_splits

from .conftest import assert_close_to_baseline
from .test_attention import SMS, _bf, _cfg, _check_rows, _Rows, _scattered

pytestmark = pytest.mark.gpu
PAGE = 64
FORMATS = ("fp8", "int8")


def _read(mem, ptr: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    mem.stream.synchronize()
    mem.device.memcpy_dtoh(out, ptr, mem.stream)
    mem.stream.synchronize()
    return out


def _quantised_pool(rng, fmt, rows, hkv, d):
    """(pool bytes, dequantised values float64 [rows, Hkv, D]) of random bf16 K or V rows; every
    17th token-head all zeros (scale 0) and some heads scaled far apart."""
    x = _bf(rng, (rows, hkv, d)) * np.exp2(rng.integers(-6, 7, (rows, hkv, 1))).astype(np.float32)
    x[::17, 0] = 0.0
    codes, scales = kf.quantise(x, fmt)
    return kf.pack_pages(codes, scales), kf.dequantise(codes, scales, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["q4_kv2_d64", "q24_kv4_d256", "q16_kv2_d256"])
def test_prep_writes_the_reference_codes(library, mem, stream, name, fmt):
    cfg = _cfg(name)
    hq, hkv, d, rd, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["rd"], cfg["x_stride"]
    rng = np.random.default_rng(11)
    m, npages, p = 7, 4, 4096
    cos, sin = (round_bf16(t) for t in tables(p, rd, 1e7))
    x = _bf(rng, (m, stride), 2.0)
    x[3, hq * 2 * d + hkv * d:] = 0.0  # row 3's V all zero: scale 0, codes 0
    x[5, hq * 2 * d + hkv * d:] *= 1e-37  # tiny V values: fp32-subnormal scales
    qn_w, kn_w = _bf(rng, (d,), 0.2), _bf(rng, (d,), 0.2)
    pos = np.array([0, 63, 64, 3000, p + 7, 5, 100])
    wrow = np.array([5, 100, 64 * 3 + 63, 17, 200, 64, 0])
    args = {"x": mem.bf16(x), "qn_w": mem.bf16(qn_w), "kn_w": mem.bf16(kn_w), "cos": mem.bf16(cos),
            "sin": mem.bf16(sin), "pos": mem.i32(pos), "wrow": mem.i32(wrow)}
    # The bf16 kernel's K / V rows: what the quantised kernel must quantise.
    q16 = mem.poisoned(m * hq * d)
    k16, v16 = mem.poisoned(npages * PAGE * hkv * d), mem.poisoned(npages * PAGE * hkv * d)
    library.kernel("attention", f"prep_{name}").launch(
        stream, {**args, "q_out": q16, "k_pages": k16, "v_pages": v16}, {"M": m, "P": p, "NP": npages})
    pb = kf.page_bytes(fmt, hkv, d)
    fill = rng.integers(0, 256, npages * pb, dtype=np.uint8)  # what was in the pool before
    q8 = mem.poisoned(m * hq * d)
    k8, v8 = mem.raw(fill), mem.raw(fill)
    library.kernel("attention", f"prep_{name}_{fmt}").launch(
        stream, {**args, "q_out": q8, "k_pages": k8, "v_pages": v8}, {"M": m, "P": p, "NP": npages})
    np.testing.assert_array_equal(mem.read_bf16(q8, (m, hq, d)), mem.read_bf16(q16, (m, hq, d)))
    for what, rows16, pool in (("k", k16, k8), ("v", v16, v8)):
        values = mem.read_bf16(rows16, (npages * PAGE, hkv, d))[wrow]
        want_codes, want_scales = kf.quantise(values, fmt)
        got = _read(mem, pool, npages * pb)
        codes, scales = kf.unpack_pages(got, hkv, d)
        np.testing.assert_array_equal(codes[wrow], want_codes, err_msg=f"{name} {fmt} {what} codes")
        np.testing.assert_array_equal(scales[wrow].view(np.uint32), want_scales.view(np.uint32),
                                      err_msg=f"{name} {fmt} {what} scales")
        others = np.setdiff1d(np.arange(npages * PAGE), wrow)
        old_codes, old_scales = kf.unpack_pages(fill, hkv, d)
        np.testing.assert_array_equal(codes[others], old_codes[others])
        np.testing.assert_array_equal(scales[others].view(np.uint32), old_scales[others].view(np.uint32))
    assert not kf.unpack_pages(_read(mem, v8, npages * pb), hkv, d)[0][wrow[3]].any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,lengths,plan", [
    ("q4_kv2_d64", [1, 63, 64, 65, 1000, 4097], "runner"),
    ("q24_kv4_d256", [1, 64, 129, 4097, 30001], "runner"),
    ("q24_kv4_d256", [5, 7777], "few"),
    ("q16_kv2_d256", [65, 1, 9000, 63], "runner"),
])
def test_decode_attention_over_quantised_pages(library, mem, stream, name, lengths, plan, fmt):
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(len(lengths) + max(lengths))
    splits, min_split = {"runner": (default_decode_splits(hkv, 262144 + 64, SMS), DECODE_MIN_SPLIT),
                         "few": (3, 64)}[plan]
    table, npages = _scattered(rng, lengths)
    k_pool, k_vals = _quantised_pool(rng, fmt, npages * PAGE, hkv, d)
    v_pool, v_vals = _quantised_pool(rng, fmt, npages * PAGE, hkv, d)
    q = _bf(rng, (len(lengths), hq, d), 2.0)
    x = _bf(rng, (len(lengths), stride))
    pos, qseq = np.array(lengths) - 1, np.arange(len(lengths))
    rows = _Rows(library, mem, name, len(lengths), table.shape, splits, min_split, npages, mem.raw(k_pool),
                 mem.raw(v_pool), kv_suffix=f"_{fmt}")
    rows.upload(q, x, table, qseq, pos, stream)
    rows.run(stream)
    _check_rows(rows.read(), q, k_vals, v_vals, table, qseq, pos, x, hq, d, f"{name} {fmt} plan {plan}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,m,start", [
    ("q24_kv4_d256", 1, 0), ("q24_kv4_d256", 77, 4030), ("q24_kv4_d256", 300, 1000),
    ("q16_kv2_d256", 129, 63), ("q16_kv2_d256", 300, 0),
])
def test_wgmma_prefill_over_quantised_pages(library, mem, stream, name, m, start, fmt):
    """A chunk of m query rows at positions start..start+m-1 over its sequence's quantised pages."""
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    key = f"fwd_{name}_wg2_{fmt}"
    rng = np.random.default_rng(m + start)
    n = start + m
    table, npages = _scattered(rng, [n])
    k_pool, k_vals = _quantised_pool(rng, fmt, npages * PAGE, hkv, d)
    v_pool, v_vals = _quantised_pool(rng, fmt, npages * PAGE, hkv, d)
    q = _bf(rng, (m, hq, d), 2.0)
    x = _bf(rng, (m, stride))
    pos = np.arange(start, n)
    out = mem.poisoned((m + 1) * hq * d)
    library.kernel("attention_wgmma", key).launch(stream, {
        "q": mem.bf16(q), "k_pages": mem.raw(k_pool), "v_pages": mem.raw(v_pool),
        "table": mem.i32(table), "qseq": mem.i32(np.zeros(m)), "pos": mem.i32(pos), "x": mem.bf16(x), "out": out},
        {"M": m, "maxp": table.shape[1], "R": 1, "NP": npages})
    got = mem.read_bf16(out, (m + 1, hq * d))
    assert np.isnan(got[m]).all(), "the kernel wrote past its rows"
    exact = attention_wgmma.reference(q, k_vals, v_vals, table[0], pos, x, exact=True)
    as_bf16 = [round_bf16(v.astype(np.float32)) for v in (k_vals, v_vals)]
    baseline = attention_wgmma.reference(q, *as_bf16, table[0], pos, x)
    assert_close_to_baseline(got[:m], exact, baseline, f"{key} m={m} start={start}", slack=2.5)


def test_quantised_pools_read_the_same_bytes_as_the_bf16_bits(library, mem, stream):
    """The split kernel over fp8 pages holding values that e4m3 represents exactly (codes of
    small integers, scale 1) gives the bf16 kernel's output on the same values bit for bit."""
    name, fmt = "q24_kv4_d256", "fp8"
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(4)
    lengths = [700, 1]
    table, npages = _scattered(rng, lengths)
    vals = [rng.integers(-8, 9, (npages * PAGE, hkv, d)).astype(np.float32) for _ in range(2)]
    for v in vals:
        v[:, :, 0] = 448.0  # amax 448: scale 1
    pools = [kf.pack_pages(*kf.quantise(v, fmt)) for v in vals]
    q = _bf(rng, (2, hq, d), 0.05)
    x = _bf(rng, (2, stride))
    pos, qseq = np.array(lengths) - 1, np.arange(2)
    outs = []
    for suffix, k, v in (("", mem.bf16(vals[0]), mem.bf16(vals[1])),
                         (f"_{fmt}", mem.raw(pools[0]), mem.raw(pools[1]))):
        rows = _Rows(library, mem, name, 2, table.shape, 4, 64, npages, k, v, kv_suffix=suffix)
        rows.upload(q, x, table, qseq, pos, stream)
        rows.run(stream)
        outs.append(rows.read())
    np.testing.assert_array_equal(to_bits(outs[1]), to_bits(outs[0]))
