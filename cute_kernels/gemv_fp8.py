"""Decode GEMV for block-scaled FP8 weights (W8A16): `out[M, :] = x[M, K] @ dequant(W)^T`, M = 1..8
(the wide variants: up to 16 or 32).

W is stored as the artifact keeps it (`fp8_e4m3`, docs/artifact.md): e4m3 codes `w[N, K]` and one
fp32 multiplier per 128 x 128 block, `scale[cdiv(N, 128), K / 128]`, so `W[n, k] =
e4m3(w[n, k]) * scale[n // 128, k // 128]`. Decode streams the weights once per step, so FP8
halves the bytes of the BF16 GEMV (`gemv.py`), whose structure this kernel keeps:

- the weights are the `mma.sync.m16n8k16` M side ("swap AB"): a CTA owns 16 rows, its 8 warps
  split the K / 128 column blocks among themselves (a warp may get one more or one less when
  they do not divide evenly; the tiny models' K = 128 leaves 7 warps idle);
- per block, lane (r, q) = (lane / 4, lane % 4) loads 32 contiguous codes (32 bytes) of rows r and
  r + 8 (the 4 lanes of a row cover its 128-byte line, which is exactly one scale block) and the
  same 32 columns of token r's activation (64 bytes);
- the codes become bf16 in registers (exact: e4m3 has 3 mantissa bits and exponents 2^-9..2^8,
  all inside bf16) and feed eight MMAs with the K permutation of `gemv.py` (the same for A and
  B, so each product is an exact dot product while every load stays a 16-byte vector);
- numerics: the MMAs accumulate the block's unscaled partial sum in fp32 (products of a bf16 and
  an e4m3 value need 12 significand bits: exact in fp32); that partial times the block's fp32
  scale is added to the fp32 total (one rounding per block). Scaling each weight instead would
  round `code * scale` to bf16 (8 bits) and add the weight's own error; scaling the partial is
  the same cost once per 128 columns. The 8 warps' totals meet in shared memory, are added in a
  fixed order (deterministic) and rounded once to bf16. `reference(exact=False)` is this order of
  roundings (per-block fp32 partial, times scale, fp32 sum, bf16).

A variant may carry a BF16 tail (`NT` rows read from `tail[NT, K]`, written after the FP8 rows):
Qwen's FP8 checkpoints keep the GDN `in_proj_b` / `in_proj_a` in BF16 while `in_proj_qkv` /
`in_proj_z` are FP8, and the runner reads all four as one projection `[qkv | z | b | a]`. The
tail's CTAs (a CTA-uniform branch) load bf16 rows and add their partials unscaled. Output rows
are `N + NT` wide (`out[M, N + NT]`). Tokens past M read token M - 1 again (valid memory); their
MMA columns are never stored. Rows past a tail CTA's last row read that row again.

Wide variants (`MB` 16 or 32, key `..._m16_r1u2`, `..._m32_r2u1`; `WIDE`) serve verification
steps (k + 1 tokens of up to 8 sequences), which otherwise ran their rows 8 at a time, each launch
re-reading every weight. They keep `gemv.py`'s wide design: one 8-token MMA column group per 8
tokens, each decoded weight fragment fed to every group, and row-group forms (`rRuU`: a CTA owns
R x 16 rows, each warp decodes R row groups' codes per block, so one activation fragment load
feeds R row groups' MMAs; with 1-byte weights the bf16 activation re-read from L2 costs twice as
much, relative to the weight stream, as in the BF16 GEMV). A row's numbers do not depend on MB or
R: its accumulator sees the same fragments in the same order (blocks in the warp's range, then
the block's 8 k16 steps, the partial times the same scale added once per block; the same 8
warps' K ranges), the token sits in the same MMA column (token % 8) and the epilogue adds the
warps' partials of one row group at a time in warp order. So row t of an m16 / m32 launch equals
row t % 8 of the m8 launch over t's block of 8, bit for bit. They are built in the `cvt` decode
only (the runner's GEMV_FORMS choice) and for the 27B's and the tiny model's shapes.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import HOPPER, Variant, i32, ptr, tensor

FAMILY = "gemv_fp8"
WARPS = 8  # warps per CTA, splitting K
ROWS = 16  # weight rows per CTA (the MMA's M)
BLOCK = 128  # scale block (rows and columns); one warp step covers one block of columns
MB = 8  # the largest M of the decode variants (one 8-token MMA column group)

# (name, N, NT, K): the FP8 linear layers of Qwen3.6-27B at decode (lm_head stays BF16 in Qwen's
# FP8 release), then the tiny test model's (tools/make_tiny.py: H 256, GDN 2/4 heads of 32,
# attention 4/2 heads of 64, MLP 512). gdn_in is [in_proj_qkv | in_proj_z] in FP8 with
# [in_proj_b | in_proj_a] as the BF16 tail.
SHAPES = [
    ("gdn_in", 16384, 96, 5120),
    ("o_proj", 5120, 0, 6144),  # GDN out_proj and attention o_proj
    ("attn_qkv", 14336, 0, 5120),  # q (with gate) + k + v
    ("gate_up", 34816, 0, 5120),
    ("down", 5120, 0, 17408),
    # Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B (hidden 2048; same GDN and attention widths).
    ("a3b_gdn_in", 12288, 64, 2048),
    ("a3b_o_proj", 2048, 0, 4096),
    ("a3b_attn_qkv", 9216, 0, 2048),
    ("tiny_gdn_in", 384, 8, 256),
    ("tiny_gdn_out", 256, 0, 128),
    ("tiny_attn_qkv", 768, 0, 256),
    ("tiny_o_proj", 256, 0, 256),
    ("tiny_gate_up", 1024, 0, 256),
    ("tiny_down", 256, 0, 512),
]


# Forms of the decode GEMV (tag -> (decode, most steps unrolled, weight rows per CTA)): each shape is built in every
# form of its family, and `bench.kernels --only gemv_q` times them side by side. The first form
# keeps the key without a tag (the runner's choice: `runtime/model/gpu/kernels.py` GEMV_FORMS).
# `shift` decodes with bit placement and one exact bf16 multiply (`dequant.py`); `_u8` unrolls up
# to 8 steps instead of 4 (K = 5120 and 6144 then run their 5 or 6 steps per warp in one body).
# `cvt_u8_pfD` (PREFETCH): the `cvt` decode unrolled up to 8 blocks (the same sums in the same
# order: bit for bit `cvt`'s numbers) plus, at each block, an L2 prefetch of the codes D blocks
# ahead (`gemv_nvfp4.py` says why: ptxas keeps the loads about one block ahead, too few bytes in
# flight per SM for the copy bandwidth). With `cvt`'s unroll of 4 the prefetches took ptxas from
# 50 to 76-80 registers (one CTA an SM fewer); unrolled by 8 they keep 50.
FORMS = {"cvt": ("cvt", 4, ROWS), "shift": ("shift", 4, ROWS), "shift_u8": ("shift", 8, ROWS),
         "cvt_u8_pf2": ("cvt", 8, ROWS), "cvt_u8_pf4": ("cvt", 8, ROWS)}
PREFETCH = {"cvt_u8_pf2": 2, "cvt_u8_pf4": 4}  # form -> blocks prefetched ahead


# Wide variants: MB -> the row-group forms (R row groups of 16 per CTA, blocks each warp's loop
# keeps in flight) built for each shape of WIDE_SHAPES in the first form's decode. Per block a
# warp holds R x 32 registers of decoded weights, 16 per token group's activations and 8 fp32
# per (row group, token group) for the running sum and the block's partial, so the R = 2 forms
# keep one block in flight. ptxas (gdn_in, none spilling): m16 r1u2 80 registers, r2u1 155; m32
# r1u1 104, r2u1 178 (one CTA of 8 warps per SM). Tested on the H200, not timed one against another:
# `runtime/model/gpu/kernels.py` GEMV_FP8_ROW_FORMS names the form the runner takes per width.
WIDE = {16: ((1, 2), (2, 1)), 32: ((1, 1), (2, 1))}
# The fused [gate | up] shapes whose m8 GEMV is also built with the SiLU epilogue (`_m8_silu`).
SILU_SHAPES = ("gate_up", "tiny_gate_up")
WIDE_SHAPES = ("gdn_in", "o_proj", "attn_qkv", "gate_up", "down", "tiny_gdn_in", "tiny_gdn_out", "tiny_attn_qkv",
               "tiny_o_proj", "tiny_gate_up", "tiny_down")


def row_form(groups: int, unroll: int) -> str:
    """The tag of a wide variant's row-group form (config `rform`, the key's last part)."""
    return f"r{groups}u{unroll}"


def _variant(name: str, n: int, nt: int, k: int, form: str, mb: int = MB, groups: int = 1,
             group_unroll: int = 0, silu: bool = False) -> Variant:
    if n % (ROWS * groups) or k % BLOCK or BLOCK % (ROWS * groups):
        raise ValueError(f"gemv_fp8 shape {name}: N = {n} must be a multiple of {ROWS * groups} (rows per CTA, "
                         f"which must divide {BLOCK}) and K = {k} of {BLOCK}")
    blocks = k // BLOCK
    return weight_only_variant(FAMILY, name, n, nt, k, blocks,
                               {"w": tensor("e4m3", n, k), "scale": tensor("f32", -(-n // BLOCK), blocks)},
                               {"block": BLOCK}, f"fp8 W[{n},{k}]^T (128x128 fp32 block scales)", FORMS, form,
                               mb, groups, group_unroll, silu)


def weight_only_variant(family: str, name: str, n: int, nt: int, k: int, steps: int, weights: dict[str, Any],
                        config: dict[str, Any], what: str, forms: dict[str, tuple[str, int, int]],
                        form: str, mb: int = MB, groups: int = 1, group_unroll: int = 0,
                        silu: bool = False) -> Variant:
    """A decode GEMV variant for weights of a quantised format (this family and `gemv_nvfp4`):
    parameters x, the format's `weights` (name -> tensor, in order), the BF16 tail when nt > 0,
    out, M; 16 rows a CTA (8 where the form says so and there is no tail: the MMA's rows 8..15
    are zeros), 8 warps over the K `steps`, M <= 8; `config` adds the format's keys, `form` (a
    tag of `forms`) the decode, unroll and rows. A wide variant (mb > 8: M <= mb) owns `groups`
    row groups of 16 per CTA (the tail's CTAs as many) and keeps `group_unroll` steps in flight;
    its config adds `groups` and `rform`, its key `_m{mb}_rRuU`. silu: the m8 GEMV of a fused
    [gate | up] weight with SiLU(gate) * up as its epilogue (`_gemv_silu.py`; key `_m8_silu`,
    config form "silu", out [M, N / 2]), in `form`'s decode over 16 rows a CTA."""
    decode, most, rows = forms[form]
    rows = rows if nt == 0 and not silu else ROWS
    wide = mb > MB
    if silu and (nt or wide or n % (2 * ROWS)):
        raise ValueError(f"{family} {name}: the SiLU epilogue is built for m8 without a tail over an even count "
                         "of 8-row gate blocks")
    if wide:
        rows, most = ROWS * groups, group_unroll
    # Steps each warp's loop keeps in flight (unroll); every warp has steps // WARPS or one more.
    unroll = max(1, min(steps // WARPS, most))
    ctas = n // rows + -(-nt // (rows if wide else ROWS))
    params = [ptr("x")] + [ptr(w) for w in weights] + ([ptr("tail")] if nt else []) + [ptr("out"), i32("M")]
    tensors = {"x": tensor("bf16", "M", k), **weights,
               "out": tensor("bf16", "M", n // 2 if silu else n + nt, role="out")}
    if nt:
        tensors["tail"] = tensor("bf16", nt, k)
    tag = "" if form == next(iter(forms)) else f"_{form}"
    if wide:
        tag = f"_{row_form(groups, group_unroll)}{tag}"
        config = {**config, "groups": groups, "rform": row_form(groups, group_unroll)}
    if silu:
        tag = "_silu"
        config = {**config, "base": form}  # the form whose decode it runs (the runner's must be it)
    return Variant(
        family=family,
        key=f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_m{mb}{tag}",
        config={"N": n, "NT": nt, "K": k, "MB": mb, "warps": WARPS, **config, "unroll": unroll,
                "form": "silu" if silu else form, "decode": decode, "rows": rows, "silu": silu},
        params=params,
        tensors=tensors,
        sizes=("M",),
        block=(32 * WARPS, 1, 1),
        grid=(ctas, 1, 1),
        requires=("M >= 1", f"M <= {mb}"),
        arches=HOPPER,
        note=f"decode x[M<={mb},{k}] @ {what}" + (f" + bf16 tail [{nt},{k}]" if nt else "") + f", {form}"
             + (f", {groups} row groups of 16 per CTA" if groups > 1 else "")
             + (", SiLU(gate) * up epilogue" if silu else ""),
        example_sizes={"M": mb if wide else 1},
    )


def variants() -> list[Variant]:
    out = [_variant(*shape, form) for shape in SHAPES for form in FORMS]
    cvt = next(iter(FORMS))
    for shape in SHAPES:
        if shape[0] in WIDE_SHAPES:
            out += [_variant(*shape, cvt, mb, groups, unroll) for mb, forms in WIDE.items() for groups, unroll in forms]
        if shape[0] in SILU_SHAPES:
            out.append(_variant(*shape, cvt, silu=True))
    return out


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """e4m3fn codes (uint8) -> float64 values (0x7F / 0xFF are NaN)."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exponent, mantissa = (c >> 3) & 0xF, c & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * magnitude)


def reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, tail: np.ndarray | None = None, *,
              exact: bool = False) -> np.ndarray:
    """out[M, N + NT] for bf16-valued x [M, K], e4m3 codes [N, K], fp32 scales [cdiv(N, 128), K / 128]
    and an optional bf16-valued tail [NT, K].

    exact: float64 of the dequantised weights. Otherwise the kernel's roundings: each 128-column
    block's partial sum in fp32 (products are exact), times its fp32 scale, summed in fp32 over
    the blocks, rounded to bf16; the tail's rows in fp32, rounded to bf16."""
    n, k = codes.shape
    values = e4m3_values(codes)
    row_scale = np.repeat(np.asarray(scales, np.float64), BLOCK, axis=0)[:n]  # [N, K / 128]
    if exact:
        w = values * np.repeat(row_scale, BLOCK, axis=1)[:, :k]
        out = x.astype(np.float64) @ w.T
        if tail is not None:
            out = np.concatenate([out, x.astype(np.float64) @ tail.astype(np.float64).T], axis=1)
        return out
    xb = x.astype(np.float32).reshape(x.shape[0], k // BLOCK, BLOCK)
    wb = values.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    partial = np.einsum("mbk,nbk->mnb", xb, wb, dtype=np.float32)  # [M, N, blocks]
    out = (partial * row_scale.astype(np.float32)[None]).sum(axis=-1, dtype=np.float32)
    if tail is not None:
        out = np.concatenate([out, x.astype(np.float32) @ tail.astype(np.float32).T], axis=1)
    return round_bf16(out.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dequant, _dsl, _gemv_silu

    n, nt, k = variant.config["N"], variant.config["NT"], variant.config["K"]
    silu = variant.config["silu"]
    unroll, form = variant.config["unroll"], variant.config["decode"]
    ahead = PREFETCH.get(variant.config["form"], 0)  # blocks prefetched to L2 ahead of the loads
    mb, row_groups = variant.config["MB"], variant.config.get("groups", 1)
    groups = mb // 8  # 8-token MMA column groups
    span = ROWS * row_groups  # rows per CTA
    ldo = n + nt
    blocks = k // BLOCK
    per_warp, extra = blocks // WARPS, blocks % WARPS  # warps < extra take one more block
    fp8_ctas = n // span
    vec = (32,)

    def mma_block(mma: Any, frag_a: Any, frag_b: Any, a_lo: list, a_hi: list, x_at: list, col: Any,
                  into: list) -> None:
        """A 128-column block into accumulators [row group][token group]: token groups outermost
        (one activation fragment live at a time), each accumulator sees k16 steps 0..7 in order."""
        for g in range(groups):  # plain Python loops: they unroll while tracing
            b = cute.make_tensor(x_at[g] + col, cute.make_layout(vec)).load()
            for j in range(8):
                for h in range(row_groups):
                    _dsl.fill_k_slots(frag_a, frag_b, a_lo[h], a_hi[h], b, j)
                    cute.gemm(mma, into[h * groups + g], frag_a, frag_b, into[h * groups + g])

    def prefetch(w_lo: list, w_hi: list, c: Any) -> None:
        """L2 prefetches of block c's codes (this lane's 32 bytes of each row)."""
        for p in w_lo + w_hi:
            cute.arch.prefetch((p + c * BLOCK).llvm_ptr, cache_level="L2")

    def fp8_block(mma: Any, frag_a: Any, frag_b: Any, accs: list, block_accs: list, w_lo: list, w_hi: list,
                  x_at: list, s_rows: tuple, c: Any) -> None:
        """One 128-column block of the CTA's FP8 rows: unscaled partials, then acc += partial * scale
        (s_rows: the scale row of the MMA's rows 0..7 and of rows 8..15, None where it is the same)."""
        col = c * BLOCK
        a_lo = [_dequant.e4m3_row(form, p + col) for p in w_lo]
        a_hi = [_dequant.e4m3_row(form, p + col) for p in w_hi]
        for part in block_accs:
            part.fill(0.0)
        mma_block(mma, frag_a, frag_b, a_lo, a_hi, x_at, col, block_accs)
        s = cute.make_tensor(s_rows[0] + c, cute.make_layout(1))[0]
        s_hi = s if s_rows[1] is None else cute.make_tensor(s_rows[1] + c, cute.make_layout(1))[0]
        for acc, part in zip(accs, block_accs):
            for i in range(4):  # slots 0, 1: row r; 2, 3: row r + 8
                acc[i] = acc[i] + part[i] * (s if i < 2 else s_hi)

    def bf16_block(mma: Any, frag_a: Any, frag_b: Any, accs: list, t_lo: list, t_hi: list, x_at: list,
                   c: Any) -> None:
        """One 128-column block of the CTA's BF16 tail rows, added to the accumulators unscaled."""
        col = c * BLOCK
        a_lo = [cute.make_tensor(p + col, cute.make_layout(vec)).load() for p in t_lo]
        a_hi = [cute.make_tensor(p + col, cute.make_layout(vec)).load() for p in t_hi]
        mma_block(mma, frag_a, frag_b, a_lo, a_hi, x_at, col, accs)

    def fragments(mma: Any) -> list:
        out = []
        for _ in range(row_groups * groups):
            acc = mma.make_fragment_C(mma.partition_shape_C((16, 8)))
            acc.fill(0.0)
            out.append(acc)
        return out

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, tail: Any, out: cute.Pointer,
               m: cutlass.Int32):
        tid, bid, warp, r, q, mma, frag_a, frag_b = _dsl.gemv_lanes()
        accs = fragments(mma)  # [row group][token group]
        block_accs = fragments(mma)
        first = warp * per_warp + cutlass.min(warp, extra)  # this warp's first column block
        x_at = []
        for g in cutlass.range_constexpr(groups):
            x_at.append(x + cutlass.Int64(cutlass.min(g * 8 + r, m - 1)) * k + q * 32)
        row0 = bid * span
        count = span
        if bid < fp8_ctas:
            w_lo, w_hi = [], []
            if cutlass.const_expr(silu):
                # 8 gate rows and their 8 up rows, each half inside one 128-row scale block.
                gate_row, up_row = _gemv_silu.gate_up_rows(bid, r, n)
                w_lo.append(w + cutlass.Int64(gate_row) * k + q * 32)
                w_hi.append(w + cutlass.Int64(up_row) * k + q * 32)
                s_row = (scale + (gate_row - r) // BLOCK * blocks, scale + (up_row - r) // BLOCK * blocks)
            else:
                for h in cutlass.range_constexpr(row_groups):
                    w_lo.append(w + cutlass.Int64(row0 + h * ROWS + r) * k + q * 32)
                    w_hi.append(w + cutlass.Int64(row0 + h * ROWS + r + 8) * k + q * 32)
                # The CTA's rows lie in one 128-row scale block (128 % span == 0, `_variant`).
                s_row = (scale + (row0 // BLOCK) * blocks, None)
            last = first + per_warp - 1  # the warp's last block (for the prefetch's clamp)
            if cutlass.const_expr(ahead > 0 and per_warp > 0):
                for c in cutlass.range_constexpr(1, ahead):  # blocks first + 1 .. first + ahead - 1
                    prefetch(w_lo, w_hi, cutlass.min(first + c, last))
            for c in cutlass.range(first, first + per_warp, unroll=unroll):
                if cutlass.const_expr(ahead > 0):
                    # Past the warp's last block: that block again (an L2 hit, no stray addresses).
                    prefetch(w_lo, w_hi, cutlass.min(c + ahead, last))
                fp8_block(mma, frag_a, frag_b, accs, block_accs, w_lo, w_hi, x_at, s_row, c)
            if cutlass.const_expr(extra > 0):
                if warp < extra:
                    fp8_block(mma, frag_a, frag_b, accs, block_accs, w_lo, w_hi, x_at, s_row, first + per_warp)
        if cutlass.const_expr(nt > 0):
            if bid >= fp8_ctas:
                t0 = (bid - fp8_ctas) * span
                count = cutlass.min(nt - t0, span)
                t_lo, t_hi = [], []
                for h in cutlass.range_constexpr(row_groups):
                    t_lo.append(tail + cutlass.Int64(t0 + cutlass.min(h * ROWS + r, count - 1)) * k + q * 32)
                    t_hi.append(tail + cutlass.Int64(t0 + cutlass.min(h * ROWS + r + 8, count - 1)) * k + q * 32)
                for c in cutlass.range(first, first + per_warp, unroll=unroll):
                    bf16_block(mma, frag_a, frag_b, accs, t_lo, t_hi, x_at, c)
                if cutlass.const_expr(extra > 0):
                    if warp < extra:
                        bf16_block(mma, frag_a, frag_b, accs, t_lo, t_hi, x_at, first + per_warp)
                row0 = n + t0
        if cutlass.const_expr(silu):
            partial = _dsl.acc_partials(accs[0], r, q, warp, ROWS, mb, WARPS)
            _gemv_silu.silu_pairs(partial, tid, out, n // 2, bid * _gemv_silu.PAIRS, m, mb, WARPS)
        else:
            _dsl.sum_row_group_partials(accs, tid, r, q, warp, out, ldo, row0, m, count, ROWS, mb, WARPS,
                                        row_groups)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gemv_fp8_{variant.key}")

    if nt:
        @cute.jit
        def launch(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, tail: cute.Pointer, out: cute.Pointer,
                   m: cutlass.Int32, stream: Any):
            kernel(x, w, scale, tail, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                     stream=stream)
    else:
        @cute.jit
        def launch(x: cute.Pointer, w: cute.Pointer, scale: cute.Pointer, out: cute.Pointer, m: cutlass.Int32,
                   stream: Any):
            kernel(x, w, scale, None, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                     stream=stream)

    return launch, _dsl.example_args(variant)
