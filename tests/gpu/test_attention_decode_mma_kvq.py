"""The tensor-core split kernel over FP8 / INT8 KV pages (`attention_decode_mma` `*_fp8` / `*_int8`).

Pools hold random K/V quantised by `kv_format.quantise` (per token-head scales; every 17th
token-head all zeros, scale 0; token-heads scaled 2^-6 .. 2^6 apart), and every slot no sequence
uses is poisoned: NaN scales and codes that decode to NaN (fp8 0x7F) or out of range (int8 -128),
so a kernel that lets a row past a sequence's end into its sums fails. Partials start as NaN.

- Rows (decode, T = 1; verification blocks, T = 3 and 8, causal inside the block; contexts across
  page and split boundaries) after `attention.combine`: against the fp64 reference over the
  dequantised K/V within `SLACK` x the same-precision NumPy model's error (the model of the bf16
  test, `attention.reference_attention(exact=False)`), and within `SPLIT_SLACK` x the error of
  the quantised CUDA-core split kernel (`attention.split_*_fp8|int8`) on the same rows. Every
  output is checked written; the reference checks every decode row, and of a verification block
  every row below 8192 keys and past them a sequence's first, middle and last tokens (as the bf16
  test: `_reference_rows`).
- The partials themselves: against `attention_decode_mma.reference` with the codes and scales
  (fp64, and its `exact=False` model: the K scale on the score, the V scale on the weight before
  its bf16 rounding) and against the quantised split kernel's partials: o_part within twice the
  two kernels' errors against the reference added (relative; the mma form's bounded by its
  model's), lse within 5x the split kernel's lse error (both sum the weights in fp32).
- Every form the runner may take over each format (`FORMATS`: K codes converted by `cvt` into
  f16 scores, four key slices a tile) runs every test (verification blocks where it serves them).
- Bits: a verification row equals the row decoded with T = 1 (every row of the block as one
  decode batch, and three rows alone), and a sequence's rows do not depend on the batch; and
  over pages whose every sum is exact in fp32 (small codes, power-of-two scales, e4m3 subnormal
  codes and -0 included) the partials equal the bf16 kernel's over the values code * scale bit
  for bit, which pins the permuted fragments, the swizzle and the conversions.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention_decode_mma
from runtime.model import kv_format as kf
from runtime.model.gpu.storage import DECODE_MIN_SPLIT, default_decode_splits

from .conftest import assert_close_to_baseline, rel_err
from .test_attention_decode_mma import (
    _bf,
    _cfg,
    _reference_rows,
    _scattered,
    sequence_references,
)

pytestmark = pytest.mark.gpu
PAGE = 64
SMS = 132  # the runner's plan on an H200
SLACK = 2.5  # as the bf16 kernel's test
SPLIT_SLACK = 2.0  # the tensor-core form's error over the CUDA-core form's, same rows
# The variants under test: "fp8" / "int8" the runner's form over each format, "kv_form" the other forms
# (`attention_decode_mma.KVQ_FORMS`: K codes by cvt, four key slices) the runner may be switched to.
# The 3- and 6-stage forms differ from the runner's only in the ring's depth.
FORMATS = ("fp8", "int8", "fp8_cvt", "fp8_k4", "fp8_k4cvt", "int8_k4")


def _kv(variant):
    return variant.partition("_")[0]


def _most_tokens(variant):
    """The most query tokens a sequence has that the variant's kernels serve."""
    form = variant.partition("_")[2]
    return attention_decode_mma.KVQ_FORMS[form][3] if form else max(attention_decode_mma.TOKENS)


def _key_slices(variant):
    form = variant.partition("_")[2]
    return attention_decode_mma.KVQ_FORMS[form][0] if form else attention_decode_mma.KS


def _for_variants(params, tokens_at=None, key_slices=None):
    """params x FORMATS as parametrize tuples, without the variants that do not serve the
    case's tokens (its element tokens_at) or, given key_slices, split a tile's keys otherwise."""
    return [(*p, v) for p in params for v in FORMATS if (tokens_at is None or p[tokens_at] <= _most_tokens(v))
            and (key_slices is None or _key_slices(v) == key_slices)]
