"""`bench.prefill`'s attention comparison: which kernels it times for a shape, and its table."""

from __future__ import annotations

from types import SimpleNamespace

from bench.prefill import prefill_attention_kernels, render


def _runner(entries):
    kernels = {(fam, key): SimpleNamespace(config=cfg) for fam, key, cfg in entries}
    return SimpleNamespace(config=SimpleNamespace(num_attention_heads=24, num_key_value_heads=4, head_dim=256),
                           library=SimpleNamespace(manifest=SimpleNamespace(kernels=kernels)))


def test_every_prefill_attention_kernel_of_the_shape_is_timed_and_nothing_else():
    shape = {"kind": "fwd", "Hq": 24, "Hkv": 4, "D": 256}
    runner = _runner([
        ("attention_prefill", "fwd_q24_kv4_d256", shape),
        ("attention_wgmma", "fwd_q24_kv4_d256_wg2", {**shape, "form": "wg2"}),
        ("attention_wgmma", "fwd_q24_kv4_d256_wg1", {**shape, "form": "wg1"}),
        ("attention_wgmma", "fwd_q24_kv4_d256_wg2p", {**shape, "form": "wg2p", "kv": "bf16"}),
        ("attention_wgmma", "fwd_q24_kv4_d256_wg2_fp8", {**shape, "form": "wg2", "kv": "fp8"}),
        ("attention_wgmma", "fwd_q24_kv4_d256_wg2_kvsplit", {**shape, "form": "wg2", "kv_split": True}),
        ("attention_wgmma", "fwd_q24_kv4_d256_wg2p_kvsplit", {**shape, "form": "wg2p", "kv_split": True}),
        ("attention_wgmma", "fwd_q16_kv2_d256_wg2", {"kind": "fwd", "Hq": 16, "Hkv": 2, "D": 256}),
        ("attention", "split_q24_kv4_d256", {"kind": "split", "Hq": 24, "Hkv": 4, "D": 256}),
    ])
    assert prefill_attention_kernels(runner) == [("attention_prefill", "fwd_q24_kv4_d256"),
                                                 ("attention_wgmma", "fwd_q24_kv4_d256_wg1"),
                                                 ("attention_wgmma", "fwd_q24_kv4_d256_wg2"),
                                                 ("attention_wgmma", "fwd_q24_kv4_d256_wg2p")]
    # The forms over key splits take other buffers: timed apart, each with the combine.
    assert prefill_attention_kernels(runner, key_split=True) == [("attention_wgmma", "fwd_q24_kv4_d256_wg2_kvsplit"),
                                                                 ("attention_wgmma", "fwd_q24_kv4_d256_wg2p_kvsplit")]


def test_the_table_lists_each_kernel_beside_sdpa():
    vs = {"tokens": 8192, "flops": 4 * 8192 ** 2 / 2 * 24 * 256, "sdpa_flash_us": 2700.0, "sdpa_tflops": 305.4,
          "torch": "2.9", "kernels": {"attention_prefill/fwd_q24_kv4_d256": {"us": 2560.0, "tflops": 322.1,
                                                                            "rel_diff_vs_sdpa": 3e-3},
                                      "attention_wgmma/fwd_q24_kv4_d256_wg2": {"us": 1500.0, "tflops": 549.8,
                                                                              "rel_diff_vs_sdpa": 3e-3}},
          "key_splits": {"attention_wgmma/fwd_q24_kv4_d256_wg2p_kvsplit": {"us": 1600.0, "tflops": 515.4, "split": 2048,
                                                                          "rel_diff_vs_sdpa": 4e-3}}}
    text = render({"matrix_rate_tflops": 700.0, "shape": "qwen3.6-27b", "router": "balanced", "chunk": 2048,
                   "runs": {}, "attention_vs_sdpa": vs})
    assert "| ours attention_wgmma/fwd_q24_kv4_d256_wg2 (gate fused) | 1.50 | 550 | 3.0e-03 |" in text
    assert "| ours attention_prefill/fwd_q24_kv4_d256 (gate fused) | 2.56 | 322 | 3.0e-03 |" in text
    assert "| torch SDPA flash (torch 2.9) | 2.70 | 305 | |" in text
    assert "| ours attention_wgmma/fwd_q24_kv4_d256_wg2p_kvsplit over 2048-key splits + combine | 1.60 | 515 | 4.0e-03 |" in text
    assert "0.82 TFLOP" in text


def test_the_chunk_sweep_table_has_a_row_per_prompt_and_chunk():
    sweep = [{"tokens": 32768, "chunk": 1024, "seconds": 4.0, "tok_s": 8192.0},
             {"tokens": 32768, "chunk": 4096, "seconds": 3.2, "tok_s": 10240.0}]
    text = render({"matrix_rate_tflops": 700.0, "shape": "qwen3.6-27b", "router": "balanced", "chunk": 4096,
                   "runs": {}, "chunk_sweep": sweep})
    assert "| 32768 | 1024 | 4.000 | 8192 |" in text
    assert "| 32768 | 4096 | 3.200 | 10240 |" in text
