"""The bit patterns of the quantised GEMVs' in-register decoders (pure Python, no DSL import).

`_dequant.py` builds the decoders from these constants; `tests/unit/test_dequant_bits.py` checks
them on every code with NumPy, so the arithmetic is proven before a GPU runs it.

Two forms turn codes into bf16 MMA operands (`form` in the variants' config):

- `lut` (NVFP4) / `cvt` (FP8): the first forms. NVFP4 looks the e2m1 magnitudes up in two
  byte-permute tables and moves the sign bits separately (about 5 integer-pipe instructions per
  code byte in the SASS); FP8 converts with `cvt.rn.f16x2.e4m3x2` then f16 -> f32 -> bf16 (one
  F2FP and one HADD2 per code byte, on the slower conversion path).
- `shift`: place the code's bits inside a bf16 so that the bf16 *is* the value times a fixed
  power of two, then remove that power with one exact bf16 multiply that the format needs (or
  can afford) anyway. An e2m1 code `s e1 e0 m` written as the bf16 bits `s 0000000 e1 e0 m
  000000` (sign at bit 15, magnitude at bits 6..8) reads as value * 2^-126: codes with e > 0 are
  normal bf16 numbers 2^(e - 127) (1 + m / 2) and e = 0 is the bf16 subnormal m / 2 * 2^-126,
  exactly like e2m1's own subnormal. An e4m3 code `s eeee mmm` written as `s 0000 eeee mmm 0000`
  reads as value * 2^-120 the same way. The multiply is `mul.rn.bf16x2`, whose inputs may be
  subnormal (PTX keeps bf16 subnormals; only the f32 forms have `.ftz`).
"""

# NVFP4 `lut`: bf16 bits of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as prmt tables (byte i
# of the pair (LO, HI) is magnitude i's byte): high bytes 00 3F 3F 3F 40 40 40 40, low 00 00 80 C0
# 00 40 80 C0. SPREAD[h] copies code bytes 2h, 2h, 2h + 1, 2h + 1 (the sign of column 4h + c is
# then bit 3 or bit 7 of byte c); PAIRS interleaves the low and high bytes of columns (0, 1) and
# (2, 3) into bf16 pairs; SIGN_SHIFTED / SIGN_IN_PLACE are the sign bits after << 4 (even c) and
# as they are (odd c).
HIGH_LO, HIGH_HI = 0x3F3F3F00, 0x40404040
LOW_LO, LOW_HI = 0xC0800000, 0xC0804000
SPREAD = (0x1100, 0x3322)
PAIRS = (0x5140, 0x7362)
SIGN_SHIFTED, SIGN_IN_PLACE = 0x00800080, 0x80008000
# Both NVFP4 forms: SCALE_PAIRS broadcasts bf16 scale 0 or 1 of a pair to both halves.
SCALE_PAIRS = (0x1010, 0x3232)

# NVFP4 `shift`: a code byte holds columns (2j, 2j + 1) in its low / high nibble, and a bf16 pair
# wants them in its low / high half. Per 32-bit word of codes, EVEN_NIBBLES keeps each byte's low
# nibble and (word >> 4) & EVEN_NIBBLES its high one; NIBBLE_PAIR[p] (a prmt selector) then
# gathers byte p's two nibbles as [low nibble, 0, high nibble, 0] (the zero bytes: sign-replicate
# mode on a byte whose top bit is 0). Multiplying by E2M1_SPREAD copies each nibble to bits 6..9
# and 12..15 of its half (the copies do not overlap, so no carries), and E2M1_KEEP keeps the
# magnitude of the first copy and the sign of the second: two bf16 of value * 2^-126.
EVEN_NIBBLES = 0x0F0F0F0F
NIBBLE_PAIR = tuple(0x8080 | p | (4 + p) << 8 for p in range(4))
E2M1_SPREAD = (1 << 6) | (1 << 12)
E2M1_KEEP = 0x81C081C0
# NVFP4 `shift_x`: the same bit placement without the nibble gather (a prmt per code byte): bf16
# pair j of a word holds columns (8i + j, 8i + j + 4), nibbles 16 bits apart in the word already,
# so INTERLEAVED_MASK[j % 2] of the word (j < 2) or of the word >> 8 (j >= 2) isolates them and
# INTERLEAVED_SPREAD[j % 2] (shifts 6 and 12 from bit 0, 2 and 8 from bit 4) places both copies.
# The activations' bf16 pairs are permuted the same way (X_PAIRS: prmt selectors taking the low
# or the high halves of words (x0, x1) and (x4, x5)), half as many prmt as the gather's.
INTERLEAVED_MASK = (0x000F000F, 0x00F000F0)
INTERLEAVED_SPREAD = ((1 << 6) | (1 << 12), (1 << 2) | (1 << 8))
X_PAIRS = (0x5410, 0x7632)
# The block scale pair is multiplied by 2^119 once (exact: |e4m3| <= 448 < 2^9 and bf16 reaches
# 2^128), so code * scale comes out as value * 2^-7: every nonzero product (|value| >= 2^-10, at
# most 6 significand bits) is a normal bf16 and exact. The MMA then accumulates x * W * 2^-7,
# the same fp32 roundings as x * W (a power of two commutes with rounding away from under- and
# overflow), and the epilogue multiplies the sum by E2M1_UNDO before the global scale.
SCALE_BIAS_BF16X2 = 0x7B007B00  # bf16 2^119 in both halves
E2M1_UNDO = 128.0  # 2^(126 - 119)

# FP8 `shift`: per 32-bit word of four codes, E4M3_PAIR[h] (prmt with a zero second operand)
# spreads bytes 2h, 2h + 1 to [byte, 0, byte, 0]; p * 16 puts each magnitude at bits 4..10 and
# its sign at bit 11, and adding (p & E4M3_SIGNS) * E4M3_SIGN_MOVE moves that sign to bit 15 (bit 11
# + 0x7800 = bit 15, no other bit touched): two bf16 of value * 2^-120, which one multiply by
# 2^120 makes exact bf16 values (every e4m3 value is one).
E4M3_PAIR = (0x4140, 0x4342)
E4M3_SIGNS = 0x00800080
E4M3_SIGN_MOVE = 240  # (0x8000 - 0x0800) / 0x80
E4M3_UNBIAS_BF16X2 = 0x7B807B80  # bf16 2^120 in both halves
