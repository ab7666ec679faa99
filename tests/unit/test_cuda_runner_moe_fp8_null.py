"""FP8 MoE experts in `CudaRunner`, on the null device: the stacks' layout and upload (codes and
scale rows of the routed experts with the shared expert last), the launches of decode (`up_fp8` /
`down_fp8` after the BF16 routing) and prefill (the stacks dequantised, then the grouped GEMMs),
synthetic FP8 MoE weights, and the Next-80B FP8 memory plan on a 139 GiB H200.

Kernels do not run here: tests/gpu/test_moe_fp8_kernels.py and test_cuda_runner_moe_fp8.py
check values on a GPU. Needs the built kernels (`python build_kernels.py`) and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def runner(tiny_moe_fp8_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_fp8_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    yield r
    r.close()


def _read(runner, ptr, count, dtype):
    out = np.empty(count, dtype)
    runner.device.memcpy_dtoh(out, runner.storage.weights_base + ptr)
    return out


def test_fp8_expert_stacks_hold_the_artifact_codes_and_scale_rows(runner, tiny_moe_fp8_path):
    """experts_gate_up: (E + 1) x 2I rows of H codes, a scale row per I = 64 rows (each gate and
    up half of an expert is one 128-row block of the artifact, padded); experts_down: (E + 1) x H
    rows, a scale row per 128. Dequantising the device bytes by those rows gives the artifact's
    values of every expert, the shared one last."""
    from cute_kernels import dequant_weights
    from runtime.artifact import open_artifact
    from runtime.model.gpu.weights import FP8

    c = runner.config
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    layer = runner.layout.layers[1]
    gu, dn = layer["experts_gate_up"], layer["experts_down"]
    assert (gu.format, gu.shape, gu.block_rows, gu.scale_shape) == (FP8, ((e + 1) * 2 * i, h), 64, (18, 2))
    assert (dn.format, dn.shape, dn.block_rows, dn.scale_shape) == (FP8, ((e + 1) * h, i), 128, (18, 1))
    assert layer["router"].format == "bf16" and layer["shared_gate"].format == "bf16"
    text = open_artifact(tiny_moe_fp8_path).component("text")
    m = "layers.1.mlp."
    for slot, routed, shared in ((gu, "experts.gate_up_proj", ("shared_expert.gate_proj.weight",
                                                                "shared_expert.up_proj.weight")),
                                 (dn, "experts.down_proj", ("shared_expert.down_proj.weight",))):
        codes = _read(runner, slot.offset, slot.shape[0] * slot.shape[1], np.uint8).reshape(slot.shape)
        scales = _read(runner, slot.scale_offset, int(np.prod(slot.scale_shape)), np.float32).reshape(slot.scale_shape)
        got = dequant_weights.reference(codes, scales, slot.block_rows).reshape(e + 1, -1, slot.shape[1])
        want_routed = text.f32(m + routed)
        want_shared = np.concatenate([text.f32(m + name) for name in shared])
        # The artifact's fp32 dequantisation and the bf16 rounding of the same products.
        np.testing.assert_allclose(got[:e], want_routed, rtol=2 ** -8, atol=0)
        np.testing.assert_allclose(got[e], want_shared, rtol=2 ** -8, atol=0)
    assert runner.kernels.moe_up_fp8 and runner.kernels.moe_down_fp8 and runner.kernels.moe_route_up is None


FAMILIES = ("moe_grouped", "moe", "dequant_weights")


def _moe_launches(runner, rows, prefill=False):
    """(family, variant key) of the MoE launches of a prefill of `rows` tokens or a decode step
    of `rows` sequences."""
    dev = runner.device
    n = len(dev.launches)
    if prefill:
        runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, rows + 1)), start_pos=0, page_table=[0]))
    else:
        runner.decode([DecodeItem(slot=s, token_id=5, pos=3, page_table=[s]) for s in range(rows)])
    out = []
    for launch in dev.launches[n:]:
        name = launch.function.split("_kernel")[0]
        family = next((f for f in FAMILIES if f"_{f}_" in name), None)
        if family:
            out.append((family, name.split(f"_{family}_", 1)[1]))
    return out


def _kinds(launches):
    """The kind of each launch: a `moe` key up to its shape, a `moe_grouped` one likewise, a
    `dequant_weights` key whole."""
    return [key if family == "dequant_weights" else key.split("_h")[0].split("_e")[0] for family, key in launches]


def test_decode_runs_the_fp8_expert_kernels_after_the_bf16_routing(runner):
    kinds = _kinds(_moe_launches(runner, 2))
    assert kinds == ["logits", "route", "up_fp8", "down_fp8"] * runner.config.num_hidden_layers


def test_prefill_dequantises_each_layer_before_the_grouped_gemms(runner):
    assert runner.kernels.moe_prefill is not None and runner.kernels.moe_prefill.dequant_gate_up
    kinds = _kinds(_moe_launches(runner, 40, prefill=True))
    # Per layer: the routing (its logits by the router GEMM, not a `moe` launch), the two stacks
    # dequantised (gate/up K = 256 in scale rows of 64, down K = 64), then the grouped path on the
    # bf16 copies.
    per_layer = ["route", "fp8_k256_br64", "fp8_k64_br128", "perm", "gather", "gemm_gate_up",
                 "gemm_down", "combine"]
    assert kinds == per_layer * runner.config.num_hidden_layers
    sizes = runner.kernels.moe_prefill.buffer_sizes(64, 256, 64)
    assert sizes["moe_dequant"] == 9 * 3 * 64 * 256 * 2


def test_synthetic_fp8_moe_weights_fill_scales_of_the_block_rows():
    """fp8_recipe_format on a MoE config: experts fp8 (block scales of their block rows), the
    router and shared gate bf16; fill_synthetic draws scales of sqrt(3 / fan_in) / 448 x [0.5, 1.5]."""
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.weights import FP8, WeightLayout, fill_synthetic, fp8_recipe_format
    from runtime.model.random_weights import tiny_config_dict

    c = ModelConfig.from_dict(tiny_config_dict("moe", hidden_size=256, num_experts=8, moe_intermediate_size=64,
                                               shared_expert_intermediate_size=64))
    # The recipe on the MLP only (this config's attention k rows do not fill 128-row blocks).
    layout = WeightLayout.plan(c, lambda name: fp8_recipe_format(name) if ".mlp." in name else "bf16")
    assert layout.expert_format == FP8 and layout.layers[0]["router"].format == "bf16"
    assert layout.layers[0]["shared_gate"].format == "bf16"
    dev = NullDevice(1 << 30)
    base = dev.mem_alloc(layout.total)
    fill_synthetic(layout, 5, dev, base, dev.create_stream())
    slot = layout.layers[0]["experts_gate_up"]
    scales = np.empty(int(np.prod(slot.scale_shape)), np.float32)
    dev.memcpy_dtoh(scales, base + slot.scale_offset)
    unit = np.sqrt(3.0 / 256) / 448.0
    assert scales.size == 18 * 2 and (scales >= 0.5 * unit).all() and (scales <= 1.5 * unit).all()


def test_the_next_80b_fp8_plan_fits_an_h200():
    """Next-80B with the FP8 recipe's formats: about 81 GB of weights (experts 1 byte a weight),
    and with the runner's buffers for a 8,192-token prefill chunk and batch 8 (the one-layer
    dequant scratch among them) and a KV pool of 8 x 32K tokens, under an H200's 139 GiB."""
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.storage import Storage
    from runtime.model.gpu.weights import FP8, WeightLayout, fp8_recipe_format
    from runtime.model.shapes import QWEN3_NEXT_80B_A3B

    c = ModelConfig.from_dict(QWEN3_NEXT_80B_A3B)
    layout = WeightLayout.plan(c, fp8_recipe_format)
    experts = 48 * 513 * 3 * 512 * 2048
    assert layout.expert_format == FP8
    assert experts < layout.total < experts + 4.2e9  # + scales, fp8 projections, bf16 embedding and head
    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    kernels = built_or_skip(lambda: KernelChoice(lib, c, expert_format=FP8))
    assert kernels.moe_prefill is not None and kernels.moe_prefill.dequant_gate_up
    h200 = NullDevice(139 << 30)
    pages = 8 * (32768 // 64 + 1)
    st = Storage(c, h200, kernels, weight_bytes=layout.total, num_pages=pages, phys_slots=16, max_batch=8,
                 prefill_chunk=8192, max_context=32768 + 64)
    used = h200.total_memory - h200.free_memory()
    print(f"weights {layout.total / 2**30:.1f} GiB, all {used / 2**30:.1f} GiB")
    assert used < 100 << 30
    st.release()


def test_the_tiny_next_fp8_model_loads_with_fp8_experts(tiny_next_fp8_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import FP8

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_next_fp8_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    try:
        assert r.config.family == "next" and r.layout.expert_format == FP8
        assert _kinds(_moe_launches(r, 1)) == ["logits", "route", "up_fp8", "down_fp8"] * r.config.num_hidden_layers
        # A prefill of a few rows reads the experts it routes to, not a dequantised copy of all
        # (its router logits by the router GEMM).
        assert _kinds(_moe_launches(r, 5, prefill=True))[:3] == ["route", "up_fp8", "down_fp8"]
    finally:
        r.close()
