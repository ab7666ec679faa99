"""The FP8 expert kernels against NumPy on a real GPU: `dequant_weights` (bit for bit against its
reference) and the `moe` family's `up_fp8` / `down_fp8` (against the BF16 references on the
dequantised weights), for the tiny model's and the 35B-A3B's shapes (the 80B's kernels are the
35B-A3B's code with E = 512 and k = 10; its stacks would take most of the suite's time to draw).

Tolerance of the expert kernels, as tests/gpu/test_moe_kernels.py: the error against float64 of
the dequantised weights must stay within 2x of the BF16 reference's (`moe.reference_up` /
`reference_down` on the same dequantised weights: g and u rounded to bf16, act rounded, the
output rounded once). The fp8 kernels scale fp32 partial sums, so they round no more than that.
Cases: routed ids leaving experts without a row, one expert set taking every row, and the chained
MLP with tied router logits (a row of zeros: every logit equal, the first k experts win), each
row alone equal to its row in the batch bit for bit. Outputs are poisoned first, with one row
past M that must stay untouched.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cute_kernels import dequant_weights, moe
from cute_kernels.bf16 import round_bf16
from cute_kernels.gemv_fp8 import e4m3_values

from .conftest import assert_close_to_baseline

pytestmark = pytest.mark.gpu

SHAPES = {shape[0]: shape for shape in moe.SHAPES if shape[0] != "next80b"}
E4M3 = e4m3_values(np.arange(256, dtype=np.uint8))  # every code's value: decoding is one gather


def _key(kind: str, name: str) -> str:
    _, h, e, k, _, _, _ = SHAPES[name]
    return next(v.key for v in moe.variants()
                if v.config["kind"] == kind and (v.config["H"], v.config["E"], v.config.get("K", k)) == (h, e, k))


def _codes(rng, shape) -> np.ndarray:
    """Random e4m3 codes of every finite value (the two NaN codes moved to their neighbours)."""
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] -= 1
    return codes


@pytest.mark.parametrize("variant", dequant_weights.variants(), ids=lambda v: v.key)
def test_dequant_weights_is_exact(library, mem, stream, variant):
    """Three scale rows of rows (odd), every code value, scales spanning 2^-20 .. 2^4: the bf16 of
    the fp32 product, bit for bit; the row after R stays poisoned."""
    k, br = variant.config["K"], variant.config["BR"]
    rng = np.random.default_rng(k + br)
    r = 3 * br
    codes = _codes(rng, (r, k))
    codes[0, :256 if k >= 256 else k] = np.arange(256, dtype=np.uint8)[:min(k, 256)]
    codes[(codes & 0x7F) == 0x7F] -= 1
    kb = -(-k // 128)
    scales = np.exp2(rng.uniform(-20, 4, (r // br, kb))).astype(np.float32)
    out = mem.poisoned((r + 1) * k)
    library.kernel("dequant_weights", variant.key).launch(
        stream, {"w": mem.raw(codes), "scale": mem.raw(scales), "out": out}, {"R": r})
    got = mem.read_bf16(out, (r + 1, k))
    assert np.isnan(got[r]).all(), "the row past R was written"
    np.testing.assert_array_equal(got[:r], dequant_weights.reference(codes, scales, br))


@functools.lru_cache(maxsize=len(SHAPES))
def _stacks(name):
    """gate_up codes [(E + 1) 2I, H] and scales [rows / BR, H / 128], down codes [(E + 1) H, I] and
    scales [rows / 128, cdiv(I, 128)]: fp8 weights of std ~ 1 / sqrt(fan_in) x the code spread."""
    _, h, e, _, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(5)
    br = moe.fp8_block_rows(inter)
    gu_rows, dn_rows = (e + 1) * 2 * inter, (e + 1) * h
    gu_scales = (rng.uniform(0.5, 1.5, (gu_rows // br, h // 128)) / (64 * np.sqrt(h))).astype(np.float32)
    dn_scales = (rng.uniform(0.5, 1.5, (dn_rows // 128, -(-inter // 128))) / (64 * np.sqrt(inter))).astype(np.float32)
    return _codes(rng, (gu_rows, h)), gu_scales, br, _codes(rng, (dn_rows, inter)), dn_scales


def _dequant_experts(codes, scales, block_rows, per_expert, experts):
    """The float64 weights of the given experts ([len(experts), per_expert, K]), exact products:
    each code's value (`e4m3_values`, through the table) times its block's scale."""
    k = codes.shape[1]
    blocks = per_expert // block_rows
    out = []
    for ex in experts:
        values = np.take(E4M3, codes[ex * per_expert:(ex + 1) * per_expert]).reshape(blocks, block_rows, k)
        cols = np.repeat(scales[ex * blocks:(ex + 1) * blocks].astype(np.float64), 128, axis=1)[:, :k]
        out.append((values * cols[:, None, :]).reshape(per_expert, k))  # a scale row over its block_rows rows
    return np.stack(out)


def _exact_act(gate_up, local, x):
    """silu(g) * u of every (row, slot) in float64, nothing rounded: g and u of the dequantised
    expert local[r, s] ([n, 2I, H]) and x[r]. One einsum per slot gives the sums one einsum over
    gate_up[local] gives, without copying an expert per slot (1.2 GB at M = 8)."""
    inter = gate_up.shape[1] // 2
    x64 = x.astype(np.float64)
    full = np.stack([[np.einsum("ih,h->i", gate_up[j], x64[r]) for j in row] for r, row in enumerate(local)])
    g, u = full[..., :inter], full[..., inter:]
    return g / (1.0 + np.exp(-g)) * u


def _local(ids):
    """(the distinct experts of ids, ids renumbered into them)."""
    used = np.unique(ids)
    return used, np.searchsorted(used, ids).astype(np.int32)


def _ids_cases(rng, m, e, k):
    rand = np.stack([rng.permutation(e)[:k] for _ in range(m)])
    same = np.broadcast_to(rng.permutation(e)[:k], (m, k))
    shared = np.full((m, 1), e)
    return {"random": np.concatenate([rand, shared], 1), "all_rows_one_set": np.concatenate([same, shared], 1)}


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_up_fp8_and_down_fp8(library, mem, stream, name, m):
    _, h, e, k, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(300 + m)
    p = k + 1
    gu_codes, gu_scales, br, dn_codes, dn_scales = _stacks(name)
    d_gu, d_gu_s = mem.raw(gu_codes), mem.raw(gu_scales)
    d_dn, d_dn_s = mem.raw(dn_codes), mem.raw(dn_scales)
    x = _bf(rng, (m, h))
    for case, ids in _ids_cases(rng, m, e, k).items():
        used, local = _local(ids)
        gate_up = _dequant_experts(gu_codes, gu_scales, br, 2 * inter, used)
        act = mem.poisoned((m + 1) * p * inter)
        d_ids = mem.i32(ids)
        library.kernel("moe", _key("up_fp8", name)).launch(
            stream, {"x": mem.bf16(x), "w": d_gu, "scale": d_gu_s, "ids": d_ids, "act": act}, {"M": m})
        got = mem.read_bf16(act, (m + 1, p, inter))
        assert np.isnan(got[m]).all(), "the row past M was written"
        assert_close_to_baseline(got[:m], _exact_act(gate_up, local, x),
                                 moe.reference_up(x, gate_up.astype(np.float32), local), f"{name} up_fp8 {case} M={m}")

        down = _dequant_experts(dn_codes, dn_scales, 128, h, used)
        wts = rng.uniform(0.05, 1.0, (m, p)).astype(np.float32)
        act_in = _bf(rng, (m, p, inter))
        out = mem.poisoned((m + 1) * h)
        library.kernel("moe", _key("down_fp8", name)).launch(
            stream, {"act": mem.bf16(act_in), "w": d_dn, "scale": d_dn_s, "ids": d_ids, "wts": mem.raw(wts),
                     "out": out}, {"M": m})
        got = mem.read_bf16(out, (m + 1, h))
        assert np.isnan(got[m]).all(), "the row past M was written"
        assert_close_to_baseline(got[:m], moe.reference_down(act_in, down, local, wts, exact=True),
                                 moe.reference_down(act_in, down.astype(np.float32), local, wts),
                                 f"{name} down_fp8 {case} M={m}")


def _chain(library, mem, stream, name, x, router, w_sg, stacks):
    """logits -> route -> up_fp8 -> down_fp8 over the rows of x; returns (ids, delta rows)."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    m, p = x.shape[0], k + 1
    d_gu, d_gu_s, d_dn, d_dn_s = stacks
    d_x = mem.bf16(x)
    logits, ids = mem.raw(np.full(m * e, np.nan, np.float32)), mem.i32(np.zeros(m * p))
    wts, act, out = mem.raw(np.full(m * p, np.nan, np.float32)), mem.poisoned(m * p * inter), mem.poisoned(m * h)
    run = library.kernel
    run("moe", _key("logits", name)).launch(stream, {"x": d_x, "w": router, "out": logits}, {"M": m})
    run("moe", _key("route", name)).launch(stream, {"logits": logits, "x": d_x, "w_sg": w_sg, "ids": ids,
                                                    "wts": wts}, {"M": m})
    run("moe", _key("up_fp8", name)).launch(stream, {"x": d_x, "w": d_gu, "scale": d_gu_s, "ids": ids, "act": act},
                                            {"M": m})
    run("moe", _key("down_fp8", name)).launch(stream, {"act": act, "w": d_dn, "scale": d_dn_s, "ids": ids,
                                                       "wts": wts, "out": out}, {"M": m})
    return mem.read_i32(ids, m * p).reshape(m, p), mem.read_bf16(out, (m, h))


