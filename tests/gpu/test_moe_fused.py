"""The `moe` family's `fused` kernel (cute_kernels/moe_fused_kernel.py: one row's routing, experts'
gate/up and down + combine in one launch of S CTAs that meet once through two counters) on a real
GPU, against the split form bit for bit (the same operations in the same order): ids, routing
weights, act and the delta row, over tied logits too, at S = the SM count and at S = 5 (each
warp's share of the items changes, the numbers must not), launched twice (the counters are back
at zero after each launch, and the second launch gives the same row). The Next-80B's variant (11
slots of down rows: a 2-stage ring) routes its 512 logits on a zero expert stack, as
test_moe_kernels.py's route_up test does.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import moe

from .test_moe_kernels import (SHAPES, WEIGHTED, _bf, _f32, _f32_poisoned, _key, _split_route_up, _tied_logits,
                               _weights, weights_on_device)

pytestmark = pytest.mark.gpu
__all__ = ["weights_on_device"]  # the module fixture, shared with test_moe_kernels.py


def _fused_key(name: str) -> str:
    _, h, e, k, inter, _, _ = SHAPES[name]
    return next(v.key for v in moe.variants() if v.config["kind"] == "fused"
                and (v.config["H"], v.config["E"], v.config["K"], v.config["I"]) == (h, e, k, inter))


def _fused(library, mem, stream, name, logits, x, w_sg, d_gate_up, d_down, ctas, sync):
    """One fused launch over one row's logits [1, E]: ids, wts, act, delta row (NaN-poisoned first)."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    p = k + 1
    ids = mem.i32(np.full(p, -7))
    wts, act, out = _f32_poisoned(mem, p), mem.poisoned(p * inter), mem.poisoned(h)
    library.kernel("moe", _fused_key(name)).launch(
        stream, {"logits": _f32(mem, logits), "x": mem.bf16(x), "w_sg": mem.bf16(w_sg), "w": d_gate_up,
                 "w_down": d_down, "ids": ids, "wts": wts, "act": act, "out": out, "sync": sync},
        {"M": 1, "S": ctas})
    counters = mem.read_i32(sync, 2)
    np.testing.assert_array_equal(counters, [0, 0], err_msg="the grid counters were left set")
    return (mem.read_i32(ids, p).reshape(1, p), mem.read_f32(wts, np.empty((1, p))),
            mem.read_bf16(act, (1, p, inter)), mem.read_bf16(out, (1, h)))


def _split_down(library, mem, stream, name, ids, wts, act, d_down):
    """The split form's down over given ids, weights and act: the delta rows."""
    _, h, _, _, _, _, _ = SHAPES[name]
    m = ids.shape[0]
    out = mem.poisoned(m * h)
    library.kernel("moe", _key("down", name)).launch(stream, {"act": mem.bf16(act), "w": d_down, "ids": mem.i32(ids),
                                                           "wts": _f32(mem, wts), "out": out}, {"M": m})
    return mem.read_bf16(out, (m, h))


@pytest.mark.parametrize("name", WEIGHTED)
def test_fused_equals_the_split_form(library, mem, stream, device, weights_on_device, name):
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(510)
    x = _bf(rng, (4, h))
    router, w_sg, _, _ = _weights(name)
    _, _, d_gate_up, d_down = weights_on_device(name)
    logits = moe.reference_logits(x, router).astype(np.float32)
    logits[1] = 0.25  # every expert tied: the first k ids win
    logits[2, [3, 1, e - 1, e // 2]] = 9.0  # a four-way tie at the top
    sync = mem.i32(np.zeros(2))
    for r in range(x.shape[0]):
        row, lg = x[r:r + 1], logits[r:r + 1]
        ids, wts, act = _split_route_up(library, mem, stream, name, lg, row, w_sg, d_gate_up)
        want = (ids, wts, act, _split_down(library, mem, stream, name, ids, wts, act, d_down))
        assert np.isfinite(want[3]).all()
        for ctas in (device.sm_count, 5, device.sm_count):
            got = _fused(library, mem, stream, name, lg, row, w_sg, d_gate_up, d_down, ctas, sync)
            for what, a, b in zip(("ids", "wts", "act", "delta"), got, want):
                np.testing.assert_array_equal(a, b, err_msg=f"{name} row {r} S={ctas} {what}")


@pytest.mark.parametrize("ctas", [None, 3])
def test_fused_routes_the_80b_top_10_of_512(library, mem, stream, device, ctas):
    """The Next-80B's fused variant on a zero expert stack (2.2 GB set on the device, standing in
    for the down stack too): ids and weights the route kernel's bit for bit, act and delta zero."""
    name = "next80b"
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(520)
    logits = _tied_logits(rng, 4, e)[1:2]  # every logit equal: the first k ids win
    x = _bf(rng, (1, h))
    w_sg = _bf(rng, (h,), h ** -0.5)
    count = (e + 1) * 2 * inter * h
    d_zero = mem.alloc(2 * count)
    mem.device.memset_d16(d_zero, 0, count, mem.stream)
    want_ids, want_wts = moe.reference_route(logits, x, w_sg, k, renorm)
    ids, wts, act, out = _fused(library, mem, stream, name, logits, x, w_sg, d_zero, d_zero,
                                ctas or device.sm_count, mem.i32(np.zeros(2)))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(wts[:, :k], want_wts[:, :k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(wts[:, k], want_wts[:, k], rtol=1e-5)
    np.testing.assert_array_equal(act, 0.0)
    np.testing.assert_array_equal(out, 0.0)
