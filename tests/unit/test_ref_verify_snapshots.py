"""The `verify` mode of the conv1d and gdn families on the CPU: declarations and references.

A verification step runs t tokens of a sequence in one launch and keeps the state after each
token (a snapshot per row). Its references (`conv1d.reference(snapshots=True)`,
`gdn.reference_snapshots`) must give, for every token, exactly what t single-token steps give,
each starting from the state the step before left: bit for bit, at the kernels' precision
(bf16 roundings) and in float64. The GPU tests then hold the kernels to the same standard
against the decode kernels (tests/gpu/test_gdn_verify.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import conv1d, gdn
from cute_kernels.bf16 import round_bf16


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _pairs(module):
    """(decode variant, its `verify` variant) for every decode shape of the family."""
    by_key = {v.key: v for v in module.variants()}
    decode_mode = {"conv1d": "chunk", "gdn": "fused"}[module.FAMILY]
    return [(v, by_key[v.key + module.VERIFY_SUFFIX]) for v in by_key.values() if v.config["mode"] == decode_mode]


@pytest.mark.parametrize("module", [conv1d, gdn], ids=lambda m: m.FAMILY)
def test_every_decode_shape_has_a_verify_variant_of_the_same_shape(module):
    pairs = _pairs(module)
    # tiny model, Qwen3.6-27B, 35B-A3B; the GDN's in 3, 4 and 4 column-block counts
    assert len(pairs) == (3 if module is conv1d else 11)
    for dec, ver in pairs:
        assert ver.config["mode"] == "verify"
        # Same shape (so `KernelChoice` finds it by the decode kernel's config) and, for the
        # GDN, the same threads and epsilons: the same per-token code.
        shape_keys = set(dec.config) - {"mode", "tokens_per_thread"}
        assert {k: ver.config[k] for k in shape_keys} == {k: dec.config[k] for k in shape_keys}
        assert ver.tensors["slots_out"].shape == ("B * T",)  # a snapshot slot per row
        assert ver.tensors["slots_in" if module is conv1d else "slots"].shape == ("B",)
        assert ver.block == dec.block
        if module is gdn:  # a GDN pair also has the same grid and cluster (column blocks)
            assert (ver.grid, ver.cluster) == (dec.grid, dec.cluster)


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 5, 8])
def test_conv1d_snapshots_equal_single_steps(exact, steps):
    rng = np.random.default_rng(steps)
    b, c, kc = 3, 40, 4
    x = _bf(rng, (b, steps, c), 2.0)
    window = _bf(rng, (b, kc - 1, c), 2.0)
    w = _bf(rng, (c, kc), 0.5)
    out, windows = conv1d.reference(x, window, w, exact=exact, snapshots=True)
    assert windows.shape == (b, steps, kc - 1, c)
    win = window
    for t in range(steps):
        y, win = conv1d.reference(x[:, t:t + 1], win, w, exact=exact)
        np.testing.assert_array_equal(out[:, t:t + 1], y)
        np.testing.assert_array_equal(windows[:, t], win)
    # The last snapshot is the window a chunk of all the tokens leaves.
    np.testing.assert_array_equal(windows[:, -1], conv1d.reference(x, window, w, exact=exact)[1])


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("hk,hv,dk,dv,steps", [(2, 4, 32, 32, 1), (2, 4, 32, 32, 8), (16, 48, 128, 128, 3)])
def test_gdn_snapshots_equal_single_steps(exact, hk, hv, dk, dv, steps):
    rng = np.random.default_rng(hv + steps)
    lay = gdn.layout(hk, hv, dk, dv)
    qkv = _bf(rng, (steps, lay["conv_dim"]))
    z = _bf(rng, (steps, hv, dv), 1.5)
    bb, aa = _bf(rng, (steps, hv), 1.5), _bf(rng, (steps, hv), 1.5)
    a_log, dt_bias = _bf(rng, (hv,), 0.5), _bf(rng, (hv,), 0.5)
    norm_w = round_bf16(1.0 + _bf(rng, (dv,), 0.1))
    state = (rng.standard_normal((hv, dv, dk)) * 0.1).astype(np.float32)
    out, states = gdn.reference_snapshots(qkv, z, bb, aa, a_log, dt_bias, norm_w, state, hk=hk, exact=exact)
    assert out.shape == (steps, hv, dv) and states.shape == (steps, hv, dv, dk)
    s = state
    for t in range(steps):
        one = slice(t, t + 1)
        y, s = gdn.reference(qkv[one], z[one], bb[one], aa[one], a_log, dt_bias, norm_w, s, hk=hk, exact=exact)
        np.testing.assert_array_equal(out[one], y)
        np.testing.assert_array_equal(states[t], s)
    # And the tokens are not all alike: every snapshot differs from the one before.
    assert all(not np.array_equal(states[t], states[t - 1]) for t in range(1, steps))
    # The last snapshot is the state the `fused` reference of all the tokens leaves.
    _, last = gdn.reference(qkv, z, bb, aa, a_log, dt_bias, norm_w, state, hk=hk, exact=exact)
    np.testing.assert_array_equal(states[-1], last)
