"""The causal conv1d and the recurrent Gated DeltaNet kernels against their NumPy references.

Fresh random inputs, poisoned outputs (NaN: an element the kernel forgets stays NaN), a random
initial window and state (a continued sequence), odd lengths, and several sequences in one launch
that use scattered slots of the pool. Outputs must be within 2x the error of the same-precision
baseline (fp32 maths with the model's bf16 roundings) against a float64 reference; states and
windows are compared directly. The prefill `split` GDN variants (then the `rmsnorm` gated_x norm)
are checked against the references and against the `fused` kernel on the same inputs; the `fused`
column-block variants against the references and, bit for bit, against the one-block kernel.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cute_kernels import conv1d, gdn
from cute_kernels.bf16 import round_bf16

from .conftest import assert_close_to_baseline, rel_err

pytestmark = pytest.mark.gpu


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _variant(module, key):
    return next(v for v in module.variants() if v.key == key)


@pytest.mark.parametrize("key,b,t,alias", [("c256_s392", 1, 1, True), ("c256_s392", 1, 2, False),
                                           ("c256_s392", 1, 37, False), ("c256_s392", 3, 1, True),
                                           ("c10240_s16480", 1, 100, False), ("c10240_s16480", 4, 1, True)])
def test_conv1d(library, mem, stream, device, key, b, t, alias):
    v = _variant(conv1d, key)
    c, stride, kc = v.config["C"], v.config["x_stride"], v.config["Kc"]
    rng = np.random.default_rng(b * 100 + t)
    slots = np.array([5, 2, 7, 0][:b])
    ns = 8
    x = _bf(rng, (b * t, stride), 2.0)
    w = _bf(rng, (c, kc), 0.5)
    windows = _bf(rng, (ns, kc - 1, c), 2.0)
    win_out = mem.bf16(windows)
    if alias:
        win_in, slots_in, ni = win_out, slots, ns
    else:
        win_in, slots_in, ni = mem.bf16(windows[slots]), np.arange(b), b
    out = mem.poisoned((b * t + 1) * c)
    library.kernel("conv1d", key).launch(stream, {
        "x": mem.bf16(x), "w": mem.bf16(w), "win_in": win_in, "win_out": win_out,
        "slots_in": mem.i32(slots_in), "slots_out": mem.i32(slots), "out": out},
        {"B": b, "T": t, "NI": ni, "NO": ns})
    got = mem.read_bf16(out, (b * t + 1, c))
    assert np.isnan(got[b * t]).all(), "wrote past the last row"
    xs = x[:, :c].reshape(b, t, c)
    want, want_win = conv1d.reference(xs, windows[slots], w, exact=True)
    base, _ = conv1d.reference(xs, windows[slots], w)
    assert_close_to_baseline(got[:b * t], want.reshape(b * t, c), base.reshape(b * t, c), f"conv1d {key} B={b} T={t}")
    new_windows = mem.read_bf16(win_out, (ns, kc - 1, c))
    np.testing.assert_array_equal(new_windows[slots], want_win)
    untouched = np.setdiff1d(np.arange(ns), slots)
    np.testing.assert_array_equal(new_windows[untouched], windows[untouched])


@pytest.mark.parametrize("key,b,t", [("k2_v4_d32", 1, 1), ("k2_v4_d32", 3, 1), ("k2_v4_d32", 1, 70),
                                     ("k16_v48_d128", 2, 1), ("k16_v48_d128", 1, 20),
                                     # column blocks (a cluster of CTAs per head)
                                     ("k2_v4_d32_c4", 3, 1), ("k2_v4_d32_c2", 1, 70), ("k16_v48_d128_c8", 1, 1),
                                     ("k16_v48_d128_c4", 2, 1), ("k16_v48_d128_c2", 1, 20),
                                     ("k16_v48_d128_c8", 1, 20), ("k16_v32_d128_c8", 3, 1)])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_gdn(library, mem, stream, key, b, t, out_of_place):
    v = _variant(gdn, key)
    cfg = v.config
    hk, hv, dk, dv = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"]
    conv_dim, stride = cfg["conv_dim"], cfg["x_stride"]
    rng = np.random.default_rng(7 * b + t)
    ns = 6
    slots = np.array([4, 1, 3][:b])
    # Out of place: read slots[b], write slots_out[b] (the runner's look-ahead); slots stay intact.
    slots_out = np.array([0, 5, 2][:b]) if out_of_place else slots
    qkv = _bf(rng, (b * t, conv_dim))
    x = _bf(rng, (b * t, stride), 1.5)
    a_log = _bf(rng, (hv,), 0.5)
    dt_bias = _bf(rng, (hv,), 0.5)
    norm_w = round_bf16(1.0 + _bf(rng, (dv,), 0.1))
    state_vk = (rng.standard_normal((ns, hv, dv, dk)) * 0.1).astype(np.float32)
    state_buf = mem.alloc(state_vk.nbytes)
    mem.device.memcpy_htod(state_buf, state_vk, stream)
    out = mem.poisoned((b * t + 1) * hv * dv)
    library.kernel("gdn", key).launch(stream, {
        "qkv": mem.bf16(qkv), "x": mem.bf16(x), "a_log": mem.bf16(a_log), "dt_bias": mem.bf16(dt_bias),
        "norm_w": mem.bf16(norm_w), "state": state_buf, "slots": mem.i32(slots),
        "slots_out": mem.i32(slots_out), "out": out}, {"B": b, "T": t, "NS": ns})
    got = mem.read_bf16(out, (b * t + 1, hv * dv))
    assert np.isnan(got[b * t]).all()
    new_state = np.empty_like(state_vk)
    stream.synchronize()
    mem.device.memcpy_dtoh(new_state, state_buf, stream)
    stream.synchronize()
    for i in range(b):
        rows = slice(i * t, (i + 1) * t)
        z = x[rows, cfg["z_off"]:cfg["z_off"] + hv * dv].reshape(t, hv, dv)
        bb = x[rows, cfg["b_off"]:cfg["b_off"] + hv]
        aa = x[rows, cfg["a_off"]:cfg["a_off"] + hv]
        args = (qkv[rows], z, bb, aa, a_log, dt_bias, norm_w, state_vk[slots[i]])
        want, want_state = gdn.reference(*args, hk=hk, exact=True)
        base, _ = gdn.reference(*args, hk=hk)
        assert_close_to_baseline(got[rows].reshape(t, hv, dv), want, base, f"gdn {key} seq {i} T={t}", slack=2.5)
        assert rel_err(new_state[slots_out[i]], want_state) < 2e-5, f"state of seq {i}"
    untouched = np.setdiff1d(np.arange(ns), slots_out)
    np.testing.assert_array_equal(new_state[untouched], state_vk[untouched])


_COLUMN_VARIANTS = [v.key for v in gdn.variants() if v.config["mode"] == "fused" and v.config["cols"] > 1]


@pytest.mark.parametrize("b,t", [(1, 1), (5, 1), (1, 9)])
@pytest.mark.parametrize("key", _COLUMN_VARIANTS)
def test_gdn_column_blocks_equal_one_block(library, mem, stream, key, b, t):
    """A column-block kernel runs the one-block kernel's arithmetic per row, and adds the norm's
    per-warp partial sums in its order: output and state bit for bit equal to it, at the shapes'
    real sizes, batch 1 (the case column blocks exist for) and more."""
    cfg = _variant(gdn, key).config
    one = next(v.key for v in gdn.variants() if v.config["mode"] == "fused" and v.config["cols"] == 1
               and all(v.config[k] == cfg[k] for k in ("Hk", "Hv", "dk", "dv", "threads")))
    hv, dv = cfg["Hv"], cfg["dv"]
    ns = 10
    # Out of place, the written slots apart from every read one (no sequence reads another's output).
    slots, slots_out = np.array([6, 1, 3, 0, 4][:b]), np.array([2, 5, 7, 8, 9][:b])
    inp = _gdn_inputs(cfg, b, t, ns, 13 * b + t + cfg["cols"])
    common = {"qkv": mem.bf16(inp["qkv"]), "x": mem.bf16(inp["x"]), "a_log": mem.bf16(inp["a_log"]),
              "dt_bias": mem.bf16(inp["dt_bias"]), "norm_w": mem.bf16(inp["norm_w"]), "slots": mem.i32(slots),
              "slots_out": mem.i32(slots_out)}
    got = {}
    for k in (one, key):
        state = mem.alloc(inp["state"].nbytes)
        mem.device.memcpy_htod(state, inp["state"], stream)
        out = mem.poisoned((b * t + 1) * hv * dv)
        library.kernel("gdn", k).launch(stream, {**common, "state": state, "out": out}, {"B": b, "T": t, "NS": ns})
        got[k] = (mem.read_bf16(out, (b * t + 1, hv * dv)), mem.read_f32(state, inp["state"]))
    (out1, state1), (outc, statec) = got[one], got[key]
    assert not np.isnan(outc[:b * t]).any() and np.isnan(outc[b * t]).all(), f"{key}: rows written"
    np.testing.assert_array_equal(outc.view(np.uint32), out1.view(np.uint32), err_msg=f"{key} vs {one}: out")
    np.testing.assert_array_equal(statec.view(np.uint32), state1.view(np.uint32), err_msg=f"{key} vs {one}: state")


def _gdn_inputs(cfg, b, t, ns, seed):
    hv, dv, dk = cfg["Hv"], cfg["dv"], cfg["dk"]
    rng = np.random.default_rng(seed)
    return {
        "qkv": _bf(rng, (b * t, cfg["conv_dim"])),
        "x": _bf(rng, (b * t, cfg["x_stride"]), 1.5),
        "a_log": _bf(rng, (hv,), 0.5),
        "dt_bias": _bf(rng, (hv,), 0.5),
        "norm_w": round_bf16(1.0 + _bf(rng, (dv,), 0.1)),
        "state": (rng.standard_normal((ns, hv, dv, dk)) * 0.1).astype(np.float32),
    }



@pytest.mark.parametrize("fused_key,split_key,norm_key,b,t", [
    ("k2_v4_d32", "k2_v4_d32_s4", "gated_x_h32_v4", 1, 70),
    ("k2_v4_d32", "k2_v4_d32_s4", "gated_x_h32_v4", 3, 5),
    ("k16_v48_d128", "k16_v48_d128_s8", "gated_x_h128_v48", 1, 33),
    ("k16_v32_d128", "k16_v32_d128_s8", "gated_x_h128_v32", 2, 9)])
def test_gdn_split(library, mem, stream, fused_key, split_key, norm_key, b, t):
    from cute_kernels import rmsnorm

    cfg = _variant(gdn, split_key).config
    assert _variant(rmsnorm, norm_key).config["z_stride"] == cfg["x_stride"]
    hk, hv, dv = cfg["Hk"], cfg["Hv"], cfg["dv"]
    ns = 6
    slots = np.array([4, 1, 3][:b])
    inp = _gdn_inputs(cfg, b, t, ns, 11 * b + t)
    qkv, x, state_vk = inp["qkv"], inp["x"], inp["state"]
    common = {"qkv": mem.bf16(qkv), "x": mem.bf16(x), "a_log": mem.bf16(inp["a_log"]),
              "dt_bias": mem.bf16(inp["dt_bias"]), "slots": mem.i32(slots)}
    norm_w = mem.bf16(inp["norm_w"])
    states = {}
    for name in ("fused", "split"):
        states[name] = mem.alloc(state_vk.nbytes)
        mem.device.memcpy_htod(states[name], state_vk, stream)
    fused_out = mem.poisoned((b * t + 1) * hv * dv)
    library.kernel("gdn", fused_key).launch(stream, {**common, "norm_w": norm_w, "state": states["fused"],
                                                      "slots_out": common["slots"], "out": fused_out},
                                            {"B": b, "T": t, "NS": ns})
    o_buf = mem.poisoned((b * t + 1) * hv * dv)
    library.kernel("gdn", split_key).launch(stream, {**common, "state": states["split"], "out": o_buf},
                                            {"B": b, "T": t, "NS": ns})
    o = mem.read_bf16(o_buf, (b * t + 1, hv * dv))
    assert np.isnan(o[b * t]).all(), "wrote past the last row"
    out = mem.poisoned((b * t + 1) * hv * dv)
    library.kernel("rmsnorm", norm_key).launch(stream, {"x": o_buf, "z": common["x"], "w": norm_w, "out": out},
                                               {"M": b * t * hv})
    got = mem.read_bf16(out, (b * t + 1, hv * dv))
    assert np.isnan(got[b * t]).all()
    fused = mem.read_bf16(fused_out, (b * t + 1, hv * dv))
    new_split = mem.read_f32(states["split"], state_vk)
    new_fused = mem.read_f32(states["fused"], state_vk)
    for i in range(b):
        rows = slice(i * t, (i + 1) * t)
        z = x[rows, cfg["z_off"]:cfg["z_off"] + hv * dv].reshape(t, hv, dv)
        bb = x[rows, cfg["b_off"]:cfg["b_off"] + hv]
        aa = x[rows, cfg["a_off"]:cfg["a_off"] + hv]
        core = (qkv[rows], bb, aa, inp["a_log"], inp["dt_bias"], state_vk[slots[i]])
        o_exact, want_state = gdn.reference_core(*core, hk=hk, exact=True)
        o_base, _ = gdn.reference_core(*core, hk=hk)
        what = f"gdn {split_key} seq {i} T={t}"
        assert_close_to_baseline(o[rows].reshape(t, hv, dv), o_exact, o_base, what + " o", slack=2.5)
        full = (qkv[rows], z, bb, aa, inp["a_log"], inp["dt_bias"], inp["norm_w"], state_vk[slots[i]])
        want, _ = gdn.reference(*full, hk=hk, exact=True)
        base, _ = gdn.reference(*full, hk=hk)
        assert_close_to_baseline(got[rows].reshape(t, hv, dv), want, base, what + " out", slack=2.5)
        assert rel_err(new_split[slots[i]], want_state) < 2e-5, f"state of seq {i}"
    untouched = np.setdiff1d(np.arange(ns), slots)
    np.testing.assert_array_equal(new_split[untouched], state_vk[untouched])
    # Against the fused kernel on the same inputs: the same state arithmetic; the output may differ
    # by the norm's summation order (an ulp of bf16 in a few elements).
    assert rel_err(new_split[slots], new_fused[slots]) < 1e-6
    g, f = got[:b * t], fused[:b * t]
    differ = int(np.count_nonzero(g != f))
    ulp = np.abs(g.astype(np.float64) - f) / np.maximum(np.abs(f.astype(np.float64)), 1e-30)
    stats = {"split": split_key, "B": b, "T": t, "state_bitwise_equal": bool(np.array_equal(new_split, new_fused)),
             "out_elements_differing": differ, "out_elements": int(g.size), "out_max_rel_diff": float(ulp.max())}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gdn_split_vs_fused.jsonl"), "a") as fh:
            fh.write(json.dumps(stats) + "\n")
    assert differ <= max(g.size // 100, 1), stats
    assert float(ulp.max()) <= 2 ** -5, stats
