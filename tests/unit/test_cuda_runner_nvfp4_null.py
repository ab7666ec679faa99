"""`CudaRunner` on an NVFP4 artifact, on the null device: the NVFP4 projections are uploaded as
stored (codes, e4m3 block scales) with each part's global scale repeated over its rows, bound to
the `gemv_nvfp4` kernels with their three pointers, prefill pieces of more than 16 rows decode
each weight to bf16 and run the BF16 GEMM (up to 16: the GEMV 8 rows at a time), and
synthetic NVFP4 weights fill codes, scales and globals. Kernels do not run here;
`tests/gpu/test_cuda_runner_nvfp4.py` checks values. Needs the built kernels and skips without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gemv_nvfp4
from runtime.model.gpu.kernels import GEMV_FORMS
from runtime.model.gpu.weights import NVFP4
from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

from null_cuda import built_or_skip, family_launches, null_runner

# The runner's NVFP4 GEMV form (`kernels.GEMV_FORMS`) tags every key but the family's first form's.
_FORM = GEMV_FORMS[NVFP4]
_TAG = "" if _FORM == next(iter(gemv_nvfp4.FORMS)) else f"_{_FORM}"
TINY_KEYS = {key + _TAG for key in ("tiny_gdn_in_n384_t8_k256_m8", "tiny_gdn_out_n256_k128_m8",
                                    "tiny_attn_qkv_n768_k256_m8", "tiny_o_proj_n256_k256_m8",
                                    "tiny_gate_up_n1024_k256_m8", "tiny_down_n256_k512_m8")}
# A step of up to 8 rows runs gate/up with its SiLU epilogue (`kernels.gate_up_silu`, built in the
# runner's form) in place of the plain GEMV and silu_mul.
DECODE_KEYS = TINY_KEYS - {"tiny_gate_up_n1024_k256_m8" + _TAG} | {"tiny_gate_up_n1024_k256_m8_silu"}

@pytest.fixture(scope="module")
def runner(tiny_nvfp4_path):
    r = null_runner(tiny_nvfp4_path)
    yield r
    r.close()


def _nvfp4_launches(launches):
    """(key, [x, w, scale, gscale, (tail,) out], M) of every gemv_nvfp4 launch, in order."""
    return family_launches(launches, "gemv_nvfp4")


def test_nvfp4_projections_are_uploaded_as_stored(runner, tiny_nvfp4_path):
    from runtime.artifact import open_artifact

    text = open_artifact(tiny_nvfp4_path).component("text")
    lay, dev, base = runner.layout, runner.device, runner.storage.weights_base
    gdn = lay.layers[0]
    assert gdn["w_in"].format == NVFP4 and gdn["w_in"].shape == (384, 256)  # in_proj_qkv | in_proj_z
    assert gdn["w_in_tail"].format == "bf16" and gdn["w_in_tail"].shape == (8, 256)  # in_proj_b | in_proj_a
    assert lay.layers[3]["w_qkv"].format == NVFP4 and lay.globals["lm_head"].format == "bf16"
    slot = gdn["w_in"]
    codes = dev.memcpy_dtoh(np.empty((384, 128), np.uint8), base + slot.offset)
    scales = dev.memcpy_dtoh(np.empty((384, 16), np.uint8), base + slot.scale_offset)
    gscale = dev.memcpy_dtoh(np.empty(384, np.float32), base + slot.gscale_offset)
    qkv, z = "layers.0.linear_attn.in_proj_qkv.weight", "layers.0.linear_attn.in_proj_z.weight"
    np.testing.assert_array_equal(codes, np.concatenate([text.raw(qkv), text.raw(z)]))
    np.testing.assert_array_equal(scales, np.concatenate([text.raw(qkv, "scale"), text.raw(z, "scale")]))
    (g_qkv,), (g_z,) = text.raw(qkv, "global_scale"), text.raw(z, "global_scale")
    np.testing.assert_array_equal(gscale, np.repeat(np.float32([g_qkv, g_z]), [256, 128]))
    # The slot's bytes end with the globals; the tail follows.
    assert slot.scale_offset >= slot.offset + 384 * 128 and slot.gscale_offset >= slot.scale_offset + 384 * 16
    assert gdn["w_in_tail"].offset >= slot.gscale_offset + 384 * 4 == slot.offset + slot.nbytes
    tail = dev.memcpy_dtoh(np.empty(gdn["w_in_tail"].shape, np.uint16), base + gdn["w_in_tail"].offset)
    np.testing.assert_array_equal(tail[:4], text.raw("layers.0.linear_attn.in_proj_b.weight"))
    assert runner.layout.nvfp4_shapes() == {(384, 8, 256), (256, 0, 128), (768, 0, 256), (256, 0, 256),
                                            (1024, 0, 256), (256, 0, 512)}
    assert runner.layout.fp8_shapes() == set()


def test_each_part_and_row_group_keeps_its_global_scale_row_by_row():
    """The tiny artifact's parts happen to share one global; a part of two row groups after
    another part, each with its own globals, lands row by row at the slot's global offsets."""
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.weights import Slot, _upload_nvfp4_scales

    rng = np.random.default_rng(1)
    parts = {"a": (rng.integers(0, 256, (32, 8), dtype=np.uint8), np.float32([0.5])),
             "b": (rng.integers(0, 256, (48, 8), dtype=np.uint8), np.float32([2.0, 3.0]))}

    class Source:
        def raw(self, name, part):
            return parts[name][0 if part == "scale" else 1]

    dev = NullDevice(total_memory=1 << 20)
    base = dev.mem_alloc(1 << 16)
    slot = Slot(0, (80, 128), (("a", 32), ("b", 48)), format=NVFP4, scale_offset=8192, gscale_offset=16384)
    offsets = (base + slot.scale_offset, base + slot.gscale_offset)
    offsets = _upload_nvfp4_scales(Source(), "a", 1, 32, slot, dev, *offsets, None)
    assert offsets == (base + 8192 + 32 * 8, base + 16384 + 32 * 4)
    _upload_nvfp4_scales(Source(), "b", 2, 48, slot, dev, *offsets, None)
    scales = dev.memcpy_dtoh(np.empty((80, 8), np.uint8), base + slot.scale_offset)
    np.testing.assert_array_equal(scales, np.concatenate([parts["a"][0], parts["b"][0]]))
    gscale = dev.memcpy_dtoh(np.empty(80, np.float32), base + slot.gscale_offset)
    np.testing.assert_array_equal(gscale, np.repeat(np.float32([0.5, 2.0, 3.0]), [32, 24, 24]))
    with pytest.raises(ValueError, match="b has 2 global scales for 3 row groups"):
        _upload_nvfp4_scales(Source(), "b", 3, 48, slot, dev, *offsets, None)
    with pytest.raises(ValueError, match=r"a has block scales \(32, 8\), 40 x 128 needs \(40, 8\)"):
        _upload_nvfp4_scales(Source(), "a", 1, 40, slot, dev, *offsets, None)


