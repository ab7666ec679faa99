"""The wide FP8 decode GEMV variants (`gemv_fp8` m16 / m32, row-group forms) on the CPU: the
variant table (the m8 keys unchanged, NVFP4's wide keys), and the runner's use of them on the null device
for rows that must get a decode step's numbers (verification steps): one launch per FP8 weight for
up to 32 rows instead of one per 8.

tests/gpu/test_kernels_fp8.py holds the kernels to bit identity with the m8 variant on a GPU.
"""

from __future__ import annotations

import pytest

from cute_kernels import gemv_fp8, gemv_nvfp4
from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

from null_cuda import built_or_skip, family_launches

# The 27B's FP8 linears (N, NT, K) -> the key's shape part.
SHAPES_27B = {(16384, 96, 5120): "gdn_in_n16384_t96_k5120", (5120, 0, 6144): "o_proj_n5120_k6144",
              (14336, 0, 5120): "attn_qkv_n14336_k5120", (34816, 0, 5120): "gate_up_n34816_k5120",
              (5120, 0, 17408): "down_n5120_k17408"}


def test_the_m8_and_nvfp4_keys_are_unchanged_and_the_wide_ones_added():
    fp8 = {v.key: v for v in gemv_fp8.variants()}
    m8 = {key for key, v in fp8.items() if v.config["MB"] == 8}
    # Every shape in every decode form, keyed as before the wide variants.
    assert m8 == {f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_m8" + ("" if form == "cvt" else f"_{form}")
                  for name, n, nt, k in gemv_fp8.SHAPES for form in ("cvt", "shift", "shift_u8", "cvt_u8_pf2", "cvt_u8_pf4")} | {
        "gate_up_n34816_k5120_m8_silu", "tiny_gate_up_n1024_k256_m8_silu"}
    assert all("groups" not in fp8[key].config and fp8[key].requires == ("M >= 1", "M <= 8") for key in m8)
    nvfp4 = [v for v in gemv_nvfp4.variants() if v.config["MB"] == 8 and not v.config["silu"]]
    assert len(nvfp4) == len(gemv_nvfp4.SHAPES) * len(gemv_nvfp4.FORMS)
    assert all(v.key.split("_m")[-1].split("_")[0] == "8" and "groups" not in v.config
               and v.requires == ("M >= 1", "M <= 8") for v in nvfp4)
    assert {v.key for v in nvfp4 if v.key.startswith("gdn_in")} == {
        "gdn_in_n16384_t96_k5120_m8", "gdn_in_n16384_t96_k5120_m8_shift", "gdn_in_n16384_t96_k5120_m8_shift_u8",
        "gdn_in_n16384_t96_k5120_m8_shift_x", "gdn_in_n16384_t96_k5120_m8_shift_h", "gdn_in_n16384_t96_k5120_m8_pf2",
        "gdn_in_n16384_t96_k5120_m8_pf4", "gdn_in_n16384_t96_k5120_m8_pf8", "gdn_in_n16384_t96_k5120_m8_pf4_h"}
    # The NVFP4 wide variants: gemv_fp8's widths and row-group forms in each of gemv_nvfp4.WIDE_FORMS.
    assert {v.key for v in gemv_nvfp4.variants() if v.config["MB"] > 8} == {
        f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_{tag}_{form}"
        for name, n, nt, k in gemv_nvfp4.SHAPES if name in gemv_fp8.WIDE_SHAPES
        for tag in ("m16_r1u2", "m16_r2u1", "m32_r1u1", "m32_r2u1") for form in ("shift_u8", "pf4")}
    wide = {key for key in fp8 if key not in m8}
    assert wide == {f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_{tag}"
                    for name, n, nt, k in gemv_fp8.SHAPES if name in gemv_fp8.WIDE_SHAPES
                    for tag in ("m16_r1u2", "m16_r2u1", "m32_r1u1", "m32_r2u1")}
    assert {f"{shape}_m32_r2u1" for shape in SHAPES_27B.values()} <= wide
    assert not any(key.startswith("a3b") for key in wide)


