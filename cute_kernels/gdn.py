"""Gated DeltaNet, recurrent form: decode steps and (for now) prefill, with the output norm fused.

For B sequences of T tokens each (decode: T = 1; prefill: B = 1, T = the chunk), value head h of
sequence b runs, token by token (research note qwen-arch.md section 2.2):

    q, k  = l2norm(q) * dk^-0.5, l2norm(k)         of key head h // (Hv / Hk), post-conv
    g     = -exp(A_log[h]) * softplus(a + dt_bias[h]);  alpha = exp(g);  beta = sigmoid(b)
    S     = alpha S;  delta = beta (v - S k);  S = S + delta k^T;  o = S q     (S: [dv, dk])
    out   = bf16(w * bf16(bf16(o) * rstd(o))) * silu(z)          (gated RMSNorm over dv, per head)

Inputs: `qkv` [B*T, conv_dim] is the conv1d output (`[q | k | v]`, bf16), `x` [B*T, x_stride] the
GDN input projection whose columns `z_off`, `b_off`, `a_off` hold z [Hv*dv], b [Hv], a [Hv]. The
fp32 state pool is `[slots, Hv, dv, dk]` (rows of dk contiguous, "v-major"): a state row is one
512-byte vector at dk = 128, so S k and S q are reductions inside a group of dk/4 lanes and the
rank-1 update is row-local. Sequence b uses slot `slots[b]` (the fused kernel reads it there and
writes it to `slots_out[b]`: the same slot in place, or another one: a spare for a decode step
the runner computes ahead and may still discard, a snapshot for a verification position; see
runtime/model/gpu/step.py).

Two modes:

- `fused` (decode; keys `k16_v48_d128`, ...): one CTA per (value head, sequence) keeps its [dv, dk]
  state in registers for the whole chunk, each thread 4 columns of dv * dk / (4 * threads) rows,
  and applies the gated norm (a block reduction over dv per token) before writing `out`.
- `split` (prefill; keys `..._s8`): the rows of the delta rule are independent (row i of S only
  needs v_i, k, q and the gates), so each head's dv rows are split over `splits` CTAs (grid
  Hv * splits), with no block barrier in the token loop and the next token's inputs loaded while
  the current one is computed. It writes the un-normalised o (rounded to bf16 exactly as `fused`
  rounds it: `reference_core`) and the state; the gated norm and silu(z) gate then run as one
  `rmsnorm` launch (mode `gated_x`, which reads z from the projection rows). o and the state are
  the same arithmetic as `fused`, row for row; the norm's sum of squares is reduced in another order.

Both are serial in T; the chunked (WY) tensor-core form is the prefill path still to come
(docs/kernels.md).
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "gdn"
L2_EPS = 1e-6
NORM_EPS = 1e-6

# (key, Hk, Hv, dk, dv, threads): tiny dense model, Qwen3.6-27B, Qwen3.6-35B-A3B / Next-80B.
_SHAPES = [
    ("k2_v4_d32", 2, 4, 32, 32, 128),
    ("k16_v48_d128", 16, 48, 128, 128, 512),
    ("k16_v32_d128", 16, 32, 128, 128, 512),
]

# (key, Hk, Hv, dk, dv, threads, splits): the prefill variants (rows of each head over `splits` CTAs).
_SPLIT_SHAPES = [
    ("k2_v4_d32_s4", 2, 4, 32, 32, 32, 4),
    ("k16_v48_d128_s8", 16, 48, 128, 128, 128, 8),
    ("k16_v32_d128_s8", 16, 32, 128, 128, 128, 8),
]


def layout(hk: int, hv: int, dk: int, dv: int) -> dict[str, int]:
    """Column offsets of the fused GDN input projection `[qkv | z | b | a]`."""
    conv_dim = 2 * hk * dk + hv * dv
    z_off = conv_dim
    b_off = z_off + hv * dv
    a_off = b_off + hv
    return {"conv_dim": conv_dim, "z_off": z_off, "b_off": b_off, "a_off": a_off, "x_stride": a_off + hv}


def _variant(key: str, hk: int, hv: int, dk: int, dv: int, threads: int) -> Variant:
    lay = layout(hk, hv, dk, dv)
    lanes = dk // 4
    groups = threads // lanes
    if dk % 4 or 32 % lanes or threads % 32 or dv % groups or hv % hk:
        raise ValueError(f"gdn {key}: dk={dk}, dv={dv}, threads={threads} do not tile")
    return Variant(
        family=FAMILY,
        key=key,
        config={"mode": "fused", "Hk": hk, "Hv": hv, "dk": dk, "dv": dv, "threads": threads, **lay,
                "l2_eps": L2_EPS, "norm_eps": NORM_EPS},
        params=[ptr("qkv"), ptr("x"), ptr("a_log"), ptr("dt_bias"), ptr("norm_w"), ptr("state"), ptr("slots"),
                ptr("slots_out"), ptr("out"), i32("B"), i32("T")],
        tensors={
            "qkv": tensor("bf16", "B * T", lay["conv_dim"]),
            "x": tensor("bf16", "B * T", lay["x_stride"]),
            "a_log": tensor("bf16", hv),
            "dt_bias": tensor("bf16", hv),
            "norm_w": tensor("bf16", dv),
            "state": tensor("f32", "NS", hv, dv, dk, role="inout"),
            "slots": tensor("i32", "B"),
            "slots_out": tensor("i32", "B"),
            "out": tensor("bf16", "B * T", hv * dv, role="out"),
        },
        sizes=("B", "T", "NS"),
        block=(threads, 1, 1),
        grid=(hv, "B", 1),
        requires=("B >= 1", "T >= 1", "B <= 65535", "NS >= 1"),
        arches=ALL_ARCHES,
        note=f"recurrent Gated DeltaNet, Hk={hk} Hv={hv} dk={dk} dv={dv}, fp32 state, gated norm fused",
        example_sizes={"B": 1, "T": 1, "NS": 1},
    )


def prefill_launcher(kernel: Any, variant: Variant) -> tuple[Any, list[Any]]:
    """The host launcher and example arguments of a kernel with `prefill_interface`'s
    parameters (`split` here, `gdn_chunked`)."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    @cute.jit
    def launch(qkv: cute.Pointer, x: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
               state: cute.Pointer, slots: cute.Pointer, out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32,
               stream: Any):
        kernel(qkv, x, a_log, dt_bias, state, slots, out, nb, nt).launch(
            grid=_dsl.grid(variant, {"B": nb, "T": nt}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"a_log": 2, "dt_bias": 2, "slots": 4})


