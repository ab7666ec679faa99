"""`CudaRunner` on an FP8 artifact, on the null device: the FP8 projections are uploaded as stored
(codes + block scales), bound to the `gemv_fp8` kernels with their scale pointers, prefill pieces
of more than 16 rows run the activation quantisation + FP8 GEMM (up to 16: the GEMV 8 rows at a
time), and synthetic FP8 weights fill codes and scales. Kernels do not run here;
`tests/gpu/test_cuda_runner_fp8.py` checks values. Needs the built kernels and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemm_fp8_sm90, quantize_act
from runtime.model.gpu import kernels
from runtime.model.gpu.weights import FP8
from runtime.model.runner import DecodeItem, PrefillChunk

from null_cuda import built_or_skip, family_launches, null_runner


@pytest.fixture(scope="module")
def runner(tiny_fp8_path):
    r = null_runner(tiny_fp8_path)
    yield r
    r.close()


def _fp8_launches(launches):
    """(key, [x, w, scale, (tail,) out], M) of every gemv_fp8 launch, in order."""
    return family_launches(launches, "gemv_fp8")


def test_fp8_projections_are_uploaded_as_stored(runner, tiny_fp8_path):
    from runtime.artifact import open_artifact

    text = open_artifact(tiny_fp8_path).component("text")
    lay, dev, base = runner.layout, runner.device, runner.storage.weights_base
    gdn = lay.layers[0]
    assert gdn["w_in"].format == FP8 and gdn["w_in"].shape == (384, 256)  # in_proj_qkv | in_proj_z
    assert gdn["w_in_tail"].format == "bf16" and gdn["w_in_tail"].shape == (8, 256)  # in_proj_b | in_proj_a
    assert lay.layers[3]["w_qkv"].format == FP8 and lay.globals["embed"].format == "bf16"
    slot = gdn["w_in"]
    codes = dev.memcpy_dtoh(np.empty(slot.shape, np.uint8), base + slot.offset)
    scales = dev.memcpy_dtoh(np.empty(slot.scale_shape, np.float32), base + slot.scale_offset)
    qkv, z = "layers.0.linear_attn.in_proj_qkv.weight", "layers.0.linear_attn.in_proj_z.weight"
    np.testing.assert_array_equal(codes, np.concatenate([text.raw(qkv), text.raw(z)]))
    np.testing.assert_array_equal(scales, np.concatenate([text.raw(qkv, "scale"), text.raw(z, "scale")]))
    assert scales.shape == (3, 2) and np.all(scales > 0)
    tail = dev.memcpy_dtoh(np.empty(gdn["w_in_tail"].shape, np.uint16), base + gdn["w_in_tail"].offset)
    np.testing.assert_array_equal(tail[:4], text.raw("layers.0.linear_attn.in_proj_b.weight"))
    assert runner.layout.fp8_shapes() == {(384, 8, 256), (256, 0, 128), (768, 0, 256), (256, 0, 256),
                                          (1024, 0, 256), (256, 0, 512)}


def test_decode_binds_the_fp8_gemv_with_scales_and_tail(runner):
    dev = runner.device
    n = len(dev.launches)
    runner.decode([DecodeItem(slot=0, token_id=5, pos=0, page_table=[0]),
                   DecodeItem(slot=1, token_id=7, pos=0, page_table=[1])])
    launches = _fp8_launches(dev.launches[n:])
    base, buf = runner.storage.weights_base, runner.storage.buf
    # 3 GDN layers x (in, out, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down).
    assert len(launches) == 16 and all(m == 2 for _, _, m in launches)
    gdn = runner.layout.layers[0]
    key, ptrs, _ = launches[0]
    assert key == "tiny_gdn_in_n384_t8_k256_m8"
    assert ptrs == [buf["h"], base + gdn["w_in"].offset, base + gdn["w_in"].scale_offset,
                    base + gdn["w_in_tail"].offset, buf["proj"]]
    key, ptrs, _ = launches[1]
    assert key == "tiny_gdn_out_n256_k128_m8"
    assert ptrs == [buf["gdn_out"], base + gdn["out_proj"].offset, base + gdn["out_proj"].scale_offset, buf["delta"]]
    # A decode step's gate/up runs with SiLU(gate) * up as its epilogue (kernels.gate_up_silu):
    # straight into the MLP's activation buffer, no silu_mul launch.
    assert {k for k, _, _ in launches} == {"tiny_gdn_in_n384_t8_k256_m8", "tiny_gdn_out_n256_k128_m8",
                                           "tiny_attn_qkv_n768_k256_m8", "tiny_o_proj_n256_k256_m8",
                                           "tiny_gate_up_n1024_k256_m8_silu", "tiny_down_n256_k512_m8"}
    gate_up = runner.layout.layers[0]["w_gate_up"]
    assert [ptrs for key, ptrs, _ in launches if key.endswith("_silu")][0] == [
        buf["h"], base + gate_up.offset, base + gate_up.scale_offset, buf["act"]]
    assert family_launches(dev.launches[n:], "silu_mul") == []


def test_gate_up_silu_off_or_past_8_rows_runs_the_gemv_and_silu_mul(monkeypatch, runner, tiny_fp8_path):
    """With GATE_UP_SILU off a decode step runs the plain gate/up GEMV and silu_mul; so does a
    prefill piece of more than 8 rows with it on (the fused variant takes up to 8)."""
    dev = runner.device
    n = len(dev.launches)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 13)), start_pos=0, page_table=[0]))
    assert [m for _, _, m in family_launches(dev.launches[n:], "silu_mul")] == [12] * 4
    monkeypatch.setattr(kernels, "GATE_UP_SILU", False)
    off = null_runner(tiny_fp8_path)
    try:
        assert off.kernels.gate_up_silu(FP8, 1024, 256) is None
        n = len(off.device.launches)
        off.decode([DecodeItem(slot=0, token_id=5, pos=0, page_table=[0])])
        new = off.device.launches[n:]
        assert [k for k, _, _ in _fp8_launches(new) if k.startswith("tiny_gate_up")] == ["tiny_gate_up_n1024_k256_m8"] * 4
        assert [m for _, _, m in family_launches(new, "silu_mul")] == [1] * 4
    finally:
        off.close()


def test_prefill_of_more_than_16_rows_runs_the_fp8_gemm(runner):
    """20 rows: every FP8 linear quantises its input rows, then runs the block-scaled GEMM over
    all of them at once; the GDN input projection's BF16 tail is the BF16 GEMM writing columns
    384.. of the same 392-wide rows. No FP8 GEMV runs."""
    dev = runner.device
    n = len(dev.launches)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 21)), start_pos=0, page_table=[0]))
    new = dev.launches[n:]
    assert _fp8_launches(new) == []
    quant = family_launches(new, "quantize_act")
    gemm = family_launches(new, "gemm_fp8_sm90")
    # 3 GDN layers x (in, out, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down).
    assert len(quant) == len(gemm) == 16 and all(m == 20 for _, _, m in quant + gemm)
    buf, base = runner.storage.buf, runner.storage.weights_base
    gdn = runner.layout.layers[0]
    # The runner's forms (kernels.QUANTIZE_ACT_FORM, kernels.GEMM_FP8_FORM) name the variants.
    form = kernels.QUANTIZE_ACT_FORM
    suffix = "" if form == quantize_act.DEFAULT_FORM else f"_{form}"
    assert quant[0] == (f"k256{suffix}", [buf["h"], buf["fp8_x"], buf["fp8_scale"]], 20)
    # Pointer parameters x_scale, w_scale, out (x and w travel as TMA descriptors).
    assert gemm[0] == (gemm_fp8_sm90.key("tiny_gdn_in", 384, 8, 256, kernels.GEMM_FP8_FORM),
                       [buf["fp8_scale"], base + gdn["w_in"].scale_offset, buf["proj"]], 20)
    assert quant[1][0] == f"k128{suffix}"
    assert gemm[1][0] == gemm_fp8_sm90.key("tiny_gdn_out", 256, 0, 128, kernels.GEMM_FP8_FORM)
    assert gemm[1][1] == [buf["fp8_scale"], base + gdn["out_proj"].scale_offset, buf["delta"]]
    tails = [t for t in family_launches(new, "gemm") if "_tail_" in t[0]]
    assert [(key, ptrs[-1], m) for key, ptrs, m in tails] == [("tiny_gdn_in_tail_n8_k256_ld392", buf["proj"] + 384 * 2,
                                                               20)] * 3
    # The quantised activations fit the widest FP8 input (down: K = 512) of a 64-row piece.
    assert buf["fp8_scale"] - buf["fp8_x"] >= 64 * 512


def test_prefill_of_16_rows_or_fewer_keeps_the_fp8_gemv(runner):
    """A piece of at most 16 rows (the BF16 path's GEMV bound) runs the FP8 GEMV 8 rows a launch."""
    dev = runner.device
    n = len(dev.launches)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 13)), start_pos=0, page_table=[0]))
    new = dev.launches[n:]
    assert family_launches(new, "quantize_act") == [] and family_launches(new, "gemm_fp8_sm90") == []
    launches = _fp8_launches(new)
    gate_up = [(ptrs, m) for key, ptrs, m in launches if key.startswith("tiny_gate_up")]
    assert len(gate_up) == 4 * 2  # 4 layers x cdiv(12, 8) pieces
    h, proj = runner.storage.buf["h"], runner.storage.buf["proj"]
    assert [m for _, m in gate_up[:2]] == [8, 4]
    assert [p[0] - h for p, _ in gate_up[:2]] == [0, 8 * 256 * 2]  # x rows
    assert [p[3] - proj for p, _ in gate_up[:2]] == [0, 8 * 1024 * 2]  # out rows
    gdn_in = [(ptrs, m) for key, ptrs, m in launches if key.startswith("tiny_gdn_in")]
    assert [p[4] - proj for p, _ in gdn_in[:2]] == [0, 8 * 392 * 2]  # rows N + NT = 392 wide


