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
# `cpS` (PIPELINE): the `cvt` decode over codes that reach shared memory by `cp.async`, each warp
# a ring of S blocks: a warp keeps S - 1 blocks (S - 1 x 2 KB) in flight without holding them in
# registers, which the register loads cannot do (ptxas sinks them to about one block ahead).
# Each lane copies exactly the 64 bytes it decodes (rows r and r + 8), so a lane waits on its
# own copies only (no barrier); the ring is chunk-major (chunk j of the 32 lanes contiguous), so
# the copies and the 16-byte shared loads are free of bank conflicts. The same decode and the
# same sums in the same order as `cvt`: bit for bit its numbers.
FORMS = {"cvt": ("cvt", 4, ROWS), "shift": ("shift", 4, ROWS), "shift_u8": ("shift", 8, ROWS),
         "cvt_u8_pf2": ("cvt", 8, ROWS), "cvt_u8_pf4": ("cvt", 8, ROWS), "cp3": ("cvt", 1, ROWS),
         "cp4": ("cvt", 1, ROWS), "cp6": ("cvt", 1, ROWS)}
PREFETCH = {"cvt_u8_pf2": 2, "cvt_u8_pf4": 4}  # form -> blocks prefetched ahead
PIPELINE = {"cp3": 3, "cp4": 4, "cp6": 6}  # form -> ring blocks per warp
RING_WORDS = 4 * 32 * 4  # one block of one warp in the ring: 4 chunks x 32 lanes x 16 bytes, in int32 words


# Wide variants: MB -> the row-group forms (R row groups of 16 per CTA, blocks each warp's loop
# keeps in flight) built for each shape of WIDE_SHAPES in the first form's decode. Per block a
# warp holds R x 32 registers of decoded weights, 16 per token group's activations and 8 fp32
# per (row group, token group) for the running sum and the block's partial, so the R = 2 forms
# keep one block in flight. ptxas (gdn_in, none spilling): m16 r1u2 80 registers, r2u1 155; m32
# r1u1 104, r2u1 178 (one CTA of 8 warps per SM). Tested on the H200, not timed one against another:
# `runtime/model/gpu/kernels.py` GEMV_FP8_ROW_FORMS names the form the runner takes per width.
WIDE = {16: ((1, 2), (2, 1)), 32: ((1, 1), (2, 1))}
WIDE_SHAPES = ("gdn_in", "o_proj", "attn_qkv", "gate_up", "down", "tiny_gdn_in", "tiny_gdn_out", "tiny_attn_qkv",
               "tiny_o_proj", "tiny_gate_up", "tiny_down")


def row_form(groups: int, unroll: int) -> str:
    """The tag of a wide variant's row-group form (config `rform`, the key's last part)."""
    return f"r{groups}u{unroll}"


