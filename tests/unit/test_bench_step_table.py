"""bench/step_table.py: each launch's part of the model, its bytes, and the grouped table (the
arithmetic of bench/step_breakdown.py, which times the launches on a GPU)."""

from __future__ import annotations

import pytest

from bench.step_table import COPY, LaunchInfo, describe, launch_bytes, parts, render, summarize

NORMS = ("zc_h256", "add_zc_h256")


def _info(family: str, key: str, rows: int | None = 1) -> LaunchInfo:
    return LaunchInfo(family, key, rows)


def test_norms_split_the_list_into_segments_named_for_their_families():
    infos = [_info("embedding", "v512_h256"), _info("rmsnorm", "zc_h256"),
             _info("gemv", "tiny_gdn_in_n392_k256_m8"), _info("conv1d", "c256_s392"), _info("gdn", "k2_v4_d32"),
             _info("gemv", "tiny_gdn_out_n256_k128_m8"), _info("rmsnorm", "add_zc_h256"),
             _info("moe", "logits_wide_e8_h256"), _info("moe", "route_up_h256_e8_k2_i64_f8"),
             _info("moe", "down_wide_h256_e8_k2_i64_r1"), _info("rmsnorm", "add_zc_h256"),
             _info("gemv", "tiny_attn_qkv_n768_k256_m8"), _info("attention", "prep_q4_kv2_d64"),
             # A prefill GDN's gated norm is an rmsnorm of another key: part of its segment.
             _info("rmsnorm", "gated_x_h32"), _info("rmsnorm", "add_zc_h256"),
             _info("gemv", "tiny_gate_up_n1024_k256_m8"), _info("silu_mul", "i512"),
             _info("gemv", "tiny_down_n256_k512_m8"), _info("rmsnorm", "add_zc_h256"),
             _info("gemv", "tiny_lm_head_n512_k256_m8"), _info(COPY, "DeviceCopy", None),
             _info("sampling", "pick"), _info("gemv", "tiny_down_n256_k512_m8")]
    assert parts(infos, NORMS) == [
        "embedding", "norms", "gdn", "gdn", "gdn", "gdn", "norms", "moe_mlp", "moe_mlp", "moe_mlp", "norms",
        "attention", "attention", "attention", "norms", "dense_mlp", "dense_mlp", "dense_mlp", "norms",
        "lm_head", "copies", "sampling", "projection"]


def test_launch_bytes_of_linears_and_moe_kernels():
    # A bf16 GEMV over 8 rows: the 2048 x 4096 weight, 8 input rows of 4096, 8 output rows of 2048.
    assert launch_bytes(_info("gemv", "a3b_o_proj_n2048_k4096_m8", 8)) == 2048 * 4096 * 2 + 2 * 8 * (4096 + 2048)
    assert launch_bytes(_info("gemm_sm90", "a3b_o_proj_n2048_k4096", 512)) == \
        2048 * 4096 * 2 + 2 * 512 * (4096 + 2048)
    router = LaunchInfo("gemm_sm90", "a3b_router_n256_k2048", 512, out_bytes=4)
    assert launch_bytes(router) == 256 * 2048 * 2 + 2 * 512 * 2048 + 4 * 512 * 256
    assert launch_bytes(_info("gemv_fp8", "attn_qkv_n14336_k5120_m8", 1)) == 14336 * 5120 + 2 * (5120 + 14336)
    assert launch_bytes(_info("gemv_nvfp4", "attn_qkv_n14336_k5120_m8", 1)) == 14336 * 5120 // 2 + 2 * (5120 + 14336)
    # The 35B-A3B's MoE at one row: the router, then 8 routed experts + the shared one.
    assert launch_bytes(_info("moe", "logits_wide_e256_h2048", 1)) == 256 * 2048 * 2 + 2048 * 2 + 256 * 4
    gate_up = 9 * 2 * 512 * 2048 * 2
    assert launch_bytes(_info("moe", "route_up_h2048_e256_k8_i512_f8", 1)) == gate_up + 2048 * 2 + 9 * 512 * 2
    assert launch_bytes(_info("moe", "down_wide_h2048_e256_k8_i512_r1", 1)) == \
        9 * 2048 * 512 * 2 + 9 * 512 * 2 + 2048 * 2
    # 64 rows of top 8 can touch at most all 256 experts (+ the shared one).
    assert launch_bytes(_info("moe", "up_h2048_e256_k8_i512", 64)) == \
        257 * 2 * 512 * 2048 * 2 + 64 * 2048 * 2 + 64 * 9 * 512 * 2
    for unknown in (_info("moe", "route_h2048_e256_k8_i512"), _info("gdn", "k16_v32_d128"),
                    _info(COPY, "DeviceCopy", None), _info("gemv", "no_shape_here_m8")):
        assert launch_bytes(unknown) is None


