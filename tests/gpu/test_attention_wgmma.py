"""The WGMMA prefill attention kernels (`attention_wgmma`, forms wg2, wg1 and wg2p) against NumPy,
and the overlapped form wg2p against wg2 (same tiles and arithmetic in the same order: outputs bit
for bit).

A chunk of t query rows at positions start..start+t-1 (start = the keys already cached before
it) attends causally to keys 0..pos[m] stored in shuffled pages; page rows outside the sequence
(and past its end inside the last page) hold NaN, which must never reach an output, and the
sequence's page table row is row qseq (the other row points at NaN pages only). Lengths leave the
last 64- or 128-row tile with 1, 63, 64, 65 rows, and the chunk starts at key 0, mid-page, or
after a long prefix; the row after the last must stay unwritten.

Tolerance: the kernels round P to bf16 for the PV product (as the mma.sync kernel does), so
their error against the float64 reference is compared with the error of the same formula in
fp32 with bf16 output (the baseline): at most 2.5x over the whole output (the mma.sync kernel's
bound) and at most 4x in every single row (a wrong row or tile cannot hide in the average; rows
have Hq * 256 elements, so their errors are stable).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention_wgmma as aw
from cute_kernels.bf16 import round_bf16
from runtime.cuda.errors import KernelMissing

from .conftest import assert_close_to_baseline, rel_err

pytestmark = pytest.mark.gpu
PAGE = 64
SHAPES = ("q24_kv4_d256", "q16_kv2_d256")
STARTS = (0, 64, 1000, 5000)
LENGTHS = (1, 63, 64, 65, 130, 300, 1000)


def _cfg(name, form):
    return next(v for v in aw.variants() if v.key == f"fwd_{name}_{form}").config


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.fixture(scope="module")
def cases():
    """(name, start, t) -> inputs and both references, shared by the two forms."""
    return {}


def _case(cases, name, start, t):
    key = (name, start, t)
    if key not in cases:
        cfg = _cfg(name, "wg2")
        hq, hkv, d, stride = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["x_stride"]
        rng = np.random.default_rng([start, t, hq])
        n = start + t
        used = -(-n // PAGE)
        npages = used + 3
        perm = rng.permutation(npages)
        seq_row = (start + t) % 2
        table = np.full((2, used + 2), perm[used], np.int64)  # the other row: a NaN page
        table[seq_row, :used] = perm[:used]
        pages_k = np.full((npages * PAGE, hkv, d), np.nan, np.float32)
        pages_v = np.full((npages * PAGE, hkv, d), np.nan, np.float32)
        rows = perm[np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
        pages_k[rows] = _bf(rng, (n, hkv, d))
        pages_v[rows] = _bf(rng, (n, hkv, d))
        q = _bf(rng, (t, hq, d), 2.0)
        x = _bf(rng, (t, stride))
        pos = start + np.arange(t)
        args = (q, pages_k, pages_v, table[seq_row], pos, x)
        cases.clear()  # one case at a time in memory: the forms of a case run back to back
        cases[key] = {"args": args, "table": table, "seq_row": seq_row, "npages": npages}
    return cases[key]


def _references(c: dict) -> tuple[np.ndarray, np.ndarray]:
    """Case c's (float64, same-precision) references, computed on first use: the bit-equality
    tests of the forms need none, and a float64 attention over thousands of keys is seconds of CPU."""
    if "exact" not in c:
        c["exact"], c["base"] = aw.reference(*c["args"], exact=True), aw.reference(*c["args"])
    return c["exact"], c["base"]


def _run(library, mem, c, stream, name, form, t):
    """The fused kernel of `form` on case c: its output rows [t + 1, Hq * D] (the last unwritten)."""
    kernel = library.kernel("attention_wgmma", f"fwd_{name}_{form}")
    cfg = _cfg(name, form)
    hq, d = cfg["Hq"], cfg["D"]
    q, pages_k, pages_v, _, pos, x = c["args"]
    table = c["table"]
    out = mem.poisoned((t + 1) * hq * d)
    kernel.launch(stream, {
        "q": mem.bf16(q), "k_pages": mem.bf16(pages_k), "v_pages": mem.bf16(pages_v), "table": mem.i32(table),
        "qseq": mem.i32(np.full(t, c["seq_row"])), "pos": mem.i32(pos), "x": mem.bf16(x), "out": out},
        {"M": t, "maxp": table.shape[1], "R": table.shape[0], "NP": c["npages"]})
    return mem.read_bf16(out, (t + 1, hq * d))


# The forms of a case run back to back (its inputs and references are computed once).
@pytest.mark.parametrize("name,start,t,form", [(name, start, t, form) for name in SHAPES for start in STARTS
                                               for t in LENGTHS for form in sorted(aw.FORMS)])
def test_wgmma_prefill_attention(library, mem, stream, cases, name, start, t, form):
    try:
        library.kernel("attention_wgmma", f"fwd_{name}_{form}")
    except KernelMissing as exc:
        pytest.skip(f"not built: {exc}")
    c = _case(cases, name, start, t)
    _check(_run(library, mem, c, stream, name, form, t), c, f"wgmma prefill attention {form} {name} start={start} t={t}")


# wg2p changes only the schedule (cute_kernels/_attention_wgmma_overlap.py): every output bit as wg2's.
@pytest.mark.parametrize("name,start,t", [(name, start, t) for name in SHAPES for start in STARTS
                                          for t in LENGTHS + (2, 127, 129, 257)])
def test_overlapped_form_equals_wg2_bit_for_bit(library, mem, stream, cases, name, start, t):
    try:
        for form in ("wg2", "wg2p"):
            library.kernel("attention_wgmma", f"fwd_{name}_{form}")
    except KernelMissing as exc:
        pytest.skip(f"not built: {exc}")
    c = _case(cases, name, start, t)
    base = _run(library, mem, c, stream, name, "wg2", t)
    got = _run(library, mem, c, stream, name, "wg2p", t)
    differ = np.flatnonzero((got.view(np.uint32) != base.view(np.uint32)).any(axis=1))
    assert not differ.size, f"wg2p {name} start={start} t={t}: rows {differ[:8].tolist()} differ from wg2"


def _check(got: np.ndarray, c: dict, what: str) -> None:
    """Rows 0..t-1 of `got` [t + 1, Hq * D] against the case's references (module docstring);
    row t, past the last, unwritten."""
    t = got.shape[0] - 1
    assert np.isnan(got[t]).all(), f"{what}: wrote past the last row"
    got = got[:t]
    exact, base = _references(c)
    assert_close_to_baseline(got, exact, base, what, slack=2.5)
    row_err = np.array([rel_err(got[i], exact[i]) for i in range(t)])
    row_base = np.array([rel_err(base[i], exact[i]) for i in range(t)])
    bad = np.flatnonzero(row_err > 4 * row_base + 1e-5)
    assert not bad.size, (f"{what}: rows {bad[:8].tolist()} err {row_err[bad[:8]].tolist()} vs baseline "
                          f"{row_base[bad[:8]].tolist()}")


def _run_key_splits(library, mem, stream, c, name, form, t, split):
    """The form's kernel over `split`-key splits, then the combine, on case c: (o_part, lse, out)
    as read back (partials the kernel did not write stay NaN)."""
    kernel = library.kernel("attention_wgmma", f"fwd_{name}_{form}_kvsplit")
    combine = library.kernel("attention", f"combine_{name}")
    cfg = _cfg(name, form)
    hq, d = cfg["Hq"], cfg["D"]
    q, pages_k, pages_v, _, pos, x = c["args"]
    table = c["table"]
    start = int(pos[0])
    splits = -(-(start + t) // split)
    o_part = mem.poisoned(2 * t * hq * splits * d)
    lse = mem.poisoned(2 * t * hq * splits)
    rows = {"table": mem.i32(table), "qseq": mem.i32(np.full(t, c["seq_row"])), "pos": mem.i32(pos)}
    kernel.launch(stream, {"q": mem.bf16(q), "k_pages": mem.bf16(pages_k), "v_pages": mem.bf16(pages_v), **rows,
                           "o_part": o_part, "lse": lse},
                  {"M": t, "maxp": table.shape[1], "R": table.shape[0], "NP": c["npages"], "S": splits,
                   "split": split})
    out = mem.poisoned((t + 1) * hq * d)
    combine.launch(stream, {"o_part": o_part, "lse": lse, "pos": rows["pos"], "x": mem.bf16(x), "out": out},
                   {"M": t, "S": splits, "min_split": split})
    return (mem.read_f32(o_part, np.empty((t, hq, splits, d), np.float32)),
            mem.read_f32(lse, np.empty((t, hq, splits), np.float32)), mem.read_bf16(out, (t + 1, hq * d)))


# Over key splits (`fwd_*_{form}_kvsplit` + the attention family's combine): split lengths of one
# page, an odd number of pages and several tiles, so rows see 1..80 splits; the partials start as
# NaN, so a split the combine reads but the kernel did not write shows up (only wg2 is built over
# key splits: attention_wgmma.KV_SPLIT_FORMS says why).
@pytest.mark.parametrize("name,start,t,split,form", [(name, start, t, split, form) for name in SHAPES
                                                     for start, t in ((0, 300), (1000, 65), (5000, 1), (5000, 130),
                                                                      (2000, 257))
                                                     for split in (64, 448, 1024) for form in aw.KV_SPLIT_FORMS])
def test_wgmma_over_key_splits_then_combine(library, mem, stream, cases, name, start, t, split, form):
    try:
        library.kernel("attention_wgmma", f"fwd_{name}_{form}_kvsplit")
        library.kernel("attention", f"combine_{name}")
    except KernelMissing as exc:
        pytest.skip(f"not built: {exc}")
    c = _case(cases, name, start, t)
    _, _, out = _run_key_splits(library, mem, stream, c, name, form, t, split)
    _check(out, c, f"wgmma prefill attention {form} over {split}-key splits {name} start={start} t={t}")
