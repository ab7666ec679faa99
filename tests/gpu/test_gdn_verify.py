"""The `verify` conv1d and gdn kernels (one launch each over t positions of nseq sequences)
against the per-position decode launches they replace, and against the NumPy references.

The same inputs go through both paths, as `layers.Forward.gdn` runs them:
- per position (the path before): for p = 0 .. t-1, a decode conv1d launch and a decode gdn
  launch over rows p * nseq .. p * nseq + nseq - 1, reading each sequence's window and state at
  the snapshot position p - 1 wrote (the sequence's own slot for p = 0) and writing them at
  snapshot p;
- verify: one conv1d `verify` launch and one gdn `verify` launch over all rows (position-major),
  reading the sequences' own slots and writing every row's snapshot.
The conv outputs, the GDN outputs, and every state and window in the pools must be equal bit for
bit: the `verify` kernels run the decode kernels' code per token (fp32 state kept in registers
instead of stored and reloaded, which loses nothing), and a GDN kernel with its value columns
over a cluster of CTAs (column blocks) the one-CTA kernel's arithmetic, so the per-position path
runs the one-block or the column-block decode kernel and the verify path a column-block one.
Snapshot and unused slots start poisoned (NaN), so a missed write or a write to a wrong slot shows;
the sequences' own slots must stay as they were. On some cases the verify outputs are also checked
against the float64 references (`gdn.reference_snapshots`, `conv1d.reference(snapshots=True)`)
within 2.5x the error of the same-precision baseline, as tests/gpu/test_gdn_kernels.py does for
the decode kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import bf16, conv1d, gdn
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline, rel_err

pytestmark = pytest.mark.gpu

# (conv1d key, gdn key): tiny model, Qwen3.6-27B, Qwen3.6-35B-A3B (conv channels = GDN conv_dim).
SHAPES = {"tiny": ("c256_s392", "k2_v4_d32"), "27b": ("c10240_s16480", "k16_v48_d128"),
          "35b": ("c8192_s12352", "k16_v32_d128")}
# Column blocks of each shape's variants (their keys: `gdn.column_key`).
COLS = {"tiny": (2, 4), "27b": (2, 4, 8), "35b": (2, 4, 8)}
# (shape, nseq, t, decode column blocks, verify column blocks). The one-block kernels over the full
# grid; then each column-block verify kernel against the one-block decode kernel (today's decode
# numbers) and against its own column-block decode kernel (the pair the runner launches).
CASES = ([(shape, nseq, t, 1, 1) for shape in ("tiny", "27b") for t in range(2, 9) for nseq in range(1, 9)]
         + [("35b", 1, 4, 1, 1), ("35b", 3, 8, 1, 1)]
         + [(shape, nseq, t, 1, c) for shape, cols in COLS.items() for c in cols
            for nseq, t in ((1, 2), (1, 4), (1, 8), (3, 5), (8, 4))]
         + [(shape, nseq, t, c, c) for shape, cols in COLS.items() for c in cols for nseq, t in ((1, 4), (2, 8))])
REFERENCE_CASES = {("tiny", 1, 2, 1, 1), ("tiny", 3, 8, 1, 1), ("tiny", 8, 5, 1, 1), ("27b", 1, 4, 1, 1),
                   ("27b", 2, 8, 1, 1), ("35b", 3, 8, 1, 1), ("tiny", 1, 8, 1, 4), ("27b", 1, 8, 1, 8),
                   ("27b", 1, 4, 4, 4), ("35b", 3, 5, 1, 8)}
POISON16 = 0xFFFF  # a bf16 NaN
POISON32 = 0xFFFFFFFF  # an fp32 NaN


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _variant(module, key):
    return next(v for v in module.variants() if v.key == key)


def _read(mem, ptr: int, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    mem.stream.synchronize()
    mem.device.memcpy_dtoh(out, ptr, mem.stream)
    mem.stream.synchronize()
    return out


def _assert_bitwise(what: str, got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns (NaN poison included), with where and how much they differ if not."""
    if np.array_equal(got, want):
        return
    diff = np.argwhere(got != want)
    g = bf16.from_bits(got) if got.dtype == np.uint16 else got.view(np.float32)
    w = bf16.from_bits(want) if want.dtype == np.uint16 else want.view(np.float32)
    first = tuple(int(i) for i in diff[0])
    raise AssertionError(f"{what}: {len(diff)} of {got.size} elements differ; first at {first}: "
                         f"verify {g[first]!r} vs per-position {w[first]!r}; max |diff| "
                         f"{float(np.nanmax(np.abs(g.astype(np.float64) - w))):.3e}")