def test_a_missing_fp8_shape_names_it_and_the_build_command(runner):
    from runtime.cuda.errors import KernelMissing

    with pytest.raises(KernelMissing, match=r"fp8 4096x256 weight.*gemv_fp8\.py.*build_kernels\.py --arch sm_90a"):
        runner.kernels.linear_quantised(FP8, 4096, 0, 256)
    with pytest.raises(KernelMissing, match="with a 16-row bf16 tail"):
        runner.kernels.linear_quantised(FP8, 384, 16, 256)


def test_mixed_formats_other_than_an_fp8_head_and_bf16_tail_are_refused():
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.weights import WeightLayout, fp8_recipe_format
    from tools.make_tiny import tiny_text_config

    ids = {"<|endoftext|>": 0, "<|image_pad|>": 1, "<|video_pad|>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4}
    config = ModelConfig.from_dict(tiny_text_config("dense", 512, ids, tie=False)["text_config"])
    bf16_q = lambda name: "bf16" if name.endswith("q_proj.weight") else fp8_recipe_format(name)  # noqa: E731
    with pytest.raises(NotImplementedError, match=r"q_proj.*'bf16', 'fp8_e4m3', 'fp8_e4m3'"):
        WeightLayout.plan(config, bf16_q)
    # All four GDN input parts in FP8: in_proj_b's 4 rows leave a partial scale block mid-matrix.
    with pytest.raises(NotImplementedError, match="in_proj_b.weight has 4 rows, not a multiple of 128"):
        WeightLayout.plan(config, lambda name: FP8)
    # A quantised run must be followed by BF16 parts only, not by another quantised format.
    nvfp4_then_fp8 = lambda name: "nvfp4" if name.endswith("in_proj_qkv.weight") else FP8  # noqa: E731
    with pytest.raises(NotImplementedError,
                       match=r"in_proj_qkv.*'nvfp4', 'fp8_e4m3'.*FP8 / NVFP4 parts followed by BF16"):
        WeightLayout.plan(config, nvfp4_then_fp8)


def test_synthetic_fp8_weights_fill_codes_and_scales(runner):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import fp8_recipe_format

    syn = built_or_skip(lambda: CudaRunner.synthetic(runner.config, 3, num_pages=4, num_slots=1, max_batch=1,
                                             device=NullDevice(total_memory=1 << 30), prefill_chunk=64,
                                             weight_formats=fp8_recipe_format))
    try:
        assert syn.layout.fp8_shapes() == runner.layout.fp8_shapes()
        slot = syn.layout.layers[1]["w_gate_up"]
        base = syn.storage.weights_base
        codes = syn.device.memcpy_dtoh(np.empty(slot.shape, np.uint8), base + slot.offset)
        scales = syn.device.memcpy_dtoh(np.empty(slot.scale_shape, np.float32), base + slot.scale_offset)
        assert not np.isin(codes & 0x7F, [0x7F]).any()  # no NaN codes
        assert len(np.unique(codes)) > 200  # spread over the e4m3 range
        bound = np.sqrt(3.0 / 256) / 448
        assert np.all(scales >= 0.5 * bound) and np.all(scales <= 1.5 * bound) and scales.std() > 0
        n = len(syn.device.launches)
        syn.decode([DecodeItem(slot=0, token_id=1, pos=0, page_table=[0])])
        assert len(_fp8_launches(syn.device.launches[n:])) == 16
    finally:
        syn.close()
