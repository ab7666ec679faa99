"""The causal conv1d and the recurrent Gated DeltaNet kernels against their NumPy references.

Fresh random inputs, poisoned outputs (NaN: an element the kernel forgets stays NaN), a random
initial window and state (a continued sequence), odd lengths, and several sequences in one launch
that use scattered slots of the pool. Outputs must be within 2x the error of the same-precision
baseline (fp32 maths with the model's bf16 roundings) against a float64 reference; states and
windows are compared directly.
"""

from __future__ import annotations

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
                                     ("k16_v48_d128", 2, 1), ("k16_v48_d128", 1, 20)])
def test_gdn(library, mem, stream, key, b, t):
    v = _variant(gdn, key)
    cfg = v.config
    hk, hv, dk, dv = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"]
    conv_dim, stride = cfg["conv_dim"], cfg["x_stride"]
    rng = np.random.default_rng(7 * b + t)
    ns = 6
    slots = np.array([4, 1, 3][:b])
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
        "norm_w": mem.bf16(norm_w), "state": state_buf, "slots": mem.i32(slots), "out": out},
        {"B": b, "T": t, "NS": ns})
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
        assert rel_err(new_state[slots[i]], want_state) < 2e-5, f"state of seq {i}"
    untouched = np.setdiff1d(np.arange(ns), slots)
    np.testing.assert_array_equal(new_state[untouched], state_vk[untouched])
