"""The wide BF16 decode GEMV variants on the CPU: the variant table, and the runner's use of them
for rows that must get a decode step's numbers (verification, MTP rounds) on the null device.

tests/gpu/test_gemv_wide.py holds the kernels to bit identity with the `m8` variant on a GPU.
"""

from __future__ import annotations

import pytest

from cute_kernels import gemv

from null_cuda import built_or_skip


def test_every_shape_has_the_four_widths_and_the_narrow_ones_are_unchanged():
    by_shape: dict[tuple[int, int], dict[tuple[int, str], object]] = {}
    for v in gemv.variants():
        if not v.config["silu"]:  # the gate/up + SiLU epilogue variants: test_gemv_fp8_wide
            by_shape.setdefault((v.config["N"], v.config["K"]), {})[v.config["MB"], v.config["form"]] = v
    assert len(by_shape) == len(gemv.SHAPES)
    for (n, k), widths in by_shape.items():
        assert sorted(widths) == [(8, "r1"), (16, "r1"), (16, "r2u2"), (16, "r4u1"), (32, "r1"), (32, "r2u1"),
                                  (32, "r2u2"), (32, "r4u1"), (64, "r1"), (64, "r2u1"), (64, "r3u1"), (64, "r4u1")]
        for (mb, form), v in widths.items():
            groups = v.config["groups"]
            assert v.key.endswith(f"_m{mb}" if form == "r1" else f"_m{mb}_{form}")
            assert form.startswith(f"r{groups}")
            assert v.requires == ("M >= 1", f"M <= {mb}")
            # The partial sums of one row group [16, MB, warps] in fp32 fit the 48 KiB of static
            # shared memory (the row groups take turns in them).
            assert 16 * mb * gemv.WARPS * 4 <= 48 << 10
            chunks = k // gemv.WARPS // gemv.CHUNK
            if mb <= 16 and groups == 1 and (mb, v.key.split("_n")[0]) != (8, "o_proj"):
                assert v.config["unroll"] == min(chunks, 4)  # the m8 / m16 cubins as before
        # The same grid at every width: the rows of a CTA do not depend on MB (o_proj's m8 spreads).
        assert widths[16, "r1"].grid == widths[32, "r1"].grid == widths[64, "r1"].grid == (n // 16, 1, 1)
        assert widths[16, "r2u2"].grid == widths[32, "r2u1"].grid == widths[64, "r2u1"].grid == (-(-n // 32), 1, 1)


def test_row_group_variants_cover_every_row_once_with_a_short_last_cta():
    keys = {v.key: v for v in gemv.variants()}
    # gdn_in (16480 rows = 1030 groups of 16): 515 CTAs of 2 groups, 344 of 3 (the last owns 1),
    # 258 of 4 (the last owns 2).
    for key, ctas, rows, unroll in [("gdn_in_n16480_k5120_m16_r2u2", 515, 32, 2),
                                    ("gdn_in_n16480_k5120_m16_r4u1", 258, 64, 1),
                                    ("gdn_in_n16480_k5120_m32_r2u2", 515, 32, 2),
                                    ("gdn_in_n16480_k5120_m32_r2u1", 515, 32, 1),
                                    ("gdn_in_n16480_k5120_m32_r4u1", 258, 64, 1),
                                    ("gdn_in_n16480_k5120_m64_r2u1", 515, 32, 1),
                                    ("gdn_in_n16480_k5120_m64_r3u1", 344, 48, 1),
                                    ("gdn_in_n16480_k5120_m64_r4u1", 258, 64, 1),
                                    # One chunk per warp: the u2 form runs its one chunk.
                                    ("test_tail_n1040_k512_m16_r2u2", 33, 32, 1),
                                    ("test_tail_n1040_k512_m16_r4u1", 17, 64, 1),
                                    ("test_tail_n1040_k512_m64_r3u1", 22, 48, 1),
                                    ("lm_head_n248320_k5120_m64_r3u1", 5174, 48, 1)]:
        v = keys[key]
        assert (v.config["ctas"], v.config["rows"], v.config["unroll"]) == (ctas, rows, unroll), key
        assert v.grid == (ctas, 1, 1) and v.block == (256, 1, 1)
        assert v.config["groups"] * 16 == rows
        # CTA b owns rows [b * rows, min((b + 1) * rows, N)): all N rows, none twice.
        n = v.config["N"]
        assert (ctas - 1) * rows < n <= ctas * rows, key
    # The tail shape leaves the last CTA short at every row-group count.
    tails = [v for v in gemv.variants() if v.key.startswith("test_tail") and v.config["groups"] > 1]
    assert len(tails) == 8
    assert all(1040 % v.config["rows"] for v in tails)
    assert keys["test_tail_n1040_k512_m8"].config["ctas"] == 65


def test_a_spread_grid_has_no_row_groups():
    with pytest.raises(ValueError, match="o_proj m8: a spread grid owns under 16 rows per CTA"):
        gemv._variant("o_proj", 5120, 6144, 8, 2)


def _forward_27b():
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.layers import Forward
    from runtime.model.gpu.storage import Storage
    from runtime.model.gpu.weights import WeightLayout
    from runtime.model.shapes import QWEN36_27B

    device = NullDevice(total_memory=200 << 30)
    library = built_or_skip(lambda: KernelLibrary.open(device, required=[]))
    config = ModelConfig.from_dict(QWEN36_27B)
    kernels = built_or_skip(lambda: KernelChoice(library, config))
    layout = WeightLayout.plan(config)
    storage = Storage(config, device, kernels, weight_bytes=layout.total, num_pages=33, phys_slots=80, max_batch=8,
                      prefill_chunk=512, max_context=2048)
    return Forward(config, kernels, library, storage, layout, phys_slots=80), storage, layout


def _rows_of(launch) -> int:
    entry = launch.kernel.entry
    raw = dict(zip((p.name for p in entry.params), launch.param_bytes()))["M"]
    return int.from_bytes(raw, "little", signed=True)


@pytest.mark.parametrize("rows,want", [
    (1, [(8, 1)]), (8, [(8, 8)]), (9, [(16, 9)]), (16, [(16, 16)]),
    (32, [(32, 32)]),  # 8 sequences of 1 + 3 tokens: one launch, each weight read once
    (40, [(64, 40)]), (64, [(64, 64)]),  # 8 x (1 + 7)
    (72, [(64, 64), (8, 8)])])
def test_exact_rows_take_the_narrowest_gemv_that_holds_them(rows, want):
    forward, storage, layout = _forward_27b()
    try:
        for role in ("w_in", "out_proj", "w_qkv", "o_proj", "w_gate_up", "down"):
            weight = next(layer[role] for layer in layout.layers if role in layer)
            n, k = weight.shape
            launches: list = []
            forward.linear(launches, storage.buf["h"], weight, storage.buf["proj"], rows, exact_rows=True)
            got = [(forward.library.manifest.kernels[("gemv", launch.kernel.entry.key)].config["MB"], _rows_of(launch))
                   for launch in launches]
            assert got == want, (role, rows)
            assert all(launch.kernel.entry.family == "gemv" for launch in launches)
        head = forward.lm_head(0, rows, exact_rows=True)
        assert [(forward.library.manifest.kernels[("gemv", launch.kernel.entry.key)].config["MB"], _rows_of(launch))
                for launch in head] == want
        # Rows whose numbers may depend on the count (prefill) keep the GEMM past 16.
        assert forward.kernels.linear(n, k, 32)[0] == "gemm_sm90"
        assert forward.kernels.linear(n, k, 32, exact=True)[0] == "gemv"
        assert forward.kernels.linear(n, k, 16) == forward.kernels.linear(n, k, 16, exact=True)
    finally:
        storage.release()


def test_the_row_form_switch_picks_that_form_at_every_width(monkeypatch):
    from runtime.model.gpu import kernels

    forward, storage, layout = _forward_27b()
    try:
        monkeypatch.setattr(kernels, "GEMV_ROW_FORMS", {8: "r1", 16: "r4u1", 32: "r2u2", 64: "r3u1"})
        weight = next(layer["w_in"] for layer in layout.layers if "w_in" in layer)
        n, k = weight.shape
        assert (n, k) == (16480, 5120)
        choice = forward.kernels
        assert choice.linear(n, k, 8, exact=True) == ("gemv", "gdn_in_n16480_k5120_m8")
        assert choice.linear(n, k, 9) == ("gemv", "gdn_in_n16480_k5120_m16_r4u1")
        assert choice.linear(n, k, 32, exact=True) == ("gemv", "gdn_in_n16480_k5120_m32_r2u2")
        assert choice.linear(n, k, 33, exact=True) == ("gemv", "gdn_in_n16480_k5120_m64_r3u1")
        assert choice.exact_block(n, k) == 64
        launches: list = []
        forward.linear(launches, storage.buf["h"], weight, storage.buf["proj"], 40, exact_rows=True)
        assert [(launch.kernel.entry.key, _rows_of(launch)) for launch in launches] == [
            ("gdn_in_n16480_k5120_m64_r3u1", 40)]
        # A form nobody built for a width: that width is missing, the blocks stop below it.
        monkeypatch.setattr(kernels, "GEMV_ROW_FORMS", {8: "r1", 16: "r1", 32: "r1", 64: "r5u1"})
        assert choice.exact_block(n, k) == 32
        assert choice.linear(n, k, 40, exact=True)[0] == "gemm_sm90"
    finally:
        storage.release()
