"""The FP8 prefill GEMM's tile forms on the CPU: the variant table (today's keys untouched, every
shape in every form), the compile-time map from accumulator slots to weight-scale blocks that the
160- and 192-column tiles promote with, the wave-efficiency figures, the runner's `GEMM_FP8_FORM`
switch and the bench's launches on the null device. tests/gpu/test_kernels_gemm_fp8.py runs them."""

from __future__ import annotations

import numpy as np
import pytest

from bench.kernels_quant import gemm_fp8_forms
from cute_kernels import gemm_fp8_sm90
from cute_kernels.bf16 import round_bf16
from cute_kernels.gemm_fp8_sm90 import FORMS, SCALE_BLOCK, slot_block
from cute_kernels.gemv_fp8 import e4m3_values

from null_cuda import built_or_skip, family_launches, null_runner

# The keys (and so the cubins the runner took) before the forms existed.
TODAY = ["gdn_in_n16384_t96_k5120", "o_proj_n5120_k6144", "attn_qkv_n14336_k5120", "gate_up_n34816_k5120",
         "down_n5120_k17408", "tiny_gdn_in_n384_t8_k256", "tiny_gdn_out_n256_k128", "tiny_attn_qkv_n768_k256",
         "tiny_o_proj_n256_k256", "tiny_gate_up_n1024_k256", "tiny_down_n256_k512", "test_n328_k320"]