_PLANS = {"runner": lambda hkv: (default_decode_splits(hkv, 262144 + 64, SMS), DECODE_MIN_SPLIT),
          "few": lambda hkv: (3, 64), "pages": lambda hkv: (1024, 64)}


def _decode(codes, fmt):
    return kf.e4m3_decode(codes) if fmt == "fp8" else np.asarray(codes, np.uint8).view(np.int8).astype(np.float64)


def _mma_key(name, t, variant):
    return f"mma_{name}_t{min(n for n in attention_decode_mma.TOKENS if n >= t)}_{variant}"


def _used_rows(table, lengths):
    return np.concatenate([table[i, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
                           for i, n in enumerate(lengths)])


class _Case:
    """One batch on the device: quantised K/V pools (codes [rows, Hkv, D], scales [rows, Hkv] on
    the host), the page table, and launches of either split form (+ the combine) over rows."""

    def __init__(self, library, mem, stream, name, fmt, rng, lengths, codes=None, scales=None):
        cfg = _cfg(name)
        self.name, self.library, self.mem, self.stream = name, library, mem, stream
        self.variant, self.fmt = fmt, _kv(fmt)  # the mma variant ("fp8_cvt"), its KV format
        self.hq, self.hkv, self.d, self.stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
        self.table, self.npages = _scattered(rng, lengths)
        rows = self.npages * PAGE
        if codes is None:
            codes, scales = zip(*(self._random(rng, rows) for _ in range(2)))
        self.codes, self.scales = [c.copy() for c in codes], [s.copy() for s in scales]
        unused = np.setdiff1d(np.arange(rows), _used_rows(self.table, lengths))
        for c, s in zip(self.codes, self.scales):
            c[unused] = 0x7F if self.fmt == "fp8" else 0x80
            s[unused] = np.nan
        self.kbuf, self.vbuf = (mem.raw(kf.pack_pages(c, s)) for c, s in zip(self.codes, self.scales))
        self.tbuf = mem.i32(self.table)

    def _random(self, rng, rows):
        x = _bf(rng, (rows, self.hkv, self.d)) * np.exp2(rng.integers(-6, 7, (rows, self.hkv, 1))).astype(np.float32)
        x[::17, 0] = 0.0
        return kf.quantise(x, self.fmt)

    def values(self, which, rows):
        """(decoded codes, scales) of K (which = 0) or V (1) at flat rows."""
        return _decode(self.codes[which][rows], self.fmt), self.scales[which][rows]

    def partials(self, form, q, qseq, pos, t, splits, min_split):
        """(o_part [M, Hq, S, D], lse [M, Hq, S]) of one launch of either form (NaN where unwritten)."""
        mem, m, hq, d = self.mem, q.shape[0], self.hq, self.d
        o_part, lse = mem.poisoned(2 * m * hq * splits * d), mem.poisoned(2 * m * hq * splits)
        self._split(form, q, qseq, pos, t, splits, min_split, o_part, lse, mem.i32(pos))
        return mem.read_f32(o_part, np.empty((m, hq, splits, d))), mem.read_f32(lse, np.empty((m, hq, splits)))

    def run(self, form, q, x, qseq, pos, t, splits, min_split):
        """bf16 attention output [M, Hq * D] of rows (q, x, qseq, pos), T = t tokens per sequence."""
        mem, m = self.mem, q.shape[0]
        o_part, lse = mem.poisoned(2 * m * self.hq * splits * self.d), mem.poisoned(2 * m * self.hq * splits)
        out, posbuf = mem.poisoned(m * self.hq * self.d), mem.i32(pos)
        self._split(form, q, qseq, pos, t, splits, min_split, o_part, lse, posbuf)
        self.library.kernel("attention", f"combine_{self.name}").launch(
            self.stream, {"o_part": o_part, "lse": lse, "pos": posbuf, "x": mem.bf16(x), "out": out},
            {"M": m, "S": splits, "min_split": min_split})
        return mem.read_bf16(out, (m, self.hq * self.d))

    def _split(self, form, q, qseq, pos, t, splits, min_split, o_part, lse, posbuf):
        mem, m = self.mem, q.shape[0]
        rows = {"q": mem.bf16(q), "k_pages": self.kbuf, "v_pages": self.vbuf, "table": self.tbuf,
                "qseq": mem.i32(qseq), "pos": posbuf, "o_part": o_part, "lse": lse}
        sizes = {"M": m, "S": splits, "min_split": min_split, "maxp": self.table.shape[1],
                 "R": self.table.shape[0], "NP": self.npages}
        if form == "mma":
            self.library.kernel("attention_decode_mma", _mma_key(self.name, t, self.variant)).launch(
                self.stream, rows, {**sizes, "T": t})
        else:
            self.library.kernel("attention", f"split_{self.name}_{self.fmt}").launch(self.stream, rows, sizes)

    def references(self, q, x, qseq, pos):
        """(fp64, same-precision) references [M, Hq * D] of rows (q, x, qseq, pos) over the
        dequantised K/V."""
        return sequence_references(q, x, qseq, pos, self.hq, self.d, self.table, lambda rows: tuple(
            c * s[..., None] for c, s in (self.values(0, rows), self.values(1, rows))))

    def check(self, got, split_got, q, x, qseq, pos, what, rows=None):
        """Every row written; each of `rows` (None: all) against fp64 over the dequantised K/V
        within SLACK x the same-precision baseline's error, and together within SPLIT_SLACK x the
        CUDA-core split kernel's error on them."""
        assert np.isfinite(got).all(), f"{what}: an output was not written"
        rows = np.arange(q.shape[0]) if rows is None else rows
        exact, base = self.references(q[rows], x[rows], qseq[rows], pos[rows])
        for j, i in enumerate(rows):
            assert_close_to_baseline(got[i:i + 1], exact[j:j + 1], base[j:j + 1], f"{what} row {i} pos={pos[i]}",
                                     slack=SLACK)
        if split_got is not None:
            e_mma, e_split = rel_err(got[rows], exact), rel_err(split_got[rows], exact)
            assert e_mma <= SPLIT_SLACK * e_split + 1e-6, f"{what}: mma error {e_mma:.3e} vs split {e_split:.3e}"


def _rows(rng, case, n):
    return _bf(rng, (n, case.hq, case.d), 2.0), _bf(rng, (n, case.stride))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name,lengths,plan", [
    ("q24_kv4_d256", [1, 63, 64, 65, 1000, 4097, 33000], "runner"),
    ("q24_kv4_d256", [5, 7777], "few"),
    ("q16_kv2_d256", [65, 1, 20000, 4097, 63], "runner"),
    ("q4_kv2_d64", [1, 63, 64, 65, 1000, 4097, 33000], "runner"),
    ("q4_kv2_d64", [129, 4000, 2], "pages"),
])
def test_decode_rows(library, mem, stream, name, lengths, plan, fmt):
    rng = np.random.default_rng(len(lengths) * 7 + max(lengths))
    case = _Case(library, mem, stream, name, fmt, rng, lengths)
    splits, min_split = _PLANS[plan](case.hkv)
    q, x = _rows(rng, case, len(lengths))
    pos, qseq = np.array(lengths) - 1, np.arange(len(lengths))
    got = case.run("mma", q, x, qseq, pos, 1, splits, min_split)
    split_got = case.run("split", q, x, qseq, pos, 1, splits, min_split)
    case.check(got, split_got, q, x, qseq, pos, f"{name} {fmt} {plan} ({splits}x{min_split})")


