"""`CudaRunner`'s MoE path on the null device: the expert weights' layout and upload, the launches of
a MoE layer, the 35B-A3B shape's plan, the synthetic routers, and what is refused.

Kernels do not run here; `tests/gpu/test_moe_kernels.py` and `tests/gpu/test_cuda_runner_moe.py`
check values on a GPU. Needs the built kernels (`python build_kernels.py`) and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def runner(tiny_moe_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    yield r
    r.close()


def _read_bf16(runner, slot, rows: slice, cols: int) -> np.ndarray:
    from cute_kernels import bf16

    out = np.empty(slot.shape[0] * cols, np.uint16)
    runner.device.memcpy_dtoh(out, runner.storage.weights_base + slot.offset)
    return bf16.from_bits(out.reshape(-1, cols)[rows])


def test_experts_are_stacked_with_the_shared_expert_last(runner, tiny_moe_path):
    """The upload puts expert e's [gate; up] rows at block e of `experts_gate_up` and the shared
    expert's at block E; `experts_down` likewise; values as the artifact stores them."""
    from runtime.artifact import open_artifact

    c = runner.config
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    text = open_artifact(tiny_moe_path).component("text")
    layer = runner.layout.layers[2]
    m = "layers.2.mlp."
    gate_up = _read_bf16(runner, layer["experts_gate_up"], slice(None), h).reshape(e + 1, 2 * i, h)
    down = _read_bf16(runner, layer["experts_down"], slice(None), i).reshape(e + 1, h, i)
    np.testing.assert_array_equal(gate_up[:e], text.f32(m + "experts.gate_up_proj"))
    np.testing.assert_array_equal(gate_up[e, :i], text.f32(m + "shared_expert.gate_proj.weight"))
    np.testing.assert_array_equal(gate_up[e, i:], text.f32(m + "shared_expert.up_proj.weight"))
    np.testing.assert_array_equal(down[:e], text.f32(m + "experts.down_proj"))
    np.testing.assert_array_equal(down[e], text.f32(m + "shared_expert.down_proj.weight"))
    np.testing.assert_array_equal(_read_bf16(runner, layer["router"], slice(None), h), text.f32(m + "gate.weight"))
    np.testing.assert_array_equal(_read_bf16(runner, layer["shared_gate"], slice(None), h),
                                  text.f32(m + "shared_expert_gate.weight"))
    assert "w_gate_up" not in layer and runner.kernels.silu_mul is None


def _ptr(raw: bytes) -> int:
    return int.from_bytes(raw, "little")


def _moe_launches(runner, rows):
    dev = runner.device
    n = len(dev.launches)
    if rows == 40:
        runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, rows + 1)), start_pos=0, page_table=[0]))
    else:
        runner.decode([DecodeItem(slot=s, token_id=5, pos=3, page_table=[s]) for s in range(rows)])
    return [launch for launch in dev.launches[n:] if "_moe_" in launch.function]


def _kinds(launches):
    return [launch.function.split("_moe_")[1].split("_h")[0].split("_e")[0] for launch in launches]


def test_a_moe_layer_is_four_launches_over_all_rows_above_the_decode_rows(runner):
    """Prefill (40 rows, past MOE_DECODE_ROWS) without the grouped GEMMs and the router GEMM
    (`moe_prefill`, `moe_router_gemm` None, as for a shape they were not compiled for; with them:
    test_moe_prefill_null.py, test_moe_router_gemm_null.py): the split form,
    logits, route, up, down over all m rows, with grids (m, E / 8), (m,), (m * (k + 1), I / 16),
    (m, H / 32) and the layer's slots bound."""
    from runtime.model.gpu.kernels import MOE_DECODE_ROWS

    c, st, m = runner.config, runner.storage, 40
    assert m > MOE_DECODE_ROWS and runner.kernels.moe_prefill is not None
    runner.kernels.moe_prefill = runner.kernels.moe_router_gemm = None  # before the 40-row plan is bound
    moe = _moe_launches(runner, m)
    assert len(moe) == 4 * c.num_hidden_layers
    p = c.num_experts_per_tok + 1
    assert [launch.grid for launch in moe[:4]] == [(m, 1, 1), (m, 1, 1), (m * p, 4, 1), (m, 8, 1)]
    assert _kinds(moe[:4]) == ["logits", "route", "up", "down"]
    base = st.weights_base
    for layer, (logits, route, up, down) in zip(runner.layout.layers, zip(*[iter(moe)] * 4)):
        assert _ptr(logits.params[1]) == base + layer["router"].offset
        assert _ptr(route.params[2]) == base + layer["shared_gate"].offset
        assert _ptr(up.params[1]) == base + layer["experts_gate_up"].offset
        assert _ptr(down.params[1]) == base + layer["experts_down"].offset
        assert _ptr(down.params[4]) == st.buf["delta"]
        assert _ptr(up.params[2]) == _ptr(down.params[2]) == _ptr(route.params[3]) == st.buf["moe_ids"]


