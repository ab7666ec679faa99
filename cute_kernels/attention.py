"""Gated full attention over the paged KV cache: q/k prep + KV write, split-KV attention, combine.

Three kernels (one variant each per model shape), launched in this order for a decode step or a
prefill chunk. Rows m = 0..M-1 are query tokens: at decode one per sequence, at prefill the
chunk's tokens (all of one sequence). Per-row metadata lives in device buffers so a CUDA graph can
replay a step with new values: `pos[m]` the token's position, `wrow[m]` the flat KV row
(`page * 64 + pos % 64`) it writes, `qseq[m]` its row of the page table.

- `prep_*`: reads the fused projection `x[m] = [q_0 gate_0 | ... | q_{Hq-1} gate_{Hq-1} | k | v]`
  (Qwen's q_proj interleaves q and the output gate per head), applies the zero-centred q/k
  RMSNorm (`(1 + w)`, fp32, rounded to bf16 as the model does) and rotate-half RoPE on the first
  `rd` dims (bf16 cos/sin tables `[P, rd/2]`; a position outside `[0, P)` is left unrotated),
  writes q to `q_out [M, Hq, D]` and k, v into the pages `[pages * 64, Hkv, D]`.
- `split_*`: one CTA per (row, KV head, split). The grid has a fixed split count S per row; the
  split LENGTH comes from the row's own position (`split_length`: the row's keys over S, rounded
  up to a page, at least `min_split`), so one captured graph serves any mix of lengths and short
  rows use few splits (the CTAs past a row's end exit at once). The Hq/Hkv query heads sharing the
  KV head are processed together, so each K/V row is read once per CTA. Keys are spread over
  groups of D/8 lanes (each lane holds 8 dims, one 16-byte load), each group taking `UNROLL` keys
  an iteration so that several loads per lane are in flight (decode at long contexts is a
  streaming read of K and V); scores reduce with shuffles; an online softmax in the exp2 domain
  per group, then the groups merge in shared memory. Writes the split's normalised output (fp32)
  and its log2-sum-exp. Row m sees keys 0..pos[m] (causal).
- `combine_*`: one CTA per (row, query head). Recomputes the row's split length and merges its
  used splits: the max and the sum of the split weights over the whole CTA, then groups of D/8
  lanes each walk every (threads / (D/8))-th split's partial and the groups add up in shared
  memory in a fixed order (so many partial loads are in flight, and a row's numbers do not depend
  on the other rows). Multiplies by `sigmoid(gate)` and writes bf16 `[M, Hq * D]` for o_proj.

Splitting the context is what keeps decode at long contexts from running on a handful of SMs
(kernel-playbook section 7.2). The same kernels serve prefill where no tensor-core prefill kernel
was compiled for the shape (each chunk token a query row, re-reading K/V per row; the tiny
model): `attention_wgmma` and `attention_prefill` are the prefill kernels. The combine kernel's
builder is in `attention_combine.py` (this file's length).
"""

from typing import Any

import numpy as np

from runtime.model.kv_format import FORMATS as KV_FORMATS
from runtime.model.kv_format import page_bytes

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "attention"
PAGE = 64
NORM_EPS = 1e-6
LOG2E = 1.4426950408889634
SPLIT_THREADS = 128
UNROLL = 2  # keys per lane group per iteration of the split kernel's key loop
COMBINE_THREADS = 256

# (name, Hq, Hkv, D, rotary dims): tiny dense model, Qwen3.6-27B, Qwen3.6-35B-A3B.
_SHAPES = [("q4_kv2_d64", 4, 2, 64, 16), ("q24_kv4_d256", 24, 4, 256, 64), ("q16_kv2_d256", 16, 2, 256, 64)]


def page_pool(hkv: int, d: int, kv: str, role: str = "in") -> Any:
    """One layer's K (or V) pool of NP pages in format kv: bf16 rows `[NP * 64, Hkv, D]`, or the
    bytes of quantised pages (`runtime.model.kv_format`: codes then scales in each page)."""
    if kv == "bf16":
        return tensor("bf16", f"NP * {PAGE}", hkv, d, role=role)
    return tensor("u8", f"NP * {page_bytes(kv, hkv, d)}", role=role)


