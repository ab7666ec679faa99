"""The `moe_grouped` kernels (cute_kernels/moe_grouped.py, the prefill MoE MLP) against their NumPy
references on a real GPU.

Per MoE shape we serve (the tiny test model's and the 35B-A3B's), at odd row counts (1, 7, 65,
300, 2048) and three routings (random ids, which leave experts empty; every row to one set of k
experts, so k experts take every row; every row to experts 0..k-1): the counting sort exactly
(stable order, padding, tile list, inverse map), the gather exactly, each grouped GEMM against a
float64 product with the fp32-sum baseline, the combine (the rows it must not read are NaN), and
the whole chain after the `moe` family's routing against the decode kernels' chain and float64,
each row alone equal to its row in the batch bit for bit. Outputs are poisoned first (NaN, or -2
for int32: what the reference says is not written must stay so).

The GEMMs' and the chain's references are computed on samples, edges included (on every output,
the 35B-A3B's were minutes of CPU): a grouped GEMM's sampled tiles (every row and column of the
first two, a middle one, the two either side of the shared expert's segment start and the last),
a chain's sampled rows (all up to 8, else the first two, the middle one and the last two). Every
other output is still checked written (finite), and every row of the chain against the decode
chain.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import bf16, moe, moe_grouped
from cute_kernels.moe_grouped import BM

from .conftest import assert_close_to_baseline, rel_err
from .test_moe_kernels import _bf, _f32, _f32_poisoned, _weights, weights_on_device  # noqa: F401 - a fixture

pytestmark = pytest.mark.gpu

SHAPES = {shape[0]: shape for shape in moe_grouped.SHAPES}
# The shapes whose grouped GEMMs are checked: the 80B's stacks (1.6 G values) would take most of
# the suite's time to draw and upload; its GEMMs are the 35B-A3B's with 513 segments, and its
# perm / gather / combine (the kernels E changes) are checked.
WEIGHTED = [name for name in SHAPES if name != "next80b"]
ROWS = [1, 7, 65, 300, 2048]
MODES = ["random", "one_set", "first_k"]


def _key(kind: str, name: str, proj: str | None = None) -> str:
    """The variant of a kernel kind (for "gemm": of a projection) for a shape."""
    _, h, e, _, inter = SHAPES[name]
    if kind == "gemm":
        n, k = (2 * inter, h) if proj == "gate_up" else (h, inter)
        match = {"proj": proj, "E1": e + 1, "N": n, "K": k}
    else:
        match = {"H": h, "E": e, "I": inter}
    return next(v.key for v in moe_grouped.variants()
                if v.config["kind"] == kind and all(v.config.get(f) == val for f, val in match.items()))


def _ids(rng, m, e, k, mode):
    """Routed ids (distinct per row) and the shared expert e in the last slot."""
    if mode == "random":
        routed = np.stack([rng.permutation(e)[:k] for _ in range(m)])
    elif mode == "one_set":
        routed = np.broadcast_to(rng.permutation(e)[:k], (m, k))
    else:
        routed = np.broadcast_to(np.arange(k), (m, k))
    return np.concatenate([routed, np.full((m, 1), e)], 1).astype(np.int32)


def _i32_poisoned(mem, count):
    return mem.i32(np.full(count, -2, np.int32))


def _perm(library, mem, stream, name, d_ids, m):
    """Run `perm`; returns (C, device pos, src, tiles)."""
    _, _, e, k, _ = SHAPES[name]
    p = k + 1
    c = moe_grouped.capacity(m, p, e + 1)
    bufs = {"ids": d_ids, "pos": _i32_poisoned(mem, (m + 1) * p), "src": _i32_poisoned(mem, c),
            "tiles": _i32_poisoned(mem, c // BM + 1)}
    library.kernel("moe_grouped", _key("perm", name)).launch(stream, bufs, {"M": m, "C": c})
    return c, bufs


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("mode", MODES)
def test_perm_and_gather(library, mem, stream, name, m, mode):
    _, h, e, k, _ = SHAPES[name]
    p = k + 1
    rng = np.random.default_rng(m)
    ids = _ids(rng, m, e, k, mode)
    c, bufs = _perm(library, mem, stream, name, mem.i32(ids), m)
    want_pos, want_src, want_tiles = moe_grouped.reference_perm(ids, e + 1, c)
    pos = mem.read_i32(bufs["pos"], (m + 1) * p).reshape(m + 1, p)
    assert (pos[m] == -2).all(), "the row past M was written"
    np.testing.assert_array_equal(pos[:m], want_pos)
    np.testing.assert_array_equal(mem.read_i32(bufs["tiles"], c // BM + 1), want_tiles)
    np.testing.assert_array_equal(mem.read_i32(bufs["src"], c), want_src)

    x = _bf(rng, (m, h))
    xg = mem.poisoned(c * h)
    library.kernel("moe_grouped", _key("gather", name)).launch(
        stream, {"x": mem.bf16(x), "src": bufs["src"], "tiles": bufs["tiles"], "xg": xg}, {"M": m, "C": c})
    got = mem.read_bf16(xg, (c, h))
    used = want_tiles[0] * BM
    np.testing.assert_array_equal(got[:used], moe_grouped.reference_gather(x, want_src, want_tiles))
    assert np.isnan(got[used:]).all(), "a row past the tiles in use was written"


def _gemm_case(name, m, mode, seed):
    """(xg rows in use, tiles, C) for a routing: the permuted layout from the reference sort."""
    _, h, e, k, _ = SHAPES[name]
    rng = np.random.default_rng(seed)
    ids = _ids(rng, m, e, k, mode)
    c = moe_grouped.capacity(m, k + 1, e + 1)
    _, src, tiles = moe_grouped.reference_perm(ids, e + 1, c)
    return rng, src, tiles, c


def _sampled_tiles(tiles: np.ndarray) -> np.ndarray:
    """The tiles in use whose outputs the references check: the first two, a middle one, the two
    either side of the last expert boundary (where the shared expert's segment starts) and the
    last. A tile's product is ~1 GFLOP in float64 and fp32 together: all of the 35B-A3B's ~270
    tiles cost about a minute of CPU per case."""
    n = tiles[0]
    experts = tiles[1:1 + n]  # ascending: segments are laid out in expert order
    shared = int(np.searchsorted(experts, experts[-1]))
    return np.unique([t for t in (0, 1, n // 2, shared - 1, shared, n - 1) if 0 <= t < n])


def _upload_rows(mem, rows, capacity):
    """A device bf16 buffer of `capacity` rows: `rows` first, NaN after (rows no kernel may read)."""
    ptr = mem.poisoned(capacity * rows.shape[1])
    mem.device.memcpy_htod(ptr, bf16.to_bits(rows), mem.stream)
    mem.stream.synchronize()
    return ptr


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [1, 65, 300, 2048])
@pytest.mark.parametrize("mode", ["random", "one_set"])
def test_grouped_gemms(library, mem, stream, weights_on_device, name, m, mode):  # noqa: F811 - the fixture imported above
    """gate_up (bf16 out) and down (fp32 out) over the tiles of a real layout: every output of the
    tiles in use written, the sampled tiles' (all their rows and columns) against float64; rows
    past the tiles in use stay poisoned."""
    _, h, e, k, inter = SHAPES[name]
    rng, _, tiles, c = _gemm_case(name, m, mode, 200 + m)
    used = tiles[0] * BM
    _, _, gate_up, down = _weights(name)
    _, _, d_gate_up, d_down = weights_on_device(name)
    d_tiles = mem.i32(tiles.clip(0))
    sampled = _sampled_tiles(tiles)
    rows = (sampled[:, None] * BM + np.arange(BM)).ravel()
    sampled_layout = np.concatenate([[len(sampled)], tiles[1 + sampled]])  # the sampled tiles as a layout
    for proj, w, d_w, kdim, n in (("gate_up", gate_up, d_gate_up, h, 2 * inter), ("down", down, d_down, inter, h)):
        xg = _bf(rng, (used, kdim))  # only the rows in use: the GEMM reads no other
        if proj == "gate_up":
            out = mem.poisoned(c * n)
        else:
            out = _f32_poisoned(mem, c * n)
        library.kernel("moe_grouped", _key("gemm", name, proj)).launch(
            stream, {"x": _upload_rows(mem, xg, c), "w": d_w, "tiles": d_tiles, "out": out}, {"C": c})
        got = mem.read_bf16(out, (c, n)) if proj == "gate_up" else mem.read_f32(out, np.empty((c, n)))
        assert np.isnan(got[used:]).all(), f"{proj}: a row past the tiles in use was written"
        assert np.isfinite(got[:used]).all(), f"{proj}: an output of the tiles in use was not written"
        # The reference's per-tile products, on the sampled tiles only (the same fp32 GEMM per tile).
        base = moe_grouped.reference_gemm(xg[rows], w, sampled_layout, rounded=proj == "gate_up")
        exact = np.concatenate([xg[t * BM:(t + 1) * BM].astype(np.float64) @ w[tiles[1 + t]].astype(np.float64).T
                                for t in sampled])
        # gate_up: bf16 rounding of fp32 sums (the baseline's own error); down: fp32 sums in
        # another order (a few fp32 ulps; the floor covers a baseline error that is near zero).
        assert_close_to_baseline(got[rows], exact, base, f"{name} {proj} {mode} M={m}", floor=1e-6)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 300])
def test_combine(library, mem, stream, name, m):
    _, h, e, k, _ = SHAPES[name]
    p = k + 1
    rng, _, _, c = _gemm_case(name, m, "random", 300 + m)
    pos = np.stack([rng.permutation(c)[:p] for _ in range(m)]).astype(np.int32)
    # Only the rows pos points at are drawn (drawing all C rows was seconds of CPU); the rest stay
    # NaN, so a row read from anywhere else shows in the output.
    dn = np.full((c, h), np.nan, np.float32)
    dn[pos.ravel()] = rng.standard_normal((m * p, h)).astype(np.float32)
    wts = rng.uniform(0.05, 1.0, (m, p)).astype(np.float32)
    out = mem.poisoned((m + 1) * h)
    library.kernel("moe_grouped", _key("combine", name)).launch(
        stream, {"dn": _f32(mem, dn), "pos": mem.i32(pos), "wts": _f32(mem, wts), "out": out}, {"M": m, "C": c})
    got = mem.read_bf16(out, (m + 1, h))
    assert np.isnan(got[m]).all(), "the row past M was written"
    exact = sum(wts[:, s:s + 1].astype(np.float64) * dn[pos[:, s]].astype(np.float64) for s in range(p))
    assert_close_to_baseline(got[:m], exact, moe_grouped.reference_combine(dn, pos, wts), f"{name} combine M={m}")


def _prefill_chain(library, mem, stream, name, x, weights):
    """logits -> route (the `moe` family) -> perm -> gather -> gate_up -> silu_mul -> down ->
    combine over the rows of x; returns (ids, wts, delta rows)."""
    _, h, e, k, inter = SHAPES[name]
    m, p = x.shape[0], k + 1
    router, w_sg, gate_up, down = weights
    c = moe_grouped.capacity(m, p, e + 1)
    run = library.kernel
    d_x = mem.bf16(x)
    logits, ids, wts = _f32_poisoned(mem, m * e), mem.i32(np.zeros(m * p)), _f32_poisoned(mem, m * p)
    moe_key = {v.config["kind"]: v.key for v in moe.variants() if (v.config["H"], v.config["E"]) == (h, e)}
    run("moe", moe_key["logits"]).launch(stream, {"x": d_x, "w": router, "out": logits}, {"M": m})
    run("moe", moe_key["route"]).launch(stream, {"logits": logits, "x": d_x, "w_sg": w_sg, "ids": ids, "wts": wts},
                                        {"M": m})
    _, bufs = _perm(library, mem, stream, name, ids, m)
    rows = _f32_poisoned(mem, c * h)
    gu, act, out = mem.poisoned(c * 2 * inter), mem.poisoned(c * inter), mem.poisoned(m * h)
    sizes = {"M": m, "C": c}
    run("moe_grouped", _key("gather", name)).launch(stream, {"x": d_x, "src": bufs["src"], "tiles": bufs["tiles"],
                                                             "xg": rows}, sizes)
    run("moe_grouped", _key("gemm", name, "gate_up")).launch(stream, {"x": rows, "w": gate_up, "tiles": bufs["tiles"],
                                                                      "out": gu}, {"C": c})
    run("silu_mul", f"i{inter}").launch(stream, {"x": gu, "out": act}, {"M": c})
    run("moe_grouped", _key("gemm", name, "down")).launch(stream, {"x": act, "w": down, "tiles": bufs["tiles"],
                                                                   "out": rows}, {"C": c})
    run("moe_grouped", _key("combine", name)).launch(stream, {"dn": rows, "pos": bufs["pos"], "wts": wts,
                                                              "out": out}, sizes)
    return (mem.read_i32(ids, m * p).reshape(m, p), mem.read_f32(wts, np.empty((m, p))),
            mem.read_bf16(out, (m, h)))


def _sampled_rows(m: int) -> np.ndarray:
    """The rows of an M-row chain whose references are computed: all up to 8, else the first two,
    the middle one and the last two. The reference chain pads every expert's rows to a 128-row
    tile, so a few rows cost a tile per expert they reach, not all of the ~270 tiles of M = 2048."""
    return np.arange(m) if m <= 8 else np.unique([0, 1, m // 2, m - 2, m - 1])


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [7, 300, 2048])
def test_prefill_chain_matches_decode_and_rows_alone(library, mem, stream, weights_on_device, name, m):  # noqa: F811 - the fixture imported above
    """The whole prefill MLP (every row written; the sampled rows against float64 on the kernels'
    routing, with the reference chain on those rows as the baseline), against the decode kernels'
    chain on every row (only the K order of the dot products differs: most elements equal, the
    rest one bf16 rounding apart), and rows computed alone equal to their rows in the batch bit
    for bit."""
    _, h, e, k, inter = SHAPES[name]
    rng = np.random.default_rng(42 + m)
    x = _bf(rng, (m, h))
    router, w_sg, gate_up, down = _weights(name)
    on_device = weights_on_device(name)
    ids, wts, got = _prefill_chain(library, mem, stream, name, x, on_device)
    want_ids, want_wts = moe.reference_route(moe.reference_logits(x, router), x, w_sg, k, True)
    np.testing.assert_array_equal(ids, want_ids)
    assert np.isfinite(got).all(), "an output of the chain was not written"
    # A row's outputs depend on its own x, ids and weights only: the references of the sampled rows
    # alone are their rows of the whole batch's (the reference chain's each tile the same fp32 GEMM).
    rows = _sampled_rows(m)
    exact = _exact(x[rows], gate_up, down, ids[rows], wts[rows])
    base = moe_grouped.reference(x[rows], ids[rows], wts[rows], gate_up, down)
    assert_close_to_baseline(got[rows], exact, base, f"{name} chain M={m}")

    # The decode kernels on the same routing.
    moe_key = {v.config["kind"]: v.key for v in moe.variants() if (v.config["H"], v.config["E"]) == (h, e)}
    d_ids, d_wts = mem.i32(ids), _f32(mem, wts)
    act, dec = mem.poisoned(m * (k + 1) * inter), mem.poisoned(m * h)
    library.kernel("moe", moe_key["up"]).launch(stream, {"x": mem.bf16(x), "w": on_device[2], "ids": d_ids,
                                                         "act": act}, {"M": m})
    library.kernel("moe", moe_key["down"]).launch(stream, {"act": act, "w": on_device[3], "ids": d_ids, "wts": d_wts,
                                                           "out": dec}, {"M": m})
    decoded = mem.read_bf16(dec, (m, h))
    scale = np.abs(got).max()
    print(f"prefill vs decode: {np.mean(got == decoded):.4f} equal, max diff {np.abs(got - decoded).max() / scale:.2e}"
          f" of max |out|, rel {rel_err(got, decoded):.2e}")
    # Every row against the decode chain, within twice the baseline's error (on the sampled rows).
    assert rel_err(got, decoded) <= 2 * rel_err(base, exact) + 1e-6
    assert np.mean(got == decoded) > 0.5

    for r in (0, m // 2, m - 1):
        _, _, alone = _prefill_chain(library, mem, stream, name, x[r:r + 1], on_device)
        np.testing.assert_array_equal(alone[0], got[r])


def _exact(x, gate_up, down, ids, wts):
    """The MLP in float64 with nothing rounded, on the given routing (each expert's weights
    converted once, for all its rows; slots summed in order)."""
    inter = gate_up.shape[1] // 2
    per_slot = np.zeros((*ids.shape, down.shape[1]))
    for ex in np.unique(ids):
        rows, slots = np.nonzero(ids == ex)
        gu = x[rows].astype(np.float64) @ gate_up[ex].astype(np.float64).T
        act = gu[:, :inter] / (1.0 + np.exp(-gu[:, :inter])) * gu[:, inter:]
        per_slot[rows, slots] = wts[rows, slots, None] * (act @ down[ex].astype(np.float64).T)
    return per_slot.sum(1)
