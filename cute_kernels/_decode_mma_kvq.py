"""FP8 / INT8 KV pages in the tensor-core decode attention (`attention_decode_mma`): the operand
transforms of its `*_fp8` / `*_int8` variants (imports the CuTe DSL: only `build()` imports this).

Page layout (`runtime.model.kv_format`): per page of a pool, the codes `[64 slots, Hkv, D]`
(one byte a value), then the fp32 scales `[64 slots, Hkv]`; value = decode(code) * scale.

- Bytes in: `load_tile` cp.asyncs a tile's code rows (BN keys x D bytes of one KV head, 16 bytes
  a copy) and its BN K and V scales (4 bytes a copy) into a staging ring. The codes stay codes in
  shared memory: half the bytes of a bf16 tile, and no conversion pass over shared memory. The
  staging is typed as 16-bit elements (two codes each) so that the bf16 kernel's swizzled layout
  and ldmatrix copies apply as they are.
- Codes to operands: each warp ldmatrix-loads its key slice's code bytes as if they were the
  bf16 B operand and converts them in registers (`codes_bf16x2`: exact, every e4m3 and int8
  value is a bf16 one). A 32-bit register then holds FOUR codes where the B fragment wants two,
  so each raw register feeds two B fragments, and the dims (for Q K^T) or the output columns
  (for P V) come permuted:
  * K (B of S = Q K^T, n = key, k = dim): the raw fragment of k-block kr (dims 32 kr ..) holds,
    per register, the codes of dims 4c .. 4c + 3 (b0) and 16 + 4c .. 16 + 4c + 3 (b1), c = lane
    % 4. Bytes 0, 1 of both make logical k-block 2 kr, bytes 2, 3 k-block 2 kr + 1; Q is stored
    in shared memory with the same dim permutation (`q_column`), so the dot products are the
    same sums.
  * V (B of O += P V, k = key, n = dim): the transposing ldmatrix of 16-bit pairs gives a
    register [V[k][2j], V[k][2j + 1], V[k + 1][2j], V[k + 1][2j + 1]] (keys k = 2c (+ 8), pair
    j = lane / 4 of its 8-pair block): bytes 0, 2 are the B fragment of the even dims, 1, 3 of
    the odd ones. Output column L of the accumulator is dim `out_column(L)`.
- Scales: S[row, key] = (q . code[key]) * (kscale[key] * D^-0.5 * log2 e) in fp32; the softmax
  weight P[key] (fp32) times vscale[key] is rounded to bf16 as the A operand of P V, while the
  row sum adds the unscaled P. `attention_decode_mma.reference(exact=False)` is this model.
- e4m3 V codes: the bf16 bits s.0000eeee.mmm0000 (the value times 2^-120) go to P V as they
  are: the weight P * vscale is rounded to bf16 times `V_SHIFT` (2^64) and the row's output
  times 2^56 at the end. Powers of two commute with every rounding on the way (no product or
  sum leaves the normal range: weights up to 2^64 * vscale, products near 2^-56), so the
  numbers are those of the scaled codes, without a bf16 product per code pair.
- The `cvt` forms (e4m3 only): K codes become f16 by the conversion unit (one `cvt` a pair)
  instead of bf16 by integer ops, so the integer pipe, which the conversions of K and V kept
  busier than the memory system, has only V's left. Q K^T is then an f16 product: Q stored as
  f16 times `Q_SCALE` (2^-4: exact for every bf16 q from 2^-10 up, q up to 2^20 without
  overflow; an e4m3 code is exact in f16), and the score's scale divided by it (a power of two:
  the same fp32 score).
"""

from __future__ import annotations

from typing import Any

import cutlass
from cutlass import cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from runtime.model.kv_format import PAGE, SCALE_BYTES, page_bytes, scale_offset

bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
Q_SCALE = 2.0 ** -4  # Q's factor in the f16 scores of the `cvt` forms (module doc)
# e4m3 V codes enter P V as value * 2^-120 (no bf16 product a pair: `codes_bf16x2(scaled=False)`);
# the weights take V_SHIFT on with the V scale and the output the rest (2^120 / V_SHIFT), both
# powers of two (module doc).
V_SHIFT = 2.0 ** 64


