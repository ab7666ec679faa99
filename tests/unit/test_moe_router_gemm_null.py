"""The MoE router logits by the FP32-out GEMM on the null device: which variant `KernelChoice` picks
(never for a BF16 projection), and which steps launch it: a prefill chunk past MOE_DECODE_ROWS
rows, not decode rows nor a verification step (whose rows must equal decode's bit for bit).
Values are checked on a GPU (tests/gpu/test_moe_router_gemm.py)."""

from __future__ import annotations

import pytest

from runtime.model.runner import PrefillChunk, StepRow

from null_cuda import built_or_skip

@pytest.fixture(scope="module")
def runner(tiny_moe_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_path, num_pages=16, num_slots=16, max_batch=2,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    yield r
    r.close()


def _ptr(raw: bytes) -> int:
    return int.from_bytes(raw, "little")


def test_the_router_gemm_is_the_fp32_variant_of_the_router_shape():
    from runtime.cuda.errors import KernelMissing
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.shapes import QWEN36_35B_A3B

    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    choice = built_or_skip(lambda: KernelChoice(lib, ModelConfig.from_dict(QWEN36_35B_A3B)))
    assert choice.moe_router_gemm == "a3b_router_n256_k2048"
    entry = lib.manifest.kernels[("gemm_sm90", choice.moe_router_gemm)]
    assert entry.config["out"] == "f32" and entry.tensors["out"].dtype == "f32"
    assert ("gemm_sm90", choice.moe_router_gemm) in choice.required()
    # A BF16 projection of the router's shape does not take the FP32-out variant.
    with pytest.raises(KernelMissing, match="256x2048 weight at M=512"):
        choice.linear(256, 2048, 512)


def _moe_kinds(launches) -> list[str]:
    """"router" (the GEMM), or the moe kernel's kind, of each router / routing launch."""
    out = []
    for launch in launches:
        name = launch.function
        if name.startswith("infx_gemm_") and "router" in name:
            out.append("router")
        elif name.startswith("infx_moe_") and not name.startswith("infx_moe_grouped_"):
            kind = name[len("infx_moe_"):].split("_h")[0].split("_e")[0]
            if kind in ("logits", "logits_wide", "route", "route_up"):
                out.append(kind)
    return out


def test_a_prefill_chunk_takes_its_router_logits_from_the_gemm(runner):
    st, c = runner.storage, runner.config
    assert runner.kernels.moe_router_gemm == "tiny_router_n8_k256"
    n = len(runner.device.launches)
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 41)), start_pos=0, page_table=[0]))
    launches = runner.device.launches[n:]
    assert _moe_kinds(launches) == ["router", "route"] * c.num_hidden_layers
    gemms = [launch for launch in launches if "tiny_router" in launch.function]
    routes = [launch for launch in launches if launch.function.startswith("infx_moe_route_")]
    for gemm, route, layer in zip(gemms, routes, runner.layout.layers):
        # The GEMM's parameters: [x_desc, x_rows, w_desc, out, M]; the route kernel reads its out.
        assert _ptr(gemm.params[3]) == _ptr(route.params[0]) == st.buf["moe_logits"]
        assert int.from_bytes(gemm.params[1], "little") == int.from_bytes(gemm.params[4], "little") == 40
        assert _ptr(route.params[2]) == st.weights_base + layer["shared_gate"].offset


def test_decode_and_verification_rows_keep_the_logits_kernels(runner):
    """A decode step (the decode form's logits_wide) and a verification step of 2 x 5 = 10 rows,
    past MOE_DECODE_ROWS (the split form's logits: its rows must equal decode's bit for bit)."""
    from runtime.model.gpu.kernels import MOE_DECODE_ROWS

    c = runner.config
    for slot in (0, 1):
        runner.reset_slot(slot)
        runner.prefill(PrefillChunk(slot=slot, token_ids=[1, 2, 3], start_pos=0, page_table=[slot]))
    n = len(runner.device.launches)
    runner.step([StepRow(slot=0, token_ids=[4], start_pos=3, page_table=[0])])
    assert _moe_kinds(runner.device.launches[n:]) == ["logits_wide", "route_up"] * c.num_hidden_layers
    assert 2 * 5 > MOE_DECODE_ROWS
    n = len(runner.device.launches)
    runner.step([StepRow(slot=s, token_ids=[4, 5, 6, 7, 8], start_pos=3, page_table=[s], logits="all",
                         snapshots=list(range(4 + 5 * s, 9 + 5 * s))) for s in (0, 1)])
    assert _moe_kinds(runner.device.launches[n:]) == ["logits", "route"] * c.num_hidden_layers
