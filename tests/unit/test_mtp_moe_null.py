"""`CudaRunner`'s MTP head with a MoE MLP (the 35B-A3B's) on the null device: the head's expert
weights placed and uploaded as a main MoE layer's, and its launches: the MoE decode form for the
chained drafts, the grouped prefill GEMMs for a long catch-up, each bound to the head's own slots.

Kernels do not run here; tests/gpu/test_mtp_moe_cuda.py checks the drafts against `NumpyRunner`
on a GPU. Needs the built kernels and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import MtpRow, PrefillChunk

from null_cuda import built_or_skip, family_launches

SHAPE = dict(num_pages=16, num_slots=8, prefill_chunk=64)

@pytest.fixture(scope="module")
def runner(tiny_moe_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_path, device=NullDevice(total_memory=2 << 30),
                                                       mtp=True, **SHAPE))
    yield r
    r.close()


def _read_bf16(r, slot, cols: int) -> np.ndarray:
    from cute_kernels import bf16

    out = np.empty(slot.shape[0] * cols, np.uint16)
    r.device.memcpy_dtoh(out, r.storage.weights_base + slot.offset)
    return bf16.from_bits(out.reshape(-1, cols))


def test_the_head_layer_has_the_moe_slots_filled_from_the_mtp_component(runner, tiny_moe_path):
    from runtime.artifact import open_artifact

    c, lay = runner.config, runner.layout
    e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
    head = lay.mtp_layers[0]
    assert set(head) == {"input_norm", "post_norm", "w_qkv", "o_proj", "q_norm", "k_norm", "router", "shared_gate",
                         "experts_gate_up", "experts_down"}
    # The same shapes as a main MoE layer's, so the same kernels serve both.
    main = lay.layers[3]
    assert {role: head[role].shape for role in ("router", "experts_gate_up", "experts_down")} == \
        {role: main[role].shape for role in ("router", "experts_gate_up", "experts_down")}
    assert head["experts_gate_up"].shape == ((e + 1) * 2 * i, h) and head["experts_down"].shape == ((e + 1) * h, i)
    mtp = open_artifact(tiny_moe_path).component("mtp")
    m = "layers.0.mlp."
    gate_up = _read_bf16(runner, head["experts_gate_up"], h).reshape(e + 1, 2 * i, h)
    down = _read_bf16(runner, head["experts_down"], i).reshape(e + 1, h, i)
    np.testing.assert_array_equal(gate_up[:e], mtp.f32(m + "experts.gate_up_proj"))
    np.testing.assert_array_equal(gate_up[e, :i], mtp.f32(m + "shared_expert.gate_proj.weight"))
    np.testing.assert_array_equal(gate_up[e, i:], mtp.f32(m + "shared_expert.up_proj.weight"))
    np.testing.assert_array_equal(down[:e], mtp.f32(m + "experts.down_proj"))
    np.testing.assert_array_equal(down[e], mtp.f32(m + "shared_expert.down_proj.weight"))
    np.testing.assert_array_equal(_read_bf16(runner, head["router"], h), mtp.f32(m + "gate.weight"))
    np.testing.assert_array_equal(_read_bf16(runner, head["shared_gate"], h),
                                  mtp.f32(m + "shared_expert_gate.weight"))


def _draft(r, prompt: int, drafts: int):
    """Prefill `prompt` tokens in slot 0, then one MTP row over them; the launches of the draft."""
    r.prefill(PrefillChunk(slot=0, token_ids=list(range(1, prompt + 1)), start_pos=0, page_table=[0]))
    n = len(r.device.launches)
    r.mtp_draft([MtpRow(0, list(range(2, prompt + 2)), 0, [0], drafts)])
    return r.device.launches[n:]


def test_short_catch_up_and_chained_drafts_run_the_decode_form_on_the_head_weights(runner):
    """A 4-row catch-up and two chained drafts (3 drafts, one graph): each step's MoE MLP is the
    decode form (logits_wide, route_up, down_wide: fewer rows than MOE_UP_WIDE_ROWS) over its rows,
    bound to the head's router and experts, none to a main layer's."""
    from runtime.model.gpu.kernels import MOE_DECODE_ROWS, MOE_UP_WIDE_ROWS

    if not runner.samples_on_device:
        pytest.skip("the sampling kernels were not built")
    assert 4 <= MOE_DECODE_ROWS and (MOE_UP_WIDE_ROWS is None or 4 < MOE_UP_WIDE_ROWS)
    launches = _draft(runner, 4, 3)
    moe = family_launches(launches, "moe")
    assert not family_launches(launches, "moe_grouped")
    kinds = [key.split("_h")[0].split("_e")[0] for key, _, _ in moe]
    assert kinds == ["logits_wide", "route_up", "down_wide"] * 3  # the catch-up, then two chained steps
    assert [rows for _, _, rows in moe] == [4, 4, 4, 1, 1, 1, 1, 1, 1]
    base, head = runner.storage.weights_base, runner.layout.mtp_layers[0]
    for logits, route_up, down in zip(*[iter(moe)] * 3):
        assert logits[1][1] == base + head["router"].offset
        assert route_up[1][2] == base + head["shared_gate"].offset
        assert route_up[1][3] == base + head["experts_gate_up"].offset
        assert down[1][1] == base + head["experts_down"].offset


def test_a_long_catch_up_runs_the_grouped_prefill_gemms_on_the_head_weights(runner):
    """40 catch-up rows (past MOE_DECODE_ROWS; not exact, like the head's projection GEMMs): the
    router logits by the router GEMM and the routing, then the grouped path (perm, gather, gate/up
    GEMM, SwiGLU, down GEMM, combine), every weight the head's own."""
    from runtime.model.gpu.kernels import MOE_DECODE_ROWS

    prompt = 40
    assert prompt > MOE_DECODE_ROWS and runner.kernels.moe_prefill is not None
    launches = _draft(runner, prompt, 0)
    moe = family_launches([launch for launch in launches if "_moe_grouped_" not in launch.function], "moe")
    assert [key.split("_h")[0].split("_e")[0] for key, _, _ in moe] == ["route"]
    grouped = [launch.function for launch in launches if "_moe_grouped_" in launch.function]
    order = ["perm", "gather", "gemm_gate_up", "gemm_down", "combine"]
    assert [next(kind for kind in order if f"_moe_grouped_{kind}_" in name) for name in grouped] == order
    base, head = runner.storage.weights_base, runner.layout.mtp_layers[0]
    assert moe[0][1][2] == base + head["shared_gate"].offset

    def weight(name: str) -> int:
        """The weight address of the one launch named `name` (the null device's TMA descriptor of
        its w starts with the address: parameters x_desc, x_rows, w_desc, ...)."""
        (launch,) = [launch for launch in launches if name in launch.function]
        return int.from_bytes(launch.params[2][:8], "little")

    assert weight("tiny_router") == base + head["router"].offset
    assert weight("_moe_grouped_gemm_gate_up_") == base + head["experts_gate_up"].offset
    assert weight("_moe_grouped_gemm_down_") == base + head["experts_down"].offset


def test_the_35b_a3b_head_plans():
    """The 35B-A3B shape with its MTP head (what `bench/mtp_round.py` times): the head layer is a
    MoE layer of the main layers' shapes (so the main layers' MoE variants, decode and grouped,
    serve it), and every projection it runs has a kernel at the catch-up's and the drafts' row
    counts (the null device cannot hold the 70 GB of synthetic weights to go further)."""
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.weights import WeightLayout
    from runtime.model.shapes import QWEN36_35B_A3B

    c = ModelConfig.from_dict(QWEN36_35B_A3B)
    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    choice = built_or_skip(lambda: KernelChoice(lib, c))
    head = WeightLayout.plan(c, mtp=True).mtp_layers[0]
    # 257 experts (the shared one last) of gate/up [2 x 512, 2048] and down [2048, 512], bf16.
    assert head["experts_gate_up"].nbytes == 257 * 1024 * 2048 * 2
    assert head["experts_down"].nbytes == 257 * 2048 * 512 * 2
    assert head["router"].shape == (256, 2048) and choice.moe_prefill is not None
    for shape in ((2048, 4096), head["w_qkv"].shape, head["o_proj"].shape):  # fc, then the layer's
        assert choice.linear(*shape, 512)[0] == "gemm_sm90"
        assert choice.linear(*shape, 8, exact=True)[0] == "gemv"
    assert choice.linear(c.vocab_size, 2048, 8)[0] == "gemv"  # the lm_head over the draft rows