@pytest.mark.parametrize("shape,nseq,t,dcols,vcols", CASES)
def test_verify_launches_equal_per_position_decode_launches(library, mem, stream, shape, nseq, t, dcols, vcols):
    conv_key, gdn_key = SHAPES[shape]
    cv, gv = _variant(conv1d, conv_key).config, _variant(gdn, gdn_key).config
    c, stride, kc = cv["C"], cv["x_stride"], cv["Kc"]
    hk, hv, dk, dv = gv["Hk"], gv["Hv"], gv["dk"], gv["dv"]
    assert (c, stride) == (gv["conv_dim"], gv["x_stride"])
    m, ns = nseq * t, nseq * (t + 1) + 2
    rng = np.random.default_rng(1000 * nseq + t + hv)
    # Slots scattered over the pool: the sequences' own, one snapshot per row, two never named.
    order = rng.permutation(ns)
    own, snaps = order[:nseq], order[nseq:nseq + m].reshape(t, nseq)  # snaps[p, b]: row p * nseq + b
    x = _bf(rng, (m, stride), 1.5)
    w = _bf(rng, (c, kc), 0.5)
    a_log, dt_bias = _bf(rng, (hv,), 0.5), _bf(rng, (hv,), 0.5)
    norm_w = round_bf16(1.0 + _bf(rng, (dv,), 0.1))
    windows = np.full((ns, kc - 1, c), POISON16, np.uint16)
    windows[own] = bf16.to_bits(_bf(rng, (nseq, kc - 1, c), 2.0))
    states = np.full((ns, hv, dv, dk), POISON32, np.uint32)
    states[own] = (rng.standard_normal((nseq, hv, dv, dk)) * 0.1).astype(np.float32).view(np.uint32)
    # Output rows poisoned, one past m included (it must stay NaN).
    conv_rows, out_rows = (np.full((m + 1, n), POISON16, np.uint16) for n in (c, hv * dv))

    common = {"x": mem.bf16(x), "w": mem.bf16(w), "a_log": mem.bf16(a_log), "dt_bias": mem.bf16(dt_bias),
              "norm_w": mem.bf16(norm_w)}
    paths = {}
    for name in ("per_position", "verify"):
        paths[name] = {"win": mem.raw(windows), "state": mem.raw(states),
                       "conv_out": mem.raw(conv_rows), "out": mem.raw(out_rows)}
    conv, rec = library.kernel("conv1d", conv_key), library.kernel("gdn", gdn.column_key(gdn_key, dcols))
    p_bufs = paths["per_position"]
    for p in range(t):
        slots_in = mem.i32(own if p == 0 else snaps[p - 1])
        slots_out = mem.i32(snaps[p])
        x_p = common["x"] + p * nseq * stride * 2
        conv_p = p_bufs["conv_out"] + p * nseq * c * 2
        conv.launch(stream, {"x": x_p, "w": common["w"], "win_in": p_bufs["win"], "win_out": p_bufs["win"],
                             "slots_in": slots_in, "slots_out": slots_out, "out": conv_p},
                    {"B": nseq, "T": 1, "NI": ns, "NO": ns})
        rec.launch(stream, {"qkv": conv_p, "x": x_p, "a_log": common["a_log"], "dt_bias": common["dt_bias"],
                            "norm_w": common["norm_w"], "state": p_bufs["state"], "slots": slots_in,
                            "slots_out": slots_out, "out": p_bufs["out"] + p * nseq * hv * dv * 2},
                   {"B": nseq, "T": 1, "NS": ns})
    v_bufs = paths["verify"]
    own_ptr, snaps_ptr = mem.i32(own), mem.i32(snaps.reshape(-1))
    library.kernel("conv1d", conv_key + conv1d.VERIFY_SUFFIX).launch(stream, {
        "x": common["x"], "w": common["w"], "win": v_bufs["win"], "slots_in": own_ptr, "slots_out": snaps_ptr,
        "out": v_bufs["conv_out"]}, {"B": nseq, "T": t, "NS": ns})
    library.kernel("gdn", gdn.column_key(gdn_key, vcols) + gdn.VERIFY_SUFFIX).launch(stream, {
        "qkv": v_bufs["conv_out"], "x": common["x"], "a_log": common["a_log"], "dt_bias": common["dt_bias"],
        "norm_w": common["norm_w"], "state": v_bufs["state"], "slots": own_ptr, "slots_out": snaps_ptr,
        "out": v_bufs["out"]}, {"B": nseq, "T": t, "NS": ns})

    got = {name: {"conv_out": _read(mem, bufs["conv_out"], conv_rows), "out": _read(mem, bufs["out"], out_rows),
                  "win": _read(mem, bufs["win"], windows), "state": _read(mem, bufs["state"], states)}
           for name, bufs in paths.items()}
    case = f"{shape} nseq={nseq} t={t} column blocks decode={dcols} verify={vcols}"
    per, ver = got["per_position"], got["verify"]
    for name in ("conv_out", "out", "win", "state"):
        _assert_bitwise(f"{case} {name}", ver[name], per[name])
    # What both paths must have done (so equal is not equally wrong): every row written, the row
    # past them and the unnamed slots untouched, the sequences' own slots only read, every
    # snapshot written.
    for name in ("conv_out", "out"):
        assert (ver[name][m] == POISON16).all(), f"{case}: {name} wrote past row {m}"
        assert not np.isnan(bf16.from_bits(ver[name][:m])).any(), f"{case}: {name} rows not all written"
    spare = order[nseq + m:]
    np.testing.assert_array_equal(ver["win"][own], windows[own])
    np.testing.assert_array_equal(ver["state"][own], states[own])
    assert (ver["win"][spare] == POISON16).all() and (ver["state"][spare] == POISON32).all(), case
    assert not np.isnan(bf16.from_bits(ver["win"][snaps])).any(), f"{case}: a window snapshot not written"
    assert not np.isnan(ver["state"][snaps].view(np.float32)).any(), f"{case}: a state snapshot not written"
    if (shape, nseq, t, dcols, vcols) in REFERENCE_CASES:
        _check_against_references(case, ver, x, w, a_log, dt_bias, norm_w, windows, states, own, snaps, gv, kc)


