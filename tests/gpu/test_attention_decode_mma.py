"""The tensor-core split kernel (`attention_decode_mma`) against NumPy and against `attention.split`.

Both forms write the same partials for `attention.combine`: decode rows (one token per sequence,
batch 1..8, contexts 1 to 256K over scattered pages) and verification blocks (T = 1..8 tokens per
sequence, rows position-major, row m seeing keys 0..pos[m]). The partials buffers start as NaN,
so a split the combine reads but the kernel did not write fails the test.

Tolerances: the reference is fp64 (`attention.reference_attention(exact=True)`); the baseline is
the same-precision NumPy model (fp32 softmax, bf16 output rounding: `exact=False`), and the
kernel's error may be `SLACK` times the baseline's. The tensor-core form also rounds the softmax
weights P to bf16 before P V (an mma.sync operand), a relative error of at most 2^-9 per weight
that averages out over the keys; its error is also checked against the CUDA-core split kernel's
(the form it replaces) on the same rows. Every output is checked written; every decode row is
checked against the reference, and of a verification block every row below `LONG` keys and,
from there on, a sequence's first, middle and last tokens (the fp64 reference costs a pass over
the keys per row and head; the references of a sequence's rows are computed together).

Bit-equality promised and checked: a verification row equals the decode row it stands for (the
same query, position and pages launched with T = 1: every row of the block as one decode batch,
and three rows alone): the CTA's extra keys outside the row's range get weight 0 exactly and the
key tiles stay aligned to the split's pages. Hence also a row's result does not depend on the
other sequences of the batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention, attention_decode_mma
from cute_kernels.bf16 import from_bits, round_bf16, to_bits
from runtime.model.gpu.storage import DECODE_MIN_SPLIT, default_decode_splits

from .conftest import assert_close_to_baseline, rel_err

pytestmark = pytest.mark.gpu
PAGE = 64
SMS = 132  # the runner's plan on an H200
SLACK = 2.5  # as tests/gpu/test_attention.py's split kernel
SPLIT_SLACK = 2.0  # the tensor-core form's error over the CUDA-core form's, same rows
LONG = 8192  # keys from which a verification block checks only some of a sequence's rows against fp64


def _bf(rng, shape, scale=1.0):
    return round_bf16(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def _pool(rng, shape):
    """`_bf(rng, shape)` and its bf16 bits, which go to the device as they are (converting a pool
    of up to 300M values back to bits cost as much as rounding it)."""
    bits = to_bits(rng.standard_normal(shape, dtype=np.float32))
    return from_bits(bits), bits


def _cfg(name):
    return next(v for v in attention.variants() if v.key == f"prep_{name}").config


def _mma_key(name, t):
    return f"mma_{name}_t{min(n for n in attention_decode_mma.TOKENS if n >= t)}"



def sequence_references(q, x, qseq, pos, hq, d, table, kv):
    """(fp64, same-precision) references [M, Hq * D] of rows (q, x, qseq, pos) over the pool of
    page table `table`, kv(rows) giving the K and V values of pool rows. A sequence's rows (a
    verification block's tokens) take one `reference_attention` call over its keys, gathered
    (and decoded) once: per row, the copies cost more than the products."""
    gate = x[:, :hq * 2 * d].reshape(-1, hq, 2 * d)[..., d:]
    exact = np.empty((q.shape[0], hq * d))
    base = np.empty((q.shape[0], hq * d), np.float32)
    for b in np.unique(qseq):
        i = np.flatnonzero(qseq == b)
        n = int(pos[i].max()) + 1
        k, v = kv(table[b, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE)
        args = (q[i], k, v, pos[i], gate[i])
        exact[i] = attention.reference_attention(*args, exact=True)
        base[i] = attention.reference_attention(*args)
    return exact, base

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


class _Case:
    """One batch on the device: K/V pools, page table, q rows, x (the gate), and the launches of
    either split form + the combine over given rows."""

    def __init__(self, library, mem, stream, name, rng, lengths):
        cfg = _cfg(name)
        self.name, self.library, self.mem, self.stream = name, library, mem, stream
        self.hq, self.hkv, self.d, self.stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
        self.table, npages = _scattered(rng, lengths)
        self.npages = npages
        self.k, k_bits = _pool(rng, (npages * PAGE, self.hkv, self.d))
        self.v, v_bits = _pool(rng, (npages * PAGE, self.hkv, self.d))
        self.kbuf, self.vbuf = mem.raw(k_bits), mem.raw(v_bits)
        self.tbuf = mem.i32(self.table)

    def run(self, form, q, x, qseq, pos, t, splits, min_split):
        """bf16 attention output [M, Hq * D] of rows (q, x, qseq, pos), T = t tokens per sequence."""
        mem, m = self.mem, q.shape[0]
        o_part = mem.poisoned(2 * m * self.hq * splits * self.d)  # fp32 NaN
        lse = mem.poisoned(2 * m * self.hq * splits)
        out = mem.poisoned(m * self.hq * self.d)
        posbuf = mem.i32(pos)
        rows = {"q": mem.bf16(q), "k_pages": self.kbuf, "v_pages": self.vbuf, "table": self.tbuf,
                "qseq": mem.i32(qseq), "pos": posbuf, "o_part": o_part, "lse": lse}
        sizes = {"M": m, "S": splits, "min_split": min_split, "maxp": self.table.shape[1],
                 "R": self.table.shape[0], "NP": self.npages}
        if form == "mma":
            self.library.kernel("attention_decode_mma", _mma_key(self.name, t)).launch(self.stream, rows,
                                                                                       {**sizes, "T": t})
        else:
            self.library.kernel("attention", f"split_{self.name}").launch(self.stream, rows, sizes)
        self.library.kernel("attention", f"combine_{self.name}").launch(
            self.stream, {"o_part": o_part, "lse": lse, "pos": posbuf, "x": mem.bf16(x), "out": out},
            {"M": m, "S": splits, "min_split": min_split})
        return mem.read_bf16(out, (m, self.hq * self.d))

    def references(self, q, x, qseq, pos):
        """(fp64, same-precision) references [M, Hq * D] of rows (q, x, qseq, pos)."""
        return sequence_references(q, x, qseq, pos, self.hq, self.d, self.table, lambda rows: (self.k[rows], self.v[rows]))

    def check(self, got, split_got, q, x, qseq, pos, what, rows=None):
        """Every row written; each of `rows` (None: all) against fp64 within SLACK x the
        same-precision baseline's error, and together within SPLIT_SLACK x the CUDA-core split
        kernel's error on them (split_got None: not run)."""
        assert np.isfinite(got).all(), f"{what}: an output was not written"
        rows = np.arange(q.shape[0]) if rows is None else rows
        exact, base = self.references(q[rows], x[rows], qseq[rows], pos[rows])
        for j, i in enumerate(rows):
            assert_close_to_baseline(got[i:i + 1], exact[j:j + 1], base[j:j + 1],
                                     f"{what} row {i} pos={pos[i]}", slack=SLACK)
        if split_got is not None:
            e_mma, e_split = rel_err(got[rows], exact), rel_err(split_got[rows], exact)
            assert e_mma <= SPLIT_SLACK * e_split + 1e-6, f"{what}: mma error {e_mma:.3e} vs split {e_split:.3e}"


