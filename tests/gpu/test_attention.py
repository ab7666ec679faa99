"""The attention kernels (q/k prep + paged KV write, split-KV attention, combine) against NumPy.

Pages are scattered and shuffled; rows attend to different context lengths (decode of several
sequences, and a prefill chunk whose rows see a growing causal prefix); split sizes that leave
the last split ragged and splits entirely past a row's end (which must be skipped).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention
from cute_kernels.bf16 import round_bf16
from cute_kernels.rope import tables

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu
PAGE = 64


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _cfg(name):
    v = next(v for v in attention.variants() if v.key == f"prep_{name}")
    return v.config


@pytest.mark.parametrize("name", ["q4_kv2_d64", "q24_kv4_d256"])
def test_prep(library, mem, stream, name):
    cfg = _cfg(name)
    hq, hkv, d, rd, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["rd"], cfg["x_stride"]
    rng = np.random.default_rng(3)
    m, npages, p = 5, 4, 4096
    cos, sin = (round_bf16(t) for t in tables(p, rd, 1e7))
    x = _bf(rng, (m, stride), 2.0)
    qn_w, kn_w = _bf(rng, (d,), 0.2), _bf(rng, (d,), 0.2)
    pos = np.array([0, 63, 64, 3000, p + 7])  # the last one is out of the table: left unrotated
    wrow = np.array([5, 100, 64 * 3 + 1, 17, 200])
    q_out = mem.poisoned(m * hq * d)
    kp, vp = mem.poisoned(npages * PAGE * hkv * d), mem.poisoned(npages * PAGE * hkv * d)
    library.kernel("attention", f"prep_{name}").launch(stream, {
        "x": mem.bf16(x), "qn_w": mem.bf16(qn_w), "kn_w": mem.bf16(kn_w), "cos": mem.bf16(cos), "sin": mem.bf16(sin),
        "pos": mem.i32(pos), "wrow": mem.i32(wrow), "q_out": q_out, "k_pages": kp, "v_pages": vp},
        {"M": m, "P": p, "NP": npages})
    got_q = mem.read_bf16(q_out, (m, hq, d))
    k_rows = mem.read_bf16(kp, (npages * PAGE, hkv, d))
    v_rows = mem.read_bf16(vp, (npages * PAGE, hkv, d))
    wq, wk, wv = attention.reference_prep(x, qn_w, kn_w, cos, sin, pos, hq=hq, hkv=hkv, d=d, exact=True)
    bq, bk, bv = attention.reference_prep(x, qn_w, kn_w, cos, sin, pos, hq=hq, hkv=hkv, d=d)
    assert_close_to_baseline(got_q, wq, bq, f"prep {name} q")
    assert_close_to_baseline(k_rows[wrow], wk, bk, f"prep {name} k")
    np.testing.assert_array_equal(v_rows[wrow], bv)
    others = np.setdiff1d(np.arange(npages * PAGE), wrow)
    assert np.isnan(k_rows[others]).all() and np.isnan(v_rows[others]).all()


def _run_attention(library, mem, stream, name, q, pages_k, pages_v, table, qseq, pos, split, x):
    cfg = _cfg(name)
    hq, d = cfg["Hq"], cfg["D"]
    m = q.shape[0]
    splits = -(-(int(pos.max()) + 1) // split) + 1  # one more than needed: must be skipped
    npages = pages_k.shape[0] // PAGE
    o_part = mem.alloc(m * hq * splits * d * 4)
    lse = mem.alloc(m * hq * splits * 4)
    out = mem.poisoned((m + 1) * hq * d)
    kbuf, vbuf = mem.bf16(pages_k), mem.bf16(pages_v)
    tbl = mem.i32(table)
    pos_buf = mem.i32(pos)
    library.kernel("attention", f"split_{name}").launch(stream, {
        "q": mem.bf16(q), "k_pages": kbuf, "v_pages": vbuf, "table": tbl, "qseq": mem.i32(qseq), "pos": pos_buf,
        "o_part": o_part, "lse": lse},
        {"M": m, "S": splits, "split": split, "maxp": table.shape[1], "R": table.shape[0], "NP": npages})
    library.kernel("attention", f"combine_{name}").launch(stream, {
        "o_part": o_part, "lse": lse, "pos": pos_buf, "x": mem.bf16(x), "out": out}, {"M": m, "S": splits, "split": split})
    got = mem.read_bf16(out, (m + 1, hq * d))
    assert np.isnan(got[m]).all()
    return got[:m]


@pytest.mark.parametrize("name,split", [("q4_kv2_d64", 64), ("q4_kv2_d64", 128), ("q24_kv4_d256", 256)])
def test_decode_attention(library, mem, stream, name, split):
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(split)
    lengths = [1, 65, 300, 1000]
    maxp = max(-(-n // PAGE) for n in lengths)
    npages = sum(-(-n // PAGE) for n in lengths) + 2
    perm = rng.permutation(npages)
    table = np.zeros((len(lengths), maxp), np.int64)
    used = 0
    for i, n in enumerate(lengths):
        k = -(-n // PAGE)
        table[i, :k] = perm[used:used + k]
        used += k
    pages_k = _bf(rng, (npages * PAGE, hkv, d))
    pages_v = _bf(rng, (npages * PAGE, hkv, d))
    q = _bf(rng, (len(lengths), hq, d), 2.0)
    x = _bf(rng, (len(lengths), stride))
    pos = np.array(lengths) - 1
    got = _run_attention(library, mem, stream, name, q, pages_k, pages_v, table, np.arange(len(lengths)), pos, split, x)
    gate = x[:, :hq * 2 * d].reshape(-1, hq, 2 * d)[..., d:]
    for i, n in enumerate(lengths):
        rows = (table[i, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE)
        args = (q[i:i + 1], pages_k[rows], pages_v[rows], pos[i:i + 1], gate[i:i + 1])
        assert_close_to_baseline(got[i:i + 1], attention.reference_attention(*args, exact=True),
                                 attention.reference_attention(*args), f"{name} len={n}", slack=2.5)


def test_prefill_attention(library, mem, stream):
    name = "q4_kv2_d64"
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(11)
    start, t = 100, 90
    n = start + t
    table = rng.permutation(8)[None, :4]
    pages_k = _bf(rng, (8 * PAGE, hkv, d))
    pages_v = _bf(rng, (8 * PAGE, hkv, d))
    q = _bf(rng, (t, hq, d), 2.0)
    x = _bf(rng, (t, stride))
    pos = start + np.arange(t)
    got = _run_attention(library, mem, stream, name, q, pages_k, pages_v, table, np.zeros(t, np.int64), pos, 64, x)
    rows = table[0, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
    gate = x[:, :hq * 2 * d].reshape(-1, hq, 2 * d)[..., d:]
    args = (q, pages_k[rows], pages_v[rows], pos, gate)
    assert_close_to_baseline(got, attention.reference_attention(*args, exact=True),
                             attention.reference_attention(*args), "prefill attention", slack=2.5)