def paged_query_tensors(hq: int, hkv: int, d: int, kv: str = "bf16") -> dict[str, Any]:
    """The inputs every kernel reading queries against the paged KV takes (split-KV here,
    `attention_prefill`): q rows, the page pools, the page table, and each row's sequence and
    position. One description of the paging contract."""
    return {
        "q": tensor("bf16", "M", hq, d),
        "k_pages": page_pool(hkv, d, kv),
        "v_pages": page_pool(hkv, d, kv),
        "table": tensor("i32", "R", "maxp"),
        "qseq": tensor("i32", "M"),
        "pos": tensor("i32", "M"),
    }


def x_stride(hq: int, hkv: int, d: int) -> int:
    """Width of the fused attention projection `[q|gate per head ... | k | v]`."""
    return hq * 2 * d + 2 * hkv * d


def split_length(pos: Any, splits: Any, min_split: Any, maximum: Any = np.maximum) -> Any:
    """Keys per split of a row at position pos (it sees pos + 1 keys) when its keys are cut into at
    most `splits` splits: the keys over the splits rounded up to a page, at least `min_split`.
    Works on ints and arrays; the split and combine kernels run this same function on DSL integers
    (`maximum=cutlass.max`), so the host's plan and the device's cannot drift apart."""
    per = (pos + splits) // splits  # ceil((pos + 1) / splits)
    return maximum(min_split, (per + PAGE - 1) // PAGE * PAGE)


def _suffix(kv: str) -> str:
    """The key suffix of a KV format's variants (none for bf16: its keys predate the formats)."""
    return "" if kv == "bf16" else f"_{kv}"


def _prep(name: str, hq: int, hkv: int, d: int, rd: int, kv: str) -> Variant:
    lanes = d // 8
    threads = -(-((hq + 2 * hkv) * lanes) // 32) * 32
    stride = x_stride(hq, hkv, d)
    return Variant(
        family=FAMILY,
        key=f"prep_{name}{_suffix(kv)}",
        config={"kind": "prep", "Hq": hq, "Hkv": hkv, "D": d, "rd": rd, "x_stride": stride, "threads": threads,
                "eps": NORM_EPS, "kv": kv, "pdl": True},
        params=[ptr("x"), ptr("qn_w"), ptr("kn_w"), ptr("cos"), ptr("sin"), ptr("pos"), ptr("wrow"), ptr("q_out"),
                ptr("k_pages"), ptr("v_pages"), i32("M"), i32("P")],
        tensors={
            "x": tensor("bf16", "M", stride),
            "qn_w": tensor("bf16", d),
            "kn_w": tensor("bf16", d),
            "cos": tensor("bf16", "P", rd // 2),
            "sin": tensor("bf16", "P", rd // 2),
            "pos": tensor("i32", "M"),
            "wrow": tensor("i32", "M"),
            "q_out": tensor("bf16", "M", hq, d, role="out"),
            "k_pages": page_pool(hkv, d, kv, role="inout"),
            "v_pages": page_pool(hkv, d, kv, role="inout"),
        },
        sizes=("M", "P", "NP"),
        block=(threads, 1, 1),
        grid=("M", 1, 1),
        requires=("M >= 1", "P >= 1", "NP >= 1"),
        arches=ALL_ARCHES,
        note=f"q/k RMSNorm + RoPE({rd}) + paged K/V write ({kv}), Hq={hq} Hkv={hkv} D={d}",
        example_sizes={"M": 1, "P": 32768, "NP": 16},
    )


def _split(name: str, hq: int, hkv: int, d: int, kv: str) -> Variant:
    return Variant(
        family=FAMILY,
        key=f"split_{name}{_suffix(kv)}",
        config={"kind": "split", "Hq": hq, "Hkv": hkv, "D": d, "threads": SPLIT_THREADS, "unroll": UNROLL,
                "kv": kv, "pdl": True},
        params=[ptr("q"), ptr("k_pages"), ptr("v_pages"), ptr("table"), ptr("qseq"), ptr("pos"), ptr("o_part"),
                ptr("lse"), i32("M"), i32("S"), i32("min_split"), i32("maxp")],
        tensors={
            **paged_query_tensors(hq, hkv, d, kv),
            "o_part": tensor("f32", "M", hq, "S", d, role="out"),
            "lse": tensor("f32", "M", hq, "S", role="out"),
        },
        sizes=("M", "S", "min_split", "maxp", "R", "NP"),
        block=(SPLIT_THREADS, 1, 1),
        grid=(f"M * {hkv}", "S", 1),
        requires=("M >= 1", "S >= 1", "S <= 65535", "min_split >= 1", "maxp >= 1", "R >= 1", "NP >= 1"),
        arches=ALL_ARCHES,
        note=f"split-KV paged attention over {kv} KV, GQA {hq}/{hkv}, D={d}",
        example_sizes={"M": 1, "S": 32, "min_split": 64, "maxp": 128, "R": 1, "NP": 128},
    )


def _combine(name: str, hq: int, hkv: int, d: int) -> Variant:
    threads = COMBINE_THREADS
    stride = x_stride(hq, hkv, d)
    return Variant(
        family=FAMILY,
        key=f"combine_{name}",
        config={"kind": "combine", "Hq": hq, "Hkv": hkv, "D": d, "x_stride": stride, "threads": threads,
                "pdl": True},
        params=[ptr("o_part"), ptr("lse"), ptr("pos"), ptr("x"), ptr("out"), i32("M"), i32("S"), i32("min_split")],
        tensors={
            "o_part": tensor("f32", "M", hq, "S", d),
            "lse": tensor("f32", "M", hq, "S"),
            "pos": tensor("i32", "M"),
            "x": tensor("bf16", "M", stride),
            "out": tensor("bf16", "M", hq * d, role="out"),
        },
        sizes=("M", "S", "min_split"),
        block=(threads, 1, 1),
        grid=(f"M * {hq}", 1, 1),
        requires=("M >= 1", "S >= 1", "min_split >= 1"),
        arches=ALL_ARCHES,
        note=f"merge attention splits, times sigmoid(gate), Hq={hq} D={d}",
        example_sizes={"M": 1, "S": 32, "min_split": 64},
    )


def variants() -> list[Variant]:
    out = []
    for name, hq, hkv, d, rd in _SHAPES:
        if d % 8 or 32 % (d // 8) or hq % hkv or (rd // 2) % 8 or (rd // 16) & (rd // 16 - 1):
            raise ValueError(f"attention {name}: shape does not tile")
        out += [_prep(name, hq, hkv, d, rd, "bf16"), _split(name, hq, hkv, d, "bf16"), _combine(name, hq, hkv, d)]
        # The quantised KV formats: their own prep (writes codes + scales) and split (reads them).
        for kv in KV_FORMATS[1:]:
            out += [_prep(name, hq, hkv, d, rd, kv), _split(name, hq, hkv, d, kv)]
    return out


# --------------------------------------------------------------------------- references


def reference_prep(x: np.ndarray, qn_w: np.ndarray, kn_w: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                   pos: np.ndarray, *, hq: int, hkv: int, d: int, exact: bool = False
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D]) from the fused projection x [M, stride]."""
    ft = np.float64 if exact else np.float32
    rnd = (lambda v: v) if exact else (lambda v: round_bf16(np.asarray(v, np.float32)).astype(ft))
    m = x.shape[0]
    qg = x[:, :hq * 2 * d].reshape(m, hq, 2 * d).astype(ft)
    q = qg[..., :d]
    k = x[:, hq * 2 * d:hq * 2 * d + hkv * d].reshape(m, hkv, d).astype(ft)
    v = x[:, hq * 2 * d + hkv * d:].reshape(m, hkv, d).astype(ft)

    def norm(t, w):
        return rnd(t / np.sqrt(np.mean(t * t, -1, keepdims=True) + NORM_EPS) * (1.0 + w.astype(ft)))

    def rope(t):
        half = cos.shape[1]
        ok = (pos >= 0) & (pos < cos.shape[0])
        c = cos[np.where(ok, pos, 0)].astype(ft)[:, None, :]
        s = sin[np.where(ok, pos, 0)].astype(ft)[:, None, :]
        x1, x2 = t[..., :half], t[..., half:2 * half]
        r = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, t[..., 2 * half:]], axis=-1)
        return rnd(np.where(ok[:, None, None], r, t))

    return rope(norm(q, qn_w)), rope(norm(k, kn_w)), rnd(v)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, gate: np.ndarray, *,
                        exact: bool = False) -> np.ndarray:
    """Gated causal attention of query rows q [M, Hq, D] at positions pos [M] over one sequence's
    keys k, v [S, Hkv, D] (row m sees keys 0..pos[m]); gate [M, Hq, D]. Returns [M, Hq*D]."""
    ft = np.float64 if exact else np.float32
    m, hq, d = q.shape
    hkv = k.shape[1]
    r = hq // hkv
    # K and V converted once (not per row and query head: over a long context the copies cost
    # most of the time); the products then read a KV head's rows in place, the same BLAS calls
    # on the same values as over a copy.
    keys = int(np.max(pos)) + 1
    k, v = k[:keys].astype(ft, copy=False), v[:keys].astype(ft, copy=False)
    out = np.empty((m, hq, d), ft)
    for i in range(m):
        n = int(pos[i]) + 1
        for h in range(hq):
            s = (k[:n, h // r] @ q[i, h].astype(ft)) * d ** -0.5
            p = np.exp(s - s.max())
            out[i, h] = (p @ v[:n, h // r]) / p.sum()
    g = 1.0 / (1.0 + np.exp(-gate.astype(ft)))
    if exact:
        return (out * g).reshape(m, hq * d)
    y = round_bf16(out.astype(np.float32)) * round_bf16(g.astype(np.float32))
    return round_bf16(y).reshape(m, hq * d)


# --------------------------------------------------------------------------- kernels


def build(variant: Variant) -> tuple[Any, list[Any]]:
    kind = variant.config["kind"]
    if kind == "prep":
        return _build_prep(variant)
    if kind == "split":
        return _build_split(variant)
    from .attention_combine import build_combine

    return build_combine(variant)


def _warp_max(value: Any, width: int) -> Any:
    """Butterfly max over groups of `width` consecutive lanes (width a power of two <= 32)."""
    import cutlass.cute as cute

    offset = width // 2
    while offset >= 1:
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
        offset //= 2
    return value


def _build_prep(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _kv_quant, _pdl

    cfg = variant.config
    hq, hkv, d, rd, stride, kv = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["rd"], cfg["x_stride"], cfg["kv"]
    lanes = d // 8
    half = rd // 2
    partner = half // 8  # lane offset between the two halves of the rotated dims
    rot_lanes = rd // 8
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, qn_w: cute.Pointer, kn_w: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer,
               pos: cute.Pointer, wrow: cute.Pointer, q_out: cute.Pointer, k_pages: cute.Pointer,
               v_pages: cute.Pointer, m: cutlass.Int32, p: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        hd = tid // lanes
        lr = tid % lanes
        v8 = cute.make_layout((8,))
        xrow = x + cutlass.Int64(row) * stride
        # Head hd: q heads first, then k heads, then v heads; threads past them idle (they
        # still take part in the shuffles, on zeros).
        off = hq * 2 * d + hkv * d + (hd - hq - hkv) * d
        if hd < hq:
            off = hd * (2 * d)
        elif hd < hq + hkv:
            off = hq * 2 * d + (hd - hq) * d
        active = hd < hq + 2 * hkv
        is_qk = hd < hq + hkv
        val = cute.make_rmem_tensor((8,), f32)
        val.fill(0.0)
        wv = cute.make_rmem_tensor((8,), f32)
        wv.fill(0.0)
        # PDL (cute_kernels/_pdl.py): the norm weights load while the previous kernel drains; x
        # (its output) after the wait, the K/V pages (read by earlier steps only) written after it.
        if hd < hq:
            wv.store(cute.make_tensor(qn_w + 8 * lr, v8).load().to(f32))
        elif is_qk:
            wv.store(cute.make_tensor(kn_w + 8 * lr, v8).load().to(f32))
        _pdl.wait()
        if active:
            val.store(cute.make_tensor(xrow + off + 8 * lr, v8).load().to(f32))
        xv = val.load()
        sumsq = _dsl.warp_sum((xv * xv).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
        rstd = cute.math.rsqrt(sumsq * f32(1.0 / d) + f32(NORM_EPS))
        if is_qk:
            val.store((xv * rstd * (wv.load() + f32(1.0))).to(bf16).to(f32))
        # RoPE: lanes below rd/8 hold rotated dims; lane lr pairs with lane lr ^ partner.
        other = cute.make_rmem_tensor((8,), f32)
        for e in cutlass.range_constexpr(8):
            other[e] = cute.arch.shuffle_sync_bfly(val[e], offset=partner)
        gp = cute.make_tensor(pos, cute.make_layout(m))
        position = gp[row]
        if is_qk and lr < rot_lanes and position >= 0 and position < p:
            # First-half lanes: x1' = x1 c - x2 s; second-half lanes: x2' = x2 c + x1 s.
            sign = f32(1.0)
            freq = lr * 8
            if lr < partner:
                sign = f32(-1.0)
            else:
                freq = (lr - partner) * 8
            c = cute.make_tensor(cos + cutlass.Int64(position) * half + freq, v8).load().to(f32)
            s = cute.make_tensor(sin + cutlass.Int64(position) * half + freq, v8).load().to(f32)
            val.store(val.load() * c + other.load() * s * sign)
        # A quantised pool: the bf16 values the bf16 pool would hold, and their token-head's amax
        # (a max over the head's D/8 lanes; every lane takes part in the shuffles).
        amax = f32(0.0)
        if cutlass.const_expr(kv != "bf16"):
            val.store(val.load().to(bf16).to(f32))
            for e in cutlass.range_constexpr(8):
                amax = cute.arch.fmax(amax, cute.arch.fmax(val[e], -val[e]))
            amax = _warp_max(amax, lanes)
        _pdl.launch_dependents()  # only the stores are left
        if hd < hq:
            cute.make_tensor(q_out + (cutlass.Int64(row) * hq + hd) * d + 8 * lr, v8).store(val.load().to(bf16))
        elif active:
            kv_row = cute.make_tensor(wrow, cute.make_layout(m))[row]
            if cutlass.const_expr(kv != "bf16"):
                if hd < hq + hkv:
                    _kv_quant.write8(k_pages, kv_row, hd - hq, lr, val, amax, kv, hkv, d)
                else:
                    _kv_quant.write8(v_pages, kv_row, hd - hq - hkv, lr, val, amax, kv, hkv, d)
            elif hd < hq + hkv:
                kdst = cute.make_tensor(k_pages + (cutlass.Int64(kv_row) * hkv + (hd - hq)) * d + 8 * lr, v8)
                kdst.store(val.load().to(bf16))
            else:
                vdst = cute.make_tensor(v_pages + (cutlass.Int64(kv_row) * hkv + (hd - hq - hkv)) * d + 8 * lr, v8)
                vdst.store(val.load().to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, qn_w: cute.Pointer, kn_w: cute.Pointer, cos: cute.Pointer, sin: cute.Pointer,
               pos: cute.Pointer, wrow: cute.Pointer, q_out: cute.Pointer, k_pages: cute.Pointer,
               v_pages: cute.Pointer, m: cutlass.Int32, p: cutlass.Int32, stream: Any):
        kernel(x, qn_w, kn_w, cos, sin, pos, wrow, q_out, k_pages, v_pages, m, p).launch(
            grid=_dsl.grid(variant, {"M": m, "P": p}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"pos": 4, "wrow": 4})


def _build_split(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _kv_quant, _pdl

    cfg = variant.config
    hq, hkv, d, threads, kv = cfg["Hq"], cfg["Hkv"], cfg["D"], cfg["threads"], cfg["kv"]
    r = hq // hkv
    lanes = d // 8
    groups = threads // lanes
    scale = d ** -0.5 * LOG2E
    neg = -3.0e38
    f32 = cutlass.Float32

    @cute.kernel
    def kernel(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, o_part: cute.Pointer, lse: cute.Pointer,
               m: cutlass.Int32, ns: cutlass.Int32, min_split: cutlass.Int32, maxp: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        row = bx // hkv
        kvh = bx % hkv
        kg = tid // lanes
        lr = tid % lanes
        v8 = cute.make_layout((8,))
        one = cute.make_layout(1)
        position = cute.make_tensor(pos, cute.make_layout(m))[row]
        seq = cute.make_tensor(qseq, cute.make_layout(m))[row]
        split = split_length(position, ns, min_split, cutlass.max)
        start = sp * split
        end = cutlass.min(start + split, position + 1)
        smem = cutlass.memory.SmemAllocator()
        s_max = smem.allocate_tensor(f32, cute.make_layout((r, groups)), byte_alignment=16)
        s_sum = smem.allocate_tensor(f32, cute.make_layout((r, groups)), byte_alignment=16)
        s_acc = smem.allocate_tensor(f32, cute.make_layout((d, groups, r), stride=(1, d, d * groups)),
                                     byte_alignment=16)
        # PDL (cute_kernels/_pdl.py): the split bounds come from the step's metadata (uploaded
        # before the step); q and the newest K/V row are the previous kernel's output.
        _pdl.wait()
        if start < end:
            qs = []
            accs = []
            mx = cute.make_rmem_tensor((r,), f32)
            den = cute.make_rmem_tensor((r,), f32)
            for h in cutlass.range_constexpr(r):
                src = q + (cutlass.Int64(row) * hq + kvh * r + h) * d + 8 * lr
                qs.append(cute.make_tensor(src, v8).load().to(f32) * f32(scale))
                acc = cute.make_rmem_tensor((8,), f32)
                acc.fill(0.0)
                accs.append(acc)
                mx[h] = f32(neg)
                den[h] = f32(0.0)
            trow = table + cutlass.Int64(seq) * maxp
            # Every lane runs the same trip count (the score reduction is a warp shuffle); a key
            # past the end computes on the last key and its score is set to -3e38 (weight 0). A
            # group's UNROLL keys of an iteration are loaded before any is used, so each lane has
            # 2 * UNROLL 16-byte loads in flight, and the online softmax takes them in one update
            # (one rescale per iteration). A group whose first iteration holds no key of the split
            # keeps the -3e38 max, so the merge below gives it weight 0.
            for base in cutlass.range(start, end, groups * UNROLL):
                keys = []
                ks = []
                vs = []
                k_scale = [f32(1.0)] * UNROLL
                v_scale = [f32(1.0)] * UNROLL
                for u in cutlass.range_constexpr(UNROLL):
                    key = base + u * groups + kg
                    keys.append(key)
                    key = cutlass.min(key, end - 1)
                    page = cute.make_tensor(trow + key // PAGE, one)[0]
                    if cutlass.const_expr(kv == "bf16"):
                        flat = (cutlass.Int64(page) * PAGE + key % PAGE) * hkv + kvh
                        ks.append(cute.make_tensor(k_pages + flat * d + 8 * lr, v8).load())
                        vs.append(cute.make_tensor(v_pages + flat * d + 8 * lr, v8).load())
                    else:
                        # Codes (8 bytes a lane) and the token-head's scales; the K scale
                        # multiplies the score and the V scale the softmax weight, so the
                        # codes are only converted, never scaled one by one.
                        codes, sc = _kv_quant.page_offsets(page * PAGE + key % PAGE, kvh, hkv, d)
                        ks.append(_kv_quant.load8(k_pages, codes + 8 * lr))
                        vs.append(_kv_quant.load8(v_pages, codes + 8 * lr))
                        k_scale[u] = _kv_quant.scale_at(k_pages, sc)
                        v_scale[u] = _kv_quant.scale_at(v_pages, sc)
                if cutlass.const_expr(kv == "bf16"):
                    kf = [ks[u].to(f32) for u in range(UNROLL)]
                    vf = [vs[u].to(f32) for u in range(UNROLL)]
                else:
                    kf = [_kv_quant.codes_f32(ks[u], kv) for u in range(UNROLL)]
                    vf = [_kv_quant.codes_f32(vs[u], kv) for u in range(UNROLL)]
                for h in cutlass.range_constexpr(r):
                    scores = []
                    for u in cutlass.range_constexpr(UNROLL):
                        sc = _dsl.warp_sum((qs[h] * kf[u]).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
                        if cutlass.const_expr(kv != "bf16"):
                            sc = sc * k_scale[u]
                        if keys[u] >= end:
                            sc = f32(neg)
                        scores.append(sc)
                    new_max = mx[h]
                    for u in cutlass.range_constexpr(UNROLL):
                        new_max = cute.arch.fmax(new_max, scores[u])
                    corr = cute.math.exp2(mx[h] - new_max, fastmath=True)
                    den_h = den[h] * corr
                    acc_h = accs[h].load() * corr
                    for u in cutlass.range_constexpr(UNROLL):
                        pr = cute.math.exp2(scores[u] - new_max, fastmath=True)
                        den_h = den_h + pr
                        if cutlass.const_expr(kv != "bf16"):
                            acc_h = acc_h + vf[u] * (pr * v_scale[u])
                        else:
                            acc_h = acc_h + vf[u] * pr
                    den[h] = den_h
                    mx[h] = new_max
                    accs[h].store(acc_h)
            _pdl.launch_dependents()  # the keys are done: only the CTA's merge is left
            for h in cutlass.range_constexpr(r):
                cute.make_tensor(s_acc.iterator + (h * groups + kg) * d + 8 * lr, v8).store(accs[h].load())
                if lr == 0:
                    s_max[h, kg] = mx[h]
                    s_sum[h, kg] = den[h]
            cute.arch.sync_threads()
            for item in cutlass.range(tid, r * d, threads):
                h = item // d
                dim = item % d
                best = f32(neg)
                for g in cutlass.range_constexpr(groups):
                    best = cute.arch.fmax(best, s_max[h, g])
                total = f32(0.0)
                value = f32(0.0)
                for g in cutlass.range_constexpr(groups):
                    wgt = cute.math.exp2(s_max[h, g] - best, fastmath=True)
                    total = total + s_sum[h, g] * wgt
                    value = value + s_acc[dim, g, h] * wgt
                head = kvh * r + h
                base = (cutlass.Int64(row) * hq + head) * ns + sp
                cute.make_tensor(o_part + base * d + dim, one)[0] = value / total
                if dim == 0:
                    cute.make_tensor(lse + base, one)[0] = best + cute.math.log2(total)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_{variant.key}")

    @cute.jit
    def launch(q: cute.Pointer, k_pages: cute.Pointer, v_pages: cute.Pointer, table: cute.Pointer,
               qseq: cute.Pointer, pos: cute.Pointer, o_part: cute.Pointer, lse: cute.Pointer,
               m: cutlass.Int32, ns: cutlass.Int32, min_split: cutlass.Int32, maxp: cutlass.Int32, stream: Any):
        kernel(q, k_pages, v_pages, table, qseq, pos, o_part, lse, m, ns, min_split, maxp).launch(
            grid=_dsl.grid(variant, {"M": m, "S": ns}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"table": 4, "qseq": 4, "pos": 4, "lse": 4, "o_part": 4})
