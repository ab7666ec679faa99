"""Register-level FP8 / INT8 KV-page access for the attention kernels (imports the CuTe DSL; build
time only). The page layout and the rounding rules are `runtime.model.kv_format`'s; every lane
holds 8 consecutive dims of one token-head (one 8-byte code load or store).

- `quantise8`: a lane's 8 fp32 values and their token-head amax -> 8 code bytes as 2 words
  (x / max(scale, TINY) + 0 in IEEE fp32, then `cvt.rn.satfinite.e4m3x2.f32` or `cvt.rni.s32.f32`
  clamped to +-127), and the scale amax / QMAX.
- `write8`: quantise and store a lane's 8 values and the scale of their token-head;
- `store8` / `load8`: the 8 code bytes at a byte offset of a pool (offsets declared multiples of
  8, so the access is one 8-byte load or store); `codes_f32`: them as fp32 values (exact: every
  e4m3 and int8 value is an fp32 one).
- `scale_at`: the fp32 scale at a byte offset; `page_offsets`: where a token-head's codes and
  scale are.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from runtime.model.kv_format import QMAX, SCALE_BYTES, TINY, scale_offset

f32, i32 = cutlass.Float32, cutlass.Int32
__all__ = ["codes_f32", "load8", "page_offsets", "quantise8", "scale_at", "store8", "write8"]


def _asm(text: str, ret: Any, args: list[Any], cons: str) -> Any:
    # Pure: ptxas may schedule them freely.
    return llvm.inline_asm(ret, args, text, cons, has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def div_rn(a: Any, b: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """IEEE fp32 division (round to nearest) plus +0, which turns -0 into +0: the NumPy
    reference's `x / den + 0` exactly (an add of +0 is no identity, so nothing folds it)."""
    return f32(_asm("{ .reg .f32 t; div.rn.f32 t, $1, $2; add.rn.f32 $0, t, 0f00000000; }", T.f32(),
                    [f32(a).ir_value(loc=loc, ip=ip), f32(b).ir_value(loc=loc, ip=ip)], "=f,f,f"))


@dsl_user_op
def e4m3x4(a: Any, b: Any, c: Any, d: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """Four fp32 values as e4m3 codes in one word, a in the lowest byte (cvt puts its first
    operand in the upper half)."""
    args = [f32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)]
    text = ("{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }")
    return i32(_asm(text, T.i32(), args, "=r,f,f,f,f"))


@dsl_user_op
def rint_s32(a: Any, *, loc: Any = None, ip: Any = None) -> Any:
    return i32(_asm("cvt.rni.s32.f32 $0, $1;", T.i32(), [f32(a).ir_value(loc=loc, ip=ip)], "=r,f"))


def quantise8(vals: Any, amax: Any, fmt: str) -> tuple[Any, Any]:
    """(2-word rmem tensor of the 8 codes, scale) of a lane's 8 fp32 values (an rmem tensor)
    whose token-head has max |value| amax. amax == 0: scale 0 and codes 0 (the divisor is the
    smallest fp32 then, and the values are zeros)."""
    scale = div_rn(amax, f32(QMAX[fmt]))
    den = cute.arch.fmax(scale, f32(TINY))
    y = [div_rn(vals[e], den) for e in range(8)]
    words = cute.make_rmem_tensor((2,), i32)
    if fmt == "fp8":
        for w in range(2):
            words[w] = e4m3x4(*y[4 * w:4 * w + 4])
    else:
        for w in range(2):
            word = i32(0)
            for b in range(4):
                code = cutlass.max(cutlass.min(rint_s32(y[4 * w + b]), i32(127)), i32(-127))
                word = word | ((code & i32(0xFF)) << (8 * b))
            words[w] = word
    return words, scale


def write8(pages: Any, flat_row: Any, head: Any, lane: Any, vals: Any, amax: Any, fmt: str, hkv: int,
           d: int) -> None:
    """Quantise a lane's 8 values (dims 8 * lane ..) of (flat_row, head) into the pool at u8
    pointer `pages`. Every lane of the token-head stores the (same) scale: no lane test needed."""
    codes, scale_byte = page_offsets(flat_row, head, hkv, d)
    words, scale = quantise8(vals, amax, fmt)
    store8(pages, codes + 8 * lane, words)
    cute.make_tensor(_scale_ptr(pages, scale_byte), cute.make_layout(1))[0] = scale


def store8(pages: Any, offset: Any, words: Any) -> None:
    """The 2 code words at byte `offset` (a multiple of 8) of u8 pointer `pages`."""
    raw = cute.recast_tensor(words, cutlass.Uint8)
    cute.make_tensor(pages + cute.assume(offset, divby=8), cute.make_layout((8,))).store(raw.load())


def load8(pages: Any, offset: Any) -> Any:
    """The 8 code bytes at byte `offset` (a multiple of 8) of `pages` into registers (issue the
    load early, convert later)."""
    raw = cute.make_rmem_tensor((8,), cutlass.Uint8)
    raw.store(cute.make_tensor(pages + cute.assume(offset, divby=8), cute.make_layout((8,))).load())
    return raw


def codes_f32(raw: Any, fmt: str) -> Any:
    """8 loaded code bytes as fp32 values (a tensor value)."""
    if fmt == "fp8":
        return cute.recast_tensor(raw, cutlass.Float8E4M3FN).load().to(cutlass.BFloat16).to(f32)
    return cute.recast_tensor(raw, cutlass.Int8).load().to(f32)


def _scale_ptr(pages: Any, offset: Any) -> Any:
    return cute.recast_ptr(pages + cute.assume(offset, divby=SCALE_BYTES), dtype=f32)


def scale_at(pages: Any, offset: Any) -> Any:
    """The fp32 scale at byte `offset` of u8 pointer `pages`."""
    return cute.make_tensor(_scale_ptr(pages, offset), cute.make_layout(1))[0]


def page_offsets(flat_row: Any, head: Any, hkv: int, d: int) -> tuple[Any, Any]:
    """(byte offset of dim 0's code, byte offset of the scale) of (flat KV row, KV head) in a pool
    of quantised pages; Int64."""
    pb = 64 * hkv * (d + SCALE_BYTES)
    page = cutlass.Int64(flat_row) // 64
    slot = cutlass.Int64((flat_row % 64) * hkv + head)
    return page * pb + slot * d, page * pb + scale_offset(hkv, d) + slot * SCALE_BYTES