def staging_layout(bn: int, d: int, stages: int) -> Any:
    """The code staging ring: (bn keys, d / 2 code pairs, 2 * stages) 16-bit elements, K tiles at
    slots 0 .. stages - 1 and V tiles after them, rows swizzled in 16-byte chunks so that the 8
    rows an ldmatrix phase reads fall in distinct banks (rows of 256 bytes at D = 256: the bf16
    kernel's 128-byte atom; of 64 bytes at D = 64: a 64-byte atom)."""
    if d // 2 >= 64:
        atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1)))
    else:
        atom = cute.make_composed_layout(cute.make_swizzle(2, 3, 3), 0, cute.make_layout((8, 32), stride=(32, 1)))
    return cute.tile_to_shape(atom, (bn, d // 2, 2 * stages), (0, 1, 2))


@cute.jit
def load_tile(tid: Any, s_codes: Any, s_scale: Any, k_pages: Any, v_pages: Any, page: Any, start: Any, end: Any,
              kvh: Any, it: Any, stage: Any, fmt: cutlass.Constexpr, threads: cutlass.Constexpr,
              hkv: cutlass.Constexpr, d: cutlass.Constexpr, bn: cutlass.Constexpr,
              stages: cutlass.Constexpr) -> None:
    """Keys start + it * bn .. + bn - 1 of KV head kvh (quantised pools; `page` the tile's page,
    `_attention_tiles.tile_page`) into `stage`: codes into s_codes (`staging_layout`), the K and
    V scales into s_scale [bn, 2 * stages] (K at column stage, V at stages + stage). Rows at or
    past `end` copy nothing and get scale 0: whatever their codes are, they convert to finite
    values, and their weight is exactly 0 (0 * a finite V code; a NaN scale would poison it),
    so a pipeline issues its loads without a runtime `if`."""
    per_row = min(8, d // 16)  # threads per code row, 16 bytes each
    g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), bf16,
                              num_bits_per_copy=128)
    gcopy = cute.make_tiled_copy_tv(g2s, cute.make_layout((threads // per_row, per_row), stride=(per_row, 1)),
                                    cute.make_layout((1, 8)))
    thr_g = gcopy.get_slice(tid)
    tile_rows = thr_g.partition_S(cute.make_identity_tensor((bn, d // 2)))
    n0 = start + it * bn
    page_base = cutlass.Int64(page) * page_bytes(fmt, hkv, d)
    head_row = (n0 % PAGE) * hkv + kvh  # (slot, head) of the tile's first key; rows hkv apart
    codes = page_base + head_row * d
    for pool_index in cutlass.range_constexpr(2):
        pool = k_pages if pool_index == 0 else v_pages
        src = cute.make_tensor(cute.recast_ptr(pool + cute.assume(codes, divby=16), dtype=bf16),
                               cute.make_layout((bn, d // 2), stride=(hkv * d // 2, 1)))
        tsrc = thr_g.partition_S(src)
        tdst = thr_g.partition_D(s_codes[None, None, pool_index * stages + stage])
        for i in cutlass.range_constexpr(cute.size(tdst.shape[1])):
            if n0 + tile_rows[0, i, 0][0] < end:
                cute.copy(gcopy, tsrc[None, i, None], tdst[None, i, None])
    # Scales: thread r < bn the K scale of row r, thread bn + r the V scale.
    if tid < 2 * bn:
        row = tid % bn
        column = tid // bn * stages + stage
        dst = cute.make_tensor(s_scale.iterator + column * bn + row, cute.make_layout(1))
        if n0 + row < end:
            offset = page_base + scale_offset(hkv, d) + (head_row + row * hkv) * SCALE_BYTES
            g2s4 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), f32,
                                       num_bits_per_copy=32)
            if tid < bn:
                cute.copy(g2s4, _scale(k_pages, offset), dst)
            else:
                cute.copy(g2s4, _scale(v_pages, offset), dst)
        else:
            dst[0] = f32(0.0)


def _scale(pages: Any, offset: Any) -> Any:
    """The fp32 scale at byte `offset` of a quantised pool, as a one-element tensor."""
    return cute.make_tensor(cute.recast_ptr(pages + cute.assume(offset, divby=SCALE_BYTES), dtype=f32),
                            cute.make_layout(1))


# --------------------------------------------------------------------------- codes to bf16


def _byte_select(lo: int, hi: int, high_byte: bool) -> int:
    """`prmt` selector making two 16-bit lanes of bytes lo and hi of the first operand: each in
    its lane's high byte (high_byte) or low byte, the lane's other byte the second operand's
    byte 0 (selector 4)."""
    if high_byte:
        return 4 | lo << 4 | 4 << 8 | hi << 12
    return lo | 4 << 4 | hi << 8 | 4 << 12


@dsl_user_op
def codes_bf16x2(word: Any, lo: int, hi: int, fmt: str, scaled: bool = True, *, loc: Any = None,
                 ip: Any = None) -> Any:
    """The codes at bytes lo and hi of a 32-bit word as a bf16x2 (lo in the low half), exactly.

    e4m3: the code s.eeee.mmm placed as bf16 bits s.0000eeee.mmm0000 is the value times 2^-120
    (subnormal codes become bf16 subnormals, which bf16 arithmetic and the tensor cores keep);
    times 2^120 (bf16 0x7B80) restores it, or with scaled=False the caller takes the 2^-120 on
    (V: `V_SHIFT`). int8: the bf16 bits 0x43.(c & 0x7F) are 128 + (c & 0x7F), 0x43.(c & 0x80)
    are 128 or 256 by the sign, and their difference is the two's-complement code. Pure integer
    ops and one bf16x2 op per pair (the cvt pipe is the narrow one on sm_90)."""
    if fmt == "fp8":
        # Bytes 1 and 3 already sit in their lanes' high bytes: the shift and mask drop the low
        # bytes, so no prmt.
        gather = "mov.b32 x, $1; " if (lo, hi) == (1, 3) else \
            "prmt.b32 x, $1, 0, " + str(_byte_select(lo, hi, True)) + "; "
        restore = "mov.b32 y, 0x7B807B80; mul.rn.bf16x2 $0, x, y; }" if scaled else "mov.b32 $0, x; }"
        text = ("{ .reg .b32 x, y; " + gather + "shr.b32 y, x, 4; "
                "and.b32 y, y, 0x07F007F0; lop3.b32 x, x, 0x80008000, y, 0xEA; " + restore)
    else:
        select = _byte_select(lo, hi, False)
        text = ("{ .reg .b32 x, a, b; mov.b32 b, 0x43434343; prmt.b32 x, $1, b, " + str(select) + "; "
                "and.b32 a, x, 0xFF7FFF7F; and.b32 b, x, 0xFF80FF80; sub.rn.bf16x2 $0, a, b; }")
    # Pure: ptxas may schedule the conversions freely among the mma.
    return i32(llvm.inline_asm(T.i32(), [i32(word).ir_value(loc=loc, ip=ip)], text, "=r,r", has_side_effects=False,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def codes_f16x2(word: Any, high: bool, *, loc: Any = None, ip: Any = None) -> Any:
    """The e4m3 codes at bytes 0, 1 (high: 2, 3) of a 32-bit word as an f16x2 (the lower byte in
    the low half), exactly, by one `cvt` a pair: the conversion unit's work, so that the integer
    pipe is left to the V codes (`codes_bf16x2`) in the `cvt` forms."""
    text = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, " + ("hi" if high else "lo")
            + "; }")
    return i32(llvm.inline_asm(T.i32(), [i32(word).ir_value(loc=loc, ip=ip)], text, "=r,r", has_side_effects=False,
                               is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def q_column(dim: Any) -> Any:
    """The shared-memory column of Q's dim `dim` (the K fragments' dim permutation, module doc):
    dim = 32 kr + 16 h + 4 c + 2 y + e sits at 32 kr + 16 y + 8 h + 2 c + e."""
    return dim // 32 * 32 + (dim // 2) % 2 * 16 + (dim // 16) % 2 * 8 + (dim // 4) % 4 * 2 + dim % 2


def out_column(col: Any) -> Any:
    """The dim of the P V accumulator's column `col`: n-block 2 p + 1 holds the odd dims of
    16-dim group p, n-block 2 p its even dims, column j of a block dim 2 j (+ 1)."""
    return col // 16 * 16 + col % 8 * 2 + (col // 8) % 2


def scores(mma: Any, acc_s: Any, raw_k: Any, k_frag: Any, ld_a: Any, tSsQ: Any, tSrQ: Any, tSrQv: Any, fmt: str,
           d: int, k_cvt: bool) -> None:
    """acc_s += Q_mt K_ks^T from the raw K fragment (the code bytes of the warp's 16 keys, as
    ldmatrix put them in registers): Q's k-blocks from shared memory, K's converted one
    k-block at a time into k_frag (a B fragment of one k16 x n16 tile). k_cvt: e4m3 codes to
    f16 by `codes_f16x2` (Q and k_frag f16, `mma` an f16 one), else to bf16. The even and the
    odd k-blocks sum into two accumulators, added at the end: half the chain of dependent
    products a warp waits on per tile (the decode is bound by one warp's latency, not by the
    pipes)."""
    raw = cute.recast_tensor(raw_k, i32)
    words = cute.recast_tensor(k_frag, i32)
    odd = cute.make_rmem_tensor(acc_s.layout, f32)
    odd.fill(0.0)
    for kr in range(d // 32):
        for y in range(2):
            kb = 2 * kr + y
            cute.copy(ld_a, tSsQ[None, None, kb], tSrQv[None, None, kb])
            for n in range(2):
                for h in range(2):
                    if k_cvt:
                        words[(0, h), n, 0] = codes_f16x2(raw[(0, h), n, kr], y == 1)
                    else:
                        words[(0, h), n, 0] = codes_bf16x2(raw[(0, h), n, kr], 2 * y, 2 * y + 1, fmt)
            acc = odd if y else acc_s
            cute.gemm(mma, acc, tSrQ[None, None, kb], k_frag[None, None, 0], acc)
    acc_s.store(acc_s.load() + odd.load())


def weighted_values(mma: Any, acc_o: Any, p_frag: Any, raw_v: Any, v_frag: Any, fmt: str, d: int) -> None:
    """acc_o += P V_ks from the raw V fragment (code pairs by the transposing ldmatrix), 16 dims
    (two n8 blocks: the even and the odd dims, `out_column`) at a time."""
    raw = cute.recast_tensor(raw_v, i32)
    words = cute.recast_tensor(v_frag, i32)
    acc_pairs = cute.make_tensor(acc_o.iterator, cute.logical_divide(acc_o.layout, (None, None, 2)))
    for pb in range(d // 16):
        for parity in range(2):
            for h in range(2):
                words[(0, h), parity, 0] = codes_bf16x2(raw[(0, h), pb, 0], parity, parity + 2, fmt, scaled=False)
        acc = acc_pairs[None, None, (None, pb)]
        cute.gemm(mma, acc, p_frag[None, None, 0], v_frag[None, None, 0], acc)