@pytest.mark.parametrize("rows, m", [(1, 1), (3, 4)])
def test_a_decode_moe_layer_is_three_launches(runner, rows, m):
    """Decode (one sequence; three, in the batch-4 bucket: below MOE_UP_WIDE_ROWS): the decode form
    of MOE_DECODE_FORM, logits_wide, route_up, down_wide over all m rows, grids (m, E / 8),
    (m * (k + 1), I / F), (m, H / (8 R)) (tiny: F = 8, R rounded up to 4 rows a warp), and the
    layer's slots bound."""
    from runtime.model.gpu.kernels import MOE_DECODE_FORM, MOE_UP_WIDE_ROWS

    c, st = runner.config, runner.storage
    gate_up, features, form = MOE_DECODE_FORM
    assert (gate_up, features, form) == ("route_up", 8, "r1") and m < MOE_UP_WIDE_ROWS
    moe = _moe_launches(runner, rows)
    assert len(moe) == 3 * c.num_hidden_layers
    p = c.num_experts_per_tok + 1
    assert [launch.grid for launch in moe[:3]] == [(m, 1, 1), (m * p, 64 // features, 1), (m, 8, 1)]
    assert _kinds(moe[:3]) == ["logits_wide", "route_up", "down_wide"]
    base = st.weights_base
    for layer, (logits, route_up, down) in zip(runner.layout.layers, zip(*[iter(moe)] * 3)):
        assert _ptr(logits.params[1]) == base + layer["router"].offset
        assert _ptr(route_up.params[0]) == _ptr(logits.params[2]) == st.buf["moe_logits"]
        assert _ptr(route_up.params[2]) == base + layer["shared_gate"].offset
        assert _ptr(route_up.params[3]) == base + layer["experts_gate_up"].offset
        assert _ptr(route_up.params[6]) == _ptr(down.params[0]) == st.buf["moe_act"]
        assert _ptr(down.params[1]) == base + layer["experts_down"].offset
        assert _ptr(down.params[4]) == st.buf["delta"]
        assert _ptr(route_up.params[4]) == _ptr(down.params[2]) == st.buf["moe_ids"]
        assert _ptr(route_up.params[5]) == _ptr(down.params[3]) == st.buf["moe_wts"]


def test_from_moe_up_wide_rows_the_routing_runs_once_before_up_wide(runner):
    """A prefill chunk of MOE_UP_WIDE_ROWS rows (as many as a decode step of that many rows):
    logits_wide, route, up_wide (the route_up form's features), down_wide, the ids from route to
    both."""
    from runtime.model.gpu.kernels import MOE_DECODE_ROWS, MOE_UP_WIDE_ROWS

    c, st, m = runner.config, runner.storage, MOE_UP_WIDE_ROWS
    assert runner.kernels.moe_up_wide_rows == m <= MOE_DECODE_ROWS
    n = len(runner.device.launches)
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, m + 1)), start_pos=0, page_table=[0]))
    moe = [launch for launch in runner.device.launches[n:] if "_moe_" in launch.function]
    assert len(moe) == 4 * c.num_hidden_layers
    assert _kinds(moe[:4]) == ["logits_wide", "route", "up_wide", "down_wide"]
    p = c.num_experts_per_tok + 1
    assert [launch.grid for launch in moe[:4]] == [(m, 1, 1), (m, 1, 1), (m * p, 8, 1), (m, 8, 1)]
    logits, route, up, down = moe[:4]
    assert _ptr(route.params[3]) == _ptr(up.params[2]) == _ptr(down.params[2]) == st.buf["moe_ids"]
    assert _ptr(up.params[3]) == _ptr(down.params[0]) == st.buf["moe_act"]
    assert _ptr(up.params[1]) == st.weights_base + runner.layout.layers[0]["experts_gate_up"].offset
    runner.reset_slot(0)