def test_decode_binds_the_nvfp4_gemv_with_scales_globals_and_tail(runner):
    dev = runner.device
    n = len(dev.launches)
    runner.decode([DecodeItem(slot=0, token_id=5, pos=0, page_table=[0]),
                   DecodeItem(slot=1, token_id=7, pos=0, page_table=[1])])
    launches = _nvfp4_launches(dev.launches[n:])
    base, buf = runner.storage.weights_base, runner.storage.buf
    # 3 GDN layers x (in, out, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down).
    assert len(launches) == 16 and all(m == 2 for _, _, m in launches)
    gdn = runner.layout.layers[0]
    w_in, out_proj = gdn["w_in"], gdn["out_proj"]
    key, ptrs, _ = launches[0]
    assert key == "tiny_gdn_in_n384_t8_k256_m8" + _TAG
    assert ptrs == [buf["h"], base + w_in.offset, base + w_in.scale_offset, base + w_in.gscale_offset,
                    base + gdn["w_in_tail"].offset, buf["proj"]]
    key, ptrs, _ = launches[1]
    assert key == "tiny_gdn_out_n256_k128_m8" + _TAG
    assert ptrs == [buf["gdn_out"], base + out_proj.offset, base + out_proj.scale_offset,
                    base + out_proj.gscale_offset, buf["delta"]]
    assert {k for k, _, _ in launches} == DECODE_KEYS
    gate_up = runner.layout.layers[0]["w_gate_up"]
    assert [ptrs for k, ptrs, _ in launches if k.endswith("_silu")][0] == [
        buf["h"], base + gate_up.offset, base + gate_up.scale_offset, base + gate_up.gscale_offset, buf["act"]]
    assert family_launches(dev.launches[n:], "silu_mul") == []


