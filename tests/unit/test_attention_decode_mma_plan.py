"""The tensor-core decode attention's variants, its NumPy partials reference, and the runner's
choice of split kernel (`KernelChoice.decode_split`), all without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import attention, attention_decode_mma
from runtime.model import kv_format as kf
from runtime.model.shapes import shape_config

PAGE = attention.PAGE


@pytest.mark.parametrize("hq,hkv,tmax,tiles", [(24, 4, 1, 1), (24, 4, 2, 1), (24, 4, 3, 2), (24, 4, 8, 4),
                                               (16, 2, 1, 1), (16, 2, 8, 4), (4, 2, 8, 1), (16, 2, 3, 2)])
def test_m_tiles_cover_heads_times_tokens_in_a_power_of_two(hq, hkv, tmax, tiles):
    assert attention_decode_mma.m_tiles(hq, hkv, tmax) == tiles
    assert tiles * 16 >= hq // hkv * tmax


def test_variants_are_drop_ins_for_split_plus_the_token_count():
    """A variant per (shape, KV format, most tokens): the bf16 keys as before, `_fp8` / `_int8`
    after the token count, each the drop-in of `attention.split` over the same pages; the
    quantised ones also in each of `KVQ_FORMS` up to its most tokens (`_{form}`, config "form"),
    the `cvt` forms over e4m3 pages only."""
    names = {(hq, hkv, d): name for name, hq, hkv, d, _ in attention._SHAPES}
    split = {(v.config["Hq"], v.config["Hkv"], v.config["D"], v.config["kv"]): v for v in attention.variants()
             if v.config["kind"] == "split"}
    assert {kv for *_, kv in split} == {"bf16", "fp8", "int8"}
    mma = attention_decode_mma.variants()
    want = [f"mma_{names[tuple(shape)]}_t{t}" + ("" if kv == "bf16" else f"_{kv}") for *shape, kv in split for t in (1, 8)]
    want += [f"mma_{names[tuple(shape)]}_t{t}_{kv}_{form}" for *shape, kv in split if kv != "bf16"
             for form, (_, _, k_cvt, most) in attention_decode_mma.KVQ_FORMS.items() for t in (1, 8)
             if t <= most and (kv == "fp8" or not k_cvt)]
    assert {"mma_q24_kv4_d256_t1_fp8_cvt", "mma_q24_kv4_d256_t8_fp8_cvt", "mma_q24_kv4_d256_t1_int8_k4"} <= set(want)
    assert "mma_q24_kv4_d256_t1_int8_cvt" not in want
    assert sorted(v.key for v in mma) == sorted(want)
    for v in mma:
        c = v.config
        ref = split[(c["Hq"], c["Hkv"], c["D"], c["kv"])]
        # Same buffers and sizes, plus T (tokens per sequence) after M.
        assert [p.name for p in v.params] == [p.name for p in ref.params][:9] + ["T"] + [p.name for p in ref.params][9:]
        assert v.tensors == ref.tensors
        assert v.grid == (f"M // T * {c['Hkv']}", "S", 1)
        assert v.block == (32 * c["MT"] * c["KS"], 1, 1)
        assert f"T <= {c['tmax']}" in v.requires and "M % T == 0" in v.requires
        # The K/V copies tile the stage in BN rows: bf16, 8 threads per 64 columns; quantised,
        # 8 threads per 128 code bytes (4 per row at D = 64).
        per_row = 8 if c["kv"] == "bf16" else min(8, c["D"] // 16)
        assert c["BN"] % (v.block[0] // per_row) == 0
        default = attention_decode_mma.STAGES if c["kv"] == "bf16" else attention_decode_mma.KVQ_STAGES
        if c["form"]:
            assert v.key.endswith("_" + c["form"])
            assert (c["KS"], c["stages"], c["k_cvt"]) == attention_decode_mma.KVQ_FORMS[c["form"]][:3], v.key
        else:
            assert (c["KS"], c["stages"], c["k_cvt"]) == (attention_decode_mma.KS, default, False), v.key
        assert c["BN"] == 16 * c["KS"] and PAGE % c["BN"] == 0  # a tile never straddles a page
        # Quantised: the page layout's file is in the fingerprint; pages keep code rows 16-byte aligned.
        if c["kv"] != "bf16":
            assert "runtime/model/kv_format.py" in v.extra_sources
            assert kf.page_bytes(c["kv"], c["Hkv"], c["D"]) % 16 == 0 and kf.scale_offset(c["Hkv"], c["D"]) % 16 == 0


def test_quantised_variants_fit_three_ctas_per_sm_at_one_token():
    """The shared memory a quantised T = 1 CTA takes (Q rows, the code staging ring, the scales):
    3 CTAs per H200 SM (228 KB, 1 KB reserved per CTA), so more bytes are in flight per SM than
    with the bf16 form's 2; rings of more than 64 KB (the 6-stage form) 2; and the merge (fp32
    rows of the other key slices) fits the ring."""
    for v in attention_decode_mma.variants():
        c = v.config
        if c["kv"] == "bf16":
            continue
        rows, ring = 16 * c["MT"], 2 * c["stages"] * c["BN"] * c["D"]
        smem = rows * c["D"] * 2 + ring + 2 * c["stages"] * c["BN"] * 4 + 1024  # + the buffers' alignment
        assert (c["KS"] - 1) * rows * c["D"] * 4 <= ring, v.key
        if c["tmax"] == 1:
            ctas = 3 if ring <= 64 * 1024 else 2
            assert ctas * (smem + 1024) <= 228 * 1024, (v.key, smem)


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


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantised_reference_is_the_reference_over_dequantised_values(fmt):
    """Codes + per token-head scales give the fp64 reference of code * scale; the kernel's model
    (exact=False: the K scale on the score, the V scale on the weight before its bf16 rounding)
    stays within the bf16 rounding of the weights of it."""
    rng = np.random.default_rng(2)
    hq, hkv, d, n = 6, 2, 32, 700
    q = rng.standard_normal((hq, d))
    raw = [rng.standard_normal((n, hkv, d)) * np.exp2(rng.integers(-4, 5, (n, hkv, 1))) for _ in range(2)]
    (kc, ks), (vc, vs) = (kf.quantise(x.astype(np.float32), fmt) for x in raw)
    decode = kf.e4m3_decode if fmt == "fp8" else (lambda c: c.view(np.int8).astype(np.float64))
    args = (q, decode(kc), decode(vc), n - 1, 5, 64)
    o, lse = attention_decode_mma.reference(*args, k_scales=ks, v_scales=vs)
    want_o, want_lse = attention_decode_mma.reference(q, kf.dequantise(kc, ks, fmt), kf.dequantise(vc, vs, fmt),
                                                      n - 1, 5, 64)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    model_o, model_lse = attention_decode_mma.reference(*args, k_scales=ks, v_scales=vs, exact=False)
    assert np.abs(model_o - o).max() <= 2.0 ** -8 * np.abs(o).max()
    np.testing.assert_allclose(model_lse, lse, rtol=1e-5, atol=1e-5)


def _choice(shape, kv="bf16"):
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
    return KernelChoice(library, ModelConfig.from_dict(shape_config(shape)), kv_dtype=kv)


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


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("shape,name", [("qwen3.6-27b", "q24_kv4_d256"), ("qwen3.6-35b-a3b", "q16_kv2_d256")])
def test_quantised_kv_takes_the_mma_variants_of_its_format(monkeypatch, shape, name, fmt):
    from runtime.model.gpu import kernels as gpu_kernels

    # On by default (their GPU tests pass on the H200); off, quantised KV takes the CUDA-core split.
    assert gpu_kernels.QUANTISED_KV_MMA is True
    # The fastest form measured (its variant for one token; the first form's for verification).
    form = gpu_kernels.QUANTISED_KV_MMA_FORM[fmt]
    assert form == {"fp8": "k4cvt", "int8": "k4"}[fmt]
    if any(key.endswith(f"_{fmt}_{form}") for _, key in _choice(shape, fmt).library.manifest.kernels):
        assert _choice(shape, fmt).decode_split(1) == ("attention_decode_mma", f"mma_{name}_t1_{fmt}_{form}")
    monkeypatch.setattr(gpu_kernels, "QUANTISED_KV_MMA_FORM", {"fp8": "", "int8": ""})
    monkeypatch.setattr(gpu_kernels, "QUANTISED_KV_MMA", False)
    kernels = _choice(shape, fmt)
    if not any(key.endswith(f"_{fmt}") for _, key in kernels.library.manifest.kernels):
        pytest.skip(f"the {fmt} attention_decode_mma variants were not built")
    assert kernels.decode_split(1) == ("attention", f"split_{name}_{fmt}")
    monkeypatch.setattr(gpu_kernels, "QUANTISED_KV_MMA", True)
    kernels = _choice(shape, fmt)
    assert kernels.decode_split(1) == ("attention_decode_mma", f"mma_{name}_t1_{fmt}")
    assert kernels.decode_split(8) == ("attention_decode_mma", f"mma_{name}_t8_{fmt}")
    assert kernels.decode_split(9) == ("attention", f"split_{name}_{fmt}")
    assert ("attention_decode_mma", f"mma_{name}_t1_{fmt}") in kernels.required()
    assert not any(key in (f"mma_{name}_t1", f"mma_{name}_t8") for _, key in kernels.required())


@pytest.mark.parametrize("shape,name", [("qwen3.6-27b", "q24_kv4_d256"), ("qwen3.6-35b-a3b", "q16_kv2_d256")])
def test_a_decode_mma_form_takes_its_variants_where_built_and_the_first_form_elsewhere(monkeypatch, shape, name):
    from runtime.model.gpu import kernels as gpu_kernels

    monkeypatch.setattr(gpu_kernels, "QUANTISED_KV_MMA_FORM", {"fp8": "", "int8": ""})
    kernels = _choice(shape, "fp8")
    if not any(key.endswith("_fp8_k4cvt") for _, key in kernels.library.manifest.kernels):
        pytest.skip("the fp8 attention_decode_mma forms were not built")
    assert kernels.decode_mma_form == "" and kernels.decode_split(1)[1] == f"mma_{name}_t1_fp8"
    kernels.use_decode_mma_form("cvt")  # built for 1 and 8 tokens
    assert (kernels.decode_split(1)[1], kernels.decode_split(8)[1]) == (f"mma_{name}_t1_fp8_cvt", f"mma_{name}_t8_fp8_cvt")
    kernels.use_decode_mma_form("k4cvt")  # built for 1 token: verification keeps the first form
    assert (kernels.decode_split(1)[1], kernels.decode_split(8)[1]) == (f"mma_{name}_t1_fp8_k4cvt", f"mma_{name}_t8_fp8")
    assert ("attention_decode_mma", f"mma_{name}_t1_fp8_k4cvt") in kernels.required()
    with pytest.raises(ValueError, match="'cvt' was not compiled for this KV format"):
        _choice(shape, "int8").use_decode_mma_form("cvt")  # e4m3 only
    # The module's choice is what a runner starts with.
    monkeypatch.setattr(gpu_kernels, "QUANTISED_KV_MMA_FORM", {"fp8": "cvt", "int8": "k4"})
    assert _choice(shape, "fp8").decode_split(8)[1] == f"mma_{name}_t8_fp8_cvt"
    assert _choice(shape, "int8").decode_split(1)[1] == f"mma_{name}_t1_int8_k4"