def test_the_staged_decode_form_is_route_then_up_wide(tiny_moe_path, monkeypatch):
    """MOE_DECODE_FORM = ("up_wide", 16, "r2"), the one-line switch to the staged form without the
    fused routing: logits_wide, route, up_wide, down_wide at decode, ids from route to both."""
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu import kernels
    from runtime.model.gpu.runner import CudaRunner

    monkeypatch.setattr(kernels, "MOE_DECODE_FORM", ("up_wide", 16, "r2"))
    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    try:
        assert r.kernels.moe_route_up is None and r.kernels.moe_up_wide.endswith("_f16")
        assert r.kernels.moe_down_wide.endswith("_r2")
        moe = _moe_launches(r, 1)
        c, st = r.config, r.storage
        assert len(moe) == 4 * c.num_hidden_layers
        assert _kinds(moe[:4]) == ["logits_wide", "route", "up_wide", "down_wide"]
        p = c.num_experts_per_tok + 1
        assert [launch.grid for launch in moe[:4]] == [(1, 1, 1), (1, 1, 1), (p, 4, 1), (1, 8, 1)]
        logits, route, up, down = moe[:4]
        assert _ptr(route.params[3]) == _ptr(up.params[2]) == _ptr(down.params[2]) == st.buf["moe_ids"]
        assert _ptr(up.params[3]) == _ptr(down.params[0]) == st.buf["moe_act"]
        assert _ptr(up.params[1]) == st.weights_base + r.layout.layers[0]["experts_gate_up"].offset
    finally:
        r.close()


def test_the_35b_a3b_shape_plans():
    """The 35B-A3B shape: every kernel it needs was built (the MoE ones and the dense parts' GEMV
    and GEMM), the weights are the expected size, and the MoE grids at batch 8 are those of
    `cute_kernels/moe.py` (the null device cannot hold 70 GB of synthetic weights to go further)."""
    from runtime.cuda.expr import evaluate
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import MOE_UP_WIDE_ROWS, KernelChoice
    from runtime.model.gpu.weights import WeightLayout
    from runtime.model.shapes import QWEN36_35B_A3B

    c = ModelConfig.from_dict(QWEN36_35B_A3B)
    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    choice = built_or_skip(lambda: KernelChoice(lib, c))
    layout = WeightLayout.plan(c)
    for role in ("w_in", "out_proj", "w_qkv", "o_proj"):
        slot = next(layer[role] for layer in layout.layers if role in layer)
        for m in (1, 8, 64):
            assert choice.linear(*slot.shape, m)[0] == ("gemv" if m <= 16 else "gemm_sm90")
    assert choice.linear(*layout.globals["lm_head"].shape, 8)[0] == "gemv"
    # Per layer: the router and shared gate, 257 experts of 3 x 512 x 2048 (64.7 GB in all).
    moe = sum(layer[role].nbytes for layer in layout.layers
              for role in ("router", "shared_gate", "experts_gate_up", "experts_down"))
    assert moe == 40 * (256 * 2048 + 2048 + 257 * 3 * 512 * 2048) * 2
    grids = [tuple(evaluate(g, {"M": 8}) for g in lib.manifest.kernels[("moe", key)].grid)
             for key in (choice.moe_logits, choice.moe_route, choice.moe_up, choice.moe_down,
                         choice.moe_logits_wide, choice.moe_route_up, choice.moe_down_wide)]
    assert grids == [(8, 32, 1), (8, 1, 1), (72, 32, 1), (8, 128, 1), (8, 32, 1), (72, 64, 1), (8, 256, 1)]
    # From MOE_UP_WIDE_ROWS rows the routing runs once (route) and up_wide reads its ids.
    assert choice.moe_up_wide == "up_wide_h2048_e256_k8_i512_f8" and choice.moe_up_wide_rows == MOE_UP_WIDE_ROWS
    assert tuple(evaluate(g, {"M": 8}) for g in lib.manifest.kernels[("moe", choice.moe_up_wide)].grid) == (72, 64, 1)