def test_prefill_of_more_than_16_rows_decodes_each_weight_then_runs_the_bf16_gemm(runner):
    """20 rows: every NVFP4 linear is decoded to bf16 into one scratch (`dequant_nvfp4`, N rows)
    and multiplied by the BF16 GEMM over all rows; the GDN input projection's head and its BF16
    tail are the strided GEMMs writing columns 0..383 and 384..391 of the 392-wide rows."""
    dev = runner.device
    n = len(dev.launches)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 21)), start_pos=0, page_table=[0]))
    new = dev.launches[n:]
    assert _nvfp4_launches(new) == []
    buf, base = runner.storage.buf, runner.storage.weights_base
    gdn = runner.layout.layers[0]
    decode = family_launches(new, "dequant_nvfp4")
    # 3 GDN layers x (in, out, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down).
    assert len(decode) == 16
    assert decode[0] == ("k256", [base + gdn["w_in"].offset, base + gdn["w_in"].scale_offset,
                                  base + gdn["w_in"].gscale_offset, buf["nvfp4_w"]], 384)
    assert decode[1] == ("k128", [base + gdn["out_proj"].offset, base + gdn["out_proj"].scale_offset,
                                  base + gdn["out_proj"].gscale_offset, buf["nvfp4_w"]], 256)
    gemms = family_launches(new, "gemm")  # gemm_sm90 (TMA descriptors left out: out, then M)
    assert gemms[:4] == [("tiny_gdn_in_head_n384_k256_ld392", [buf["proj"]], 20),
                         ("tiny_gdn_in_tail_n8_k256_ld392", [buf["proj"] + 384 * 2], 20),
                         ("tiny_gdn_out_n256_k128", [buf["delta"]], 20),
                         ("tiny_gate_up_n1024_k256", [buf["proj"]], 20)]
    # The scratch holds the largest NVFP4 weight (gate_up, 1024 x 256) in bf16: the next buffer
    # starts at least that far after it.
    after = min(ptr for ptr in buf.values() if ptr > buf["nvfp4_w"])
    assert after - buf["nvfp4_w"] >= 1024 * 256 * 2


def test_prefill_of_16_rows_or_fewer_keeps_the_nvfp4_gemv(runner):
    dev = runner.device
    n = len(dev.launches)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 13)), start_pos=0, page_table=[0]))
    new = dev.launches[n:]
    assert family_launches(new, "dequant_nvfp4") == []
    launches = _nvfp4_launches(new)
    gate_up = [(ptrs, m) for key, ptrs, m in launches if key.startswith("tiny_gate_up")]
    assert len(gate_up) == 4 * 2  # 4 layers x cdiv(12, 8) pieces
    h, proj = runner.storage.buf["h"], runner.storage.buf["proj"]
    assert [m for _, m in gate_up[:2]] == [8, 4]
    assert [p[0] - h for p, _ in gate_up[:2]] == [0, 8 * 256 * 2]  # x rows
    assert [p[4] - proj for p, _ in gate_up[:2]] == [0, 8 * 1024 * 2]  # out rows
    assert len({tuple(p[1:4]) for p, _ in gate_up[:2]}) == 1  # the same weights for every piece
    gdn_in = [(ptrs, m) for key, ptrs, m in launches if key.startswith("tiny_gdn_in")]
    assert [p[5] - proj for p, _ in gdn_in[:2]] == [0, 8 * 392 * 2]  # rows N + NT = 392 wide


