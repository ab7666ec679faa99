"""NVFP4 MoE experts in `CudaRunner`, on the null device: the stacks' layout and upload (codes,
block scales and per-row globals of the routed experts with the shared expert last), the launches
of decode (`up_nvfp4` / `down_nvfp4` after the BF16 routing) and prefill (the stacks dequantised by
`dequant_nvfp4`, then the grouped GEMMs), synthetic NVFP4 MoE weights, and the 35B-A3B NVFP4 plan.

Kernels do not run here: tests/gpu/test_moe_nvfp4.py checks values on a GPU. Needs the built
kernels (`python build_kernels.py`) and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def runner(tiny_moe_nvfp4_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_nvfp4_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    yield r
    r.close()


def _read(runner, ptr, count, dtype):
    out = np.empty(count, dtype)
    runner.device.memcpy_dtoh(out, runner.storage.weights_base + ptr)
    return out


def test_nvfp4_expert_stacks_hold_the_artifact_values(runner, tiny_moe_nvfp4_path):
    """experts_gate_up: (E + 1) x 2I rows of H / 2 code bytes, H / 16 scales, a global per row (each
    expert's gate and up halves their own); experts_down: (E + 1) x H rows of I. Dequantising the
    device bytes gives the artifact's values of every expert, the shared one last."""
    from cute_kernels import moe_nvfp4
    from runtime.artifact import open_artifact
    from runtime.model.gpu.weights import NVFP4

    c = runner.config
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    layer = runner.layout.layers[1]
    gu, dn = layer["experts_gate_up"], layer["experts_down"]
    assert (gu.format, gu.shape, gu.scale_shape) == (NVFP4, ((e + 1) * 2 * i, h), ((e + 1) * 2 * i, h // 16))
    assert (dn.format, dn.shape, dn.scale_shape) == (NVFP4, ((e + 1) * h, i), ((e + 1) * h, i // 16))
    assert layer["router"].format == "bf16" and layer["shared_gate"].format == "bf16"
    text = open_artifact(tiny_moe_nvfp4_path).component("text")
    m = "layers.1.mlp."
    for slot, per_expert, routed, shared in (
            (gu, 2 * i, "experts.gate_up_proj", ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")),
            (dn, h, "experts.down_proj", ("shared_expert.down_proj.weight",))):
        rows, k = slot.shape
        codes = _read(runner, slot.offset, rows * k // 2, np.uint8).reshape(rows, k // 2)
        scales = _read(runner, slot.scale_offset, rows * k // 16, np.uint8).reshape(rows, k // 16)
        gscale = _read(runner, slot.gscale_offset, rows, np.float32)
        got = moe_nvfp4.dequantise(codes, scales, gscale, per_expert, np.arange(e + 1))
        want_routed = text.f32(m + routed)
        want_shared = np.concatenate([text.f32(m + name) for name in shared])
        # The artifact's float32 product and the exact one; each gate / up half its own global.
        np.testing.assert_allclose(got[:e], want_routed, rtol=2 ** -22, atol=0)
        np.testing.assert_allclose(got[e], want_shared, rtol=2 ** -22, atol=0)
        halves = gscale.reshape(e + 1, -1, per_expert // (2 if slot is gu else 1))
        assert (halves == halves[..., :1]).all()
    assert runner.kernels.moe_up_nvfp4 and runner.kernels.moe_down_nvfp4 and runner.kernels.moe_route_up is None


FAMILIES = ("moe_grouped", "moe", "dequant_nvfp4")


def _moe_launches(runner, rows, prefill=False):
    """(family, variant key) of the MoE and NVFP4-dequant launches of a prefill of `rows` tokens or
    a decode step of `rows` sequences."""
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
    """The kind of each launch: a `moe` or `moe_grouped` key up to its shape, a `dequant_nvfp4`
    key whole."""
    return [key if family == "dequant_nvfp4" else key.split("_h")[0].split("_e")[0] for family, key in launches]


def test_decode_runs_the_nvfp4_expert_kernels_after_the_bf16_routing(runner):
    kinds = _kinds(_moe_launches(runner, 2))
    assert kinds == ["logits", "route", "up_nvfp4", "down_nvfp4"] * runner.config.num_hidden_layers


def test_the_nvfp4_expert_launches_bind_the_stacks_scales_and_globals(runner):
    """up_nvfp4's parameters: x, then the gate/up stack's codes, block scales and globals at their
    slot offsets; down_nvfp4's the down stack's."""
    dev = runner.device
    n = len(dev.launches)
    runner.decode([DecodeItem(slot=0, token_id=5, pos=3, page_table=[0])])
    base = runner.storage.weights_base
    layer = runner.layout.layers[0]
    launches = [x for x in dev.launches[n:] if "_moe_up_nvfp4_" in x.function or "_moe_down_nvfp4_" in x.function]
    for launch, slot in zip(launches[:2], (layer["experts_gate_up"], layer["experts_down"])):
        ptrs = [int.from_bytes(p, "little") for p in launch.params[1:4]]
        assert ptrs == [base + slot.offset, base + slot.scale_offset, base + slot.gscale_offset]


def test_prefill_dequantises_each_layer_before_the_grouped_gemms(runner):
    prefill = runner.kernels.moe_prefill
    assert prefill is not None and prefill.dequant_family == "dequant_nvfp4"
    kinds = _kinds(_moe_launches(runner, 40, prefill=True))
    # Per layer: the routing (its logits by the router GEMM, not a `moe` launch), the two stacks
    # dequantised (gate/up K = 256, down K = 64), then the grouped path on the bf16 copies. (The
    # NVFP4 projections' own dequants come before the routing.)
    per_layer = ["route", "k256", "k64", "perm", "gather", "gemm_gate_up", "gemm_down", "combine"]
    starts = [j for j, kind in enumerate(kinds) if kind == "route"]
    assert len(starts) == runner.config.num_hidden_layers
    for j in starts:
        assert kinds[j:j + len(per_layer)] == per_layer
    assert prefill.buffer_sizes(64, 256, 64)["moe_dequant"] == 9 * 3 * 64 * 256 * 2


def test_a_short_prefill_reads_the_routed_experts_in_place(runner):
    assert _kinds(_moe_launches(runner, 5, prefill=True))[-3:] == ["route", "up_nvfp4", "down_nvfp4"]


def test_synthetic_nvfp4_moe_weights_fill_codes_scales_and_globals():
    """nvfp4_recipe_format on a MoE config: experts nvfp4, the router and shared gate bf16;
    fill_synthetic draws every stack's globals so a weight's std is about 1 / sqrt(fan_in)."""
    from runtime.artifact.formats import E2M1_VALUES
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.weights import NVFP4, WeightLayout, fill_synthetic, nvfp4_recipe_format
    from runtime.model.random_weights import tiny_config_dict

    c = ModelConfig.from_dict(tiny_config_dict("moe", hidden_size=256, num_experts=8, moe_intermediate_size=64,
                                               shared_expert_intermediate_size=64))
    layout = WeightLayout.plan(c, nvfp4_recipe_format)
    assert layout.expert_format == NVFP4 and layout.layers[0]["router"].format == "bf16"
    assert layout.layers[0]["shared_gate"].format == "bf16"
    dev = NullDevice(1 << 30)
    base = dev.mem_alloc(layout.total)
    fill_synthetic(layout, 5, dev, base, dev.create_stream())
    for role, fan_in in (("experts_gate_up", 256), ("experts_down", 64)):
        slot = layout.layers[0][role]
        gscale = np.empty(slot.shape[0], np.float32)
        dev.memcpy_dtoh(gscale, base + slot.gscale_offset)
        unit = np.sqrt(np.mean(E2M1_VALUES ** 2) * 13.0 / 12.0 * fan_in)
        assert (gscale >= 0.5 / unit * (1 - 1e-6)).all() and (gscale <= 1.5 / unit * (1 + 1e-6)).all()


def test_the_35b_a3b_nvfp4_plan_has_its_kernels_and_fits_an_h200():
    """Qwen3.6-35B-A3B with the NVFP4 recipe's formats (`bench.decode --format nvfp4`): experts at
    0.5625 bytes a weight plus globals, every kernel found (the NVFP4 GEMVs of its projections, the
    expert kernels, the stacks' dequants), and with a 8,192-token prefill chunk and batch 8 under
    an H200's 139 GiB."""
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.storage import Storage
    from runtime.model.gpu.weights import NVFP4, WeightLayout, nvfp4_recipe_format
    from runtime.model.shapes import QWEN36_35B_A3B

    c = ModelConfig.from_dict(QWEN36_35B_A3B)
    layout = WeightLayout.plan(c, nvfp4_recipe_format)
    assert layout.expert_format == NVFP4
    stack = layout.layers[0]["experts_gate_up"]
    weights = 257 * 2 * 512 * 2048
    assert stack.nbytes >= weights * 9 // 16 + 257 * 1024 * 4
    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    kernels = built_or_skip(lambda: KernelChoice(lib, c, expert_format=NVFP4))
    assert kernels.moe_up_nvfp4 == "up_nvfp4_h2048_e256_k8_i512"
    assert kernels.moe_down_nvfp4 == "down_nvfp4_h2048_e256_k8_i512"
    assert (kernels.moe_prefill.dequant_gate_up, kernels.moe_prefill.dequant_down) == ("k2048", "k512")
    for fam, key in kernels.required():
        assert (fam, key) in lib.manifest.kernels
    for n, nt, k in layout.nvfp4_shapes():
        kernels.linear_quantised(NVFP4, n, nt, k)  # raises naming a shape nobody compiled
    h200 = NullDevice(139 << 30)
    st = Storage(c, h200, kernels, weight_bytes=layout.total, num_pages=8 * (32768 // 64 + 1), phys_slots=16,
                 max_batch=8, prefill_chunk=8192, max_context=32768 + 64)
    assert h200.total_memory - h200.free_memory() < 60 << 30
    st.release()
