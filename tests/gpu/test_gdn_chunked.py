"""The chunked (WY) Gated DeltaNet prefill kernel against the recurrence and the `split` kernel.

Fresh bf16 inputs, a random initial state, odd lengths (one token, a partial chunk, exact chunks,
several chunks with a ragged tail), several sequences in one launch on scattered slots, poisoned
outputs. The kernel feeds tensor cores bf16 operands (like FLA), so its error against the float64
recurrence is bounded by 2x the error of a float64 model of exactly those roundings
(`gdn_chunked.reference_core(kernel_rounding=True)`) plus a small floor; untouched slots stay
bit-identical. It also runs next to the `split` kernel on the same inputs (the numbers go to
$OUT/gdn_chunked_vs_split.jsonl when OUT is set).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from cute_kernels import gdn, gdn_chunked
from cute_kernels.bf16 import round_bf16

from .conftest import rel_err

pytestmark = pytest.mark.gpu


def _bf(rng, shape, scale=1.0):
    return round_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def _variant(module, key):
    return next(v for v in module.variants() if v.key == key)



# Every form of the kernel (gdn_chunked._FORMS: "" one CTA per head, the plain form; _v2pt value
# columns over 2 CTAs, prefetch, blocked T, the one the runner uses): one token, a partial chunk,
# an exact chunk, several chunks with a ragged tail, and several sequences on scattered slots.
_SUFFIXES = [suffix for suffix, *_ in gdn_chunked._FORMS]
_CASES = [(f"fwd_k16_v48_d128{suffix}", "k16_v48_d128_s8", 1, t) for suffix in _SUFFIXES
          for t in (1, 63, 64, 200)]
_CASES += [(f"fwd_k16_v32_d128{suffix}", "k16_v32_d128_s8", b, t) for suffix in _SUFFIXES
           for b, t in ((2, 65), (3, 130))]


@pytest.mark.parametrize("key,split_key,b,t", _CASES)
def test_gdn_chunked(library, mem, stream, key, split_key, b, t):
    cfg = _variant(gdn_chunked, key).config
    assert _variant(gdn, split_key).config["x_stride"] == cfg["x_stride"]
    hk, hv, dk, dv = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"]
    rng = np.random.default_rng(13 * b + t)
    ns = 6
    slots = np.array([4, 1, 3][:b])
    qkv = _bf(rng, (b * t, cfg["conv_dim"]))
    x = _bf(rng, (b * t, cfg["x_stride"]), 1.5)
    a_log, dt_bias = _bf(rng, (hv,), 0.5), _bf(rng, (hv,), 0.5)
    state_vk = (rng.standard_normal((ns, hv, dv, dk)) * 0.1).astype(np.float32)
    common = {"qkv": mem.bf16(qkv), "x": mem.bf16(x), "a_log": mem.bf16(a_log), "dt_bias": mem.bf16(dt_bias),
              "slots": mem.i32(slots)}
    bufs = {}
    for name, fam, k in (("chunked", "gdn_chunked", key), ("split", "gdn", split_key)):
        st = mem.alloc(state_vk.nbytes)
        mem.device.memcpy_htod(st, state_vk, stream)
        o = mem.poisoned((b * t + 1) * hv * dv)
        library.kernel(fam, k).launch(stream, {**common, "state": st, "out": o}, {"B": b, "T": t, "NS": ns})
        bufs[name] = (mem.read_bf16(o, (b * t + 1, hv * dv)), mem.read_f32(st, state_vk))
    o_c, s_c = bufs["chunked"]
    o_s, _ = bufs["split"]
    assert np.isnan(o_c[b * t]).all(), "wrote past the last row"
    stats = {"key": key, "B": b, "T": t}
    for i in range(b):
        rows = slice(i * t, (i + 1) * t)
        bb = x[rows, cfg["b_off"]:cfg["b_off"] + hv]
        aa = x[rows, cfg["a_off"]:cfg["a_off"] + hv]
        core = (qkv[rows], bb, aa, a_log, dt_bias, state_vk[slots[i]])
        o_exact, s_exact = gdn.reference_core(*core, hk=hk, exact=True)
        o_model, s_model = gdn_chunked.reference_core(*core, hk=hk, kernel_rounding=True)
        got = o_c[rows].reshape(t, hv, dv)
        assert np.isfinite(got).all(), "non-finite outputs"
        e_o, e_om = rel_err(got, o_exact), rel_err(o_model, o_exact)
        e_s, e_sm = rel_err(s_c[slots[i]], s_exact), rel_err(s_model, s_exact)
        e_split = rel_err(o_s[rows].reshape(t, hv, dv), o_exact)
        stats.update({f"seq{i}_o_err": e_o, f"seq{i}_o_model_err": e_om, f"seq{i}_state_err": e_s,
                      f"seq{i}_state_model_err": e_sm, f"seq{i}_split_o_err": e_split})
        assert e_o <= 2 * e_om + 2e-3, stats
        assert e_s <= 2 * e_sm + 1e-3, stats
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gdn_chunked_vs_split.jsonl"), "a") as fh:
            fh.write(json.dumps(stats) + "\n")
    untouched = np.setdiff1d(np.arange(ns), slots)
    np.testing.assert_array_equal(s_c[untouched], state_vk[untouched])