def _variant(name: str, n: int, nt: int, k: int, form: str, mb: int = MB, groups: int = 1,
             group_unroll: int = 0) -> Variant:
    if n % (ROWS * groups) or k % BLOCK or BLOCK % (ROWS * groups):
        raise ValueError(f"gemv_fp8 shape {name}: N = {n} must be a multiple of {ROWS * groups} (rows per CTA, "
                         f"which must divide {BLOCK}) and K = {k} of {BLOCK}")
    blocks = k // BLOCK
    return weight_only_variant(FAMILY, name, n, nt, k, blocks,
                               {"w": tensor("e4m3", n, k), "scale": tensor("f32", -(-n // BLOCK), blocks)},
                               {"block": BLOCK}, f"fp8 W[{n},{k}]^T (128x128 fp32 block scales)", FORMS, form,
                               mb, groups, group_unroll)


def weight_only_variant(family: str, name: str, n: int, nt: int, k: int, steps: int, weights: dict[str, Any],
                        config: dict[str, Any], what: str, forms: dict[str, tuple[str, int, int]],
                        form: str, mb: int = MB, groups: int = 1, group_unroll: int = 0) -> Variant:
    """A decode GEMV variant for weights of a quantised format (this family and `gemv_nvfp4`):
    parameters x, the format's `weights` (name -> tensor, in order), the BF16 tail when nt > 0,
    out, M; 16 rows a CTA (8 where the form says so and there is no tail: the MMA's rows 8..15
    are zeros), 8 warps over the K `steps`, M <= 8; `config` adds the format's keys, `form` (a
    tag of `forms`) the decode, unroll and rows. A wide variant (mb > 8: M <= mb) owns `groups`
    row groups of 16 per CTA (the tail's CTAs as many) and keeps `group_unroll` steps in flight;
    its config adds `groups` and `rform`, its key `_m{mb}_rRuU`."""
    decode, most, rows = forms[form]
    rows = rows if nt == 0 else ROWS
    wide = mb > MB
    if wide:
        rows, most = ROWS * groups, group_unroll
    # Steps each warp's loop keeps in flight (unroll); every warp has steps // WARPS or one more.
    unroll = max(1, min(steps // WARPS, most))
    ctas = n // rows + -(-nt // (rows if wide else ROWS))
    params = [ptr("x")] + [ptr(w) for w in weights] + ([ptr("tail")] if nt else []) + [ptr("out"), i32("M")]
    tensors = {"x": tensor("bf16", "M", k), **weights, "out": tensor("bf16", "M", n + nt, role="out")}
    if nt:
        tensors["tail"] = tensor("bf16", nt, k)
    tag = "" if form == next(iter(forms)) else f"_{form}"
    if wide:
        tag = f"_{row_form(groups, group_unroll)}{tag}"
        config = {**config, "groups": groups, "rform": row_form(groups, group_unroll)}
    return Variant(
        family=family,
        key=f"{name}_n{n}" + (f"_t{nt}" if nt else "") + f"_k{k}_m{mb}{tag}",
        config={"N": n, "NT": nt, "K": k, "MB": mb, "warps": WARPS, **config, "unroll": unroll, "form": form,
                "decode": decode, "rows": rows},
        params=params,
        tensors=tensors,
        sizes=("M",),
        block=(32 * WARPS, 1, 1),
        grid=(ctas, 1, 1),
        requires=("M >= 1", f"M <= {mb}"),
        arches=HOPPER,
        note=f"decode x[M<={mb},{k}] @ {what}" + (f" + bf16 tail [{nt},{k}]" if nt else "") + f", {form}"
             + (f", {groups} row groups of 16 per CTA" if groups > 1 else ""),
        example_sizes={"M": mb if wide else 1},
    )


def variants() -> list[Variant]:
    out = [_variant(*shape, form) for shape in SHAPES for form in FORMS]
    cvt = next(iter(FORMS))
    for shape in SHAPES:
        if shape[0] in WIDE_SHAPES:
            out += [_variant(*shape, cvt, mb, groups, unroll) for mb, forms in WIDE.items() for groups, unroll in forms]
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

    from cutlass.cute.nvgpu import cpasync

    from . import _dequant, _dsl

    n, nt, k = variant.config["N"], variant.config["NT"], variant.config["K"]
    unroll, form = variant.config["unroll"], variant.config["decode"]
    ahead = PREFETCH.get(variant.config["form"], 0)  # blocks prefetched to L2 ahead of the loads
    stages = PIPELINE.get(variant.config["form"], 0)  # cp.async ring blocks per warp (0: register loads)
    mb, row_groups = variant.config["MB"], variant.config.get("groups", 1)
    groups = mb // 8  # 8-token MMA column groups
    span = ROWS * row_groups  # rows per CTA
    ldo = n + nt
    blocks = k // BLOCK
    per_warp, extra = blocks // WARPS, blocks % WARPS  # warps < extra take one more block
    fp8_ctas = n // span
    vec = (32,)

    def load_x(x_at: list, col: Any) -> list:
        """The lane's 32 activations of each token group at column col."""
        return [cute.make_tensor(p + col, cute.make_layout(vec)).load() for p in x_at]

    def mma_block(mma: Any, frag_a: Any, frag_b: Any, a_lo: list, a_hi: list, x_at: list, col: Any,
                  into: list, xs: list | None = None) -> None:
        """A 128-column block into accumulators [row group][token group]: token groups outermost
        (one activation fragment live at a time), each accumulator sees k16 steps 0..7 in order.
        xs: the block's activations already loaded (`load_x`), else loaded here."""
        for g in range(groups):  # plain Python loops: they unroll while tracing
            b = cute.make_tensor(x_at[g] + col, cute.make_layout(vec)).load() if xs is None else xs[g]
            for j in range(8):
                for h in range(row_groups):
                    _dsl.fill_k_slots(frag_a, frag_b, a_lo[h], a_hi[h], b, j)
                    cute.gemm(mma, into[h * groups + g], frag_a, frag_b, into[h * groups + g])

    def prefetch(w_lo: list, w_hi: list, c: Any) -> None:
        """L2 prefetches of block c's codes (this lane's 32 bytes of each row)."""
        for p in w_lo + w_hi:
            cute.arch.prefetch((p + c * BLOCK).llvm_ptr, cache_level="L2")

    def fp8_block(mma: Any, frag_a: Any, frag_b: Any, accs: list, block_accs: list, w_lo: list, w_hi: list,
                  x_at: list, s_row: Any, c: Any, held: tuple | None = None) -> None:
        """One 128-column block of the CTA's FP8 rows: unscaled partials, then acc += partial * scale.
        held (the ring forms): (decoded rows, activations, scale) already in registers, else
        everything is read here."""
        col = c * BLOCK
        if held is None:
            a_lo = [_dequant.e4m3_row(form, p + col) for p in w_lo]
            a_hi = [_dequant.e4m3_row(form, p + col) for p in w_hi]
            xs, s = None, cute.make_tensor(s_row + c, cute.make_layout(1))[0]
        else:
            (a_lo, a_hi), xs, s = held
        for part in block_accs:
            part.fill(0.0)
        mma_block(mma, frag_a, frag_b, a_lo, a_hi, x_at, col, block_accs, xs)
        for acc, part in zip(accs, block_accs):
            for i in range(4):
                acc[i] = acc[i] + part[i] * s

    def ring_issue(ring: Any, w: Any, w_row: Any, slot: Any, c: Any) -> None:
        """cp.async of this lane's 64 code bytes of block c (rows r and r + 8: chunks 0, 1 and 2,
        3 of 16 bytes) into its ring slot (word offset of chunk 0; chunk j is j x 128 words on).
        w_row: the byte offset in the codes `w` of the lane's row r at block 0."""
        # Through L1 (`.ca`): the two 16-byte chunks of a row's 32 bytes are half of one sector
        # each; the second copy then finds the sector in L1 instead of fetching it from L2 again.
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), cutlass.Int32,
                                  num_bits_per_copy=128)
        for chunk in range(4):
            offset = w_row + cutlass.Int64(chunk // 2 * 8) * k + c * BLOCK + chunk % 2 * 16
            src = cute.make_tensor(cute.recast_ptr(w + cute.assume(offset, divby=16), dtype=cutlass.Int32),
                                   cute.make_layout(4))
            dst = cute.make_tensor(ring.iterator + cute.assume(slot + chunk * 128, divby=4), cute.make_layout(4))
            cute.copy(g2s, src, dst)

    def ring_rows(ring: Any, slot: Any) -> tuple:
        """The lane's two rows of one ring slot, decoded: ([row r], [row r + 8]) of 32 bf16 each."""
        rows = []
        for half in range(2):
            raw = cute.make_rmem_tensor((8,), cutlass.Int32)
            raw.store(cute.make_tensor(ring.iterator + cute.assume(slot + half * 256, divby=4),
                                       cute.make_layout((4, 2), stride=(1, 128))).load())
            rows.append([cute.recast_tensor(raw, cutlass.Float8E4M3FN).load().to(cutlass.BFloat16)])
        return rows[0], rows[1]

    def ring_fill(ring: Any, w: Any, w_row: Any, base: Any, first: Any, i: int) -> None:
        """Copy group i of a warp's ring: block first + i (clamped to the last block: valid memory;
        the extra block of warps >= extra is copied but not used) into slot i % stages, or an
        empty group past the warp's blocks, so that `wait_group(stages - 1)` at iteration i
        always means "block i has landed"."""
        if i < per_warp + (1 if extra else 0):
            ring_issue(ring, w, w_row, base + i % stages * RING_WORDS, cutlass.min(first + i, blocks - 1))
        cute.arch.cp_async_commit_group()

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
        smem = cutlass.memory.SmemAllocator()
        if cutlass.const_expr(stages > 0):
            ring = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS * stages * RING_WORDS), byte_alignment=16)
            if bid < fp8_ctas:
                # The warp's blocks in order through its ring, stages - 1 copy groups ahead.
                s_row = scale + (row0 // BLOCK) * blocks
                w_row = cutlass.Int64(row0 + r) * k + q * 32
                base = warp * (stages * RING_WORDS) + (tid % 32) * 4
                # Each block's activations and scale are loaded one block ahead into registers:
                # `wait_group` orders the loads after it, so loaded behind it their L2 latency
                # would stall every block.
                ring_blocks = per_warp + (1 if extra else 0)
                for i in cutlass.range_constexpr(stages - 1):
                    ring_fill(ring, w, w_row, base, first, i)
                c_next = cutlass.min(first, blocks - 1)
                x_next = load_x(x_at, c_next * BLOCK)
                s_next = cute.make_tensor(s_row + c_next, cute.make_layout(1))[0]
                for i in cutlass.range_constexpr(ring_blocks):
                    ring_fill(ring, w, w_row, base, first, i + stages - 1)
                    x_cur, s_cur = x_next, s_next
                    if cutlass.const_expr(i + 1 < ring_blocks):
                        c_next = cutlass.min(first + i + 1, blocks - 1)
                        x_next = load_x(x_at, c_next * BLOCK)
                        s_next = cute.make_tensor(s_row + c_next, cute.make_layout(1))[0]
                    cute.arch.cp_async_wait_group(stages - 1)
                    held = (ring_rows(ring, base + i % stages * RING_WORDS), x_cur, s_cur)
                    if cutlass.const_expr(i < per_warp):
                        fp8_block(mma, frag_a, frag_b, accs, block_accs, None, None, x_at, s_row, first + i, held)
                    else:
                        if warp < extra:
                            fp8_block(mma, frag_a, frag_b, accs, block_accs, None, None, x_at, s_row, first + i,
                                      held)
        elif bid < fp8_ctas:
            w_lo, w_hi = [], []
            for h in cutlass.range_constexpr(row_groups):
                w_lo.append(w + cutlass.Int64(row0 + h * ROWS + r) * k + q * 32)
                w_hi.append(w + cutlass.Int64(row0 + h * ROWS + r + 8) * k + q * 32)
            # The CTA's rows lie in one 128-row scale block (128 % span == 0, `_variant`).
            s_row = scale + (row0 // BLOCK) * blocks
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
        partial = smem.allocate_tensor(cutlass.Float32, cute.make_layout((ROWS, mb, WARPS), stride=(1, ROWS, ROWS * mb)),
                                       byte_alignment=16)
        # The epilogue adds one (row, token) per thread: MB = 32 takes two passes of 16 tokens, row
        # groups one after the other through the same partials.
        per = min(mb, 32 * WARPS // ROWS)
        for h in cutlass.range_constexpr(row_groups):
            if cutlass.const_expr(h > 0):
                cute.arch.sync_threads()  # every thread has added the previous group's partials
            for g in cutlass.range_constexpr(groups):
                # Accumulator slots: (row r, token 2q), (r, 2q + 1), (r + 8, 2q), (r + 8, 2q + 1).
                acc = accs[h * groups + g]
                partial[r, g * 8 + 2 * q, warp] = acc[0]
                partial[r, g * 8 + 2 * q + 1, warp] = acc[1]
                partial[r + 8, g * 8 + 2 * q, warp] = acc[2]
                partial[r + 8, g * 8 + 2 * q + 1, warp] = acc[3]
            for p in cutlass.range_constexpr(mb // per):
                part = cute.make_tensor(partial.iterator + p * per * ROWS,
                                        cute.make_layout((ROWS, per, WARPS), stride=(1, ROWS, ROWS * mb)))
                _dsl.sum_warp_partials(part, tid, out + cutlass.Int64(p * per) * ldo, ldo, row0 + h * ROWS,
                                       m - p * per, count - h * ROWS, ROWS, per, WARPS)

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
