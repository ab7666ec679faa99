"""The decode attention benches' tables: each split form beside SDPA, as shares of the copy
bandwidth (`bench/attention_forms.py` alone, `bench/decode_attention.py` inside `bench.decode`)."""

from __future__ import annotations

from bench import attention_forms, decode_attention


def test_attention_forms_table_gives_each_form_its_share_of_the_copy_bandwidth():
    row = {"shape": "q24_kv4_d256", "batch": 1, "context": 32768, "tokens": 1, "splits": 198, "min_split": 128,
           "kv_bytes": 134_219_776, "split_us": 100.0, "mma_us": 40.0, "sdpa_us": 50.0, "split_split_only_us": 95.0,
           "mma_split_only_us": 36.5}
    text = attention_forms.render([row], copy_tb_s=4.0)
    # 134.2 MB in 100 / 40 / 50 us: 1.34 / 3.36 / 2.68 TB/s of 4.0.
    assert "| q24_kv4_d256 | 1 | 32768 | 1 | 198 | 100.0 | 40.0 | 50.0 | 34% | 84% | 67% | 36.5 |" in text
    assert text.startswith("Copy bandwidth in the same run: **4.00 TB/s**")


def test_decode_attention_table_leaves_a_form_not_compiled_blank():
    row = {"batch": 8, "context": 1024, "kv_dtype": "bf16", "splits": 9, "min_split": 128, "sdpa_us": 20.0,
           "sdpa_tb_s": 1.0, "sdpa_mode": "flash, enable_gqa", "split_us": 25.0, "split_tb_s": 0.8, "split_rel_diff_vs_sdpa": 2e-3}
    text = decode_attention.render([row], copy_bw_tb_s=4.0)
    assert "| 8 | 1024 | bf16 | 9 x 128 | 25.0 | - | 20.0 | 20% | - | 25% | 2.0e-03 | - | flash, enable_gqa |" in text
