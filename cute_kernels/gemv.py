"""Decode GEMV / skinny GEMM: `out[M, N] = x[M, K] @ W[N, K]^T` for M = 1..64, BF16, fp32 accumulate.

At decode the weights are read once per step and M is tiny, so the kernel is built to stream W at
memory bandwidth, not to use the tensor cores fully. The weights are the MMA's M side ("swap AB"):

- a CTA owns 16 rows of W (7 or 8 for the `SPREAD` variants, whose MMA rows 8..15 are zeros and
  whose grid is a multiple of the SM count) and 8 warps split K among themselves (so even
  N = 5120 puts ~19 warps on every SM, enough bytes in flight), each warp walking its K range in
  128-column chunks;
- per chunk, lane (r, q) = (lane / 4, lane % 4) loads 32 contiguous bytes of rows r and r + 8 (the
  4 lanes of a row cover one full 128-byte line) and the same 16 columns of token r's activation;
- those columns feed four `mma.sync.m16n8k16` (BF16 in, FP32 accumulate) per 8 tokens. The MMA
  fragment's K slots are a permutation of the physical columns, the same one for A and B, so the
  dot products are exact sums over the chunk while every load stays a 16-byte vector;
- the 8 warps' 16 x M partial sums meet in shared memory, are added in a fixed order
  (deterministic) and written as bf16.

Tokens past M read token M - 1 again (valid memory); their MMA columns are never stored. `MB` (8,
16, 32 or 64) is the largest M a variant accepts: one 8-token MMA column group per 8 tokens, each
weight chunk loaded once and fed to every group. A token's result does not depend on MB: its
group's MMAs see the same weight fragments in the same K order (chunks, then the 4 k16 steps), the
token sits in the same MMA column (token % 8) and the warps' partials are added in warp order, so
row t of an `m32` or `m64` launch equals row t % 8 of the `m8` launch over t's block of 8 bit for
bit. The wide variants exist for verification steps (k + 1 tokens of up to 8 sequences): one launch
reads each weight once for all their rows.

Row-group forms (config `groups` = R and `unroll`, tag `rRuU` in the key, e.g. `..._m32_r2u2`): a
CTA owns R x 16 rows and each warp holds R weight fragments per chunk, so one load of a token
group's activation fragment feeds R row groups' MMAs. With 16 rows per CTA every CTA re-reads the
whole x[M, K] from L2: M / 16 times the weight bytes (4x at M = 64), more than L2 delivers next to
the weight stream; R row groups cut it to M / (16 R). Nothing else changes for a row: its row
group's MMAs see the same fragments in the same order (chunks, then the 4 k16 steps; the same 8
warps' K ranges), its row sits in the same MMA row (row % 16) and the epilogue adds the warps'
partials of one row group at a time in warp order, so every form gives the m8 numbers bit for
bit. `runtime/model/gpu/kernels.py` picks a form per width (`GEMV_ROW_FORMS`); `python -m
bench.kernels --only gemv` times them all.

`..._m8_silu` (the shapes of `SILU`, config form "silu"): the m8 GEMV of a fused [gate | up]
weight with SiLU(gate) * up as its epilogue (`_gemv_silu.py`): out is [M, N / 2], the decode
step's `silu_mul` launch folded in, the same numbers bit for bit.
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import HOPPER, Variant, i32, ptr, tensor

FAMILY = "gemv"
WARPS = 8  # warps per CTA, splitting K
ROWS = 16  # weight rows per CTA (the MMA's M)
SMS = 132  # SMs of an H100/H200 SXM (any count is correct; this one balances the spread grids)
# Spread variants: a grid of SPREAD[(name, MB)] x SMS CTAs, CTA b owning rows
# [b * N // grid, (b + 1) * N // grid) (7 or 8 rows: the MMA's upper 8 rows are zeros). N = 5120
# with 16 rows per CTA gives 320 CTAs, 2 or 3 per SM, and the SMs holding 3 stream 1.24x the
# average and finish last; 6 x 132 CTAs of 6-7 rows give every SM the same bytes.
SPREAD = {("o_proj", 8): 6}
# Chunks each warp's loop keeps in flight (default min(chunks, 4)). o_proj's K = 6144 leaves each
# warp 12 chunks: unrolling all 12 (with 6 x 132 CTAs) measured 88 % of copy bandwidth at M = 1
# against 86 % for 4 (5 x 132 CTAs) in the same run; 6 fell to 70 % (docs/performance.md).
UNROLL = {("o_proj", 8): 12}
CHUNK = 64  # K columns per warp step: 4 lanes x 32 bytes = one 128-byte line per row
MBS = (8, 16, 32, 64)  # the row counts of each shape's variants
# Chunks in flight per warp at MB = 64: each chunk holds MB / 8 activation fragments in registers
# (8 each). ptxas: m32 with the default 4 uses 100 registers, m64 with 2 uses 142 (one CTA per
# SM), with 1 100 (two), none spilling. Unrolling changes only the schedule, not the order of each
# accumulator's MMAs.
WIDE_UNROLL = {64: 1}
# The row-group forms built for each width besides the plain one (R = 1, the R = 1 unroll rule
# above): (R, chunks in flight per warp). A warp holds R x MB / 2 fp32 accumulators and 16 R
# weight registers per chunk in flight. ptxas on gdn_in, none spilling: m16 r2u2 116 registers
# (two CTAs per SM), r4u1 160; m32 r2u1 126 (two CTAs per SM), r2u2 146, r4u1 180; m64 r2u1 170,
# r3u1 218, r4u1 255 (the most a thread may hold). R = 4 with 4 chunks in flight spilled (m16 120
# bytes, m32 240).
ROW_FORMS = {16: ((2, 2), (4, 1)), 32: ((2, 2), (2, 1), (4, 1)), 64: ((2, 1), (3, 1), (4, 1))}
PLAIN = "r1"  # the form tag of the 16-row variants (keys without a tag)


# The shapes whose m8 GEMV is also built with the gate/up + SiLU epilogue (key `..._m8_silu`).
SILU = ("gate_up",)


def form_tag(groups: int, unroll: int) -> str:
    return PLAIN if groups == 1 else f"r{groups}u{unroll}"


# (name, N, K): every linear layer of the 27B (and of its MTP head) at decode (BF16 weights).
SHAPES = [
    ("gdn_in", 16480, 5120),  # in_proj_qkv + in_proj_z + in_proj_b + in_proj_a
    ("o_proj", 5120, 6144),  # GDN out_proj and attention o_proj
    ("attn_qkv", 14336, 5120),  # q (with gate) + k + v
    ("gate_up", 34816, 5120),
    ("down", 5120, 17408),
    ("lm_head", 248320, 5120),
    # The lm_head's first 32768 rows: MTP drafts over a smaller vocabulary (`--mtp-draft-vocab`,
    # runtime/model/gpu/mtp.py), a view of the same weight.
    ("lm_head_draft", 32768, 5120),
    ("mtp_fc", 5120, 10240),  # the MTP head's fc over [embedding | hidden] (2H -> H)
    # Qwen3.5/3.6-35B-A3B (hidden 2048; its MoE MLP is the moe family's).
    ("a3b_gdn_in", 12352, 2048),  # in_proj_qkv + in_proj_z + in_proj_b + in_proj_a
    ("a3b_o_proj", 2048, 4096),  # GDN out_proj and attention o_proj
    ("a3b_attn_qkv", 9216, 2048),
    ("a3b_lm_head", 248320, 2048),
    # Tests only (tests/gpu/test_gemv_wide.py): 65 row groups of 16, so the last CTA of every row
    # group count (2, 3, 4) owns fewer groups than the others; one 64-column chunk per warp.
    ("test_tail", 1040, 512),
]


def _variant(name: str, n: int, k: int, mb: int, groups: int = 1, group_unroll: int = 1, silu: bool = False) -> Variant:
    spread = SPREAD.get((name, mb))
    if silu and (spread or groups > 1 or mb != 8 or n % (2 * ROWS)):
        raise ValueError(f"gemv {name}: the SiLU epilogue is built for m8 over 16 rows a CTA and an even count "
                         "of 8-row gate blocks")
    if spread and groups > 1:
        raise ValueError(f"gemv {name} m{mb}: a spread grid owns under 16 rows per CTA, it has no row groups")
    chunks = k // WARPS // CHUNK
    ctas = spread * SMS if spread else -(-n // (ROWS * groups))  # the last CTA may own fewer groups
    unroll = UNROLL.get((name, mb), min(chunks, WIDE_UNROLL.get(mb, 4)))
    if groups > 1:
        unroll = min(chunks, group_unroll)  # the key keeps the form's U; fewer chunks unroll whole
    rows = -(-n // ctas) if spread else ROWS * groups  # the most rows one CTA owns
    if spread and rows > ROWS // 2:
        raise ValueError(f"gemv {name} m{mb}: {ctas} CTAs give {rows} rows per CTA, more than {ROWS // 2}")
    return Variant(
        family=FAMILY,
        key=f"{name}_n{n}_k{k}_m{mb}" + (f"_{form_tag(groups, group_unroll)}" if groups > 1 else "")
            + ("_silu" if silu else ""),
        config={"N": n, "K": k, "MB": mb, "form": "silu" if silu else form_tag(groups, group_unroll),
                "groups": groups, "warps": WARPS, "rows": rows, "ctas": ctas, "chunk": CHUNK, "unroll": unroll,
                "pdl": True, "silu": silu},
        params=[ptr("x"), ptr("w"), ptr("out"), i32("M")],
        tensors={"x": tensor("bf16", "M", k), "w": tensor("bf16", n, k),
                 "out": tensor("bf16", "M", n // 2 if silu else n, role="out")},
        sizes=("M",),
        block=(32 * WARPS, 1, 1),
        grid=(ctas, 1, 1),
        requires=("M >= 1", f"M <= {mb}"),
        arches=HOPPER,
        note=f"decode x[M<={mb},{k}] @ W[{n},{k}]^T, weights streamed once"
             + (f", {groups} row groups of 16 per CTA" if groups > 1 else "")
             + (", SiLU(gate) * up epilogue" if silu else ""),
        example_sizes={"M": 1 if mb == 8 else mb},
    )


def variants() -> list[Variant]:
    out = []
    for name, n, k in SHAPES:
        if n % ROWS or k % (CHUNK * WARPS):
            raise ValueError(f"gemv shape {name} {n}x{k} does not tile by {ROWS} rows and {CHUNK * WARPS} columns")
        for mb in MBS:
            out.append(_variant(name, n, k, mb))
            out += [_variant(name, n, k, mb, groups, unroll) for groups, unroll in ROW_FORMS.get(mb, ())]
        if name in SILU:
            out.append(_variant(name, n, k, 8, silu=True))
    return out


def reference(x: np.ndarray, w: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """x @ w.T for bf16-valued inputs: float64 when exact, else fp32 accumulate + bf16 output."""
    if exact:
        return x.astype(np.float64) @ w.astype(np.float64).T
    return round_bf16((x.astype(np.float32) @ w.astype(np.float32).T).astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _gemv_silu, _pdl

    n, k, mb = variant.config["N"], variant.config["K"], variant.config["MB"]
    ctas, row_groups = variant.config["ctas"], variant.config["groups"]
    half = ctas != n // ROWS and row_groups == 1  # spread: <= 8 rows per CTA, rows r + 8 of the MMA are zeros
    rows = ROWS // 2 if half else ROWS  # rows of one row group (the MMA's M)
    groups = mb // 8  # 8-token MMA column groups
    per_warp = k // WARPS
    chunks = per_warp // CHUNK
    unroll = variant.config["unroll"]
    silu = variant.config["silu"]
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, bid, warp, r, q, mma, frag_a, frag_b = _dsl.gemv_lanes()
        accs = []  # [row group][token group]
        for h in cutlass.range_constexpr(row_groups):
            for g in cutlass.range_constexpr(groups):
                acc = mma.make_fragment_C(mma.partition_shape_C((16, 8)))
                acc.fill(0.0)
                accs.append(acc)
        row0 = bid * (rows * row_groups)
        count = rows * row_groups
        if cutlass.const_expr(half):
            row0 = (bid * n) // ctas
            count = ((bid + 1) * n) // ctas - row0
        if cutlass.const_expr(row_groups > 1):
            count = cutlass.min(n - row0, rows * row_groups)  # the last CTA may own fewer groups
        col0 = warp * per_warp + q * 16
        vec = cute.make_layout((16,))
        w_lo, w_hi = [], []
        if cutlass.const_expr(silu):
            gate_row, up_row = _gemv_silu.gate_up_rows(bid, r, n)
            w_lo.append(w + cutlass.Int64(gate_row) * k + col0)
            w_hi.append(w + cutlass.Int64(up_row) * k + col0)
        elif cutlass.const_expr(row_groups == 1):
            # Lanes past the CTA's last row read that row again (same addresses, no extra traffic).
            w_lo.append(w + cutlass.Int64(row0 + cutlass.min(r, count - 1)) * k + col0)
            w_hi.append(w + cutlass.Int64(row0 + r + 8) * k + col0)
        else:
            # A row group past N (N is a multiple of 16: whole groups) re-reads row N - 1.
            for h in cutlass.range_constexpr(row_groups):
                w_lo.append(w + cutlass.Int64(cutlass.min(row0 + h * ROWS + r, n - 1)) * k + col0)
                w_hi.append(w + cutlass.Int64(cutlass.min(row0 + h * ROWS + r + 8, n - 1)) * k + col0)
        if cutlass.const_expr(half):
            frag_a[2] = bf16(0.0)
            frag_a[3] = bf16(0.0)
            frag_a[6] = bf16(0.0)
            frag_a[7] = bf16(0.0)
        # PDL (cute_kernels/_pdl.py): the weights are no earlier kernel's output, so each row's bytes
        # of the chunks the warp's loop first keeps in flight (contiguous: lane q = 0's address on)
        # head for L2 while the previous kernel drains; x (its output) is read, and `out` written,
        # only after the wait.
        if q == 0:
            for h in cutlass.range_constexpr(row_groups):
                _pdl.prefetch_l2(w_lo[h], min(unroll, chunks) * CHUNK * 2)
                if cutlass.const_expr(not half):
                    _pdl.prefetch_l2(w_hi[h], min(unroll, chunks) * CHUNK * 2)
        _pdl.wait()
        x_rows = []
        for g in cutlass.range_constexpr(groups):
            token = cutlass.min(g * 8 + r, m - 1)
            x_rows.append(x + cutlass.Int64(token) * k + col0)
        for c in cutlass.range(chunks, unroll=unroll):
            a_lo, a_hi = [], []
            for h in cutlass.range_constexpr(row_groups):
                lo = cute.make_tensor(w_lo[h] + c * CHUNK, vec).load()
                a_lo.append(lo)
                a_hi.append(None if half else cute.make_tensor(w_hi[h] + c * CHUNK, vec).load())
            for g in cutlass.range_constexpr(groups):
                b = cute.make_tensor(x_rows[g] + c * CHUNK, vec).load()
                for j in cutlass.range_constexpr(4):
                    # Row groups innermost: each accumulator still sees k16 steps 0..3 in order,
                    # and back-to-back MMAs write different accumulators.
                    for h in cutlass.range_constexpr(row_groups):
                        _dsl.fill_k_slots(frag_a, frag_b, a_lo[h], a_hi[h], b, j)
                        cute.gemm(mma, accs[h * groups + g], frag_a, frag_b, accs[h * groups + g])
        _pdl.launch_dependents()  # only the epilogue is left: the next kernel's CTAs may start
        smem = cutlass.memory.SmemAllocator()
        partial = smem.allocate_tensor(
            f32, cute.make_layout((rows, mb, WARPS), stride=(1, rows, rows * mb)), byte_alignment=16
        )
        # The epilogue adds one (row, token) per thread: MB = 32 and 64 take it in passes of
        # `per` tokens (a pass is the m16 epilogue over a slice of the partials and the output),
        # row groups one after the other through the same partials.
        per = min(mb, 32 * WARPS // rows)
        for h in cutlass.range_constexpr(row_groups):
            group0, group_count = row0, count
            if cutlass.const_expr(h > 0):
                cute.arch.sync_threads()  # every thread has added the previous group's partials
                group0, group_count = row0 + h * rows, count - h * rows
            for g in cutlass.range_constexpr(groups):
                acc = accs[h * groups + g]
                # Accumulator slots: (row r, token 2q), (r, 2q+1), (r+8, 2q), (r+8, 2q+1).
                partial[r, g * 8 + 2 * q, warp] = acc[0]
                partial[r, g * 8 + 2 * q + 1, warp] = acc[1]
                if cutlass.const_expr(not half):
                    partial[r + 8, g * 8 + 2 * q, warp] = acc[2]
                    partial[r + 8, g * 8 + 2 * q + 1, warp] = acc[3]
            if cutlass.const_expr(silu):
                _gemv_silu.silu_pairs(partial, tid, out, n // 2, bid * _gemv_silu.PAIRS, m, mb, WARPS)
            for p in cutlass.range_constexpr(0 if silu else mb // per):
                if cutlass.const_expr(p == 0):
                    _dsl.sum_warp_partials(partial, tid, out, n, group0, m, group_count, rows, per, WARPS)
                else:
                    part = cute.make_tensor(partial.iterator + p * per * rows,
                                            cute.make_layout((rows, per, WARPS), stride=(1, rows, rows * mb)))
                    _dsl.sum_warp_partials(part, tid, out + cutlass.Int64(p * per) * n, n, group0, m - p * per,
                                           group_count, rows, per, WARPS)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gemv_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(x, w, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
