"""The quantised GEMVs' register decoders (imports the CuTe DSL; build time only).

Each decoder reads one lane's 32 columns of one weight row and returns them as 32 bf16 values
(an rmem tensor or a tensor value) in column order, ready for `_dsl.fill_k_slots`. The bit
patterns and why they are exact are in `dequant.py`; `form` picks the decoder:
`e2m1_row(form, ...)` for NVFP4 (`lut`, `shift`), `e4m3_row(form, ...)` for FP8 (`cvt`, `shift`).
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from . import dequant as d

i32t = cutlass.Int32


def s32(v: int) -> int:
    """A 32-bit pattern as the signed value an Int32 constant takes."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _asm(text: str, *args: Any, loc: Any = None, ip: Any = None) -> Any:
    # Pure (no side effects) so that ptxas may schedule and share them; cute.arch.prmt is volatile.
    return i32t(llvm.inline_asm(
        T.i32(), [i32t(a).ir_value(loc=loc, ip=ip) for a in args], text, ",".join(["=r"] + ["r"] * len(args)),
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def prmt(a: Any, b: Any, sel: Any, *, loc: Any = None, ip: Any = None) -> Any:
    return _asm("prmt.b32 $0, $1, $2, $3;", a, b, sel, loc=loc, ip=ip)


@dsl_user_op
def mul_bf16x2(a: Any, b: Any, *, loc: Any = None, ip: Any = None) -> Any:
    return _asm("mul.rn.bf16x2 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def mul_u32(a: Any, b: Any, *, loc: Any = None, ip: Any = None) -> Any:
    # Unsigned wrap-around by definition (an Int32 `*` may carry LLVM's no-signed-wrap), and an
    # IMAD on the FMA pipe, off the integer pipe that the masks and permutes fill.
    return _asm("mul.lo.u32 $0, $1, $2;", a, b, loc=loc, ip=ip)


@dsl_user_op
def mad_u32(a: Any, b: Any, c: Any, *, loc: Any = None, ip: Any = None) -> Any:
    return _asm("mad.lo.u32 $0, $1, $2, $3;", a, b, c, loc=loc, ip=ip)


def _scale_pairs(scale: Any, bias: int | None) -> list[Any]:
    """The lane's two e4m3 block scales (2 bytes at `scale`) as bf16 pairs (s0, s0), (s1, s1),
    times the bf16 pair `bias` when given."""
    s = cute.make_rmem_tensor((2,), cutlass.BFloat16)
    s.store(cute.make_tensor(scale, cute.make_layout((2,))).load().to(cutlass.BFloat16))  # exact: e4m3 is in bf16
    word = cute.recast_tensor(s, i32t)[0]
    if bias is not None:
        word = mul_bf16x2(word, s32(bias))
    return [prmt(word, 0, sel) for sel in d.SCALE_PAIRS]


def _code_words(codes: Any, count: int) -> Any:
    raw = cute.make_rmem_tensor((count,), codes.dtype)  # the bytes as they are (u8 or e4m3)
    raw.store(cute.make_tensor(codes, cute.make_layout((count,))).load())
    return cute.recast_tensor(raw, i32t)


def e2m1_row(form: str, codes: Any, scale: Any) -> Any:
    """32 NVFP4 columns (16 code bytes at `codes`, 2 e4m3 scale bytes at `scale`) as bf16 code *
    scale: exact for `lut`, times 2^-7 for `shift` and `shift_x` (the caller scales the sum by
    E2M1_UNDO); `shift_x` in the column order of `activations`."""
    words = _code_words(codes, 16)
    pairs = cute.make_rmem_tensor((16,), i32t)
    if form == "lut":
        s_pairs = _scale_pairs(scale, None)
        for i in range(4):  # word i: columns 8i .. 8i + 7, nibble c = column 8i + c
            word = words[i]
            for h in range(2):  # columns 8i + 4h .. + 3
                sel = (word >> (16 * h)) & 0x7777  # the four magnitudes, one per selector nibble
                high = prmt(s32(d.HIGH_LO), d.HIGH_HI, sel)
                low = prmt(s32(d.LOW_LO), s32(d.LOW_HI), sel)
                # Byte c of spread holds code byte (2h + c // 2): the sign of column 4h + c is its
                # bit 3 (even c, moved to bit 7) or bit 7 (odd c, in place).
                spread = prmt(word, 0, d.SPREAD[h])
                high = high | ((spread << 4) & d.SIGN_SHIFTED) | (spread & s32(d.SIGN_IN_PLACE))
                scale_pair = s_pairs[i // 2]  # columns 0..15 are block 0, 16..31 block 1
                for p in range(2):
                    pairs[4 * i + 2 * h + p] = mul_bf16x2(prmt(low, high, d.PAIRS[p]), scale_pair)
    elif form == "shift":
        s_pairs = _scale_pairs(scale, d.SCALE_BIAS_BF16X2)
        for i in range(4):
            even = words[i] & d.EVEN_NIBBLES
            odd = (words[i] >> 4) & d.EVEN_NIBBLES  # an arithmetic shift: the mask drops the copies of bit 31
            for p in range(4):  # code byte 4i + p: columns 8i + 2p, 8i + 2p + 1
                q = prmt(even, odd, d.NIBBLE_PAIR[p])
                pair = mul_u32(q, d.E2M1_SPREAD) & s32(d.E2M1_KEEP)
                pairs[4 * i + p] = mul_bf16x2(pair, s_pairs[i // 2])
    elif form == "shift_x":
        s_pairs = _scale_pairs(scale, d.SCALE_BIAS_BF16X2)
        for i in range(4):
            high = words[i] >> 8  # nibbles 2, 3, 6, 7 at 0, 4, 16, 20 (the masks drop bit 31's copies)
            for j in range(4):  # columns 8i + j, 8i + j + 4
                q = (words[i] if j < 2 else high) & d.INTERLEAVED_MASK[j % 2]
                pair = mul_u32(q, d.INTERLEAVED_SPREAD[j % 2]) & s32(d.E2M1_KEEP)
                pairs[4 * i + j] = mul_bf16x2(pair, s_pairs[i // 2])
    else:
        raise ValueError(f"unknown NVFP4 decode form {form!r}")
    return cute.recast_tensor(pairs, cutlass.BFloat16)


def activations(form: str, x: Any) -> Any:
    """32 bf16 activations (a tensor value, column order) in the order `e2m1_row(form)` returns
    its weights: as they are, or for `shift_x` each 8 columns as (0, 4), (1, 5), (2, 6), (3, 7)."""
    if form != "shift_x":
        return x
    raw = cute.make_rmem_tensor((32,), cutlass.BFloat16)
    raw.store(x)
    words = cute.recast_tensor(raw, i32t)  # word 4i + w: columns 8i + 2w, 8i + 2w + 1
    pairs = cute.make_rmem_tensor((16,), i32t)
    for i in range(4):
        for j in range(4):
            pairs[4 * i + j] = prmt(words[4 * i + j // 2], words[4 * i + 2 + j // 2], d.X_PAIRS[j % 2])
    return cute.recast_tensor(pairs, cutlass.BFloat16)


def e4m3_row(form: str, codes: Any) -> Any:
    """32 FP8 columns (32 e4m3 bytes at `codes`) as exact bf16 values."""
    if form == "cvt":
        return cute.make_tensor(codes, cute.make_layout((32,))).load().to(cutlass.BFloat16)
    if form != "shift":
        raise ValueError(f"unknown FP8 decode form {form!r}")
    words = _code_words(codes, 32)
    pairs = cute.make_rmem_tensor((16,), i32t)
    for i in range(8):  # word i: columns 4i .. 4i + 3
        for h in range(2):  # columns 4i + 2h, 4i + 2h + 1
            p = prmt(words[i], 0, d.E4M3_PAIR[h])
            biased = mad_u32(p, 16, mul_u32(p & d.E4M3_SIGNS, d.E4M3_SIGN_MOVE))
            pairs[2 * i + h] = mul_bf16x2(biased, d.E4M3_UNBIAS_BF16X2)
    return cute.recast_tensor(pairs, cutlass.BFloat16)
