"""`CudaRunner` on a Qwen3-Next model, on the null device: the tiny model loads (its GDN
projections already in the split form, so a Next layer is a Qwen3.5-MoE layer) and routes with
the renormalising kernels, and the Next-80B-A3B shape plans: its MoE kernels (512 experts, top
10) were built with the grids of `cute_kernels/moe.py`, and its expert stacks have the expected size.
Values are checked on a GPU by tests/gpu/test_cuda_runner_next.py.
"""

from __future__ import annotations

import pytest

from null_cuda import built_or_skip


def test_the_tiny_next_model_loads_with_the_renormalising_route(tiny_next_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_next_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    try:
        assert r.config.family == "next"
        for key in (r.kernels.moe_route, r.kernels.moe_route_up):
            cfg = r.library.manifest.kernels[("moe", key)].config
            assert (cfg["E"], cfg["K"], cfg["renorm"]) == (8, 2, True)
        assert set(r.layout.layers[3]) >= {"w_qkv", "o_proj", "router", "experts_gate_up", "experts_down"}
    finally:
        r.close()


def test_a_next_model_without_norm_topk_prob_needs_the_softmax_over_all_route():
    """norm_topk_prob false: the route kernels that divide by the sum over all E experts, which
    no shape was built for: the error names the family and the renorm flag."""
    from runtime.cuda.errors import KernelMissing
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.shapes import QWEN3_NEXT_80B_A3B

    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    c = ModelConfig.from_dict({**QWEN3_NEXT_80B_A3B, "norm_topk_prob": False})
    with pytest.raises(KernelMissing, match=r"no moe kernel for MoE top-k routing \(kind=route, renorm=False"):
        KernelChoice(lib, c)


def test_the_next_80b_shape_plans():
    from runtime.cuda.expr import evaluate
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import FULL_ATTENTION, ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.weights import WeightLayout
    from runtime.model.shapes import QWEN3_NEXT_80B_A3B

    c = ModelConfig.from_dict(QWEN3_NEXT_80B_A3B)
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.vocab_size, c.rotary_dim) == (
        "next", 512, 10, 151936, 64)
    assert c.layer_types.count(FULL_ATTENTION) == 12 and c.mrope_section is None and c.norm_topk_prob
    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    choice = built_or_skip(lambda: KernelChoice(lib, c))
    layout = WeightLayout.plan(c)
    # Per layer: the router [512, 2048], the shared gate, 513 experts of 3 x 512 x 2048 bf16.
    moe = sum(layer[role].nbytes for layer in layout.layers
              for role in ("router", "shared_gate", "experts_gate_up", "experts_down"))
    assert moe == 48 * (512 * 2048 + 2048 + 513 * 3 * 512 * 2048) * 2
    grids = [tuple(evaluate(g, {"M": 8}) for g in lib.manifest.kernels[("moe", key)].grid)
             for key in (choice.moe_logits, choice.moe_route, choice.moe_up, choice.moe_down,
                         choice.moe_logits_wide, choice.moe_route_up, choice.moe_down_wide)]
    # 11 slots a row (10 routed + the shared expert); the router's 512 rows over 8 warps a CTA.
    assert grids == [(8, 64, 1), (8, 1, 1), (88, 32, 1), (8, 128, 1), (8, 64, 1), (88, 64, 1), (8, 256, 1)]
    assert choice.moe_prefill is not None and choice.moe_prefill.experts == 513 and choice.moe_prefill.slots == 11