def test_todays_keys_keep_their_tile_and_every_shape_has_every_form():
    by_key = {v.key: v for v in gemm_fp8_sm90.variants()}
    for key in TODAY:
        v = by_key[key]
        assert v.config["form"] == "bn128" and v.config["tile"] == [128, 128, 128] and v.config["stages"] == 6
        assert v.config["regs"] == [40, 232] and v.config["cluster"] == 1 and v.cluster == (1, 1, 1)
    assert len(by_key) == len(gemm_fp8_sm90.SHAPES) * len(FORMS)
    for name, n, nt, k in gemm_fp8_sm90.SHAPES:
        for form, tile, stages, c in (("bn160", 160, 6, 1), ("bn192", 192, 5, 1), ("bn160c2", 160, 6, 2),
                                      ("bn192c2", 192, 5, 2), ("bn128d", 128, 6, 1), ("bn128dc2", 128, 6, 2)):
            v = by_key[f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_{form}"]
            assert v.config["tile"] == [128, tile, 128] and v.config["stages"] == stages
            assert v.config["regs"] == [24, 240] and v.cluster == (c, 1, 1)
            # The weight TMA box: the N tile, split between the CTAs of a cluster (each loads its
            # part and multicasts it; the compiled coordinates are n_tile * 192 + rank * 96).
            assert v.params[2].encode.box == (128, tile // c)
            # The weight scales stay one per 128 x 128 block whatever the tile.
            assert v.tensors["w_scale"].shape == (-(-n // 128), -(-k // 128))
            # A cluster's CTAs share an N tile on consecutive M tiles: whole clusters on 132 SMs.
            want = (f"min(cdiv(M, 128) * {-(-n // tile)}, 132)" if c == 1
                    else f"min(cdiv(M, 256) * {-(-n // tile) * 2}, 132)")
            assert v.grid[0] == want
            # (BM + BN) x BK bytes a stage, in the 227 KiB an H200 block may take.
            assert stages * (128 + tile) * 128 <= 227 * 1024 - 1024


def test_wide_tiles_start_at_the_offsets_the_kernel_branches_on(monkeypatch):
    assert FORMS["bn128"].offsets(34816) == [0]
    assert FORMS["bn160"].offsets(5120) == [0, 32, 64, 96]
    assert FORMS["bn192"].offsets(5120) == [0, 64]
    assert FORMS["bn192"].offsets(192) == [0]
    # test_wide (N = 680) reaches every offset of both wide forms, so the GPU tests run every branch.
    assert FORMS["bn160"].offsets(680) == [0, 32, 64, 96] and FORMS["bn192"].offsets(680) == [0, 64]
    # 176 columns: tiles starting 112 columns into a block reach a third one.
    monkeypatch.setitem(FORMS, "bn176", gemm_fp8_sm90.Form(176, 5, (24, 240)))
    with pytest.raises(ValueError, match="at most two"):
        gemm_fp8_sm90._variant("x", 5120, 0, 5120, "bn176")
    # Overlapped k-tiles hold three fragments of bn / 2 registers: 128-column tiles only.
    assert FORMS["bn128d"].overlap and FORMS["bn128dc2"].overlap and not FORMS["bn160"].overlap
    monkeypatch.setitem(FORMS, "bn160d", gemm_fp8_sm90.Form(160, 6, (24, 240), overlap=True))
    with pytest.raises(ValueError, match="only 128-column tiles"):
        gemm_fp8_sm90._variant("x", 5120, 0, 5120, "bn160d")


@pytest.mark.parametrize("form", list(FORMS))
def test_every_slot_is_promoted_with_its_own_columns_block(form):
    """For every tile offset of the form, every consumer thread (lane) and accumulator slot j: the
    slot's output column (m64nNk32 C layout: 8 (j // 4) + 2 (lane % 4) + j % 2 from the tile's
    start) lies in weight-scale block `slot_block(off, j)` of the tile's two."""
    bn = FORMS[form].bn
    for off in FORMS[form].offsets(34816 * 3):
        for lane in range(32):
            for j in range(bn // 2):
                col = 8 * (j // 4) + 2 * (lane % 4) + j % 2
                assert col < bn
                assert (off + col) // SCALE_BLOCK == slot_block(off, j), (form, off, lane, j)


def test_promotion_by_slot_blocks_is_the_reference():
    """The wide forms' scaling, modelled per tile on the CPU (each output column scaled by the
    block `slot_block` gives its slot, k-block by k-block in fp32), equals the reference's
    per-column weight scale bit for bit, at N = 680 (every tile offset, a partial last block)."""
    rng = np.random.default_rng(7)
    m, n, k = 3, 680, 320
    xq, wq = rng.integers(0, 0x7E, (m, k), dtype=np.uint8), rng.integers(0, 0x7E, (n, k), dtype=np.uint8)
    kb, nb = -(-k // 128), -(-n // 128)
    x_scale = rng.uniform(0.5, 1.5, (m, kb)).astype(np.float32) * 1e-3
    w_scale = rng.uniform(-1.5, 1.5, (nb, kb)).astype(np.float32) * 1e-3
    want = gemm_fp8_sm90.reference(xq, x_scale, wq, w_scale)
    a, b = e4m3_values(xq).astype(np.float32), e4m3_values(wq).astype(np.float32)
    for form in ("bn160", "bn192"):
        bn = FORMS[form].bn
        got = np.zeros((m, n), np.float32)
        for col0 in range(0, n, bn):
            block0 = col0 // SCALE_BLOCK
            off = col0 - block0 * SCALE_BLOCK
            blocks = [block0, min(block0 + 1, nb - 1)]
            cols = np.arange(col0, min(col0 + bn, n))
            # A column's slot j: 4 slots per 8-column group, so group (c - col0) // 8 -> j = 4 * group.
            which = np.array([blocks[slot_block(off, 4 * ((c - col0) // 8))] for c in cols])
            for t in range(kb):
                part = a[:, t * 128:(t + 1) * 128] @ b[cols, t * 128:(t + 1) * 128].T
                got[:, cols] += part * (x_scale[:, t:t + 1] * w_scale[which, t][None, :])
        np.testing.assert_array_equal(round_bf16(got), want, err_msg=form)


def test_wave_efficiency_by_hand():
    # M = 2048, N = 5120: 16 M tiles x 40 / 32 / 27 N tiles = 640 / 512 / 432 tiles, 5 / 4 / 4 waves.
    assert gemm_fp8_sm90.wave_efficiency("bn128", 2048, 5120) == pytest.approx(640 / 660)
    assert gemm_fp8_sm90.wave_efficiency("bn160", 2048, 5120) == pytest.approx(512 / 528)
    assert gemm_fp8_sm90.wave_efficiency("bn192", 2048, 5120) == pytest.approx(16 * 5120 / 192 / 528)
    assert gemm_fp8_sm90.wave_efficiency("bn128", 8192, 34816) == pytest.approx(17408 / 17424)
    # Clusters of 2: 8 pairs of M tiles x 27 N tiles = 216 items on 66 clusters: 4 waves of 66.
    assert gemm_fp8_sm90.wave_efficiency("bn192c2", 2048, 5120) == pytest.approx(16 * 5120 / 192 / (4 * 132))
    # 3 M tiles: the second pair is half empty.
    assert gemm_fp8_sm90.wave_efficiency("bn192c2", 384, 192) == pytest.approx(3 / 132)


def test_the_form_switch_picks_that_forms_gemm(monkeypatch, tiny_fp8_path):
    """Every form is compiled for the tiny model: GEMM_FP8_FORM selects its key for every FP8
    linear, and a prefill of 20 rows launches it with its own grid (a runner per form: the step
    plans keep the kernels they were made with)."""
    from runtime.model.gpu import kernels
    from runtime.model.gpu.weights import FP8
    from runtime.model.runner import PrefillChunk

    assert kernels.GEMM_FP8_FORM == "bn128d"  # the H200's fastest over most 27B and every A3B shape
    for form in FORMS:
        monkeypatch.setattr(kernels, "GEMM_FP8_FORM", form)
        runner = null_runner(tiny_fp8_path)
        try:
            for n, nt, k in runner.layout.fp8_shapes():
                name = next(s[0] for s in gemm_fp8_sm90.SHAPES if s[1:] == (n, nt, k))
                want = f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}" + ("" if form == "bn128" else f"_{form}")
                assert runner.kernels.quantised_prefill(FP8, n, nt, k).gemm == ("gemm_fp8_sm90", want)
            dev = runner.device
            first = len(dev.launches)
            runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 21)), start_pos=0, page_table=[0]))
            gemm = family_launches(dev.launches[first:], "gemm_fp8_sm90")
            assert [m for _, _, m in gemm] == [20] * 16
            built = {v.key: v.config["form"] for v in gemm_fp8_sm90.variants()}
            assert {built[key] for key, _, _ in gemm} == {form}
            recs = [r for r in dev.launches[first:] if r.function.startswith("infx_gemm_fp8_sm90_tiny_gate_up")]
            c = FORMS[form].cluster  # 20 rows: one M tile (a cluster's second CTA takes the empty one)
            assert {(r.grid, r.cluster) for r in recs} == {((-(-1024 // FORMS[form].bn) * c, 1, 1), (c, 1, 1))}
        finally:
            runner.close()


def test_the_bench_binds_every_form_of_every_27b_shape():
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice

    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    for name, n, nt, k in gemm_fp8_sm90.SHAPES[:5]:
        forms = gemm_fp8_forms(name, n, nt, k)
        assert [form for form, _ in forms] == ["bn128", "bn160", "bn192", "bn160c2", "bn192c2", "bn128d", "bn128dc2"]
        assert forms[0][1] == TODAY[[s[0] for s in gemm_fp8_sm90.SHAPES].index(name)]
        for _, key in forms:
            kern = built_or_skip(lambda key=key: lib.kernel("gemm_fp8_sm90", key))
            bufs = {name: 0x100000 * (i + 1) for i, name in enumerate(("x", "w", "x_scale", "w_scale", "out"))}
            kern.bind(bufs, {"M": 8192})  # raises on a size rule, a missing buffer or alignment
            kern.bind(bufs, {"M": 2048})


# ---------------------------------------------------------------------------- quantize_act forms


def test_quantize_act_forms_keep_todays_keys_and_cover_every_item_once():
    from cute_kernels import quantize_act

    by_key = {v.key: v for v in quantize_act.variants()}
    for name, k in quantize_act.SHAPES:
        old, new = by_key[name], by_key[f"{name}_v8"]
        assert old.config["form"] == "v4" and old.grid[0] == f"cdiv(M * {-(-k // 128)}, 8)"
        assert new.config["form"] == "v8" and new.grid[0] == f"cdiv(M * {-(-k // 128)}, 64)"
        assert old.params == new.params and old.tensors == new.tensors and new.block == (256, 1, 1)
    # v8: warp w of CTA b, lane l, round u takes item (b * 8 + w) * 8 + 2 u + l // 16, columns
    # group * 128 + (l % 16) * 8 .. + 8: every (item, column) once over the grid.
    assert quantize_act.items_per_cta("v8") == 64 and quantize_act.items_per_cta("v4") == 8
    m, k = 37, 320
    kb = -(-k // 128)
    seen = np.zeros((m * kb, kb * 128), np.int32)
    for b in range(-(-m * kb // 64)):
        for w in range(8):
            for lane in range(32):
                for u in range(4):
                    item = (b * 8 + w) * 8 + 2 * u + lane // 16
                    if item < m * kb:
                        group = item % kb
                        seen[item, group * 128 + (lane % 16) * 8:group * 128 + (lane % 16) * 8 + 8] += 1
    for item in range(m * kb):
        group = item % kb
        assert (seen[item, group * 128:(group + 1) * 128] == 1).all() and seen[item].sum() == 128


def test_the_quantize_act_switch_picks_that_form(monkeypatch, tiny_fp8_path):
    from runtime.model.gpu import kernels
    from runtime.model.gpu.weights import FP8

    assert kernels.QUANTIZE_ACT_FORM == "v8"  # the H200's faster
    runner = null_runner(tiny_fp8_path)
    try:
        monkeypatch.setattr(kernels, "QUANTIZE_ACT_FORM", "v4")
        assert runner.kernels.quantised_prefill(FP8, 1024, 0, 256).first == ("quantize_act", "k256")
        monkeypatch.setattr(kernels, "QUANTIZE_ACT_FORM", "v8")
        assert runner.kernels.quantised_prefill(FP8, 1024, 0, 256).first == ("quantize_act", "k256_v8")
        assert runner.kernels.quantised_prefill(FP8, 256, 0, 512).first == ("quantize_act", "k512_v8")
    finally:
        runner.close()


def test_the_27b_shapes_take_their_own_forms(monkeypatch, tiny_fp8_path):
    """gemm_fp8_form: gdn_in and o_proj of the 27B run the form GEMM_FP8_SHAPE_FORMS names for
    them, every other shape GEMM_FP8_FORM; the runner's prefill kernels follow it."""
    from runtime.model.gpu import kernels
    from runtime.model.gpu.weights import FP8

    assert kernels.gemm_fp8_form(16384, 5120) == "bn160" and kernels.gemm_fp8_form(5120, 6144) == "bn160"
    assert [kernels.gemm_fp8_form(n, k) for n, k in ((34816, 5120), (14336, 5120), (5120, 17408), (384, 256))] == \
        [kernels.GEMM_FP8_FORM] * 4
    runner = null_runner(tiny_fp8_path)
    try:
        choice = runner.kernels
        assert choice.quantised_prefill(FP8, 16384, 96, 5120).gemm == ("gemm_fp8_sm90", "gdn_in_n16384_t96_k5120_bn160")
        assert choice.quantised_prefill(FP8, 34816, 0, 5120).gemm == ("gemm_fp8_sm90", "gate_up_n34816_k5120_bn128d")
        assert choice.quantised_prefill(FP8, 5120, 0, 6144).gemm == ("gemm_fp8_sm90", "o_proj_n5120_k6144_bn160")
        monkeypatch.setitem(kernels.GEMM_FP8_SHAPE_FORMS, (5120, 17408), "bn192")
        assert choice.quantised_prefill(FP8, 5120, 0, 17408).gemm == ("gemm_fp8_sm90", "down_n5120_k17408_bn192")
    finally:
        runner.close()
