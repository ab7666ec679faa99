"""`attention_wgmma.reference` (blocked matrix products, for the GPU tests' long chunks) against
the row-by-row `attention_prefill.reference`, and the variant list the runner picks from."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention, attention_prefill, attention_wgmma
from cute_kernels.bf16 import round_bf16

PAGE = 64


def _case(rng, hq, hkv, d, start, t):
    """A chunk of t rows at positions start.. over shuffled pages whose unused rows hold NaN."""
    n = start + t
    used = -(-n // PAGE)
    npages = used + 2
    table = rng.permutation(npages)[:used]
    pages_k = np.full((npages * PAGE, hkv, d), np.nan, np.float32)
    pages_v = np.full((npages * PAGE, hkv, d), np.nan, np.float32)
    rows = table[np.arange(n) // PAGE] * PAGE + np.arange(n) % PAGE
    pages_k[rows] = round_bf16(rng.standard_normal((n, hkv, d)).astype(np.float32))
    pages_v[rows] = round_bf16(rng.standard_normal((n, hkv, d)).astype(np.float32))
    q = round_bf16((2 * rng.standard_normal((t, hq, d))).astype(np.float32))
    x = round_bf16(rng.standard_normal((t, hq * 2 * d + 2 * hkv * d)).astype(np.float32))
    return q, pages_k, pages_v, table, start + np.arange(t), x


@pytest.mark.parametrize("start,t,block", [(0, 1, 64), (0, 70, 16), (100, 45, 64), (130, 3, 2)])
def test_blocked_reference_matches_the_row_by_row_one(start, t, block):
    rng = np.random.default_rng(start * 7 + t)
    args = _case(rng, 6, 2, 32, start, t)
    exact = attention_wgmma.reference(*args, exact=True, block=block)
    want = attention_prefill.reference(*args, exact=True)
    assert np.isfinite(exact).all()
    np.testing.assert_allclose(exact, want, rtol=1e-11, atol=1e-13)
    # The bf16 baseline: same formula in fp32, summed in another order, so a rounding may
    # land one bf16 step apart (2^-8 relative) on a few elements.
    base = attention_wgmma.reference(*args, block=block)
    base_rows = attention_prefill.reference(*args)
    np.testing.assert_allclose(base, base_rows, rtol=2 ** -7, atol=1e-6)
    assert np.mean(base == base_rows) > 0.95


def test_variants_cover_both_large_shapes_in_both_forms():
    got = {(v.config["Hq"], v.config["Hkv"], v.config["D"], v.config["form"], v.config["BM"], v.block[0],
            v.config["kv"], bool(v.config.get("kv_split"))) for v in attention_wgmma.variants()}
    assert got == {(24, 4, 256, "wg2", 128, 256, "bf16", False), (24, 4, 256, "wg1", 64, 128, "bf16", False),
                   (16, 2, 256, "wg2", 128, 256, "bf16", False), (16, 2, 256, "wg1", 64, 128, "bf16", False),
                   (24, 4, 256, "wg2", 128, 256, "fp8", False), (24, 4, 256, "wg2", 128, 256, "int8", False),
                   (16, 2, 256, "wg2", 128, 256, "fp8", False), (16, 2, 256, "wg2", 128, 256, "int8", False),
                   (24, 4, 256, "wg2", 128, 256, "bf16", True), (16, 2, 256, "wg2", 128, 256, "bf16", True),
                   # the overlapped form: bf16 pages, fused only (attention_wgmma.KV_SPLIT_FORMS says why)
                   (24, 4, 256, "wg2p", 128, 256, "bf16", False), (16, 2, 256, "wg2p", 128, 256, "bf16", False)}
    for v in attention_wgmma.variants():  # the runner swaps it for attention_prefill: same buffers
        if v.config.get("kv_split"):
            continue  # its buffers: the next test
        twin = next(p for p in attention_prefill.variants()
                    if (p.config["Hq"], p.config["Hkv"], p.config["D"]) == (v.config["Hq"], v.config["Hkv"], v.config["D"]))
        assert [p.name for p in v.params] == [p.name for p in twin.params]
        assert v.config["x_stride"] == twin.config["x_stride"]
        if v.config["kv"] == "bf16":
            assert v.tensors == twin.tensors
        else:  # the split kernel of the same format reads the same pools
            split = next(s for s in attention.variants()
                         if s.config["kind"] == "split" and s.config["kv"] == v.config["kv"]
                         and (s.config["Hq"], s.config["Hkv"], s.config["D"]) == (v.config["Hq"], v.config["Hkv"],
                                                                                 v.config["D"]))
            assert v.tensors["k_pages"] == split.tensors["k_pages"] == v.tensors["v_pages"]
            pb = 64 * v.config["Hkv"] * (256 + 4)
            assert v.tensors["k_pages"].shape == (f"NP * {pb}",) and v.tensors["k_pages"].dtype == "u8"


def test_the_overlapped_form_has_wg2s_tiles_and_launch():
    """wg2p replaces wg2 one for one: same tile, threads, stages, buffers, grid and constraints;
    only its key and note differ."""
    by_key = {v.key: v for v in attention_wgmma.variants()}
    overlapped = [v for v in by_key.values() if v.config["form"] == "wg2p"]
    assert len(overlapped) == 2
    for v in overlapped:
        twin = by_key[v.key.replace("_wg2p", "_wg2")]
        assert {**v.config, "form": "wg2"} == twin.config
        assert (v.params, v.tensors, v.sizes, v.block, v.grid, v.requires) == (
            twin.params, twin.tensors, twin.sizes, twin.block, twin.grid, twin.requires)


def test_the_key_split_form_writes_the_split_kernels_partials():
    """Over key splits the kernel takes the split-KV kernel's partial buffers (the combine merges
    them), plus the split length, which must be whole pages."""
    for v in attention_wgmma.variants():
        if not v.config.get("kv_split"):
            continue
        twin = next(p for p in attention.variants() if p.config["kind"] == "split" and p.config["kv"] == "bf16"
                    and (p.config["Hq"], p.config["Hkv"], p.config["D"]) == (v.config["Hq"], v.config["Hkv"], v.config["D"]))
        assert v.tensors["o_part"] == twin.tensors["o_part"] and v.tensors["lse"] == twin.tensors["lse"]
        assert [p.name for p in v.params] == ["q", "k_pages", "v_pages", "table", "qseq", "pos", "o_part", "lse",
                                              "M", "maxp", "S", "split"]
        assert v.grid[2] == "S" and "split % 64 == 0" in v.requires