def _moe_config(**overrides):
    from runtime.model.config import ModelConfig
    from runtime.model.random_weights import tiny_config_dict

    return ModelConfig.from_dict(tiny_config_dict("moe", hidden_size=256, **{
        "num_experts": 32, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, **overrides}))


def test_skewed_synthetic_router_makes_the_first_experts_hot():
    """fill_synthetic(router="skewed") scales the first HOT_EXPERTS router rows by HOT_SCALE; the
    balanced router leaves every row at the same scale."""
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.weights import HOT_EXPERTS, HOT_SCALE, WeightLayout, fill_synthetic
    from cute_kernels import bf16

    layout = WeightLayout.plan(_moe_config())
    dev = NullDevice(1 << 30)
    stds = {}
    for mode in ("balanced", "skewed"):
        base = dev.mem_alloc(layout.total)
        fill_synthetic(layout, 3, dev, base, dev.create_stream(), router=mode)
        slot = layout.layers[1]["router"]
        bits = np.empty(slot.shape[0] * slot.shape[1], np.uint16)
        dev.memcpy_dtoh(bits, base + slot.offset)
        rows = bf16.from_bits(bits).reshape(slot.shape)
        stds[mode] = rows[:HOT_EXPERTS].std(), rows[HOT_EXPERTS:].std()
    hot, cold = stds["skewed"]
    assert hot == pytest.approx(HOT_SCALE * cold, rel=0.05)
    assert cold == pytest.approx(np.sqrt(1 / 256), rel=0.05)  # a projection's 1/sqrt(fan_in)
    assert stds["balanced"][0] == pytest.approx(cold, rel=0.05)
    with pytest.raises(ValueError, match="synthetic router 'hot': one of balanced, skewed"):
        fill_synthetic(layout, 3, dev, base, dev.create_stream(), router="hot")


def test_what_the_moe_path_refuses_is_named():
    from runtime.model.gpu.weights import FP8, WeightLayout

    with pytest.raises(NotImplementedError, match=r"shared expert's width \(48\) differs .* \(64\)"):
        WeightLayout.plan(_moe_config(shared_expert_intermediate_size=48))
    # Routed experts fp8 beside a bf16 shared expert: one stack has one format.
    with pytest.raises(NotImplementedError, match=r"are \['fp8_e4m3', 'bf16', 'bf16'\]; .* all in bf16, all in fp8_e4m3 or all in nvfp4"):
        WeightLayout.plan(_moe_config(), lambda name: FP8 if "experts." in name else "bf16")
    with pytest.raises(NotImplementedError, match=r"\['layers.0.mlp.gate.weight'\] are \['fp8_e4m3'\]; .* router"):
        WeightLayout.plan(_moe_config(), lambda name: FP8 if name.endswith("mlp.gate.weight") else "bf16")


def test_decode_bench_counts_only_the_experts_touched(runner):
    """bench.decode's roofline bytes at context 0: every expert touched reads the whole layout
    (less the embedding, plus the batch's hidden rows and GDN states); none touched leaves the shared expert only, one
    expert's gate/up and down (3 x I x H bf16) per MoE layer less per expert."""
    from bench.decode import experts_touched, step_bytes

    c, lay = runner.config, runner.layout
    batch = 2
    full = lay.total - lay.globals["embed"].nbytes + batch * c.hidden_size * 2 \
        + batch * len(c.linear_layers) * 2 * runner.storage.state_slot_bytes
    expert = 3 * c.moe_intermediate_size * c.hidden_size * 2
    assert step_bytes(runner, batch, 0, c.num_experts) == full
    assert step_bytes(runner, batch, 0, 0) == full - c.num_experts * expert * c.num_hidden_layers
    # The null device's routing buffer holds zeros: every row picked expert 0.
    assert experts_touched(runner, batch) == 1

