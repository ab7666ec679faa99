"""The `shift` decoders' bit arithmetic (cute_kernels/dequant.py) on every code, in NumPy.

Each step the kernels take (prmt, 32-bit multiply, and, bf16 multiply) is emulated with the
same constants, and the result must equal the formats' own decoders (`e2m1_values`,
`e4m3_values`: written from the format definitions) exactly, for every code and, for NVFP4,
every finite block scale."""

from __future__ import annotations

import numpy as np

from cute_kernels import dequant
from cute_kernels.gemv_fp8 import e4m3_values
from cute_kernels.gemv_nvfp4 import e2m1_values


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): result byte k from selector nibble k of {b, a}."""
    pool = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
    out = 0
    for k in range(4):
        nib = sel >> 4 * k & 0xF
        byte = pool >> 8 * (nib & 7) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * k
    return out


def _bf16(bits: int) -> float:
    """A bf16 bit pattern's value (subnormals kept: float32 holds them exactly)."""
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def _halves(word: int) -> tuple[float, float]:
    return _bf16(word & 0xFFFF), _bf16(word >> 16)


def _exact_bf16(value: float) -> bool:
    return float(np.float32(value)) == value and value == _bf16(int(np.array([value], np.float32).view(np.uint32)[0]) >> 16)


def test_prmt_emulation_matches_the_ptx_definition():
    assert _prmt(0x33221100, 0x77665544, 0x3210) == 0x33221100
    assert _prmt(0x33221100, 0x77665544, 0x7654) == 0x77665544
    assert _prmt(0x000000F0, 0, 0x4448) == 0xFF  # sign-replicate mode on byte 0, then zeros
    assert _prmt(0x00000070, 0, 0x4448) == 0x00


def test_e2m1_shift_reads_value_times_2_pow_minus_126():
    """Every code byte (both nibbles, all 16 codes each, signed zeros included) in every byte
    position p of a word: the pair is (low nibble, high nibble) * 2^-126."""
    values = e2m1_values(np.arange(256, dtype=np.uint8)[:, None])  # [256, 2]
    for byte in range(256):
        for p in range(4):
            word = 0
            for b in range(4):  # other bytes (0xA5) must not leak in
                word |= (byte if b == p else 0xA5) << 8 * b
            even = word & dequant.EVEN_NIBBLES
            odd = (word >> 4) & dequant.EVEN_NIBBLES
            q = _prmt(even, odd, dequant.NIBBLE_PAIR[p])
            r = (q * dequant.E2M1_SPREAD) & dequant.E2M1_KEEP
            assert q * dequant.E2M1_SPREAD < 1 << 32
            lo, hi = _halves(r)
            assert (lo, hi) == (values[byte, 0] * 2.0 ** -126, values[byte, 1] * 2.0 ** -126), (byte, p)
            assert np.signbit(lo) == bool(byte & 0x08) and np.signbit(hi) == bool(byte & 0x80)


def test_e2m1_shift_times_biased_scale_is_exact_and_normal():
    """code * 2^-126 times (scale * 2^119), for every code and every finite e4m3 scale, is the
    exact product times 2^-7, a normal bf16 (or zero), and 2^7 undoes it."""
    codes = np.arange(16, dtype=np.uint8)
    code_values = np.where(codes & 8, -1.0, 1.0) * np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[codes & 7]
    scales = np.array([s for s in range(256) if (s & 0x7F) != 0x7F], np.uint8)
    scale_values = e4m3_values(scales)
    bias = _bf16(dequant.SCALE_BIAS_BF16X2 & 0xFFFF)
    assert bias == 2.0 ** 119 and dequant.SCALE_BIAS_BF16X2 >> 16 == dequant.SCALE_BIAS_BF16X2 & 0xFFFF
    for s in scale_values:
        biased = s * bias
        assert _exact_bf16(biased)
        for c in code_values:
            product = (c * 2.0 ** -126) * biased
            assert product == c * s * 2.0 ** -7
            assert product == 0 or (abs(product) >= 2.0 ** -126 and _exact_bf16(product))
            assert product * dequant.E2M1_UNDO == c * s


def test_e4m3_shift_reads_value_times_2_pow_minus_120():
    """Every e4m3 code (NaN codes aside) in both halves of both pair selectors, then the exact
    multiply by 2^120."""
    values = e4m3_values(np.arange(256, dtype=np.uint8))
    unbias = _bf16(dequant.E4M3_UNBIAS_BF16X2 & 0xFFFF)
    assert unbias == 2.0 ** 120 and dequant.E4M3_UNBIAS_BF16X2 >> 16 == dequant.E4M3_UNBIAS_BF16X2 & 0xFFFF
    other = 0xC3  # a code in the other bytes, which must not leak in
    for code in range(256):
        if (code & 0x7F) == 0x7F:
            continue
        for h in range(2):
            for slot in range(2):
                word = 0
                for b in range(4):
                    word |= (code if b == 2 * h + slot else other) << 8 * b
                p = _prmt(word, 0, dequant.E4M3_PAIR[h])
                r = p * 16 + (p & dequant.E4M3_SIGNS) * dequant.E4M3_SIGN_MOVE
                assert r < 1 << 32
                got = _halves(r)[slot]
                assert got == values[code] * 2.0 ** -120, (code, h, slot)
                assert np.signbit(got) == bool(code & 0x80)
                assert got * unbias == values[code]


def test_e2m1_shift_x_pairs_match_the_activation_permutation():
    """`shift_x`: a word of 8 random codes decodes to pairs (8i + j, 8i + j + 4) * 2^-126, and the
    activations' prmt selectors put columns in the same order (so each MMA K slot holds one
    column's weight and activation)."""
    rng = np.random.default_rng(5)
    for word in [int(w) for w in rng.integers(0, 1 << 32, 400, dtype=np.uint64)] + [0xFFFFFFFF, 0x88888888]:
        codes = np.array([word >> 8 * b & 0xFF for b in range(4)], np.uint8)
        values = e2m1_values(codes[None, :])[0]  # columns 0..7
        decoded = []
        for j in range(4):
            src = word if j < 2 else word >> 8
            q = src & dequant.INTERLEAVED_MASK[j % 2]
            assert q * dequant.INTERLEAVED_SPREAD[j % 2] < 1 << 32
            decoded += _halves((q * dequant.INTERLEAVED_SPREAD[j % 2]) & dequant.E2M1_KEEP)
        order = [0, 4, 1, 5, 2, 6, 3, 7]
        assert decoded == [values[c] * 2.0 ** -126 for c in order], hex(word)
        # Activation words (x0, x1), (x2, x3), (x4, x5), (x6, x7) of column ids 0..7 as 16-bit halves.
        x_words = [(2 * w) | (2 * w + 1) << 16 for w in range(4)]
        permuted = []
        for j in range(4):
            pair = _prmt(x_words[j // 2], x_words[2 + j // 2], dequant.X_PAIRS[j % 2])
            permuted += [pair & 0xFFFF, pair >> 16]
        assert permuted == order
