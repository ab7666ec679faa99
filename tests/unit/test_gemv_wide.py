"""The wide BF16 decode GEMV variants on the CPU: the variant table, and the runner's use of them
for rows that must get a decode step's numbers (verification, MTP rounds) on the null device.

tests/gpu/test_gemv_wide.py holds the kernels to bit identity with the `m8` variant on a GPU.
"""

from __future__ import annotations

import pytest

from cute_kernels import gemv

from null_cuda import built_or_skip


def test_every_shape_has_the_four_widths_and_the_narrow_ones_are_unchanged():
    by_shape: dict[tuple[int, int], dict[int, object]] = {}
    for v in gemv.variants():
        by_shape.setdefault((v.config["N"], v.config["K"]), {})[v.config["MB"]] = v
    assert len(by_shape) == len(gemv.SHAPES)
    for (n, k), widths in by_shape.items():
        assert sorted(widths) == [8, 16, 32, 64]
        for mb, v in widths.items():
            assert v.requires == ("M >= 1", f"M <= {mb}")
            # The partial sums [rows, MB, warps] in fp32 fit the 48 KiB of static shared memory.
            assert v.config["rows"] * mb * gemv.WARPS * 4 <= 48 << 10
            chunks = k // gemv.WARPS // gemv.CHUNK
            if mb <= 16 and (mb, v.key.split("_n")[0]) != (8, "o_proj"):
                assert v.config["unroll"] == min(chunks, 4)  # the m8 / m16 cubins as before
        # The same grid at every width: the rows of a CTA do not depend on MB (o_proj's m8 spreads).
        assert widths[16].grid == widths[32].grid == widths[64].grid


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
        assert [(int(launch.kernel.entry.key.rsplit("_m", 1)[1]), _rows_of(launch)) for launch in head] == want
        # Rows whose numbers may depend on the count (prefill) keep the GEMM past 16.
        assert forward.kernels.linear(n, k, 32)[0] == "gemm_sm90"
        assert forward.kernels.linear(n, k, 32, exact=True)[0] == "gemv"
        assert forward.kernels.linear(n, k, 16) == forward.kernels.linear(n, k, 16, exact=True)
    finally:
        storage.release()