def test_a_missing_nvfp4_shape_names_it_and_the_build_command(runner):
    from runtime.cuda.errors import KernelMissing

    with pytest.raises(KernelMissing, match=r"nvfp4 4096x256 weight.*gemv_fp8\.py.*build_kernels\.py --arch sm_90a"):
        runner.kernels.linear_quantised(NVFP4, 4096, 0, 256)
    with pytest.raises(KernelMissing, match="with a 16-row bf16 tail"):
        runner.kernels.linear_quantised(NVFP4, 384, 16, 256)


def test_nvfp4_moe_experts_are_planned_and_a_mix_is_refused_by_name():
    """The NVFP4 recipe's MoE model plans with NVFP4 experts (tests/unit/test_cuda_runner_moe_nvfp4_null.py
    runs it); routed NVFP4 experts beside a BF16 shared expert are refused, naming the tensors."""
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.weights import NVFP4, WeightLayout, nvfp4_recipe_format
    from tools.make_tiny import tiny_text_config

    ids = {"<|endoftext|>": 0, "<|image_pad|>": 1, "<|video_pad|>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4}
    config = ModelConfig.from_dict(tiny_text_config("moe", 512, ids, tie=False)["text_config"])
    assert WeightLayout.plan(config, nvfp4_recipe_format).expert_format == NVFP4
    with pytest.raises(NotImplementedError, match=r"experts\.gate_up_proj', .* are \['nvfp4', 'bf16', 'bf16'\]; "
                                                  r".* all in bf16, all in fp8_e4m3 or all in nvfp4"):
        WeightLayout.plan(config, lambda name: "bf16" if "shared_expert" in name else nvfp4_recipe_format(name))


def test_synthetic_nvfp4_weights_fill_codes_scales_and_globals(runner):
    from runtime.artifact import formats
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.gpu.weights import nvfp4_recipe_format

    syn = built_or_skip(lambda: CudaRunner.synthetic(runner.config, 3, num_pages=4, num_slots=1, max_batch=1,
                                                     device=NullDevice(total_memory=1 << 30), prefill_chunk=64,
                                                     weight_formats=nvfp4_recipe_format))
    try:
        assert syn.layout.nvfp4_shapes() == runner.layout.nvfp4_shapes()
        slot = syn.layout.layers[1]["w_gate_up"]
        base, dev = syn.storage.weights_base, syn.device
        codes = dev.memcpy_dtoh(np.empty((1024, 128), np.uint8), base + slot.offset)
        scales = formats.e4m3_to_f32(dev.memcpy_dtoh(np.empty((1024, 16), np.uint8), base + slot.scale_offset))
        gscale = dev.memcpy_dtoh(np.empty(1024, np.float32), base + slot.gscale_offset)
        assert len(np.unique(codes)) == 256  # every code pair
        assert scales.min() >= 0.5 and scales.max() <= 1.5 and scales.std() > 0
        # Codes' mean square 8.5625 (uniform over the e2m1 values), scales' 13 / 12: std 1 / sqrt(256).
        unit = 1.0 / np.sqrt(8.5625 * 13 / 12 * 256)
        assert np.all(gscale >= 0.5 * unit * (1 - 1e-6)) and np.all(gscale <= 1.5 * unit * (1 + 1e-6))
        n = len(dev.launches)
        syn.decode([DecodeItem(slot=0, token_id=1, pos=0, page_table=[0])])
        assert {k for k, _, _ in _nvfp4_launches(dev.launches[n:])} == DECODE_KEYS
    finally:
        syn.close()


def test_the_gemv_form_switch_picks_that_form_of_every_shape(runner, monkeypatch):
    """`kernels.GEMV_FORMS` is the runner's one-line choice among the forms every shape is built
    in: each form of both families resolves to its own tagged key."""
    from cute_kernels import gemv_fp8, gemv_nvfp4
    from runtime.model.gpu import kernels
    from runtime.model.gpu.weights import FP8

    assert kernels.GEMV_FORMS[FP8] in gemv_fp8.FORMS and kernels.GEMV_FORMS[NVFP4] in gemv_nvfp4.FORMS
    for fmt, family in ((FP8, gemv_fp8), (NVFP4, gemv_nvfp4)):
        for i, form in enumerate(family.FORMS):
            monkeypatch.setitem(kernels.GEMV_FORMS, fmt, form)
            got = runner.kernels.linear_quantised(fmt, 1024, 0, 256)
            assert got == (family.FAMILY, "tiny_gate_up_n1024_k256_m8" + (f"_{form}" if i else ""))


def test_a_verification_step_of_an_nvfp4_model_runs_one_wide_launch_per_weight(tiny_nvfp4_path):
    """2 sequences of 1 + 4 tokens (10 rows): every NVFP4 linear is one m16 launch over all 10
    rows in the runner's row-group form (before: two m8 launches, each reading the weight), with
    the weight, scales, globals and tail bound as for decode; 4 sequences of 1 + 4 (20 rows) one
    m32 launch; a decode step keeps the m8 variant."""
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.kernels import quantised_row_forms
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_nvfp4_path, num_pages=16, num_slots=24,
                                                       device=NullDevice(total_memory=2 << 30), prefill_chunk=64))
    try:
        for slot in range(4):
            r.prefill(PrefillChunk(slot=slot, token_ids=[3 + slot, 4], start_pos=0, page_table=[slot]))
        dev = r.device
        for sequences, mb in ((2, 16), (4, 32)):
            n = len(dev.launches)
            snapshots = iter(range(4, 24))
            r.step([StepRow(slot, [5, 6, 7, 8, 9], 2, [slot], logits="all",
                            snapshots=[next(snapshots) for _ in range(5)]) for slot in range(sequences)])
            launches = _nvfp4_launches(dev.launches[n:])
            # 3 GDN layers x (in, out, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down).
            assert len(launches) == 16 and all(m == 5 * sequences for _, _, m in launches)
            assert {key for key, _, _ in launches} == {
                key.replace("_m8", f"_m{mb}_{quantised_row_forms(NVFP4)[mb]}") for key in TINY_KEYS}
            base, buf = r.storage.weights_base, r.storage.buf
            gdn = r.layout.layers[0]
            w_in = gdn["w_in"]
            assert launches[0][1] == [buf["h"], base + w_in.offset, base + w_in.scale_offset,
                                      base + w_in.gscale_offset, base + gdn["w_in_tail"].offset, buf["proj"]]
        n = len(dev.launches)
        r.decode([DecodeItem(slot=slot, token_id=5, pos=2, page_table=[slot]) for slot in range(4)])
        launches = _nvfp4_launches(dev.launches[n:])
        assert len(launches) == 16 and {key for key, _, _ in launches} == DECODE_KEYS
        assert all(m == 4 for _, _, m in launches)
    finally:
        r.close()


def test_the_gate_up_silu_variant_serves_only_the_form_it_was_built_in(runner, monkeypatch):
    """The NVFP4 gate/up + SiLU GEMV runs `shift_u8`'s decode: with another runner's form (whose
    numbers may differ: `shift_x`) the step keeps the plain GEMV and silu_mul."""
    from runtime.model.gpu import kernels

    assert runner.kernels.gate_up_silu(NVFP4, 1024, 256) == ("gemv_nvfp4", "tiny_gate_up_n1024_k256_m8_silu")
    monkeypatch.setitem(kernels.GEMV_FORMS, NVFP4, "shift_x")
    assert runner.kernels.gate_up_silu(NVFP4, 1024, 256) is None
    monkeypatch.setitem(kernels.GEMV_FORMS, NVFP4, "shift_u8")
    monkeypatch.setattr(kernels, "GATE_UP_SILU", False)
    assert runner.kernels.gate_up_silu(NVFP4, 1024, 256) is None
