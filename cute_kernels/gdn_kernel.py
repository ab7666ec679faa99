"""The CuTe DSL code of the `gdn` family: the recurrent kernels and their launchers, for the
variants cute_kernels/gdn.py declares (its `build` calls this).

The maths, the modes (`fused`, `verify`, `split`) and their thread layouts are in that module's
docstring; `gdn.reference`, `gdn.reference_core` and `gdn.reference_snapshots` model what these
compute.
"""

from typing import Any

from .gdn import L2_EPS, NORM_EPS, prefill_launcher
from .variant import Variant


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["mode"] == "split":
        return _build_split(variant)
    return _build_recurrent(variant)


def _store_cluster(smem_ptr: Any, rank: int, value: Any) -> None:
    """Store an fp32 `value` at `smem_ptr`'s offset in the shared memory of CTA `rank` of the
    cluster (st.shared::cluster: the DSL's tensors and `store` take no distributed pointer)."""
    import cutlass
    from cutlass._mlir.dialects import llvm, nvvm

    cluster_space = 7  # NVPTX's shared::cluster address space
    remote = nvvm.mapa(llvm.PointerType.get(cluster_space), smem_ptr.to_llvm_ptr(), cutlass.Int32(rank).ir_value())
    llvm.store(cutlass.Float32(value).ir_value(), remote)


