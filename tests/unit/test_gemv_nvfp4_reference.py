"""`cute_kernels/gemv_nvfp4.py` on the CPU: its NumPy reference against an independent float64
dequantise-then-matmul (the artifact reader's decoding), the decode tables the kernel's byte
permutes use, and that its variants cover every NVFP4 projection the runner lays out."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import dequant, gemv_nvfp4
from cute_kernels.bf16 import round_bf16
from runtime.artifact import formats


def _case(rng, m, n, nt, k):
    x = round_bf16(rng.standard_normal((m, k)).astype(np.float32))
    codes = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)  # every byte is two valid e2m1 codes
    scales = rng.integers(0, 256, (n, k // 16), dtype=np.uint8)
    scales[(scales & 0x7F) == 0x7F] = 0x38  # 0x7F / 0xFF are NaN in e4m3fn (0x38 is 1.0)
    scales[0, :2] = 0x80  # negative zero
    gscale = rng.uniform(-1e-3, 1e-3, n).astype(np.float32)
    gscale[-1] = 0.0
    tail = round_bf16(rng.standard_normal((nt, k)).astype(np.float32)) if nt else None
    return x, codes, scales, gscale, tail


def _dequantize(codes, scales, gscale):
    """float64 weights through the artifact reader's tables: one group per row, so each row's
    global is its own (the runner's per-row expansion)."""
    values = formats.e2m1_to_f32(formats.unpack_nibbles(codes)).astype(np.float64)
    block = np.repeat(formats.e4m3_to_f32(scales).astype(np.float64), 16, axis=1)
    return values * block * gscale.astype(np.float64)[:, None]


def _check(m, n, nt, k, seed):
    x, codes, scales, gscale, tail = _case(np.random.default_rng(seed), m, n, nt, k)
    w = _dequantize(codes, scales, gscale)
    want = x.astype(np.float64) @ w.T
    full = np.concatenate([w, tail.astype(np.float64)]) if nt else w
    if nt:
        want = np.concatenate([want, x.astype(np.float64) @ tail.astype(np.float64).T], axis=1)
    exact = gemv_nvfp4.reference(x, codes, scales, gscale, tail, exact=True)
    assert exact.shape == (m, n + nt)
    np.testing.assert_allclose(exact, want, rtol=1e-12, atol=1e-300)
    # The kernel's roundings: an fp32 dot product of exact products (K * 2^-24 of the absolute
    # sum, taken as K * 2^-23 for the global's multiply), one bf16 rounding (2^-8 relative).
    same = gemv_nvfp4.reference(x, codes, scales, gscale, tail)
    assert np.array_equal(same, round_bf16(same))
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(full).T
    bound = 2.0 ** -8 * np.abs(want) + k * 2.0 ** -23 * magnitude + 1e-30
    excess = np.abs(same - want) - bound
    assert np.all(excess <= 0), f"worst excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), excess.shape)}"
    assert np.abs(same - want).max() > 0  # the bf16 rounding is really there
    assert np.all(same[:, n - 1] == 0)  # the zero global scale


@pytest.mark.parametrize("m, n, nt, k", [(1, 16, 0, 128), (3, 48, 0, 384), (7, 272, 5, 640), (8, 32, 37, 1152)])
def test_reference_against_dequantize_then_matmul_at_odd_sizes(m, n, nt, k):
    _check(m, n, nt, k, seed=m * 1000 + n)


@pytest.mark.parametrize("name", [s[0] for s in gemv_nvfp4.SHAPES if not s[0].startswith("tiny")])
def test_reference_at_the_27b_shapes(name):
    """The real K (the fp32 sums' length) and tail; 32 of the N rows (rows are independent)."""
    _, n, nt, k = next(s for s in gemv_nvfp4.SHAPES if s[0] == name)
    _check(3, 32, nt, k, seed=k + nt)


def test_reference_refuses_mismatched_scales():
    x, codes, scales, gscale, _ = _case(np.random.default_rng(0), 1, 16, 0, 128)
    with pytest.raises(ValueError, match=r"need scales \(16, 8\) and gscale \(16,\)"):
        gemv_nvfp4.reference(x, codes, scales[:, :4], gscale)


def test_prmt_tables_are_the_bf16_bits_of_the_e2m1_magnitudes():
    """The kernel looks magnitude i up as byte i of (LO, HI) for the high and the low byte."""
    table = lambda lo, hi: [(lo | hi << 32) >> (8 * i) & 0xFF for i in range(8)]  # noqa: E731
    bits = [int(v) >> 16 for v in np.array(formats.E2M1_VALUES[:8], np.float32).view(np.uint32)]
    assert table(dequant.HIGH_LO, dequant.HIGH_HI) == [b >> 8 for b in bits]
    assert table(dequant.LOW_LO, dequant.LOW_HI) == [b & 0xFF for b in bits]
    assert all(b & 0xFFFF == b for b in bits)  # bf16 holds every magnitude exactly


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte i is byte (selector nibble i & 7) of {b, a}, or
    that byte's sign replicated when the nibble's bit 3 is set."""
    pool = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
    out = 0
    for i in range(4):
        nib = sel >> (4 * i) & 0xF
        byte = pool >> (8 * (nib & 7)) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
    return out


def _decode_word(word: int) -> list[int]:
    """The kernel's decode of one 32-bit code word (8 columns), op for op, to 8 bf16 bit patterns."""
    g = dequant
    bits = []
    for h in range(2):
        sel = (word >> (16 * h)) & 0x7777
        high = _prmt(g.HIGH_LO, g.HIGH_HI, sel)
        low = _prmt(g.LOW_LO, g.LOW_HI, sel)
        spread = _prmt(word, 0, g.SPREAD[h])
        high = high | ((spread << 4) & g.SIGN_SHIFTED) | (spread & g.SIGN_IN_PLACE)
        for p in range(2):
            pair = _prmt(low, high, g.PAIRS[p])
            bits += [pair & 0xFFFF, pair >> 16]
    return bits


def test_the_kernels_decode_gives_the_bf16_bits_of_every_code_in_every_position():
    """Every byte value in each of the word's four byte positions, against the artifact reader's
    e2m1 values (column 2j in the low nibble) as bf16 bits."""
    want_bits = np.array(formats.E2M1_VALUES, np.float32).view(np.uint32) >> 16
    for position in range(4):
        for byte in range(256):
            word = (byte << (8 * position)) | (0x5A << (8 * ((position + 1) % 4)))  # a neighbour byte too
            packed = np.array([word >> (8 * i) & 0xFF for i in range(4)], np.uint8)
            codes = formats.unpack_nibbles(packed[None])[0]
            assert _decode_word(word) == [int(want_bits[c]) for c in codes], f"byte {byte:#04x} at {position}"


def test_scale_pairs_broadcast_each_half():
    word = 0xBEEF1234
    assert _prmt(word, 0, dequant.SCALE_PAIRS[0]) == 0x12341234
    assert _prmt(word, 0, dequant.SCALE_PAIRS[1]) == 0xBEEFBEEF


def test_variants_cover_the_nvfp4_layouts_of_the_27b_and_the_tiny_model():
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.weights import WeightLayout, nvfp4_recipe_format
    from runtime.model.shapes import shape_config
    from tools.make_tiny import tiny_text_config

    built = {(v.config["N"], v.config["NT"], v.config["K"]) for v in gemv_nvfp4.variants()}
    big = WeightLayout.plan(ModelConfig.from_dict(shape_config("qwen3.6-27b")), nvfp4_recipe_format)
    assert big.nvfp4_shapes() == {(n, nt, k) for name, n, nt, k in gemv_nvfp4.SHAPES
                                  if not name.startswith(("tiny", "a3b"))}  # a3b: the hidden-2048 models
    ids = {"<|endoftext|>": 0, "<|image_pad|>": 1, "<|video_pad|>": 2, "<|vision_start|>": 3, "<|vision_end|>": 4}
    tiny = WeightLayout.plan(ModelConfig.from_dict(tiny_text_config("dense", 512, ids, tie=False)["text_config"]),
                             nvfp4_recipe_format)
    assert tiny.nvfp4_shapes() <= built and len(tiny.nvfp4_shapes()) == 6
    # About 16.3 GB a token at the 27B shape (the roofline): every weight but the embedding.
    assert abs((big.total - big.globals["embed"].nbytes) / 1e9 - 16.29) < 0.01
    assert all(v.requires == ("M >= 1", f"M <= {v.config['MB']}") and v.config["MB"] in (8, 16, 32)
               for v in gemv_nvfp4.variants())
    # Every shape in every form; the first form's keys carry no tag (the ones built before the forms).
    keys = {v.key for v in gemv_nvfp4.variants()}
    for name, n, nt, k in gemv_nvfp4.SHAPES:
        base = f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_m8"
        assert {base} | {f"{base}_{form}" for form in list(gemv_nvfp4.FORMS)[1:]} <= keys



def test_the_prefetch_forms_are_the_kept_decodes_unrolled_by_8_plus_prefetches():
    """The L2-prefetch forms (NVFP4 `pfD`: `shift_u8` plus prefetches; FP8 `cvt_u8_pfD`: `cvt`
    unrolled by 8 plus prefetches) keep the decode of the form they extend, so they compute the
    same sums in the same order (the GPU tests check it bit for bit), and every shape is built in
    each of them."""
    from cute_kernels import gemv_fp8

    for family, base in ((gemv_nvfp4, "shift_u8"), (gemv_fp8, "cvt")):
        assert set(family.PREFETCH) <= set(family.FORMS) and base not in family.PREFETCH
        by_key = {v.key: v for v in family.variants()}
        for form, ahead in family.PREFETCH.items():
            assert ahead >= 2 and form.removesuffix("_h").endswith(f"pf{ahead}")
            decode, unroll, rows = family.FORMS[form]
            assert decode == family.FORMS[base][0] and unroll == 8
            for name, n, nt, k in family.SHAPES:
                stem = f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_m8"
                kept = by_key[stem + ("" if base == next(iter(family.FORMS)) else f"_{base}")]
                v = by_key[f"{stem}_{form}"]
                assert v.config["decode"] == kept.config["decode"] and v.config["form"] == form
                assert v.config["rows"] == (rows if nt == 0 else family.ROWS)
    assert gemv_nvfp4.FORMS["pf4_h"][2] == gemv_nvfp4.ROWS // 2  # shift_h's grid: 8 rows a CTA
