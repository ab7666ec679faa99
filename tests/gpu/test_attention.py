"""The attention kernels (q/k prep + paged KV write, split-KV attention, combine) against NumPy.

Pages are scattered and shuffled; rows attend to different context lengths (decode of up to 8
sequences with contexts from 1 to 256K keys, and a prefill chunk whose rows see a growing causal
prefix). Split-KV runs with a fixed split count per row and each row's split length from its own
position (`attention.split_length`): the runner's decode plan, a few long ragged splits, and the
prefill plan. The partials buffer starts as NaN, so a split the combine reads but the split kernel
did not write fails the test. One captured graph replays correctly after the lengths change, and
a row's output does not depend on the rows beside it (verification rows equal decode rows).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention
from cute_kernels.bf16 import from_bits, round_bf16, to_bits
from cute_kernels.rope import tables
from runtime.model.gpu.storage import (DECODE_MIN_SPLIT, PREFILL_MIN_SPLIT, PREFILL_SPLITS,
                                       default_decode_splits)

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu
PAGE = 64
SMS = 132  # the runner's plan on an H200 (it takes the device's SM count)


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _pool(rng, shape):
    """`_bf(rng, shape)` and its bf16 bits, which go to the device as they are (converting a pool
    of up to 300M values back to bits cost as much as rounding it)."""
    bits = to_bits(rng.standard_normal(shape).astype(np.float32))
    return from_bits(bits), bits


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


class _Rows:
    """Device buffers of one split + combine launch pair over M query rows: the per-row metadata
    (rewritable in place, for graph replays), the partials (NaN at first) and the output (one
    poisoned row past M, which must stay untouched)."""

    def __init__(self, library, mem, name, m, table_shape, splits, min_split, npages, kbuf, vbuf, kv_suffix=""):
        cfg = _cfg(name)
        self.hq, self.d, self.stride = cfg["Hq"], cfg["D"], cfg["x_stride"]
        self.mem, self.m = mem, m
        self.q = mem.alloc(m * self.hq * self.d * 2)
        self.x = mem.alloc(m * self.stride * 2)
        self.table = mem.alloc(table_shape[0] * table_shape[1] * 4)
        self.qseq, self.pos = mem.alloc(m * 4), mem.alloc(m * 4)
        o_part = mem.poisoned(2 * m * self.hq * splits * self.d)  # fp32 NaN (two bf16 NaN halves)
        lse = mem.poisoned(2 * m * self.hq * splits)
        self.out = mem.poisoned((m + 1) * self.hq * self.d)
        self.launches = [
            library.kernel("attention", f"split_{name}{kv_suffix}").bind(
                {"q": self.q, "k_pages": kbuf, "v_pages": vbuf, "table": self.table, "qseq": self.qseq,
                 "pos": self.pos, "o_part": o_part, "lse": lse},
                {"M": m, "S": splits, "min_split": min_split, "maxp": table_shape[1], "R": table_shape[0],
                 "NP": npages}),
            library.kernel("attention", f"combine_{name}").bind(
                {"o_part": o_part, "lse": lse, "pos": self.pos, "x": self.x, "out": self.out},
                {"M": m, "S": splits, "min_split": min_split})]

    def upload(self, q, x, table, qseq, pos, stream):
        dev = self.mem.device
        dev.memcpy_htod(self.q, to_bits(q), stream)
        dev.memcpy_htod(self.x, to_bits(x), stream)
        dev.memcpy_htod(self.table, np.ascontiguousarray(table, np.int32), stream)
        dev.memcpy_htod(self.qseq, np.ascontiguousarray(qseq, np.int32), stream)
        dev.memcpy_htod(self.pos, np.ascontiguousarray(pos, np.int32), stream)
        stream.synchronize()

    def run(self, stream):
        for launch in self.launches:
            launch(stream)

    def read(self):
        got = self.mem.read_bf16(self.out, (self.m + 1, self.hq * self.d))
        assert np.isnan(got[self.m]).all(), "the combine wrote past its rows"
        return got[:self.m]


def _run_attention(library, mem, stream, name, q, k_bits, v_bits, table, qseq, pos, splits, min_split, x):
    """Split + combine over the rows once (K/V pools as bf16 bits); returns the bf16 output rows
    [M, Hq * D]."""
    npages = k_bits.shape[0] // PAGE
    rows = _Rows(library, mem, name, q.shape[0], table.shape, splits, min_split, npages, mem.raw(k_bits),
                 mem.raw(v_bits))
    rows.upload(q, x, table, qseq, pos, stream)
    rows.run(stream)
    return rows.read()


def _scattered(rng, lengths, spare=2):
    """A page table [len(lengths), maxp] giving each sequence its pages from a shuffled pool."""
    maxp = max(-(-n // PAGE) for n in lengths)
    npages = sum(-(-n // PAGE) for n in lengths) + spare
    perm = rng.permutation(npages)
    table = np.zeros((len(lengths), maxp), np.int64)
    used = 0
    for i, n in enumerate(lengths):
        k = -(-n // PAGE)
        table[i, :k] = perm[used:used + k]
        used += k
    return table, npages


def _check_rows(got, q, pages_k, pages_v, table, qseq, pos, x, hq, d, what):
    """Each row against the fp64 reference within 2.5x the same-precision baseline's error. A
    sequence's rows (a prefill chunk's) take one `reference_attention` call over its keys,
    gathered and converted once."""
    gate = x[:, :hq * 2 * d].reshape(-1, hq, 2 * d)[..., d:]
    for b in np.unique(qseq):
        i = np.flatnonzero(qseq == b)
        n = int(pos[i].max()) + 1
        rows = table[b, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        args = (q[i], pages_k[rows], pages_v[rows], pos[i], gate[i])
        exact, base = attention.reference_attention(*args, exact=True), attention.reference_attention(*args)
        for j, r in enumerate(i):
            assert_close_to_baseline(got[r:r + 1], exact[j:j + 1], base[j:j + 1],
                                     f"{what} row {r} len={pos[r] + 1}", slack=2.5)


# Decode plans: the runner's (splits for its longest context, `DECODE_MIN_SPLIT`), a few long
# ragged splits, and one split per page (many splits, the combine's lane loop over several).
_PLANS = {"runner": lambda hkv: (default_decode_splits(hkv, 262144 + 64, SMS), DECODE_MIN_SPLIT),
          "few": lambda hkv: (3, 64), "pages": lambda hkv: (1024, 64)}


@pytest.mark.parametrize("name,lengths,plan", [
    ("q4_kv2_d64", [1, 63, 64, 65, 1000, 4097, 40000, 262144], "runner"),
    ("q4_kv2_d64", [1, 65, 300, 1000, 4097], "few"),
    ("q4_kv2_d64", [129, 40000, 2], "pages"),
    ("q24_kv4_d256", [1, 63, 64, 65, 1000, 4097, 40000], "runner"),
    ("q24_kv4_d256", [5, 77777], "few"),
    ("q16_kv2_d256", [65, 1, 20000, 4097, 63], "runner"),
])
def test_decode_attention(library, mem, stream, name, lengths, plan):
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(len(lengths) * 7 + max(lengths))
    splits, min_split = _PLANS[plan](hkv)
    table, npages = _scattered(rng, lengths)
    pages_k, k_bits = _pool(rng, (npages * PAGE, hkv, d))
    pages_v, v_bits = _pool(rng, (npages * PAGE, hkv, d))
    q = _bf(rng, (len(lengths), hq, d), 2.0)
    x = _bf(rng, (len(lengths), stride))
    pos = np.array(lengths) - 1
    qseq = np.arange(len(lengths))
    got = _run_attention(library, mem, stream, name, q, k_bits, v_bits, table, qseq, pos, splits, min_split, x)
    _check_rows(got, q, pages_k, pages_v, table, qseq, pos, x, hq, d, f"{name} plan {plan} ({splits}x{min_split})")


def test_one_graph_serves_changing_lengths(library, mem, stream, device):
    """Captured once over 4 rows, replayed with new positions and page tables (longer, shorter,
    another row order): each replay matches the reference."""
    from runtime.cuda.device import capture_graph

    name = "q24_kv4_d256"
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(5)
    capacity = [41000] * 4
    table, npages = _scattered(rng, capacity)
    pages_k, k_bits = _pool(rng, (npages * PAGE, hkv, d))
    pages_v, v_bits = _pool(rng, (npages * PAGE, hkv, d))
    splits = default_decode_splits(hkv, 262144, SMS)
    rows = _Rows(library, mem, name, 4, table.shape, splits, DECODE_MIN_SPLIT, npages, mem.raw(k_bits),
                 mem.raw(v_bits))
    rows.upload(np.zeros((4, hq, d), np.float32), np.zeros((4, stride), np.float32), table, np.arange(4),
                np.zeros(4, np.int64), stream)
    graph = capture_graph(device, stream, lambda: rows.run(stream))
    try:
        for lengths, order in (([1, 64, 1000, 65], [0, 1, 2, 3]), ([41000, 129, 4097, 2], [3, 1, 0, 2]),
                               ([63, 40000, 1, 41000], [2, 0, 3, 1])):
            q = _bf(rng, (4, hq, d), 2.0)
            x = _bf(rng, (4, stride))
            pos, qseq = np.array(lengths) - 1, np.array(order)
            rows.upload(q, x, table, qseq, pos, stream)
            graph.replay(stream)
            _check_rows(rows.read(), q, pages_k, pages_v, table, qseq, pos, x, hq, d, f"replay {lengths}")
    finally:
        stream.synchronize()
        graph.destroy()


def test_a_row_does_not_depend_on_its_neighbours(library, mem, stream):
    """The same (query, position, pages) row alone and among 7 other rows of other lengths gives
    the same bits: verification rows (one per position) equal the decode rows they stand for."""
    name = "q24_kv4_d256"
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(9)
    lengths = [4097, 1, 65, 40000, 300, 64, 1000, 12345]
    table, npages = _scattered(rng, lengths)
    _, k_bits = _pool(rng, (npages * PAGE, hkv, d))
    _, v_bits = _pool(rng, (npages * PAGE, hkv, d))
    kbuf, vbuf = mem.raw(k_bits), mem.raw(v_bits)
    q = _bf(rng, (8, hq, d), 2.0)
    x = _bf(rng, (8, stride))
    pos = np.array(lengths) - 1
    splits = default_decode_splits(hkv, 262144, SMS)
    batch = _Rows(library, mem, name, 8, table.shape, splits, DECODE_MIN_SPLIT, npages, kbuf, vbuf)
    batch.upload(q, x, table, np.arange(8), pos, stream)
    batch.run(stream)
    together = batch.read()
    for i in (0, 3, 7):
        alone = _Rows(library, mem, name, 1, table.shape, splits, DECODE_MIN_SPLIT, npages, kbuf, vbuf)
        alone.upload(q[i:i + 1], x[i:i + 1], table, [i], pos[i:i + 1], stream)
        alone.run(stream)
        np.testing.assert_array_equal(alone.read(), together[i:i + 1])


def test_prefill_attention(library, mem, stream):
    """A prefill chunk over split-KV (the path of a shape without `attention_prefill`): rows of
    one sequence at consecutive positions, each its own query row, with the prefill plan."""
    name = "q4_kv2_d64"
    cfg = _cfg(name)
    hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
    rng = np.random.default_rng(11)
    start, t = 100, 300
    n = start + t
    table = rng.permutation(10)[None, :7]
    pages_k, k_bits = _pool(rng, (10 * PAGE, hkv, d))
    pages_v, v_bits = _pool(rng, (10 * PAGE, hkv, d))
    q = _bf(rng, (t, hq, d), 2.0)
    x = _bf(rng, (t, stride))
    pos = start + np.arange(t)
    qseq = np.zeros(t, np.int64)
    got = _run_attention(library, mem, stream, name, q, k_bits, v_bits, table, qseq, pos, PREFILL_SPLITS,
                         PREFILL_MIN_SPLIT, x)
    assert n <= table.shape[1] * PAGE
    _check_rows(got, q, pages_k, pages_v, table, qseq, pos, x, hq, d, "prefill attention")
