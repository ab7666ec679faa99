"""The decode attention benches' tables: each split form beside SDPA, as shares of the copy
bandwidth (`bench/attention_forms.py` alone, `bench/decode_attention.py` inside `bench.decode`)."""

from __future__ import annotations

from bench import attention_forms, decode_attention


def test_attention_forms_table_gives_each_form_its_share_of_the_copy_bandwidth():
    row = {"shape": "q24_kv4_d256", "batch": 1, "context": 32768, "tokens": 1, "splits": 198, "min_split": 128,
           "kv_bytes": 134_219_776, "split_us": 100.0, "mma_us": 40.0, "sdpa_us": 50.0, "split_split_only_us": 95.0,
           "mma_split_only_us": 36.5}
    text = attention_forms.render([row], copy_tb_s=4.0)
    # 134.2 MB in 100 / 40 / 50 us: 1.34 / 3.36 / 2.68 TB/s of 4.0 (a row without kv_dtype is bf16).
    assert "| q24_kv4_d256 | 1 | 32768 | 1 | bf16 | 198 | 100.0 | 40.0 | 50.0 | 34% | 84% | 67% | 36.5 | - |" in text
    assert text.startswith("Copy bandwidth in the same run: **4.00 TB/s**")


def test_attention_forms_table_gives_a_quantised_rows_mma_speed_over_the_bf16_rows():
    """FP8 pages (520 bytes per token-head, K and V, against bf16's 1024): the same context in
    25 us where bf16 took 40 is 1.60x; a quantised row without its bf16 row gets "-"."""
    base = {"shape": "q24_kv4_d256", "batch": 1, "context": 32768, "tokens": 1, "splits": 198, "min_split": 128,
            "sdpa_us": 50.0, "split_split_only_us": 95.0}
    rows = [{**base, "kv_dtype": "bf16", "kv_bytes": 134_219_776, "split_us": 100.0, "mma_us": 40.0,
             "mma_split_only_us": 36.5},
            {**base, "kv_dtype": "fp8", "kv_bytes": 68_157_440, "split_us": 120.0, "mma_us": 25.0,
             "mma_split_only_us": 22.0},
            {**base, "batch": 8, "kv_dtype": "int8", "kv_bytes": 545_259_520, "split_us": 900.0, "mma_us": 170.0,
             "mma_split_only_us": 160.0}]
    text = attention_forms.render(rows, copy_tb_s=4.0)
    # 68.2 MB in 120 / 25 us: 0.57 / 2.73 TB/s of 4.0.
    assert "| q24_kv4_d256 | 1 | 32768 | 1 | fp8 | 198 | 120.0 | 25.0 | 50.0 | 14% | 68% | 34% | 22.0 | 1.60x |" in text
    assert "| q24_kv4_d256 | 8 | 32768 | 1 | int8 | 198 | 900.0 | 170.0 |" in text and text.endswith("| 160.0 | - |")


def test_attention_forms_table_lists_the_quantised_stage_forms():
    """A row with other stage counts of the quantised mma kernel gets them in a second table, each
    as a share of the copy bandwidth: 68.2 MB in 20 us is 3.41 TB/s, 85 % of 4.0."""
    row = {"shape": "q24_kv4_d256", "batch": 1, "context": 32768, "tokens": 1, "splits": 198, "min_split": 128,
           "kv_dtype": "fp8", "kv_bytes": 68_157_440, "split_us": 120.0, "mma_us": 25.0, "mma_split_only_us": 22.0,
           "stage_forms": ["s3", "s6"], "mma_s3_us": 30.0, "mma_s6_us": 20.0}
    text = attention_forms.render([row], copy_tb_s=4.0)
    assert "| q24_kv4_d256 | 1 | 32768 | 1 | fp8 | s3 | 30.0 | 57% |" in text
    assert text.endswith("| q24_kv4_d256 | 1 | 32768 | 1 | fp8 | s6 | 20.0 | 85% |")


def test_decode_attention_table_leaves_a_form_not_compiled_blank():
    row = {"batch": 8, "context": 1024, "kv_dtype": "bf16", "splits": 9, "min_split": 128, "sdpa_us": 20.0,
           "sdpa_tb_s": 1.0, "sdpa_mode": "flash, enable_gqa", "split_us": 25.0, "split_tb_s": 0.8, "split_rel_diff_vs_sdpa": 2e-3}
    text = decode_attention.render([row], copy_bw_tb_s=4.0)
    assert "| 8 | 1024 | bf16 | 9 x 128 | 25.0 | - | 20.0 | 20% | - | 25% | 2.0e-03 | - | flash, enable_gqa |" in text
