"""The `moe` kernels (cute_kernels/moe.py) against their NumPy references on a real GPU.

Per MoE shape we serve (the tiny test model's, the 35B-A3B's and the Next-80B's): router logits;
routing with tied logits, a row of equal logits and renormalised weights (for the 80B also
`route_up`'s routing, on a zero expert stack). Per shape but the 80B's (`WEIGHTED`): the experts' gate/up and down with ids
that leave experts without a row and with one expert taking every row; the four kernels chained,
each row computed alone equal to the batch bit for bit. The decode form (every compiled
logits_wide, route_up, up_wide and down_wide variant): against the same references, and equal to
the split form bit for bit (same operations in the same order), chained and row by row.
Outputs are poisoned with NaN first (an element a kernel forgets stays NaN) with one poisoned row
past M that must stay untouched.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cute_kernels import bf16, moe
from cute_kernels.bf16 import round_bf16

from .conftest import Mem, assert_close_to_baseline, rel_err

pytestmark = pytest.mark.gpu

SHAPES = {shape[0]: shape for shape in moe.SHAPES}
# The shapes whose expert kernels are checked: the 80B's stacks (513 experts of 3 x 512 x 2048, 1.6 G
# values) would take most of the suite's time to draw and upload; its kernels are the 35B-A3B's
# code with E = 512 and k = 10, which its router logits and routing tests cover.
WEIGHTED = [name for name in SHAPES if name != "next80b"]


def _of(name: str, v) -> bool:
    """Whether variant v is of shape `name` (the 35B-A3B and the 80B share H: E tells them apart)."""
    _, h, e, k, _, _, _ = SHAPES[name]
    return (v.config["H"], v.config["E"]) == (h, e) and v.config.get("K", k) == k


def _key(kind: str, name: str) -> str:
    return next(v.key for v in moe.variants() if v.config["kind"] == kind and _of(name, v))


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _f32(mem, values) -> int:
    arr = np.ascontiguousarray(values, np.float32)
    ptr = mem.alloc(arr.nbytes)
    mem.device.memcpy_htod(ptr, arr, mem.stream)
    mem.stream.synchronize()
    return ptr


def _f32_poisoned(mem, count: int) -> int:
    return _f32(mem, np.full(count, np.nan, np.float32))


def _bf_stack(rng, shape, scale):
    """`_bf(rng, shape, scale)` drawn one expert at a time: the same values (the generator's stream
    is read in the same order) without a float64 temporary of the whole stack (6.5 GB for the
    35B-A3B's gate_up)."""
    out = np.empty(shape, np.float32)
    for ex in range(shape[0]):
        out[ex] = _bf(rng, shape[1:], scale)
    return out


@functools.lru_cache(maxsize=len(WEIGHTED))
def _weights(name):
    """Router [E, H], shared gate [H], gate_up [E + 1, 2I, H], down [E + 1, H, I] (1/sqrt(fan_in)),
    drawn once per shape (the 35B-A3B's stacks are 0.8 G values)."""
    _, h, e, _, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(99)
    return (_bf(rng, (e, h), h ** -0.5), _bf(rng, (h,), h ** -0.5), _bf_stack(rng, (e + 1, 2 * inter, h), h ** -0.5),
            _bf_stack(rng, (e + 1, h, inter), inter ** -0.5))


def _bits_by_expert(stack):
    """`bf16.to_bits(stack)` one expert at a time: the same bits without stack-sized uint32
    temporaries, whose page faults alone cost seconds for the 35B-A3B's gate_up."""
    bits = np.empty(stack.shape, np.uint16)
    for ex, weights in enumerate(stack):
        bits[ex] = bf16.to_bits(weights)
    return bits


@pytest.fixture(scope="module")
def weights_on_device(device, stream):
    """name -> `_weights(name)` as device bf16 pointers, uploaded on a shape's first use and kept
    until the module ends (at most the tiny shape's and the 35B-A3B's, 1.6 GB): converting the
    35B-A3B's stacks to bf16 and copying them is seconds of CPU, which every test paid again when
    it uploaded its own copy. The kernels only read them."""
    held = Mem(device, stream)
    uploaded = {}

    def on_device(name):
        if name not in uploaded:
            router, w_sg, gate_up, down = _weights(name)
            uploaded[name] = [held.bf16(router), held.bf16(w_sg), held.raw(_bits_by_expert(gate_up)),
                              held.raw(_bits_by_expert(down))]
        return uploaded[name]

    yield on_device
    held.free()


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_logits(library, mem, stream, name, m):
    _, h, e, _, _, _, _ = SHAPES[name]
    rng = np.random.default_rng(m)
    x = _bf(rng, (m, h))
    router = _bf(rng, (e, h), h ** -0.5)
    out = _f32_poisoned(mem, (m + 1) * e)
    library.kernel("moe", _key("logits", name)).launch(stream, {"x": mem.bf16(x), "w": mem.bf16(router), "out": out},
                                                    {"M": m})
    got = mem.read_f32(out, np.empty((m + 1, e))).astype(np.float64)
    assert np.isnan(got[m]).all(), "the row past M was written"
    want = moe.reference_logits(x, router)
    # fp32 sums of H bf16 products against float64: a few fp32 ulps of the row's magnitude.
    assert rel_err(got[:m], want) < 1e-5, rel_err(got[:m], want)


def _route(library, mem, stream, name, logits, x, w_sg):
    _, h, e, k, _, _, _ = SHAPES[name]
    m = logits.shape[0]
    ids = mem.i32(np.full((m + 1) * (k + 1), -7))
    wts = _f32_poisoned(mem, (m + 1) * (k + 1))
    library.kernel("moe", _key("route", name)).launch(
        stream, {"logits": _f32(mem, logits), "x": mem.bf16(x), "w_sg": mem.bf16(w_sg), "ids": ids, "wts": wts},
        {"M": m})
    got_ids = mem.read_i32(ids, (m + 1) * (k + 1)).reshape(m + 1, k + 1)
    got_wts = mem.read_f32(wts, np.empty((m + 1, k + 1)))
    assert (got_ids[m] == -7).all() and np.isnan(got_wts[m]).all(), "the row past M was written"
    return got_ids[:m], got_wts[:m]


@pytest.mark.parametrize("name", SHAPES)
def test_route_ties_and_weights(library, mem, stream, name):
    _, h, e, k, _, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(7)
    m = 6
    logits = rng.standard_normal((m, e)).astype(np.float32)
    logits[1] = 0.25  # every expert tied: the first k ids win
    logits[2, [3, 1, e - 1, e // 2]] = 9.0  # a four-way tie at the top: ascending ids
    logits[3, ::2] = logits[3, 1::2]  # pairs of equal logits everywhere
    x = _bf(rng, (m, h))
    w_sg = _bf(rng, (h,), h ** -0.5)
    ids, wts = _route(library, mem, stream, name, logits, x, w_sg)
    want_ids, want_wts = moe.reference_route(logits, x, w_sg, k, renorm)
    print("ids", ids.tolist(), "want", want_ids.tolist())  # shown on failure
    np.testing.assert_array_equal(ids, want_ids)
    assert ids[1, :k].tolist() == list(range(k))
    # Weights: fp32 with the fast exp (ex2.approx on x * log2 e: a few 1e-7 relative for the
    # logit gaps here) and one division; the shared gate: an fp32 dot product over H terms, then a
    # sigmoid. 1e-5 leaves a margin and is far below what the bf16 model notices.
    np.testing.assert_allclose(wts[:, :k], want_wts[:, :k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(wts[:, k], want_wts[:, k], rtol=1e-5)
    if renorm:
        np.testing.assert_allclose(wts[:, :k].sum(-1), 1.0, rtol=1e-5)


def _exact_act(x, gate_up, ids):
    """silu(gate) * up of every (row, slot) in float64, nothing rounded."""
    inter = gate_up.shape[1] // 2
    full = np.stack([[gate_up[ex].astype(np.float64) @ x[r].astype(np.float64) for ex in row]
                     for r, row in enumerate(ids)])
    g, u = full[..., :inter], full[..., inter:]
    return g / (1.0 + np.exp(-g)) * u


def _ids_cases(rng, m, e, k):
    """Routed ids per row (distinct within a row), then the shared expert E: random (several
    experts get no row), and one expert set taking every row."""
    rand = np.stack([rng.permutation(e)[:k] for _ in range(m)])
    same = np.broadcast_to(rng.permutation(e)[:k], (m, k))
    shared = np.full((m, 1), e)
    return {"random": np.concatenate([rand, shared], 1), "all_rows_one_set": np.concatenate([same, shared], 1)}


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_up_and_down(library, mem, stream, weights_on_device, name, m):
    _, h, e, k, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(100 + m)
    p = k + 1
    _, _, gate_up, down = _weights(name)
    _, _, d_gate_up, d_down = weights_on_device(name)
    x = _bf(rng, (m, h))
    d_x = mem.bf16(x)
    for case, ids in _ids_cases(rng, m, e, k).items():
        act = mem.poisoned((m + 1) * p * inter)
        d_ids = mem.i32(ids)
        library.kernel("moe", _key("up", name)).launch(stream, {"x": d_x, "w": d_gate_up, "ids": d_ids, "act": act},
                                                    {"M": m})
        got = mem.read_bf16(act, (m + 1, p, inter))
        assert np.isnan(got[m]).all(), "the row past M was written"
        assert_close_to_baseline(got[:m], _exact_act(x, gate_up, ids), moe.reference_up(x, gate_up, ids),
                                 f"{name} up {case} M={m}")

        wts = rng.uniform(0.05, 1.0, (m, p)).astype(np.float32)
        act_in = _bf(rng, (m, p, inter))
        out = mem.poisoned((m + 1) * h)
        library.kernel("moe", _key("down", name)).launch(
            stream, {"act": mem.bf16(act_in), "w": d_down, "ids": d_ids, "wts": _f32(mem, wts), "out": out}, {"M": m})
        got = mem.read_bf16(out, (m + 1, h))
        assert np.isnan(got[m]).all(), "the row past M was written"
        assert_close_to_baseline(got[:m], moe.reference_down(act_in, down, ids, wts, exact=True),
                                 moe.reference_down(act_in, down, ids, wts), f"{name} down {case} M={m}")


def _chain(library, mem, stream, name, x, weights):
    """The four kernels over the rows of x, weights as device pointers; returns (ids, delta rows)."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    m, p = x.shape[0], k + 1
    router, w_sg, gate_up, down = weights
    bufs = {"x": mem.bf16(x), "logits": _f32_poisoned(mem, m * e), "ids": mem.i32(np.zeros(m * p)),
            "wts": _f32_poisoned(mem, m * p), "act": mem.poisoned(m * p * inter), "out": mem.poisoned(m * h)}
    run = library.kernel
    run("moe", _key("logits", name)).launch(stream, {"x": bufs["x"], "w": router, "out": bufs["logits"]}, {"M": m})
    run("moe", _key("route", name)).launch(stream, {"logits": bufs["logits"], "x": bufs["x"], "w_sg": w_sg,
                                                 "ids": bufs["ids"], "wts": bufs["wts"]}, {"M": m})
    run("moe", _key("up", name)).launch(stream, {"x": bufs["x"], "w": gate_up, "ids": bufs["ids"],
                                              "act": bufs["act"]}, {"M": m})
    run("moe", _key("down", name)).launch(stream, {"act": bufs["act"], "w": down, "ids": bufs["ids"],
                                                "wts": bufs["wts"], "out": bufs["out"]}, {"M": m})
    return mem.read_i32(bufs["ids"], m * p).reshape(m, p), mem.read_bf16(bufs["out"], (m, h))


@pytest.mark.parametrize("name", WEIGHTED)
def test_chained_mlp_and_rows_alone(library, mem, stream, weights_on_device, name):
    """Logits -> route -> up -> down on 8 rows against `moe.reference` (same routing expected:
    fp32 logits, so a flip needs two logits within fp32 rounding), and each row alone equal to
    its row in the batch bit for bit."""
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(42)
    x = _bf(rng, (8, h))
    weights = _weights(name)
    on_device = weights_on_device(name)
    ids, got = _chain(library, mem, stream, name, x, on_device)
    router, w_sg, gate_up, down = weights
    want_ids, want_wts = moe.reference_route(moe.reference_logits(x, router), x, w_sg, k, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    exact = moe.reference_down(_exact_act(x, gate_up, want_ids), down, want_ids, want_wts, exact=True)
    assert_close_to_baseline(got, exact, moe.reference(x, router, w_sg, gate_up, down, k, renorm),
                             f"{name} chained")
    for r in (0, 3, 7):
        _, alone = _chain(library, mem, stream, name, x[r:r + 1], on_device)
        np.testing.assert_array_equal(alone[0], got[r])


# --- the decode form: route_up and down_wide (every compiled variant) ----------------------------

def _form_keys(kind: str, name: str) -> list[str]:
    return [v.key for v in moe.variants() if v.config["kind"] == kind and _of(name, v)]


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_logits_wide_equals_logits(library, mem, stream, name, m):
    """logits_wide: the reference's logits as `logits` is, and `logits`'s bit for bit (the same
    sums in the same order, only the loads staged); the row past M stays untouched."""
    _, h, e, _, _, _, _ = SHAPES[name]
    rng = np.random.default_rng(300 + m)
    x = _bf(rng, (m, h))
    router = _bf(rng, (e, h), h ** -0.5)
    got = {}
    for kind in ("logits", "logits_wide"):
        out = _f32_poisoned(mem, (m + 1) * e)
        library.kernel("moe", _key(kind, name)).launch(stream, {"x": mem.bf16(x), "w": mem.bf16(router), "out": out},
                                                    {"M": m})
        got[kind] = mem.read_f32(out, np.empty((m + 1, e)))
        assert np.isnan(got[kind][m]).all(), f"{kind}: the row past M was written"
    want = moe.reference_logits(x, router)
    assert rel_err(got["logits_wide"][:m].astype(np.float64), want) < 1e-5
    np.testing.assert_array_equal(got["logits_wide"], got["logits"])


def _route_up(library, mem, stream, name, key, logits, x, w_sg, d_gate_up):
    """ids, wts, act of one route_up launch over the rows of logits; checks the row past M."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    m, p = logits.shape[0], k + 1
    ids = mem.i32(np.full((m + 1) * p, -7))
    wts = _f32_poisoned(mem, (m + 1) * p)
    act = mem.poisoned((m + 1) * p * inter)
    library.kernel("moe", key).launch(stream, {"logits": _f32(mem, logits), "x": mem.bf16(x), "w_sg": mem.bf16(w_sg),
                                               "w": d_gate_up, "ids": ids, "wts": wts, "act": act}, {"M": m})
    got_ids = mem.read_i32(ids, (m + 1) * p).reshape(m + 1, p)
    got_wts = mem.read_f32(wts, np.empty((m + 1, p)))
    got_act = mem.read_bf16(act, (m + 1, p, inter))
    assert (got_ids[m] == -7).all() and np.isnan(got_wts[m]).all() and np.isnan(got_act[m]).all(), \
        "the row past M was written"
    return got_ids[:m], got_wts[:m], got_act[:m]


def _split_route_up(library, mem, stream, name, logits, x, w_sg, d_gate_up):
    """The split form's route then up on the same inputs: ids, wts, act."""
    _, h, _, k, inter, _, _ = SHAPES[name]
    m = logits.shape[0]
    ids, wts = _route(library, mem, stream, name, logits, x, w_sg)
    act = mem.poisoned(m * (k + 1) * inter)
    library.kernel("moe", _key("up", name)).launch(stream, {"x": mem.bf16(x), "w": d_gate_up, "ids": mem.i32(ids),
                                                         "act": act}, {"M": m})
    return ids, wts, mem.read_bf16(act, (m, k + 1, inter))


def _tied_logits(rng, m, e):
    logits = rng.standard_normal((m, e)).astype(np.float32)
    if m >= 4:
        logits[1] = 0.25  # every expert tied: the first k ids win
        logits[2, [3, 1, e - 1, e // 2]] = 9.0  # a four-way tie at the top: ascending ids
        logits[3, ::2] = logits[3, 1::2]  # pairs of equal logits everywhere
    return logits


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [1, 6, 8])
def test_route_up_against_the_references(library, mem, stream, weights_on_device, name, m):
    """Ids exactly the reference's (ties included: rows 1-3 at m >= 4), weights as tight as
    `route`'s test, act as close to the exact act as the bf16 reference is, for every
    route_up variant."""
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(70 + m)
    logits = _tied_logits(rng, m, e)
    x = _bf(rng, (m, h))
    _, w_sg, gate_up, _ = _weights(name)
    d_gate_up = weights_on_device(name)[2]
    want_ids, want_wts = moe.reference_route(logits, x, w_sg, k, renorm)
    exact, base = _exact_act(x, gate_up, want_ids), moe.reference_up(x, gate_up, want_ids)
    for key in _form_keys("route_up", name):
        ids, wts, act = _route_up(library, mem, stream, name, key, logits, x, w_sg, d_gate_up)
        print(key, "ids", ids.tolist(), "want", want_ids.tolist())  # shown on failure
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(wts[:, :k], want_wts[:, :k], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(wts[:, k], want_wts[:, k], rtol=1e-5)
        assert_close_to_baseline(act, exact, base, f"{key} act M={m}")


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [1, 6, 8])
def test_route_up_equals_the_split_form(library, mem, stream, weights_on_device, name, m):
    """route_up computes route's and up's numbers with the same operations in the same order:
    ids, weights and act equal to the split form's bit for bit."""
    _, h, e, _, _, _, _ = SHAPES[name]
    rng = np.random.default_rng(80 + m)
    logits = _tied_logits(rng, m, e)
    x = _bf(rng, (m, h))
    w_sg = _weights(name)[1]
    d_gate_up = weights_on_device(name)[2]
    split = _split_route_up(library, mem, stream, name, logits, x, w_sg, d_gate_up)
    for key in _form_keys("route_up", name):
        fused = _route_up(library, mem, stream, name, key, logits, x, w_sg, d_gate_up)
        for what, a, b in zip(("ids", "wts", "act"), fused, split):
            np.testing.assert_array_equal(a, b, err_msg=f"{key} {what} M={m}")


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_down_wide_equals_down(library, mem, stream, weights_on_device, name, m):
    """Every down_wide variant against `down` bit for bit (same sums, same order) and against the
    reference as `down` is, with ids leaving experts without a row and one expert set taking
    every row; the row past M stays untouched."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(200 + m)
    p = k + 1
    down = _weights(name)[3]
    d_down = weights_on_device(name)[3]
    for case, ids in _ids_cases(rng, m, e, k).items():
        wts = rng.uniform(0.05, 1.0, (m, p)).astype(np.float32)
        act_in = _bf(rng, (m, p, inter))
        exact, base = moe.reference_down(act_in, down, ids, wts, exact=True), moe.reference_down(act_in, down, ids, wts)
        bufs = {"act": mem.bf16(act_in), "w": d_down, "ids": mem.i32(ids), "wts": _f32(mem, wts)}
        outs = {}
        for key in [_key("down", name)] + _form_keys("down_wide", name):
            out = mem.poisoned((m + 1) * h)
            library.kernel("moe", key).launch(stream, {**bufs, "out": out}, {"M": m})
            outs[key] = mem.read_bf16(out, (m + 1, h))
            assert np.isnan(outs[key][m]).all(), f"{key}: the row past M was written"
        split = outs.pop(_key("down", name))
        for key, got in outs.items():
            np.testing.assert_array_equal(got[:m], split[:m], err_msg=f"{key} {case} M={m}")
            assert_close_to_baseline(got[:m], exact, base, f"{key} {case} M={m}")


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_up_wide_equals_up(library, mem, stream, weights_on_device, name, m):
    """Every up_wide variant against `up` bit for bit (the same dot products, only the loads
    staged) and against the reference as `up` is, for random ids and one expert set taking every
    row; the row past M stays untouched."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(400 + m)
    p = k + 1
    gate_up = _weights(name)[2]
    x = _bf(rng, (m, h))
    d_gate_up, d_x = weights_on_device(name)[2], mem.bf16(x)
    for case, ids in _ids_cases(rng, m, e, k).items():
        exact, base = _exact_act(x, gate_up, ids), moe.reference_up(x, gate_up, ids)
        d_ids = mem.i32(ids)
        outs = {}
        for key in [_key("up", name)] + _form_keys("up_wide", name):
            act = mem.poisoned((m + 1) * p * inter)
            library.kernel("moe", key).launch(stream, {"x": d_x, "w": d_gate_up, "ids": d_ids, "act": act}, {"M": m})
            outs[key] = mem.read_bf16(act, (m + 1, p, inter))
            assert np.isnan(outs[key][m]).all(), f"{key}: the row past M was written"
        split = outs.pop(_key("up", name))
        for key, got in outs.items():
            np.testing.assert_array_equal(got[:m], split[:m], err_msg=f"{key} {case} M={m}")
            assert_close_to_baseline(got[:m], exact, base, f"{key} {case} M={m}")


def _decode_chain(library, mem, stream, name, x, weights, route_up_key, down_key):
    """logits_wide -> route_up (or route -> up_wide) -> down_wide over the rows of x; returns (ids,
    delta rows)."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    m, p = x.shape[0], k + 1
    router, w_sg, gate_up, down = weights
    bufs = {"x": mem.bf16(x), "logits": _f32_poisoned(mem, m * e), "ids": mem.i32(np.zeros(m * p)),
            "wts": _f32_poisoned(mem, m * p), "act": mem.poisoned(m * p * inter), "out": mem.poisoned(m * h)}
    run = library.kernel
    run("moe", _key("logits_wide", name)).launch(stream, {"x": bufs["x"], "w": router, "out": bufs["logits"]},
                                              {"M": m})
    if route_up_key.startswith("route_up"):
        run("moe", route_up_key).launch(stream, {"logits": bufs["logits"], "x": bufs["x"], "w_sg": w_sg, "w": gate_up,
                                                 "ids": bufs["ids"], "wts": bufs["wts"], "act": bufs["act"]}, {"M": m})
    else:  # route, then up_wide
        run("moe", _key("route", name)).launch(stream, {"logits": bufs["logits"], "x": bufs["x"], "w_sg": w_sg,
                                                     "ids": bufs["ids"], "wts": bufs["wts"]}, {"M": m})
        run("moe", route_up_key).launch(stream, {"x": bufs["x"], "w": gate_up, "ids": bufs["ids"],
                                                 "act": bufs["act"]}, {"M": m})
    run("moe", down_key).launch(stream, {"act": bufs["act"], "w": down, "ids": bufs["ids"], "wts": bufs["wts"],
                                         "out": bufs["out"]}, {"M": m})
    return mem.read_i32(bufs["ids"], m * p).reshape(m, p), mem.read_bf16(bufs["out"], (m, h))


@pytest.mark.parametrize("name", WEIGHTED)
def test_decode_form_chain_and_rows_alone(library, mem, stream, weights_on_device, name):
    """logits_wide -> route_up or route + up_wide -> down_wide (every decode form) on 8 rows: the
    split chain's ids and delta rows bit for bit, close to `moe.reference`, and each row alone
    equal to its row in the batch."""
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(43)
    x = _bf(rng, (8, h))
    weights = _weights(name)
    on_device = weights_on_device(name)
    split_ids, split = _chain(library, mem, stream, name, x, on_device)
    router, w_sg, gate_up, down = weights
    want_ids, want_wts = moe.reference_route(moe.reference_logits(x, router), x, w_sg, k, renorm)
    exact = moe.reference_down(_exact_act(x, gate_up, want_ids), down, want_ids, want_wts, exact=True)
    baseline = moe.reference(x, router, w_sg, gate_up, down, k, renorm)
    for ru in _form_keys("route_up", name) + _form_keys("up_wide", name):
        for dw in _form_keys("down_wide", name):
            ids, got = _decode_chain(library, mem, stream, name, x, on_device, ru, dw)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(ids, split_ids)
            assert_close_to_baseline(got, exact, baseline, f"{name} {ru} {dw} chained")
            np.testing.assert_array_equal(got, split, err_msg=f"{ru} {dw} vs the split chain")
            for r in (0, 5):
                _, alone = _decode_chain(library, mem, stream, name, x[r:r + 1], on_device, ru, dw)
                np.testing.assert_array_equal(alone[0], got[r])


@pytest.mark.parametrize("m", [1, 8])
def test_route_up_routes_the_80b_top_10_of_512(library, mem, stream, m):
    """The Next-80B's route_up variants (512 logits ranked in 16 groups of 32, top 10): ids and
    weights exactly as `route`'s test holds them, ties included. The expert stack is zeros (2.2 GB
    set on the device, not drawn), so act is silu(0) * 0 = 0 in every slot: the values of the
    experts' gate/up are the 35B-A3B tests' business, the same code."""
    name = "next80b"
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(80 + m)
    logits = _tied_logits(rng, m, e)
    x = _bf(rng, (m, h))
    w_sg = _bf(rng, (h,), h ** -0.5)
    count = (e + 1) * 2 * inter * h
    d_gate_up = mem.alloc(2 * count)
    mem.device.memset_d16(d_gate_up, 0, count, mem.stream)
    want_ids, want_wts = moe.reference_route(logits, x, w_sg, k, renorm)
    for key in _form_keys("route_up", name):
        ids, wts, act = _route_up(library, mem, stream, name, key, logits, x, w_sg, d_gate_up)
        print(key, "ids", ids.tolist(), "want", want_ids.tolist())  # shown on failure
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(wts[:, :k], want_wts[:, :k], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(wts[:, k], want_wts[:, k], rtol=1e-5)
        np.testing.assert_array_equal(act, 0.0)