def _check_against_references(case, got, x, w, a_log, dt_bias, norm_w, windows, states, own, snaps, gv, kc):
    """The verify path's outputs and snapshots against the references, sequence by sequence.

    The conv windows are copies of bf16 inputs, so equal exactly; the conv output within 2x and
    the GDN output within 2.5x the error of the same-precision baseline (the decode kernels'
    tolerances in test_gdn_kernels.py); the fp32 states within 2e-5 relative (as there). The GDN
    reference takes the kernel's own conv output as its input, so each check is of one kernel."""
    t, nseq = snaps.shape
    hk, hv, dv, c = gv["Hk"], gv["Hv"], gv["dv"], gv["conv_dim"]
    conv_out = bf16.from_bits(got["conv_out"])
    out = bf16.from_bits(got["out"])
    for b in range(nseq):
        rows = [p * nseq + b for p in range(t)]
        xs = x[rows, :c][None]
        win0 = bf16.from_bits(windows[own[b]])[None]
        want, want_wins = conv1d.reference(xs, win0, w, exact=True, snapshots=True)
        base, _ = conv1d.reference(xs, win0, w)
        assert_close_to_baseline(conv_out[rows], want[0], base[0], f"{case} conv seq {b}")
        np.testing.assert_array_equal(bf16.from_bits(got["win"][snaps[:, b]]), want_wins[0])
        xr = x[rows]
        args = (conv_out[rows], xr[:, gv["z_off"]:gv["z_off"] + hv * dv].reshape(t, hv, dv),
                xr[:, gv["b_off"]:gv["b_off"] + hv], xr[:, gv["a_off"]:gv["a_off"] + hv], a_log, dt_bias, norm_w,
                states[own[b]].view(np.float32))
        want, want_states = gdn.reference_snapshots(*args, hk=hk, exact=True)
        base, _ = gdn.reference_snapshots(*args, hk=hk)
        assert_close_to_baseline(out[rows].reshape(t, hv, dv), want, base, f"{case} gdn seq {b}", slack=2.5)
        for p in range(t):
            err = rel_err(got["state"][snaps[p, b]].view(np.float32), want_states[p])
            assert err < 2e-5, f"{case}: state of seq {b} after position {p}: relative error {err:.2e}"