def test_summary_groups_by_part_and_family_against_the_graph():
    infos = [_info("rmsnorm", "zc_h256"), _info("gemv", "a_n100_k50_m8", 1), _info("gdn", "k2_v4_d32"),
             _info("gemv", "b_n100_k50_m8", 1), _info("rmsnorm", "add_zc_h256")]
    names = parts(infos, NORMS)
    linear = 100 * 50 * 2 + 2 * (50 + 100)
    s = summarize(infos, names, [1.0, 2.0, 4.0, 3.0, 2.0], graph_us=15.0, copy_bw=2 * linear / 5e-6)
    assert (s["launches"], s["sum_us"], s["graph_us"], s["gap_us"]) == (5, 12.0, 15.0, 3.0)
    rows = {(r["part"], r["family"]): r for r in s["rows"]}
    assert [(r["part"], r["family"]) for r in s["rows"]][0] == ("gdn", "gemv")  # 5 µs, the largest
    gemv = rows[("gdn", "gemv")]
    assert (gemv["count"], gemv["us"], gemv["bytes"]) == (2, 5.0, 2 * linear)
    assert gemv["pct"] == pytest.approx(100 * 5 / 12)
    assert gemv["gb_s"] == pytest.approx(2 * linear / 5e-6 / 1e9)
    assert gemv["pct_copy_bw"] == pytest.approx(100.0)  # the copy bandwidth was set to this rate
    assert gemv["keys"] == ["a_n100_k50_m8", "b_n100_k50_m8"]
    norms = rows[("norms", "rmsnorm")]
    assert (norms["count"], norms["us"], norms["bytes"], norms["gb_s"]) == (2, 3.0, None, None)
    assert s["parts"] == {"gdn": 9.0, "norms": 3.0}
    text = render("decode", s)
    assert "summed 12.0 µs; captured graph 15.0 µs a step; gap (graph - sum) +3.0 µs" in text
    assert "| gdn | gemv | 2 | 5.0 | 41.7 | 0.02 | 4 | 100 |" in text
    assert "| norms | rmsnorm | 2 | 3.0 | 25.0 | - | - | - |" in text
    with pytest.raises(ValueError, match="5 launches, 5 parts and 4 times"):
        summarize(infos, names, [1.0] * 4, None, None)


def test_a_null_device_decode_plan_of_the_tiny_moe_model_splits_into_its_layers(tiny_moe_path):
    """The real launch list of a decode step: per layer a mixer of the layer's kind and a MoE MLP,
    between the norms; the embedding first, the lm_head last."""
    from null_cuda import null_runner

    r = null_runner(tiny_moe_path)
    try:
        plan = r.steps.decode_plan(1)
        infos = [describe(launch) for launch in plan]
        names = parts(infos, (r.kernels.norm, r.kernels.add_norm))
    finally:
        r.close()
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    mixers = ["gdn" if kind == "linear_attention" else "attention" for kind in r.config.layer_types]
    expected = ["embedding"]
    for mixer in mixers:
        expected += ["norms", mixer, "norms", "moe_mlp"]
    assert collapsed == expected + ["norms", "lm_head"]
    # Projections and MoE kernels take the step's M (the GDN and conv kernels take B and T instead).
    assert {i.rows for i in infos if i.family in ("gemv", "moe")} == {1}


def test_step_breakdown_sets_up_and_tables_every_step_kind_on_the_null_device(tiny_moe_path, monkeypatch):
    """bench/step_breakdown.run on the tiny MoE model with its MTP head (2 rows, k = 3): each kind's
    step is set up by the runner's own call and its bound launch list is the one timed (the null
    device's events read 0 µs, so the tables' times are not checked here: a GPU's are)."""
    import bench.step_breakdown as sb
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner

    from null_cuda import built_or_skip

    monkeypatch.setattr(sb, "HEAD_START_BYTES", 1 << 16)  # the null device backs small buffers only
    batch, k = 2, 3
    r = built_or_skip(lambda: CudaRunner.from_artifact(
        tiny_moe_path, device=NullDevice(total_memory=2 << 30), mtp=True, num_pages=2 * 20,
        num_slots=batch * (k + 2), max_batch=batch, max_context=1100, prefill_chunk=128))
    try:
        steps = sb.run(r, list(sb.KINDS), batch, k, 1000, 128, 1, 3e12)
        assert list(steps) == ["decode, batch 2, context 1000", "verify 1+3, batch 2, context 1000",
                               "MTP chain of drafts 2..3, batch 2", "MTP catch-up over 1+3 positions, batch 2",
                               "prefill chunk of 128 tokens"]
        decode = steps["decode, batch 2, context 1000"]
        plan = r.steps.decode_plan(2)
        assert [launch["key"] for launch in decode["launches"]] == [describe(launch).key for launch in plan]
        assert decode["events"]["launches"] == decode["alone"]["launches"] == len(plan)
        # The chain: two chained steps of the head, each ending in the greedy pick.
        chain = steps["MTP chain of drafts 2..3, batch 2"]["launches"]
        assert sum(launch["part"] == "sampling" for launch in chain) == 2 * 2  # candidates + pick a step
        assert {launch["part"] for launch in chain} >= {"copies", "attention", "moe_mlp", "lm_head", "projection"}
        prefill = steps["prefill chunk of 128 tokens"]["launches"]
        assert {launch["rows"] for launch in prefill if launch["family"] == "moe"} == {128}  # route over the chunk
        assert any(launch["family"] == "moe_grouped" for launch in prefill)
    finally:
        r.close()