def prefill_interface(lay: dict[str, int], hv: int, dk: int, dv: int) -> dict[str, Any]:
    """Parameters, tensors and sizes shared by the GDN prefill kernels that write the
    un-normalised o (`split` here, `gdn_chunked`): one description, so the runner can launch
    either with the same arguments."""
    return {
        "params": [ptr("qkv"), ptr("x"), ptr("a_log"), ptr("dt_bias"), ptr("state"), ptr("slots"),
                   ptr("out"), i32("B"), i32("T")],
        "tensors": {
            "qkv": tensor("bf16", "B * T", lay["conv_dim"]),
            "x": tensor("bf16", "B * T", lay["x_stride"]),
            "a_log": tensor("bf16", hv),
            "dt_bias": tensor("bf16", hv),
            "state": tensor("f32", "NS", hv, dv, dk, role="inout"),
            "slots": tensor("i32", "B"),
            "out": tensor("bf16", "B * T", hv * dv, role="out"),
        },
        "sizes": ("B", "T", "NS"),
    }


def _split_variant(key: str, hk: int, hv: int, dk: int, dv: int, threads: int, splits: int) -> Variant:
    lay = layout(hk, hv, dk, dv)
    lanes = dk // 4
    groups = threads // lanes
    if dk % 4 or 32 % lanes or threads % 32 or dv % splits or (dv // splits) % groups or hv % hk:
        raise ValueError(f"gdn {key}: dk={dk}, dv={dv}, threads={threads}, splits={splits} do not tile")
    return Variant(
        family=FAMILY,
        key=key,
        config={"mode": "split", "Hk": hk, "Hv": hv, "dk": dk, "dv": dv, "threads": threads, "splits": splits,
                **lay, "l2_eps": L2_EPS},
        **prefill_interface(lay, hv, dk, dv),
        block=(threads, 1, 1),
        grid=(hv * splits, "B", 1),
        requires=("B >= 1", "T >= 1", "B <= 65535", "NS >= 1"),
        arches=ALL_ARCHES,
        note=f"recurrent Gated DeltaNet, rows over {splits} CTAs per head, Hk={hk} Hv={hv} dk={dk} dv={dv}, "
             "fp32 state, un-normalised bf16 o (gated norm: rmsnorm gated_x)",
        example_sizes={"B": 1, "T": 1, "NS": 1},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in _SHAPES] + [_split_variant(*s) for s in _SPLIT_SHAPES]


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def reference(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, a_log: np.ndarray,
              dt_bias: np.ndarray, norm_w: np.ndarray, state: np.ndarray, *, hk: int,
              exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: qkv [T, conv_dim] (post-conv), z [T, Hv, dv], b, a [T, Hv], state
    [Hv, dv, dk] (v-major). Returns (out [T, Hv, dv], new state). exact=False rounds where the
    kernel (and the bf16 model) rounds: o to bf16, then the gated norm's two roundings.
    The `fused` kernels compute all of it; a `split` kernel computes `reference_core` and the
    `rmsnorm` gated_x launch the rest (`gated_norm`)."""
    o, s = reference_core(qkv, b, a, a_log, dt_bias, state, hk=hk, exact=exact)
    return gated_norm(o, z, norm_w, exact=exact), s


def gated_norm(o: np.ndarray, z: np.ndarray, norm_w: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """The gated RMSNorm over dv of o [T, Hv, dv]: `bf16(w * bf16(o * rstd)) * silu(z)`."""
    ft = np.float64 if exact else np.float32
    rnd = (lambda v: v) if exact else (lambda v: round_bf16(np.asarray(v, np.float32)).astype(ft))
    o = o.astype(ft)
    rstd = 1.0 / np.sqrt(np.mean(o * o, -1, keepdims=True) + NORM_EPS)
    zf = z.astype(ft)
    y = rnd(norm_w.astype(ft) * rnd(o * rstd)) * (zf / (1.0 + np.exp(-zf)))
    return y if exact else round_bf16(y.astype(np.float32))


def reference_core(qkv: np.ndarray, b: np.ndarray, a: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
                   state: np.ndarray, *, hk: int, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule without the norm: (o [T, Hv, dv], new state); exact=False rounds o to bf16."""
    ft = np.float64 if exact else np.float32
    rnd = (lambda v: v) if exact else (lambda v: round_bf16(np.asarray(v, np.float32)).astype(ft))
    hv, dv, dk = state.shape
    steps = qkv.shape[0]
    key_dim = hk * dk
    q = qkv[:, :key_dim].reshape(steps, hk, dk).astype(ft)
    k = qkv[:, key_dim:2 * key_dim].reshape(steps, hk, dk).astype(ft)
    v = qkv[:, 2 * key_dim:].reshape(steps, hv, dv).astype(ft)
    q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + L2_EPS) * dk ** -0.5
    k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + L2_EPS)
    rep = hv // hk
    q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    g = -np.exp(a_log.astype(ft)) * _softplus(a.astype(ft) + dt_bias.astype(ft))
    beta = 1.0 / (1.0 + np.exp(-b.astype(ft)))
    s = state.astype(ft).copy()
    out = np.empty((steps, hv, dv), ft)
    for t in range(steps):
        alpha = np.exp(g[t])[:, None, None]
        s = alpha * s
        pred = np.einsum("hvk,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - pred)
        s = s + delta[:, :, None] * k[t][:, None, :]
        out[t] = rnd(np.einsum("hvk,hk->hv", s, q[t]))
    return out, s


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["mode"] == "split":
        return _build_split(variant)
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    hk, hv, dk, dv, nt_threads = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"], cfg["threads"]
    conv_dim, stride = cfg["conv_dim"], cfg["x_stride"]
    z_off, b_off, a_off = cfg["z_off"], cfg["b_off"], cfg["a_off"]
    key_dim = hk * dk
    rep = hv // hk
    lanes = dk // 4
    groups = nt_threads // lanes
    rows = dv // groups  # state rows per thread
    warps = nt_threads // 32
    q_scale = dk ** -0.5
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(qkv: cute.Pointer, x: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
               norm_w: cute.Pointer, state: cute.Pointer, slots: cute.Pointer, slots_out: cute.Pointer,
               out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        lr = tid % lanes
        grp = tid // lanes
        warp = tid // 32
        lane = tid % 32
        kh = h // rep
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(f32, cute.make_layout((warps, 2)), byte_alignment=16)
        slot = cute.make_tensor(slots, cute.make_layout(nb))[b]
        slot_out = cute.make_tensor(slots_out, cute.make_layout(nb))[b]
        v4 = cute.make_layout((4,))
        one = cute.make_layout(1)
        s_base = state + (cutlass.Int64(slot) * hv + h) * (dv * dk) + 4 * lr
        s_out = state + (cutlass.Int64(slot_out) * hv + h) * (dv * dk) + 4 * lr
        s = cute.make_rmem_tensor((4, rows), f32)
        nw = cute.make_rmem_tensor((rows,), f32)
        for i in cutlass.range_constexpr(rows):
            j = grp + i * groups
            s[None, i].store(cute.make_tensor(s_base + j * dk, v4).load())
            nw[i] = cute.make_tensor(norm_w + j, one)[0].to(f32)
        neg_a = -cute.math.exp(cute.make_tensor(a_log + h, one)[0].to(f32))
        dtb = cute.make_tensor(dt_bias + h, one)[0].to(f32)
        o = cute.make_rmem_tensor((rows,), f32)
        for t in cutlass.range(nt):
            row = cutlass.Int64(b) * nt + t
            qrow = qkv + row * conv_dim
            xrow = x + row * stride
            q4 = cute.make_tensor(qrow + kh * dk + 4 * lr, v4).load().to(f32)
            k4 = cute.make_tensor(qrow + key_dim + kh * dk + 4 * lr, v4).load().to(f32)
            sq = _dsl.warp_sum((q4 * q4).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
            sk = _dsl.warp_sum((k4 * k4).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
            qn = q4 * (cute.math.rsqrt(sq + f32(L2_EPS)) * f32(q_scale))
            kn = k4 * cute.math.rsqrt(sk + f32(L2_EPS))
            qk = _dsl.warp_sum((qn * kn).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
            av = cute.make_tensor(xrow + a_off + h, one)[0].to(f32) + dtb
            bv = cute.make_tensor(xrow + b_off + h, one)[0].to(f32)
            softplus = cute.math.log1p(cute.math.exp(-cute.math.absf(av))) + cute.arch.fmax(av, f32(0.0))
            alpha = cute.math.exp(neg_a * softplus)
            beta = f32(1.0) / (f32(1.0) + cute.math.exp(-bv))
            part = f32(0.0)
            for i in cutlass.range_constexpr(rows):
                j = grp + i * groups
                vj = cute.make_tensor(qrow + 2 * key_dim + h * dv + j, one)[0].to(f32)
                sv = s[None, i].load()
                sa = _dsl.warp_sum((sv * kn).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
                sb = _dsl.warp_sum((sv * qn).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
                delta = beta * (vj - alpha * sa)
                s[None, i].store(sv * alpha + kn * delta)
                oj = (alpha * sb + delta * qk).to(bf16).to(f32)
                o[i] = oj
                part = part + oj * oj
            if lr != 0:
                part = f32(0.0)
            part = _dsl.warp_sum(part, 32)
            parity = t % 2
            if lane == 0:
                red[warp, parity] = part
            cute.arch.sync_threads()
            total = f32(0.0)
            for w in cutlass.range_constexpr(warps):
                total = total + red[w, parity]
            rstd = cute.math.rsqrt(total * f32(1.0 / dv) + f32(NORM_EPS))
            if lr == 0:
                orow = out + row * (hv * dv) + h * dv
                for i in cutlass.range_constexpr(rows):
                    j = grp + i * groups
                    zj = cute.make_tensor(xrow + z_off + h * dv + j, one)[0].to(f32)
                    xn = (o[i] * rstd).to(bf16).to(f32)
                    tv = (nw[i] * xn).to(bf16).to(f32)
                    y = tv * zj / (f32(1.0) + cute.math.exp(-zj))
                    cute.make_tensor(orow + j, one)[0] = y.to(bf16)
        for i in cutlass.range_constexpr(rows):
            j = grp + i * groups
            cute.make_tensor(s_out + j * dk, v4).store(s[None, i].load())

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gdn_{variant.key}")

    @cute.jit
    def launch(qkv: cute.Pointer, x: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
               norm_w: cute.Pointer, state: cute.Pointer, slots: cute.Pointer, slots_out: cute.Pointer,
               out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32, stream: Any):
        kernel(qkv, x, a_log, dt_bias, norm_w, state, slots, slots_out, out, nb, nt).launch(
            grid=_dsl.grid(variant, {"B": nb, "T": nt}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"a_log": 2, "dt_bias": 2, "slots": 4, "slots_out": 4})


def _build_split(variant: Variant) -> tuple[Any, list[Any]]:
    """The `split` kernel: CTA (h * splits + part, b) owns rows [part * dv / splits, ...) of head h.

    Per-row arithmetic is the `fused` kernel's (same lanes, same shuffle order, same roundings of o),
    so o and the state match it bit for bit. Each warp is independent: no barrier in the token
    loop, and the q, k, v, a, b of token t + 1 are loaded before token t is computed."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    hk, hv, dk, dv, nt_threads, splits = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"], cfg["threads"], cfg["splits"]
    conv_dim, stride = cfg["conv_dim"], cfg["x_stride"]
    b_off, a_off = cfg["b_off"], cfg["a_off"]
    key_dim = hk * dk
    rep = hv // hk
    lanes = dk // 4
    groups = nt_threads // lanes
    rows_cta = dv // splits
    rows = rows_cta // groups  # state rows per thread
    q_scale = dk ** -0.5
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(qkv: cute.Pointer, x: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
               state: cute.Pointer, slots: cute.Pointer, out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, b, _ = cute.arch.block_idx()
        h = bid // splits
        part = bid % splits
        lr = tid % lanes
        grp = tid // lanes
        kh = h // rep
        j0 = part * rows_cta + grp
        slot = cute.make_tensor(slots, cute.make_layout(nb))[b]
        v4 = cute.make_layout((4,))
        one = cute.make_layout(1)
        s_base = state + (cutlass.Int64(slot) * hv + h) * (dv * dk) + 4 * lr
        s = cute.make_rmem_tensor((4, rows), f32)
        for i in cutlass.range_constexpr(rows):
            s[None, i].store(cute.make_tensor(s_base + (j0 + i * groups) * dk, v4).load())
        neg_a = -cute.math.exp(cute.make_tensor(a_log + h, one)[0].to(f32))
        dtb = cute.make_tensor(dt_bias + h, one)[0].to(f32)
        # Inputs of the next token, loaded one iteration ahead.
        nq = cute.make_rmem_tensor((4,), f32)
        nk = cute.make_rmem_tensor((4,), f32)
        nv = cute.make_rmem_tensor((rows,), f32)
        nab = cute.make_rmem_tensor((2,), f32)
        row0 = cutlass.Int64(b) * nt
        qrow = qkv + row0 * conv_dim
        xrow = x + row0 * stride
        nq.store(cute.make_tensor(qrow + kh * dk + 4 * lr, v4).load().to(f32))
        nk.store(cute.make_tensor(qrow + key_dim + kh * dk + 4 * lr, v4).load().to(f32))
        for i in cutlass.range_constexpr(rows):
            nv[i] = cute.make_tensor(qrow + 2 * key_dim + h * dv + j0 + i * groups, one)[0].to(f32)
        nab[0] = cute.make_tensor(xrow + a_off + h, one)[0].to(f32)
        nab[1] = cute.make_tensor(xrow + b_off + h, one)[0].to(f32)
        cv = cute.make_rmem_tensor((rows,), f32)
        ov = cute.make_rmem_tensor((rows,), f32)
        for t in cutlass.range(nt, unroll=1):
            q4 = nq.load()
            k4 = nk.load()
            for i in cutlass.range_constexpr(rows):
                cv[i] = nv[i]
            araw = nab[0]
            bv = nab[1]
            # Prefetch token t + 1 (the last token re-reads itself).
            nrow = row0 + cutlass.min(t + 1, nt - 1)
            pq = qkv + nrow * conv_dim
            px = x + nrow * stride
            nq.store(cute.make_tensor(pq + kh * dk + 4 * lr, v4).load().to(f32))
            nk.store(cute.make_tensor(pq + key_dim + kh * dk + 4 * lr, v4).load().to(f32))
            for i in cutlass.range_constexpr(rows):
                nv[i] = cute.make_tensor(pq + 2 * key_dim + h * dv + j0 + i * groups, one)[0].to(f32)
            nab[0] = cute.make_tensor(px + a_off + h, one)[0].to(f32)
            nab[1] = cute.make_tensor(px + b_off + h, one)[0].to(f32)

            sq = _dsl.warp_sum((q4 * q4).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
            sk = _dsl.warp_sum((k4 * k4).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
            qn = q4 * (cute.math.rsqrt(sq + f32(L2_EPS)) * f32(q_scale))
            kn = k4 * cute.math.rsqrt(sk + f32(L2_EPS))
            qk = _dsl.warp_sum((qn * kn).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
            av = araw + dtb
            softplus = cute.math.log1p(cute.math.exp(-cute.math.absf(av))) + cute.arch.fmax(av, f32(0.0))
            alpha = cute.math.exp(neg_a * softplus)
            beta = f32(1.0) / (f32(1.0) + cute.math.exp(-bv))
            orow = out + (row0 + t) * (hv * dv) + h * dv + j0
            for i in cutlass.range_constexpr(rows):
                sv = s[None, i].load()
                sa = _dsl.warp_sum((sv * kn).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
                sb = _dsl.warp_sum((sv * qn).reduce(cute.ReductionOp.ADD, f32(0.0), 0), lanes)
                delta = beta * (cv[i] - alpha * sa)
                s[None, i].store(sv * alpha + kn * delta)
                ov[i] = alpha * sb + delta * qk
            if lr == 0:
                for i in cutlass.range_constexpr(rows):
                    cute.make_tensor(orow + i * groups, one)[0] = ov[i].to(bf16)
        for i in cutlass.range_constexpr(rows):
            cute.make_tensor(s_base + (j0 + i * groups) * dk, v4).store(s[None, i].load())

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gdn_{variant.key}")
    return prefill_launcher(kernel, variant)