def _rows(rng, case, n):
    return _bf(rng, (n, case.hq, case.d), 2.0), _bf(rng, (n, case.stride))


def _reference_rows(pos, t):
    """The rows of a verification block (row p * B + b: token p of sequence b) that it checks
    against fp64: every row at a position below LONG, and past it a sequence's first, middle and
    last tokens. The reference costs a pass over the row's keys per head; the tiles and masks of
    the other tokens are the same code at every length, checked on every row of the block's
    shorter sequences, and every row is also checked equal to its decode row (T = 1)."""
    p = np.arange(len(pos)) // (len(pos) // t)
    return np.flatnonzero((pos < LONG) | (p == 0) | (p == t // 2) | (p == t - 1))


_PLANS = {"runner": lambda hkv: (default_decode_splits(hkv, 262144 + 64, SMS), DECODE_MIN_SPLIT),
          "few": lambda hkv: (3, 64), "pages": lambda hkv: (1024, 64)}


@pytest.mark.parametrize("name,lengths,plan", [
    ("q24_kv4_d256", [1, 63, 64, 65, 1000, 4097, 33000], "runner"),
    ("q24_kv4_d256", [33000], "runner"),
    ("q24_kv4_d256", [5, 77777], "few"),
    ("q16_kv2_d256", [65, 1, 20000, 4097, 63, 262144], "runner"),
    ("q4_kv2_d64", [1, 63, 64, 65, 1000, 4097, 33000, 262144], "runner"),
    ("q4_kv2_d64", [129, 40000, 2], "pages"),
])
def test_decode_rows(library, mem, stream, name, lengths, plan):
    rng = np.random.default_rng(len(lengths) * 7 + max(lengths))
    case = _Case(library, mem, stream, name, rng, lengths)
    splits, min_split = _PLANS[plan](case.hkv)
    q, x = _rows(rng, case, len(lengths))
    pos, qseq = np.array(lengths) - 1, np.arange(len(lengths))
    got = case.run("mma", q, x, qseq, pos, 1, splits, min_split)
    split_got = case.run("split", q, x, qseq, pos, 1, splits, min_split)
    case.check(got, split_got, q, x, qseq, pos, f"{name} {plan} ({splits}x{min_split})")


@pytest.mark.parametrize("name,t,bases", [
    ("q24_kv4_d256", 8, [0, 60, 4090, 33000]),  # 60..67 and 4090..4097 straddle page / split edges
    ("q24_kv4_d256", 3, [1, 2047, 8189, 12000, 500, 64, 30000, 7]),
    ("q24_kv4_d256", 2, [126]),
    ("q16_kv2_d256", 8, [62, 40000]),
    ("q16_kv2_d256", 5, [1000, 3, 127]),
    ("q4_kv2_d64", 8, [0, 63, 1000, 66000]),
])
def test_verification_blocks(library, mem, stream, name, t, bases):
    """B sequences of t tokens each, row p * B + b at position bases[b] + p: the rows of
    `_reference_rows` against the reference (causal inside the block), and every row bit-equal to
    the same row decoded (T = 1), in one decode batch and alone."""
    rng = np.random.default_rng(t * 31 + len(bases))
    nseq = len(bases)
    case = _Case(library, mem, stream, name, rng, [b + t for b in bases])
    splits, min_split = _PLANS["runner"](case.hkv)
    q, x = _rows(rng, case, nseq * t)
    pos = np.array([bases[b] + p for p in range(t) for b in range(nseq)])
    qseq = np.array([b for _ in range(t) for b in range(nseq)])
    got = case.run("mma", q, x, qseq, pos, t, splits, min_split)
    case.check(got, None, q, x, qseq, pos, f"{name} verify T={t}", _reference_rows(pos, t))
    decoded = case.run("mma", q, x, qseq, pos, 1, splits, min_split)  # every row a decode row (T = 1)
    np.testing.assert_array_equal(decoded, got, err_msg=f"{name} T={t}: the block's rows vs its rows decoded")
    for i in (0, nseq * t - 1, (t // 2) * nseq + nseq // 2):
        alone = case.run("mma", q[i:i + 1], x[i:i + 1], qseq[i:i + 1], pos[i:i + 1], 1, splits, min_split)
        np.testing.assert_array_equal(alone, got[i:i + 1], err_msg=f"{name} T={t} row {i} alone vs in its block")


def test_a_sequence_does_not_depend_on_the_batch(library, mem, stream):
    """A sequence's rows alone and among 7 other sequences of other lengths give the same bits."""
    name = "q24_kv4_d256"
    rng = np.random.default_rng(9)
    lengths = [4097, 1, 65, 40000, 300, 64, 1000, 12345]
    case = _Case(library, mem, stream, name, rng, lengths)
    splits, min_split = _PLANS["runner"](case.hkv)
    q, x = _rows(rng, case, 8)
    pos, qseq = np.array(lengths) - 1, np.arange(8)
    together = case.run("mma", q, x, qseq, pos, 1, splits, min_split)
    for i in (0, 3, 7):
        alone = case.run("mma", q[i:i + 1], x[i:i + 1], qseq[i:i + 1], pos[i:i + 1], 1, splits, min_split)
        np.testing.assert_array_equal(alone, together[i:i + 1])


def test_partials_match_the_split_contract(library, mem, stream):
    """The partials themselves (what `attention.combine` reads): o_part and lse of every used split
    of a row against `attention_decode_mma.reference` (fp64) within 2x the error of its precision
    model (`exact=False`: fp32 with P rounded to bf16 for P V, an error of about 1e-3 that the
    CUDA-core kernel's fp32 P does not have); lse (fp32 sums in both forms) as close as the
    CUDA-core split kernel's."""
    name = "q24_kv4_d256"
    rng = np.random.default_rng(21)
    lengths = [4097, 130]
    case = _Case(library, mem, stream, name, rng, lengths)
    splits, min_split = 7, 64
    q, _ = _rows(rng, case, 2)
    pos, qseq = np.array(lengths) - 1, np.arange(2)
    hq, d, m = case.hq, case.d, 2
    got = {}
    for form in ("mma", "split"):
        o_part = mem.poisoned(2 * m * hq * splits * d)
        lse = mem.poisoned(2 * m * hq * splits)
        rows = {"q": mem.bf16(q), "k_pages": case.kbuf, "v_pages": case.vbuf, "table": case.tbuf,
                "qseq": mem.i32(qseq), "pos": mem.i32(pos), "o_part": o_part, "lse": lse}
        sizes = {"M": m, "S": splits, "min_split": min_split, "maxp": case.table.shape[1], "R": 2,
                 "NP": case.npages}
        if form == "mma":
            library.kernel("attention_decode_mma", _mma_key(name, 1)).launch(stream, rows, {**sizes, "T": 1})
        else:
            library.kernel("attention", f"split_{name}").launch(stream, rows, sizes)
        got[form] = (mem.read_f32(o_part, np.empty((m, hq, splits, d))), mem.read_f32(lse, np.empty((m, hq, splits))))
    for i in range(m):
        n = int(pos[i]) + 1
        rows = case.table[i, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        args = (q[i], case.k[rows], case.v[rows], int(pos[i]), splits, min_split)
        want_o, want_lse = attention_decode_mma.reference(*args)
        model_o, _ = attention_decode_mma.reference(*args, exact=False)
        used = want_o.shape[1]
        assert used == (7 if i == 0 else 3)  # 4097 keys in splits of 640, 130 in splits of 64
        mo, ml = got["mma"][0][i, :, :used], got["mma"][1][i, :, :used]
        sl = got["split"][1][i, :, :used]
        assert np.isfinite(mo).all() and np.isfinite(ml).all(), f"row {i}: a used split was not written"
        assert rel_err(mo, want_o) <= 2.0 * rel_err(model_o, want_o) + 1e-6, \
            f"row {i}: o_part error {rel_err(mo, want_o):.3e} vs model {rel_err(model_o, want_o):.3e}"
        assert np.abs(ml - want_lse).max() <= 4.0 * np.abs(sl - want_lse).max() + 1e-5


def test_graph_replay_with_new_lengths(library, mem, stream, device):
    """One capture over 4 sequences, replayed with new positions and page tables."""
    from runtime.cuda.device import capture_graph

    name = "q24_kv4_d256"
    rng = np.random.default_rng(5)
    case = _Case(library, mem, stream, name, rng, [41000] * 4)
    hq, d, m = case.hq, case.d, 4
    splits = default_decode_splits(case.hkv, 262144, SMS)
    qbuf, xbuf = mem.alloc(m * hq * d * 2), mem.alloc(m * case.stride * 2)
    qseqbuf, posbuf = mem.i32(np.arange(m)), mem.i32(np.zeros(m))
    o_part, lse = mem.poisoned(2 * m * hq * splits * d), mem.poisoned(2 * m * hq * splits)
    out = mem.poisoned(m * hq * d)
    split = library.kernel("attention_decode_mma", _mma_key(name, 1)).bind(
        {"q": qbuf, "k_pages": case.kbuf, "v_pages": case.vbuf, "table": case.tbuf, "qseq": qseqbuf, "pos": posbuf,
         "o_part": o_part, "lse": lse},
        {"M": m, "T": 1, "S": splits, "min_split": DECODE_MIN_SPLIT, "maxp": case.table.shape[1], "R": m,
         "NP": case.npages})
    combine = library.kernel("attention", f"combine_{name}").bind(
        {"o_part": o_part, "lse": lse, "pos": posbuf, "x": xbuf, "out": out},
        {"M": m, "S": splits, "min_split": DECODE_MIN_SPLIT})
    graph = capture_graph(device, stream, lambda: (split(stream), combine(stream)))
    try:
        for lengths, order in (([1, 64, 1000, 65], [0, 1, 2, 3]), ([41000, 129, 4097, 2], [3, 1, 0, 2])):
            q, x = _rows(rng, case, m)
            pos, qseq = np.array(lengths) - 1, np.array(order)
            for ptr, arr in ((qbuf, to_bits(q)), (xbuf, to_bits(x)), (qseqbuf, qseq.astype(np.int32)),
                             (posbuf, pos.astype(np.int32))):
                device.memcpy_htod(ptr, np.ascontiguousarray(arr), stream)
                stream.synchronize()
            graph.replay(stream)
            case.check(mem.read_bf16(out, (m, hq * d)), None, q, x, qseq, pos, f"replay {lengths}")
    finally:
        stream.synchronize()
        graph.destroy()