def test_chained_fp8_mlp_with_tied_logits_and_rows_alone(library, mem, stream):
    """The tiny shape's four launches on 8 rows, row 2 all zeros (every router logit 0: a tie
    the lowest ids win, the shared gate 0.5) against `moe.reference` on the dequantised stacks;
    rows 0, 2 and 7 alone equal to their rows in the batch."""
    name = "tiny"
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(77)
    x = _bf(rng, (8, h))
    x[2] = 0.0
    router, w_sg = _bf(rng, (e, h), h ** -0.5), _bf(rng, (h,), h ** -0.5)
    gu_codes, gu_scales, br, dn_codes, dn_scales = _stacks(name)
    stacks = [mem.raw(a) for a in (gu_codes, gu_scales, dn_codes, dn_scales)]
    d_router, d_sg = mem.bf16(router), mem.bf16(w_sg)
    ids, got = _chain(library, mem, stream, name, x, d_router, d_sg, stacks)
    want_ids, want_wts = moe.reference_route(moe.reference_logits(x, router), x, w_sg, k, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    assert ids[2, :k].tolist() == list(range(k))
    experts = np.arange(e + 1)
    gate_up = _dequant_experts(gu_codes, gu_scales, br, 2 * inter, experts)
    down = _dequant_experts(dn_codes, dn_scales, 128, h, experts)
    exact = moe.reference_down(_exact_act(gate_up, want_ids, x), down, want_ids, want_wts, exact=True)
    assert_close_to_baseline(got, exact, moe.reference(x, router, w_sg, gate_up.astype(np.float32),
                                                       down.astype(np.float32), k, renorm), f"{name} fp8 chained")
    for r in (0, 2, 7):
        _, alone = _chain(library, mem, stream, name, x[r:r + 1], d_router, d_sg, stacks)
        np.testing.assert_array_equal(alone[0], got[r])