@pytest.mark.parametrize("name,t,bases,fmt", _for_variants([
    ("q24_kv4_d256", 8, [0, 60, 4090, 12000]),  # 60..67 and 4090..4097 straddle page / split edges
    ("q24_kv4_d256", 3, [1, 2047, 126, 7]),
    ("q16_kv2_d256", 8, [62, 9000]),
    ("q4_kv2_d64", 8, [0, 63, 1000, 20000]),
], tokens_at=1))
def test_verification_blocks(library, mem, stream, name, t, bases, fmt):
    """B sequences of t tokens each, row p * B + b at position bases[b] + p: the rows of
    `_reference_rows` against the reference (causal inside the block), and every row bit-equal to
    the same row decoded (T = 1), in one decode batch and alone."""
    rng = np.random.default_rng(t * 31 + len(bases))
    nseq = len(bases)
    case = _Case(library, mem, stream, name, fmt, rng, [b + t for b in bases])
    splits, min_split = _PLANS["runner"](case.hkv)
    q, x = _rows(rng, case, nseq * t)
    pos = np.array([bases[b] + p for p in range(t) for b in range(nseq)])
    qseq = np.array([b for _ in range(t) for b in range(nseq)])
    got = case.run("mma", q, x, qseq, pos, t, splits, min_split)
    split_got = case.run("split", q, x, qseq, pos, t, splits, min_split)
    case.check(got, split_got, q, x, qseq, pos, f"{name} {fmt} verify T={t}", _reference_rows(pos, t))
    decoded = case.run("mma", q, x, qseq, pos, 1, splits, min_split)  # every row a decode row (T = 1)
    np.testing.assert_array_equal(decoded, got, err_msg=f"{name} {fmt} T={t}: the block's rows vs its rows decoded")
    for i in (0, nseq * t - 1, (t // 2) * nseq + nseq // 2):
        alone = case.run("mma", q[i:i + 1], x[i:i + 1], qseq[i:i + 1], pos[i:i + 1], 1, splits, min_split)
        np.testing.assert_array_equal(alone, got[i:i + 1], err_msg=f"{name} {fmt} T={t} row {i} alone vs in its block")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_sequence_does_not_depend_on_the_batch(library, mem, stream, fmt):
    name = "q24_kv4_d256"
    rng = np.random.default_rng(9)
    lengths = [4097, 1, 65, 20000, 300, 64, 1000, 12345]
    case = _Case(library, mem, stream, name, fmt, rng, lengths)
    splits, min_split = _PLANS["runner"](case.hkv)
    q, x = _rows(rng, case, 8)
    pos, qseq = np.array(lengths) - 1, np.arange(8)
    together = case.run("mma", q, x, qseq, pos, 1, splits, min_split)
    for i in (0, 3, 7):
        alone = case.run("mma", q[i:i + 1], x[i:i + 1], qseq[i:i + 1], pos[i:i + 1], 1, splits, min_split)
        np.testing.assert_array_equal(alone, together[i:i + 1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["q24_kv4_d256", "q4_kv2_d64"])
def test_partials_match_the_split_contract(library, mem, stream, name, fmt):
    """o_part and lse of every used split (and nothing past them) against the reference over the
    codes and scales, and against the quantised CUDA-core split kernel's partials."""
    rng = np.random.default_rng(21)
    lengths = [4097, 130]
    case = _Case(library, mem, stream, name, fmt, rng, lengths)
    splits, min_split = 7, 64
    q, _ = _rows(rng, case, 2)
    pos, qseq = np.array(lengths) - 1, np.arange(2)
    mma_o, mma_lse = case.partials("mma", q, qseq, pos, 1, splits, min_split)
    split_o, split_lse = case.partials("split", q, qseq, pos, 1, splits, min_split)
    for i in range(2):
        n = int(pos[i]) + 1
        rows = case.table[i, np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        (kc, ks), (vc, vs) = case.values(0, rows), case.values(1, rows)
        args = (q[i], kc, vc, int(pos[i]), splits, min_split)
        want_o, want_lse = attention_decode_mma.reference(*args, k_scales=ks, v_scales=vs)
        model_o, _ = attention_decode_mma.reference(*args, k_scales=ks, v_scales=vs, exact=False)
        used = want_o.shape[1]
        assert used == (7 if i == 0 else 3)  # 4097 keys in splits of 640, 130 in splits of 64
        mo, ml = mma_o[i, :, :used], mma_lse[i, :, :used]
        so, sl = split_o[i, :, :used], split_lse[i, :, :used]
        assert np.isfinite(mo).all() and np.isfinite(ml).all(), f"row {i}: a used split was not written"
        assert np.isnan(mma_o[i, :, used:]).all() and np.isnan(mma_lse[i, :, used:]).all(), \
            f"row {i}: a split past the row's keys was written"
        e_model, e_split = rel_err(model_o, want_o), rel_err(so, want_o)
        assert rel_err(mo, want_o) <= 2.0 * e_model + 1e-6, \
            f"row {i}: o_part error {rel_err(mo, want_o):.3e} vs model {e_model:.3e}"
        assert rel_err(mo, so) <= 2.0 * e_model + 2.0 * e_split + 1e-6, \
            f"row {i}: o_part vs the split kernel's {rel_err(mo, so):.3e} (model {e_model:.3e}, split {e_split:.3e})"
        assert np.abs(ml - want_lse).max() <= 4.0 * np.abs(sl - want_lse).max() + 1e-5
        assert np.abs(ml - sl).max() <= 5.0 * np.abs(sl - want_lse).max() + 1e-5


def _exact_pages(rng, fmt, rows, hkv, d, scale):
    """Codes whose every sum with a q of multiples of 2^-6 up to 1/16 is exact in fp32: fp8 codes
    of |value| <= 16 (subnormals and -0 among them), int8 codes in [-16, 16]; one power-of-two
    scale for every token-head (so code * scale is exact in bf16, and scaling commutes with the
    roundings)."""
    if fmt == "fp8":
        pool = np.array([c for c in range(256) if (c & 0x7F) != 0x7F and abs(kf.e4m3_decode(np.uint8(c))) <= 16],
                        np.uint8)
        codes = rng.choice(pool, (rows, hkv, d))
    else:
        codes = rng.integers(-16, 17, (rows, hkv, d)).astype(np.int8).view(np.uint8)
    return codes, np.full((rows, hkv), scale, np.float32)


@pytest.mark.parametrize("name,t,bases,fmt", _for_variants([
    ("q24_kv4_d256", 1, [700, 1, 4096]), ("q24_kv4_d256", 8, [60, 1000]), ("q4_kv2_d64", 1, [700, 63]),
    ("q16_kv2_d256", 8, [5, 130])], tokens_at=1, key_slices=attention_decode_mma.KS))
def test_exact_pages_give_the_bf16_kernels_bits(library, mem, stream, name, t, bases, fmt):
    """Pages whose scores are exact sums: the quantised kernel's partials equal the bf16 kernel's
    over the values code * scale bit for bit (the same weights, rounded alike; P V sums the same
    products in the same key order, only over permuted columns). Forms with the bf16 kernel's key
    slices only: four slices a tile (`k4`) merge their sums in another grouping, so their bits
    differ within rounding (the other tests hold them to the reference)."""
    rng = np.random.default_rng(len(bases) + t)
    cfg = _cfg(name)
    hkv, d, hq = cfg["Hkv"], cfg["D"], cfg["Hq"]
    lengths = [b + t for b in bases]
    table, npages = _scattered(rng, lengths)
    k_codes, k_scales = _exact_pages(rng, _kv(fmt), npages * PAGE, hkv, d, 0.125)
    v_codes, v_scales = _exact_pages(rng, _kv(fmt), npages * PAGE, hkv, d, 0.25)
    case = _Case(library, mem, stream, name, fmt, rng, lengths, codes=(k_codes, v_codes), scales=(k_scales, v_scales))
    nseq = len(bases)
    q = (rng.integers(-4, 5, (nseq * t, hq, d)) / 64.0).astype(np.float32)
    pos = np.array([bases[b] + p for p in range(t) for b in range(nseq)])
    qseq = np.array([b for _ in range(t) for b in range(nseq)])
    splits, min_split = 5, 64
    got = case.partials("mma", q, qseq, pos, t, splits, min_split)
    # The bf16 kernel over the same values (the unused rows NaN there too).
    values = [_decode(c, case.fmt) * s[..., None] for c, s in zip(case.codes, case.scales)]
    bufs = [mem.bf16(v.astype(np.float32)) for v in values]
    o_part, lse = mem.poisoned(2 * nseq * t * hq * splits * d), mem.poisoned(2 * nseq * t * hq * splits)
    library.kernel("attention_decode_mma", f"mma_{name}_t{t}").launch(stream, {
        "q": mem.bf16(q), "k_pages": bufs[0], "v_pages": bufs[1], "table": case.tbuf, "qseq": mem.i32(qseq),
        "pos": mem.i32(pos), "o_part": o_part, "lse": lse},
        {"M": nseq * t, "T": t, "S": splits, "min_split": min_split, "maxp": table.shape[1], "R": nseq,
         "NP": npages})
    want = (mem.read_f32(o_part, got[0]), mem.read_f32(lse, got[1]))
    for g, w, what in zip(got, want, ("o_part", "lse")):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=f"{name} {fmt} T={t} {what}")