def _build_recurrent(variant: Variant) -> tuple[Any, list[Any]]:
    """The `fused` kernel (B sequences of T tokens, rows sequence-major, the state read at
    slots[b] and written once at slots_out[b]) and the `verify` kernel: the same code, so the
    same arithmetic per token, but rows position-major (row t * B + b) and the state read at
    slots[b] and written after each token at slots_out[row] (a snapshot slot per row). With
    column blocks (cols > 1) each CTA of a head's cluster runs whole warps of the one-block layout
    and the norm's per-warp partials cross the cluster through distributed shared memory.

    PDL (cute_kernels/_pdl.py): the state, the slots (host-uploaded step metadata) and the
    weights load before the wait, overlapping the previous kernel's drain: within a step no kernel
    but this layer's own GDN launch writes its state slots (the slot copies run outside the
    step's launches). q, k, v, z, a, b (the projection's output) are read after the wait."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    hk, hv, dk, dv, nt_threads = cfg["Hk"], cfg["Hv"], cfg["dk"], cfg["dv"], cfg["threads"]
    conv_dim, stride = cfg["conv_dim"], cfg["x_stride"]
    z_off, b_off, a_off = cfg["z_off"], cfg["b_off"], cfg["a_off"]
    cols = cfg["cols"]  # column blocks: the CTAs (one cluster) of each (head, sequence)
    key_dim = hk * dk
    rep = hv // hk
    lanes = dk // 4
    groups = nt_threads // lanes  # row groups of the whole head; groups // cols per CTA
    rows = dv // groups  # state rows per thread
    warps = nt_threads // 32  # warps of the whole head; warps // cols per CTA
    q_scale = dk ** -0.5
    f32, bf16 = cutlass.Float32, cutlass.BFloat16
    # Compile-time: `fused` traces exactly the code it had before `verify` existed (same cubin),
    # and one column block (cols = 1) the code it had before column blocks existed.
    verify = cfg["mode"] == "verify"
    split = cols > 1

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
        if cutlass.const_expr(split):
            # CTA `blk` of the head's cluster is the head's row groups [blk * groups / cols, ...)
            # of the one-CTA kernel (whole warps), so grp and warp below are the head-wide numbers
            # that kernel gives the same rows: the same per-row code and the same norm partials.
            cute.arch.cluster_arrive_relaxed()  # (waited before the first remote store)
            blk = h % cols
            h = h // cols
            grp = grp + blk * (groups // cols)
            warp = warp + blk * (warps // cols)
        kh = h // rep
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(f32, cute.make_layout((warps, 2)), byte_alignment=16)
        slot = cute.make_tensor(slots, cute.make_layout(nb))[b]
        v4 = cute.make_layout((4,))
        one = cute.make_layout(1)
        s_base = state + (cutlass.Int64(slot) * hv + h) * (dv * dk) + 4 * lr
        if cutlass.const_expr(not verify):
            slot_out = cute.make_tensor(slots_out, cute.make_layout(nb))[b]
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
        if cutlass.const_expr(verify):
            zv = cute.make_rmem_tensor((rows,), f32)
        if cutlass.const_expr(split):
            # Every CTA of the cluster has started (its shared memory exists) before any writes
            # into it; the state loads above are in flight meanwhile.
            cute.arch.cluster_wait()
        _pdl.wait()
        for t in cutlass.range(nt):
            if cutlass.const_expr(verify):
                row = cutlass.Int64(t) * nb + b
            else:
                row = cutlass.Int64(b) * nt + t
            qrow = qkv + row * conv_dim
            xrow = x + row * stride
            q4 = cute.make_tensor(qrow + kh * dk + 4 * lr, v4).load().to(f32)
            k4 = cute.make_tensor(qrow + key_dim + kh * dk + 4 * lr, v4).load().to(f32)
            if cutlass.const_expr(verify):
                # z with the token's other inputs, not after the norm's barrier: one memory
                # latency per token instead of two (8 more registers; `fused` keeps its 103).
                for i in cutlass.range_constexpr(rows):
                    zv[i] = cute.make_tensor(xrow + z_off + h * dv + grp + i * groups, one)[0].to(f32)
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
            if cutlass.const_expr(verify):
                # The state after token t into its snapshot slot (stores drain during the norm).
                snap = cute.make_tensor(slots_out + row, one)[0]
                s_snap = state + (cutlass.Int64(snap) * hv + h) * (dv * dk) + 4 * lr
                for i in cutlass.range_constexpr(rows):
                    cute.make_tensor(s_snap + (grp + i * groups) * dk, v4).store(s[None, i].load())
            if lr != 0:
                part = f32(0.0)
            part = _dsl.warp_sum(part, 32)
            parity = t % 2
            if cutlass.const_expr(split):
                # Each warp's partial into red[warp, parity] of every CTA of the cluster, then a
                # cluster barrier (release / acquire): every CTA then sums all the head's partials
                # in the one-CTA kernel's order. The parity keeps token t + 1's stores off the
                # slots a slower CTA may still be reading for token t, as the block barrier does.
                if lane == 0:
                    mine = red.iterator + red.layout((warp, parity))
                    for r in cutlass.range_constexpr(cols):
                        _store_cluster(mine, r, part)
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
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
                    if cutlass.const_expr(verify):
                        zj = zv[i]
                    else:
                        zj = cute.make_tensor(xrow + z_off + h * dv + j, one)[0].to(f32)
                    xn = (o[i] * rstd).to(bf16).to(f32)
                    tv = (nw[i] * xn).to(bf16).to(f32)
                    y = tv * zj / (f32(1.0) + cute.math.exp(-zj))
                    cute.make_tensor(orow + j, one)[0] = y.to(bf16)
        _pdl.launch_dependents()  # only the state's store is left
        if cutlass.const_expr(not verify):
            for i in cutlass.range_constexpr(rows):
                j = grp + i * groups
                cute.make_tensor(s_out + j * dk, v4).store(s[None, i].load())

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_gdn_{variant.key}")

    @cute.jit
    def launch(qkv: cute.Pointer, x: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
               norm_w: cute.Pointer, state: cute.Pointer, slots: cute.Pointer, slots_out: cute.Pointer,
               out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32, stream: Any):
        kernel(qkv, x, a_log, dt_bias, norm_w, state, slots, slots_out, out, nb, nt).launch(
            grid=_dsl.grid(variant, {"B": nb, "T": nt}), block=list(variant.block),
            **({"cluster": list(variant.cluster)} if split else {}), stream=stream)

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

    def load_inputs(qkv: Any, x: Any, row: Any, kh: Any, h: Any, j0: Any, lr: Any, nq: Any, nk: Any, nv: Any,
                    nab: Any) -> None:
        """q, k, the thread's v rows and the a, b gates of token row `row` into nq, nk, nv, nab (a
        plain helper, inlined while tracing: the first token's, then each next one's ahead)."""
        v4, one = cute.make_layout((4,)), cute.make_layout(1)
        qrow = qkv + row * conv_dim
        xrow = x + row * stride
        nq.store(cute.make_tensor(qrow + kh * dk + 4 * lr, v4).load().to(f32))
        nk.store(cute.make_tensor(qrow + key_dim + kh * dk + 4 * lr, v4).load().to(f32))
        for i in range(rows):  # a plain helper: Python loops unroll while tracing
            nv[i] = cute.make_tensor(qrow + 2 * key_dim + h * dv + j0 + i * groups, one)[0].to(f32)
        nab[0] = cute.make_tensor(xrow + a_off + h, one)[0].to(f32)
        nab[1] = cute.make_tensor(xrow + b_off + h, one)[0].to(f32)

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
        load_inputs(qkv, x, row0, kh, h, j0, lr, nq, nk, nv, nab)
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
            load_inputs(qkv, x, row0 + cutlass.min(t + 1, nt - 1), kh, h, j0, lr, nq, nk, nv, nab)

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
