"""The tensor-core decode attention's variants, its NumPy partials reference, and the runner's
choice of split kernel (`KernelChoice.decode_split`), all without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention, attention_decode_mma
from runtime.model.shapes import shape_config


@pytest.mark.parametrize("hq,hkv,tmax,tiles", [(24, 4, 1, 1), (24, 4, 2, 1), (24, 4, 3, 2), (24, 4, 8, 4),
                                               (16, 2, 1, 1), (16, 2, 8, 4), (4, 2, 8, 1), (16, 2, 3, 2)])
def test_m_tiles_cover_heads_times_tokens_in_a_power_of_two(hq, hkv, tmax, tiles):
    assert attention_decode_mma.m_tiles(hq, hkv, tmax) == tiles
    assert tiles * 16 >= hq // hkv * tmax


def test_variants_are_drop_ins_for_split_plus_the_token_count():
    split = {v.key.removeprefix("split_"): v for v in attention.variants()
             if v.config["kind"] == "split" and v.config["kv"] == "bf16"}  # the mma form reads bf16 pages
    mma = attention_decode_mma.variants()
    assert sorted(v.key for v in mma) == sorted(f"mma_{name}_t{t}" for name in split for t in (1, 8))
    for v in mma:
        name = v.key.removeprefix("mma_").rsplit("_t", 1)[0]
        ref = split[name]
        # Same buffers and sizes, plus T (tokens per sequence) after M.
        assert [p.name for p in v.params] == [p.name for p in ref.params][:9] + ["T"] + [p.name for p in ref.params][9:]
        assert v.tensors == ref.tensors
        assert v.grid == (f"M // T * {v.config['Hkv']}", "S", 1)
        assert v.block == (32 * v.config["MT"] * v.config["KS"], 1, 1)
        assert f"T <= {v.config['tmax']}" in v.requires and "M % T == 0" in v.requires
        # The K/V copies tile the stage (8 threads per 64 columns, BN rows).
        assert v.config["BN"] % (v.block[0] // 8) == 0


def test_reference_partials_combine_to_the_attention_reference():
    """Merging the reference's split partials by their lse weights (what `attention.combine` does)
    gives `attention.reference_attention` (fp64, ungated) for a row split over several pages."""
    rng = np.random.default_rng(1)
    hq, hkv, d, n = 6, 2, 16, 1000
    q = rng.standard_normal((hq, d))
    k = rng.standard_normal((n, hkv, d))
    v = rng.standard_normal((n, hkv, d))
    pos = n - 1
    o, lse = attention_decode_mma.reference(q, k, v, pos, splits=7, min_split=64)
    split = attention.split_length(pos, 7, 64)
    assert split == 192 and o.shape == (hq, 6, d)  # ceil(1000 / 7) = 143 -> 192 keys, 6 splits used
    w = np.exp2(lse - lse.max(axis=1, keepdims=True))
    merged = (o * w[..., None]).sum(1) / w.sum(1)[:, None]
    gate = np.full((1, hq, d), 50.0)  # sigmoid(50) = 1 in fp64 to 1e-21
    want = attention.reference_attention(q[None], k, v, np.array([pos]), gate, exact=True).reshape(hq, d)
    np.testing.assert_allclose(merged, want, rtol=1e-12, atol=1e-12)
    # lse of split 0: log2 sum exp2 of its scaled scores, from scratch.
    sc = k[:192, 0] @ q[0] * d ** -0.5 * attention.LOG2E
    assert lse[0, 0] == pytest.approx(np.log2(np.exp2(sc).sum()), rel=1e-12)


def _choice(shape):
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.manifest import ManifestError
    from runtime.cuda.null import NullDevice
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import KernelChoice

    try:
        library = KernelLibrary.open(NullDevice(total_memory=200 << 30), required=[])
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    if not any(fam == "attention_decode_mma" for fam, _ in library.manifest.kernels):
        pytest.skip("attention_decode_mma was not built")
    return KernelChoice(library, ModelConfig.from_dict(shape_config(shape)))


@pytest.mark.parametrize("shape,name", [("qwen3.6-27b", "q24_kv4_d256"), ("qwen3.6-35b-a3b", "q16_kv2_d256")])
def test_decode_split_picks_the_fewest_tokens_that_fit(shape, name):
    kernels = _choice(shape)
    assert kernels.decode_attention_form == "mma"  # the default (runtime/model/gpu/kernels.py)
    assert kernels.decode_split(1) == ("attention_decode_mma", f"mma_{name}_t1")
    assert kernels.decode_split(2) == ("attention_decode_mma", f"mma_{name}_t8")
    assert kernels.decode_split(8) == ("attention_decode_mma", f"mma_{name}_t8")
    assert kernels.decode_split(9) == ("attention", f"split_{name}")  # a split-KV prefill chunk
    assert ("attention_decode_mma", f"mma_{name}_t8") in kernels.required()
    kernels.use_decode_attention("split")
    assert kernels.decode_split(1) == ("attention", f"split_{name}")
    with pytest.raises(ValueError, match="unknown decode attention form 'wgmma'"):
        kernels.use_decode_attention("wgmma")
