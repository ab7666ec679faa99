"""`CudaRunner`'s MoE prefill path on the null device: a prefill chunk's MoE layer runs the grouped
kernels (`gpu.moe_prefill`, cute_kernels/moe_grouped.py) with their grids sized for the chunk's
capacity and their buffers chained; decode keeps the per-row kernels; the 35B-A3B shape finds
every variant. Values are checked on a GPU (tests/gpu/test_moe_grouped.py)."""

from __future__ import annotations

import pytest

from runtime.model.runner import PrefillChunk

from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def runner(tiny_moe_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    r = built_or_skip(lambda: CudaRunner.from_artifact(tiny_moe_path, num_pages=16, num_slots=4,
                                                       device=NullDevice(2 << 30), prefill_chunk=64))
    yield r
    r.close()


def _ptr(raw: bytes) -> int:
    return int.from_bytes(raw, "little")


def _kind(function: str) -> str:
    """router (the router logits' GEMM), logits / route (the moe family), perm / gather / combine /
    gemm, or silu."""
    if function.startswith("infx_silu_mul"):
        return "silu"
    if function.startswith("infx_gemm_"):
        return "router"
    return function.split("_moe_")[1].removeprefix("grouped_").split("_")[0]


@pytest.mark.parametrize("rows", [9, 40, 64])
def test_a_prefill_moe_layer_runs_the_grouped_kernels(runner, rows):
    """Per layer: the router logits' GEMM, route, perm, gather, gate/up GEMM, SwiGLU, down GEMM, combine, with
    grids from the capacity C of the chunk's rows and the buffers of one launch feeding the next.
    (A chunk of at most MOE_DECODE_ROWS rows takes the decode form instead: see below.)"""
    dev, c, st = runner.device, runner.config, runner.storage
    mp = runner.kernels.moe_prefill
    assert mp is not None
    p = c.num_experts_per_tok + 1
    cap = mp.capacity(rows)
    assert cap == -(-(rows * p + min(c.num_experts + 1, rows * p) * 127) // 128) * 128
    n = len(dev.launches)
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, rows + 1)), start_pos=0, page_table=[0]))
    moe = [launch for launch in dev.launches[n:] if "_moe_" in launch.function or "silu_mul" in launch.function
           or "_router_" in launch.function]
    per_layer = ["router", "route", "perm", "gather", "gemm", "silu", "gemm", "combine"]
    assert [_kind(launch.function) for launch in moe] == per_layer * c.num_hidden_layers
    tiles = cap // 128
    assert [launch.grid for launch in moe[2:8]] == [(1, 1, 1), (tiles, 1, 1), (min(tiles, 132), 1, 1),
                                                   (-(-cap * 8 // 256), 1, 1), (min(tiles, 132), 1, 1),
                                                   (rows, 1, 1)]
    buf = st.buf
    for layer in range(c.num_hidden_layers):
        _, route, perm, gather, gate_up, silu, down, combine = moe[8 * layer:8 * layer + 8]
        assert _ptr(perm.params[0]) == _ptr(route.params[3]) == buf["moe_ids"]
        assert [_ptr(b) for b in perm.params[1:4]] == [buf["moe_pos"], buf["moe_src"], buf["moe_tiles"]]
        assert [_ptr(b) for b in gather.params[:4]] == [buf["h"], buf["moe_src"], buf["moe_tiles"], buf["moe_rows"]]
        # The GEMMs: [x_desc, x_rows, w_desc, tiles, out, C].
        assert [_ptr(b) for b in gate_up.params[3:5]] == [buf["moe_tiles"], buf["moe_gu"]]
        assert [_ptr(b) for b in silu.params[:2]] == [buf["moe_gu"], buf["moe_gact"]]
        assert [_ptr(b) for b in down.params[3:5]] == [buf["moe_tiles"], buf["moe_rows"]]
        assert [_ptr(b) for b in combine.params[:4]] == [buf["moe_rows"], buf["moe_pos"], buf["moe_wts"],
                                                         buf["delta"]]
        assert int.from_bytes(gate_up.params[5], "little") == int.from_bytes(down.params[5], "little") == cap


def test_a_prefill_chunk_of_few_rows_takes_the_decode_form(runner):
    """A chunk of at most MOE_DECODE_ROWS rows (a short prompt, the tail of a long one) runs the
    decode form of MOE_DECODE_FORM, as decode rows do (MOE_DECODE_ROWS rows: route + up_wide from
    MOE_UP_WIDE_ROWS), not the grouped GEMMs sized for a chunk."""
    from runtime.model.gpu.kernels import MOE_DECODE_FORM, MOE_DECODE_ROWS, MOE_UP_WIDE_ROWS

    dev, c = runner.device, runner.config
    n = len(dev.launches)
    runner.reset_slot(0)
    runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, MOE_DECODE_ROWS + 1)), start_pos=0, page_table=[0]))
    moe = [launch.function for launch in dev.launches[n:] if "_moe_" in launch.function]
    fused = MOE_DECODE_FORM[0] == "route_up" and (MOE_UP_WIDE_ROWS is None or MOE_DECODE_ROWS < MOE_UP_WIDE_ROWS)
    gate_up = "route_up" if fused else "up_wide"
    assert len(moe) == (3 if gate_up == "route_up" else 4) * c.num_hidden_layers
    assert not any("grouped" in f for f in moe)
    assert any(f"_moe_{gate_up}_" in f for f in moe) and any("_moe_down_wide_" in f for f in moe)


def test_the_workspace_holds_the_capacity_of_a_whole_chunk(runner):
    """The buffers are sized for the largest prefill chunk (64 rows here): xg then the down
    GEMM's fp32 rows share `moe_rows`."""
    c, st = runner.config, runner.storage
    cap = runner.kernels.moe_prefill.capacity(st.rows)
    sizes = runner.kernels.moe_prefill.buffer_sizes(st.rows, c.hidden_size, c.moe_intermediate_size)
    assert sizes["moe_rows"] == cap * c.hidden_size * 4
    assert sizes["moe_gu"] == cap * 2 * c.moe_intermediate_size * 2 and sizes["moe_tiles"] == (cap // 128 + 1) * 4
    ordered = sorted((st.buf[name], name) for name in sizes)
    for (start, name), (nxt, _) in zip(ordered, ordered[1:]):
        assert nxt - start >= sizes[name], name


def test_the_35b_a3b_shape_finds_the_grouped_kernels():
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice
    from runtime.model.shapes import QWEN36_35B_A3B

    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    choice = built_or_skip(lambda: KernelChoice(lib, ModelConfig.from_dict(QWEN36_35B_A3B)))
    mp = choice.moe_prefill
    assert mp is not None and mp.slots == 9 and mp.experts == 257
    assert (mp.gate_up, mp.down, mp.silu) == ("gemm_gate_up_e257_n1024_k2048", "gemm_down_e257_n2048_k512", "i512")
    assert mp.capacity(2048) == 51072
    assert ("moe_grouped", mp.perm) in choice.required()
