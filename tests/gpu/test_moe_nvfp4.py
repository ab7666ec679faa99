"""NVFP4 MoE experts on a real GPU: the `moe` family's `up_nvfp4` / `down_nvfp4` against NumPy, and
`CudaRunner` on the tiny MoE model converted with `--recipe nvfp4` against `NumpyRunner`.

Kernels, for the tiny model's and the 35B-A3B's shapes (the 80B's kernels are the 35B-A3B's code
with E = 512 and k = 10): random stacks of every e2m1 code and e4m3 block scales over most of
e4m3's range (subnormals included), fp32 globals per row. Tolerance as
tests/gpu/test_moe_fp8_kernels.py: the error against float64 of the dequantised weights must stay
within 2x of a same-precision baseline, here `moe_nvfp4.reference_up` / `reference_down` (the
kernels' rounding model: exact weights, fp32 sums, the global on the fp32 sum, then `up`'s and
`down`'s bf16 roundings; only the order of the fp32 sums differs). Cases: odd row counts, routed
ids leaving experts without a row, one expert set taking every row, and the chained MLP with tied
router logits, each row alone equal to its row in the batch bit for bit. Outputs are poisoned
first, with one row past M that must stay untouched.

Model: the checks of tests/gpu/test_cuda_runner_nvfp4.py (the dense NVFP4 model's), run here
with this module's `tiny_nvfp4_path` (the MoE artifact) and `runners`, plus a decode batch of 8
equal to each row alone. The bound is that file's: 2x the BF16 torch forward's error against the
fp32 NumpyRunner. NVFP4 is weight-only (W4A16), so unlike the FP8 model no activation-quantised
baseline enters: decode reads the experts through `up_nvfp4` / `down_nvfp4` (no weight rounded),
prefill pieces of more than 16 rows dequantise each layer's stacks to bf16 (`dequant_nvfp4`,
rounded once, as the torch forward's weights are) for the grouped GEMMs.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cute_kernels import moe, moe_nvfp4
from cute_kernels.bf16 import round_bf16
from cute_kernels.gemv_fp8 import e4m3_values
from cute_kernels.gemv_nvfp4 import E2M1

from .conftest import assert_close_to_baseline
from .test_cuda_runner_moe import test_a_batch_of_eight_equals_each_row_alone  # noqa: F401
from .test_cuda_runner_nvfp4 import (test_nvfp4_decode_logits_match_reference,  # noqa: F401
                                     test_nvfp4_prefill_is_the_same_however_the_prompt_is_chunked,
                                     test_nvfp4_prefill_logits_match_reference)
from .test_moe_fp8_kernels import _exact_act

pytestmark = pytest.mark.gpu

SHAPES = {shape[0]: shape for shape in moe.SHAPES if shape[0] != "next80b"}
SCALE_CODES = np.arange(1, 0x7F, dtype=np.uint8)  # positive e4m3 scales, subnormals to 448


def _key(kind: str, name: str) -> str:
    _, h, e, k, _, _, _ = SHAPES[name]
    return next(v.key for v in moe.variants()
                if v.config["kind"] == kind and (v.config["H"], v.config["E"], v.config.get("K", k)) == (h, e, k))


def _stack(rng, rows, k):
    """(codes [rows, K / 2], scale codes [rows, K / 16], globals [rows]): every code byte, scales
    over SCALE_CODES, globals making a weight's rms about 1 / sqrt(K) x [0.5, 1.5]."""
    codes = rng.integers(0, 256, (rows, k // 2), dtype=np.uint8)
    scales = rng.choice(SCALE_CODES, (rows, k // 16))
    rms = np.sqrt(np.mean(E2M1 ** 2) * np.mean(e4m3_values(SCALE_CODES) ** 2) * k)
    return codes, scales, (rng.uniform(0.5, 1.5, rows) / rms).astype(np.float32)


@functools.lru_cache(maxsize=len(SHAPES))
def _stacks(name):
    """gate/up (rows (E + 1) 2I of H) and down (rows (E + 1) H of I) stacks."""
    _, h, e, _, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(7)
    return _stack(rng, (e + 1) * 2 * inter, h), _stack(rng, (e + 1) * h, inter)


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


def _upload(mem, stack):
    return {"w": mem.raw(stack[0]), "scale": mem.raw(stack[1]), "gscale": mem.raw(stack[2])}


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 8])
def test_up_nvfp4_and_down_nvfp4(library, mem, stream, name, m):
    _, h, e, k, inter, _, _ = SHAPES[name]
    rng = np.random.default_rng(400 + m)
    p = k + 1
    gu, dn = _stacks(name)
    d_gu, d_dn = _upload(mem, gu), _upload(mem, dn)
    x = _bf(rng, (m, h))
    for case, ids in _ids_cases(rng, m, e, k).items():
        used, local = _local(ids)
        act = mem.poisoned((m + 1) * p * inter)
        d_ids = mem.i32(ids)
        library.kernel("moe", _key("up_nvfp4", name)).launch(
            stream, {"x": mem.bf16(x), **d_gu, "ids": d_ids, "act": act}, {"M": m})
        got = mem.read_bf16(act, (m + 1, p, inter))
        assert np.isnan(got[m]).all(), "the row past M was written"
        gate_up = moe_nvfp4.dequantise(*gu, 2 * inter, used)
        assert_close_to_baseline(got[:m], _exact_act(gate_up, local, x),
                                 moe_nvfp4.reference_up(x, *gu, ids, inter), f"{name} up_nvfp4 {case} M={m}")

        down = moe_nvfp4.dequantise(*dn, h, used)
        wts = rng.uniform(0.05, 1.0, (m, p)).astype(np.float32)
        act_in = _bf(rng, (m, p, inter))
        out = mem.poisoned((m + 1) * h)
        library.kernel("moe", _key("down_nvfp4", name)).launch(
            stream, {"act": mem.bf16(act_in), **d_dn, "ids": d_ids, "wts": mem.raw(wts), "out": out}, {"M": m})
        got = mem.read_bf16(out, (m + 1, h))
        assert np.isnan(got[m]).all(), "the row past M was written"
        assert_close_to_baseline(got[:m], moe.reference_down(act_in, down, local, wts, exact=True),
                                 moe_nvfp4.reference_down(act_in, *dn, ids, wts, h),
                                 f"{name} down_nvfp4 {case} M={m}")


def _chain(library, mem, stream, name, x, router, w_sg, stacks):
    """logits -> route -> up_nvfp4 -> down_nvfp4 over the rows of x; returns (ids, delta rows)."""
    _, h, e, k, inter, _, _ = SHAPES[name]
    m, p = x.shape[0], k + 1
    d_gu, d_dn = stacks
    d_x = mem.bf16(x)
    logits, ids = mem.raw(np.full(m * e, np.nan, np.float32)), mem.i32(np.zeros(m * p))
    wts, act, out = mem.raw(np.full(m * p, np.nan, np.float32)), mem.poisoned(m * p * inter), mem.poisoned(m * h)
    run = library.kernel
    run("moe", _key("logits", name)).launch(stream, {"x": d_x, "w": router, "out": logits}, {"M": m})
    run("moe", _key("route", name)).launch(stream, {"logits": logits, "x": d_x, "w_sg": w_sg, "ids": ids,
                                                    "wts": wts}, {"M": m})
    run("moe", _key("up_nvfp4", name)).launch(stream, {"x": d_x, **d_gu, "ids": ids, "act": act}, {"M": m})
    run("moe", _key("down_nvfp4", name)).launch(stream, {"act": act, **d_dn, "ids": ids, "wts": wts, "out": out},
                                                {"M": m})
    return mem.read_i32(ids, m * p).reshape(m, p), mem.read_bf16(out, (m, h))


def test_chained_nvfp4_mlp_with_tied_logits_and_rows_alone(library, mem, stream):
    """The tiny shape's four launches on 7 rows, row 2 all zeros (every router logit 0: a tie the
    lowest ids win, the shared gate 0.5) against the float64 MLP on the dequantised stacks (the
    BF16 `moe.reference` on them as the baseline); rows 0, 2 and 6 alone equal to their rows in
    the batch."""
    name = "tiny"
    _, h, e, k, inter, renorm, _ = SHAPES[name]
    rng = np.random.default_rng(78)
    x = _bf(rng, (7, h))
    x[2] = 0.0
    router, w_sg = _bf(rng, (e, h), h ** -0.5), _bf(rng, (h,), h ** -0.5)
    gu, dn = _stacks(name)
    stacks = (_upload(mem, gu), _upload(mem, dn))
    d_router, d_sg = mem.bf16(router), mem.bf16(w_sg)
    ids, got = _chain(library, mem, stream, name, x, d_router, d_sg, stacks)
    want_ids, want_wts = moe.reference_route(moe.reference_logits(x, router), x, w_sg, k, renorm)
    np.testing.assert_array_equal(ids, want_ids)
    assert ids[2, :k].tolist() == list(range(k))
    experts = np.arange(e + 1)
    gate_up, down = moe_nvfp4.dequantise(*gu, 2 * inter, experts), moe_nvfp4.dequantise(*dn, h, experts)
    exact = moe.reference_down(_exact_act(gate_up, want_ids, x), down, want_ids, want_wts, exact=True)
    assert_close_to_baseline(got, exact, moe.reference(x, router, w_sg, gate_up.astype(np.float32),
                                                       down.astype(np.float32), k, renorm), f"{name} nvfp4 chained")
    for r in (0, 2, 6):
        _, alone = _chain(library, mem, stream, name, x[r:r + 1], d_router, d_sg, stacks)
        np.testing.assert_array_equal(alone[0], got[r])


@pytest.fixture(scope="module")
def tiny_nvfp4_path(tiny_moe_nvfp4_path):
    """The imported dense-model checks read this fixture: here the MoE artifact."""
    return tiny_moe_nvfp4_path


@pytest.fixture(scope="module")
def runners(tiny_nvfp4_path, device, library):
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import NVFP4
    from runtime.model.numpy_runner import NumpyRunner

    cuda = CudaRunner.from_artifact(tiny_nvfp4_path, num_pages=80, num_slots=12, device=device, library=library,
                                    prefill_chunk=128)
    ref = NumpyRunner.from_artifact(tiny_nvfp4_path, num_pages=80, num_slots=12)
    assert cuda.layout.expert_format == NVFP4 and cuda.kernels.moe_up_nvfp4
    assert cuda.kernels.moe_prefill is not None and cuda.kernels.moe_prefill.dequant_family == "dequant_nvfp4"
    yield cuda, ref
    cuda.close()