@pytest.mark.parametrize("mb,groups,unroll", [(16, 1, 2), (16, 2, 1), (32, 1, 1), (32, 2, 1)])
def test_a_wide_variant_owns_whole_row_groups_and_fits_shared_memory(mb, groups, unroll):
    for name, n, nt, k in gemv_fp8.SHAPES:
        if name not in gemv_fp8.WIDE_SHAPES:
            continue
        v = gemv_fp8._variant(name, n, nt, k, "cvt", mb, groups, unroll)
        rows = 16 * groups
        assert v.key.endswith(f"_m{mb}_r{groups}u{unroll}")
        assert v.requires == ("M >= 1", f"M <= {mb}")
        assert (v.config["MB"], v.config["groups"], v.config["rform"], v.config["rows"]) == (
            mb, groups, f"r{groups}u{unroll}", rows)
        assert v.config["decode"] == "cvt" and v.config["form"] == "cvt"
        # The FP8 rows' CTAs, then the tail's (its last CTA may own fewer than `rows`).
        assert v.grid == (n // rows + -(-nt // rows), 1, 1) and v.block == (256, 1, 1)
        # A CTA's rows lie in one 128-row scale block; the epilogue's partials [16, MB, warps]
        # in fp32 fit static shared memory (the row groups take turns in them).
        assert 128 % rows == 0 and n % rows == 0
        assert 16 * mb * gemv_fp8.WARPS * 4 <= 48 << 10
        assert v.config["unroll"] == max(1, min(k // 128 // gemv_fp8.WARPS, unroll))
    assert gemv_fp8._variant("gdn_in", 16384, 96, 5120, "cvt", 32, 2, 1).grid == (512 + 3, 1, 1)
    assert gemv_fp8._variant("tiny_gdn_in", 384, 8, 256, "cvt", 32, 2, 1).grid == (12 + 1, 1, 1)


def test_a_row_count_that_does_not_tile_the_rows_is_refused():
    with pytest.raises(ValueError, match="N = 400 must be a multiple of 32"):
        gemv_fp8._variant("odd", 400, 0, 256, "cvt", 32, 2, 1)
    with pytest.raises(ValueError, match="multiple of 256 .rows per CTA, which must divide 128"):
        gemv_fp8._variant("big", 4096, 0, 256, "cvt", 32, 16, 1)


def _forward_27b_fp8():
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.gpu.layers import Forward
    from runtime.model.gpu.storage import Storage
    from runtime.model.gpu.weights import WeightLayout, fp8_recipe_format
    from runtime.model.shapes import QWEN36_27B

    device = NullDevice(total_memory=200 << 30)
    library = built_or_skip(lambda: KernelLibrary.open(device, required=[]))
    config = ModelConfig.from_dict(QWEN36_27B)
    kernels = built_or_skip(lambda: KernelChoice(library, config))
    layout = WeightLayout.plan(config, fp8_recipe_format)
    storage = Storage(config, device, kernels, weight_bytes=layout.total, num_pages=33, phys_slots=80, max_batch=8,
                      prefill_chunk=512, max_context=2048)
    return Forward(config, kernels, library, storage, layout, phys_slots=80), storage, layout


def _params(launch) -> dict[str, bytes]:
    return dict(zip((p.name for p in launch.kernel.entry.params), launch.param_bytes()))


def _rows_of(launch) -> int:
    return int.from_bytes(_params(launch)["M"], "little", signed=True)


def _pointer(launch, name: str) -> int:
    return int.from_bytes(_params(launch)[name], "little")


ROLES = ("w_in", "out_proj", "w_qkv", "o_proj", "w_gate_up", "down")


@pytest.mark.parametrize("rows,want", [
    (1, [("m8", 1)]), (8, [("m8", 8)]), (9, [("m16_r1u2", 9)]), (16, [("m16_r1u2", 16)]), (17, [("m32_r2u1", 17)]),
    (32, [("m32_r2u1", 32)]),  # 8 sequences of 1 + 3 tokens: one launch, each weight read once
    (40, [("m32_r2u1", 32), ("m8", 8)]), (64, [("m32_r2u1", 32), ("m32_r2u1", 32)])])
def test_exact_rows_of_an_fp8_weight_take_the_narrowest_width_that_holds_them(rows, want):
    from runtime.model.gpu.weights import FP8

    forward, storage, layout = _forward_27b_fp8()
    try:
        for role in ROLES:
            layer = next(layer for layer in layout.layers if role in layer)
            weight, tail = layer[role], layer.get("w_in_tail") if role == "w_in" else None
            assert weight.format == FP8
            n, k = weight.shape
            nt = tail.shape[0] if tail else 0
            shape = SHAPES_27B[n, nt, k]
            assert forward.kernels.exact_block(n, k, FP8, nt) == 32
            launches: list = []
            x, y = storage.buf["h"], storage.buf["proj"]
            forward.linear(launches, x, weight, y, rows, tail, exact_rows=True)
            assert all(launch.kernel.entry.family == "gemv_fp8" for launch in launches)
            assert [(launch.kernel.entry.key, _rows_of(launch)) for launch in launches] == [
                (f"{shape}_{width}", m) for width, m in want], (role, rows)
            # Block b reads its rows of x and writes its rows of y (N + NT wide), with the weight,
            # its scales and the BF16 tail bound as for the m8 launches.
            assert [_pointer(launch, "x") - x for launch in launches] == [32 * b * k * 2 for b in range(len(want))]
            assert [_pointer(launch, "out") - y for launch in launches] == [
                32 * b * (n + nt) * 2 for b in range(len(want))]
            base = storage.weights_base
            for launch in launches:
                assert _pointer(launch, "w") == base + weight.offset
                assert _pointer(launch, "scale") == base + weight.scale_offset
                if tail:
                    assert _pointer(launch, "tail") == base + tail.offset
    finally:
        storage.release()


def test_prefill_rows_of_an_fp8_weight_keep_8_rows_a_launch_and_nvfp4_has_the_same_widths():
    from runtime.model.gpu.weights import FP8, NVFP4

    forward, storage, layout = _forward_27b_fp8()
    try:
        weight = next(layer["w_gate_up"] for layer in layout.layers if "w_gate_up" in layer)
        n, k = weight.shape
        launches: list = []
        # 12 rows of a prefill piece (at most PREFILL_GEMV_ROWS: the GEMV, not the W8A8 GEMM).
        forward.linear(launches, storage.buf["h"], weight, storage.buf["proj"], 12, exact_rows=False)
        assert [(launch.kernel.entry.key, _rows_of(launch)) for launch in launches] == [
            ("gate_up_n34816_k5120_m8", 8), ("gate_up_n34816_k5120_m8", 4)]
        choice = forward.kernels
        assert choice.quantised_widths(FP8, n, 0, k) == [8, 16, 32]
        assert choice.quantised_widths(NVFP4, n, 0, k) == [8, 16, 32]
        assert choice.exact_block(n, k, NVFP4) == 32
        assert choice.linear_quantised(NVFP4, n, 0, k, 8) == ("gemv_nvfp4", "gate_up_n34816_k5120_m8_shift_u8")
        assert choice.linear_quantised(NVFP4, n, 0, k, 9) == ("gemv_nvfp4", "gate_up_n34816_k5120_m16_r1u2_shift_u8")
        assert choice.linear_quantised(NVFP4, n, 0, k, 32) == ("gemv_nvfp4", "gate_up_n34816_k5120_m32_r2u1_shift_u8")
        assert choice.linear_quantised(FP8, n, 0, k, 3) == ("gemv_fp8", "gate_up_n34816_k5120_m8")
        assert choice.linear_quantised(FP8, n, 0, k, 32) == ("gemv_fp8", "gate_up_n34816_k5120_m32_r2u1")
        from runtime.cuda.errors import KernelMissing
        with pytest.raises(KernelMissing, match="takes 33 rows of an fp8 34816x5120 weight; the widest compiled takes 32"):
            choice.linear_quantised(FP8, n, 0, k, 33)
    finally:
        storage.release()


def test_the_fp8_row_form_switch_picks_that_form_and_an_unbuilt_one_drops_the_width(monkeypatch):
    from runtime.model.gpu import kernels
    from runtime.model.gpu.weights import FP8

    forward, storage, layout = _forward_27b_fp8()
    try:
        layer = next(layer for layer in layout.layers if "w_in" in layer)
        weight, tail = layer["w_in"], layer["w_in_tail"]
        n, k = weight.shape
        choice = forward.kernels
        monkeypatch.setattr(kernels, "GEMV_FP8_ROW_FORMS", {16: "r2u1", 32: "r1u1"})
        assert choice.linear_quantised(FP8, n, 96, k, 12) == ("gemv_fp8", "gdn_in_n16384_t96_k5120_m16_r2u1")
        assert choice.linear_quantised(FP8, n, 96, k, 20) == ("gemv_fp8", "gdn_in_n16384_t96_k5120_m32_r1u1")
        # A form nobody built for m32: that width is missing, exact rows run 16 at a time.
        monkeypatch.setattr(kernels, "GEMV_FP8_ROW_FORMS", {16: "r1u2", 32: "r9u1"})
        assert choice.exact_block(n, k, FP8, 96) == 16
        launches: list = []
        forward.linear(launches, storage.buf["h"], weight, storage.buf["proj"], 20, tail, exact_rows=True)
        assert [(launch.kernel.entry.key, _rows_of(launch)) for launch in launches] == [
            ("gdn_in_n16384_t96_k5120_m16_r1u2", 16), ("gdn_in_n16384_t96_k5120_m8", 4)]
        # Another decode form for FP8: the wide variants are built in `cvt` only, so 8 rows a launch.
        monkeypatch.setitem(kernels.GEMV_FORMS, FP8, "shift")
        assert choice.exact_block(n, k, FP8, 96) == 8
        assert choice.linear_quantised(FP8, n, 96, k, 5) == ("gemv_fp8", "gdn_in_n16384_t96_k5120_m8_shift")
    finally:
        storage.release()


@pytest.fixture(scope="module")
def runner(tiny_fp8_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_fp8_path, num_pages=16, num_slots=24,
                                                       device=NullDevice(total_memory=2 << 30), prefill_chunk=64))
    yield r
    r.close()


def _fp8(launches) -> list[tuple[str, list[int], int]]:
    return family_launches(launches, "gemv_fp8")


def test_a_verification_step_of_an_fp8_model_runs_one_wide_launch_per_weight(runner):
    """4 sequences of 1 + 4 tokens (20 rows): every FP8 linear is one m32 launch over all 20 rows
    (before: three m8 launches, each reading the weight); a decode step keeps the m8 variant."""
    r = runner
    for slot in range(4):
        r.prefill(PrefillChunk(slot=slot, token_ids=[3 + slot, 4], start_pos=0, page_table=[slot]))
    dev = r.device
    n = len(dev.launches)
    snapshots = iter(range(4, 24))
    r.step([StepRow(slot, [5, 6, 7, 8, 9], 2, [slot], logits="all", snapshots=[next(snapshots) for _ in range(5)])
            for slot in range(4)])
    launches = _fp8(dev.launches[n:])
    # 3 GDN layers x (in, out, gate_up, down) + 1 attention layer x (qkv, o, gate_up, down).
    assert len(launches) == 16 and all(m == 20 for _, _, m in launches)
    assert {key for key, _, _ in launches} == {
        "tiny_gdn_in_n384_t8_k256_m32_r2u1", "tiny_gdn_out_n256_k128_m32_r2u1", "tiny_attn_qkv_n768_k256_m32_r2u1",
        "tiny_o_proj_n256_k256_m32_r2u1", "tiny_gate_up_n1024_k256_m32_r2u1", "tiny_down_n256_k512_m32_r2u1"}
    base, buf = r.storage.weights_base, r.storage.buf
    gdn = r.layout.layers[0]
    assert launches[0][1] == [buf["h"], base + gdn["w_in"].offset, base + gdn["w_in"].scale_offset,
                              base + gdn["w_in_tail"].offset, buf["proj"]]
    # 3 sequences of 1 + 3 tokens (12 rows): the m16 width.
    n = len(dev.launches)
    snapshots = iter(range(4, 24))
    r.step([StepRow(slot, [5, 6, 7, 8], 2, [slot], logits="all", snapshots=[next(snapshots) for _ in range(4)])
            for slot in range(3)])
    launches = _fp8(dev.launches[n:])
    assert len(launches) == 16 and all(key.endswith("_m16_r1u2") and m == 12 for key, _, m in launches)
    n = len(dev.launches)
    r.decode([DecodeItem(slot=slot, token_id=5, pos=2, page_table=[slot]) for slot in range(4)])
    launches = _fp8(dev.launches[n:])
    # The gate/up GEMV runs with its SiLU epilogue at up to 8 rows (kernels.gate_up_silu).
    assert len(launches) == 16 and all(key.endswith(("_m8", "_m8_silu")) and m == 4 for key, _, m in launches)
    assert sum(key.endswith("_m8_silu") for key, _, _ in launches) == 4


def test_the_gate_up_silu_variants():
    """`_m8_silu`: the m8 GEMV of a fused [gate | up] weight with SiLU(gate) * up as its epilogue,
    for the 27B's gate_up (BF16, FP8, NVFP4) and the tiny model's (FP8, NVFP4): out is [M, N / 2], one CTA a
    16 rows as the plain m8 variant; every other variant says silu False, and the runner's lookups
    of the plain GEMVs (form r1 / cvt) never match a fused one."""
    from cute_kernels import gemv

    bf = {v.key: v for v in gemv.variants() if v.config["silu"]}
    q8 = {v.key: v for v in gemv_fp8.variants() if v.config["silu"]}
    q4 = {v.key: v for v in gemv_nvfp4.variants() if v.config["silu"]}
    assert set(bf) == {"gate_up_n34816_k5120_m8_silu"}
    assert set(q8) == set(q4) == {"gate_up_n34816_k5120_m8_silu", "tiny_gate_up_n1024_k256_m8_silu"}
    # A quantised one is built in the runner's form (kernels.gate_up_silu matches it).
    assert {v.config["base"] for v in q8.values()} == {"cvt"} and {v.config["base"] for v in q4.values()} == {"shift_u8"}
    for v in [*bf.values(), *q8.values(), *q4.values()]:
        n = v.config["N"]
        assert v.config["MB"] == 8 and v.config["form"] == "silu" and v.requires == ("M >= 1", "M <= 8")
        assert v.tensors["out"].shape == ("M", n // 2) and v.grid == (n // 16, 1, 1)
    assert q8["gate_up_n34816_k5120_m8_silu"].config["decode"] == "cvt"
    assert all(not v.config["silu"] for v in [*gemv.variants(), *gemv_fp8.variants(), *gemv_nvfp4.variants()]
               if not v.key.endswith("_silu"))
    with pytest.raises(ValueError, match="SiLU epilogue"):
        gemv_fp8._variant("gdn_in", 16384, 96, 5120, "cvt", silu=True)  # a BF16 tail
