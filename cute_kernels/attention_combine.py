"""The `combine_*` kernel of the `attention` family (its docstring describes it): merge a row's
split-KV partials, times sigmoid(gate), bf16 out. Built by `attention.build`; kept apart only so
that neither file grows past the project's length."""

from typing import Any

from .attention import _warp_max, split_length
from .variant import Variant


def build_combine(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    hq, d, stride, threads = cfg["Hq"], cfg["D"], cfg["x_stride"], cfg["threads"]
    lanes = d // 8
    groups = threads // lanes
    warps = threads // 32
    neg = -3.0e38
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(o_part: cute.Pointer, lse: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32, ns: cutlass.Int32, min_split: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        row = bx // hq
        h = bx % hq
        kg = tid // lanes
        lr = tid % lanes
        warp = tid // 32
        v8 = cute.make_layout((8,))
        one = cute.make_layout(1)
        position = cute.make_tensor(pos, cute.make_layout(m))[row]
        split = split_length(position, ns, min_split, cutlass.max)
        n = (position + split) // split  # the splits that hold keys 0..position
        base = (cutlass.Int64(row) * hq + h) * ns
        smem = cutlass.memory.SmemAllocator()
        s_red = smem.allocate_tensor(f32, cute.make_layout((2, warps)), byte_alignment=16)
        s_acc = smem.allocate_tensor(f32, cute.make_layout((d, groups)), byte_alignment=16)
        # PDL (cute_kernels/_pdl.py): the split count follows from the step's metadata; the
        # partials are the previous kernel's output.
        _pdl.wait()
        # The max and the sum of the split weights over the CTA: strided over the threads, then
        # the warps, then the warps' values in order.
        best = f32(neg)
        for s in cutlass.range(tid, n, threads):
            best = cute.arch.fmax(best, cute.make_tensor(lse + base + s, one)[0])
        best = _warp_max(best, 32)
        if tid % 32 == 0:
            s_red[0, warp] = best
        cute.arch.sync_threads()
        best = f32(neg)
        for w in cutlass.range_constexpr(warps):
            best = cute.arch.fmax(best, s_red[0, w])
        total = f32(0.0)
        for s in cutlass.range(tid, n, threads):
            total = total + cute.math.exp2(cute.make_tensor(lse + base + s, one)[0] - best, fastmath=True)
        total = _dsl.warp_sum(total, 32)
        if tid % 32 == 0:
            s_red[1, warp] = total
        cute.arch.sync_threads()
        total = f32(0.0)
        for w in cutlass.range_constexpr(warps):
            total = total + s_red[1, w]
        acc = cute.make_rmem_tensor((8,), f32)
        acc.fill(0.0)
        for s in cutlass.range(kg, n, groups, unroll=2):
            wgt = cute.math.exp2(cute.make_tensor(lse + base + s, one)[0] - best, fastmath=True)
            part = cute.make_tensor(o_part + (base + s) * d + 8 * lr, v8).load()
            acc.store(acc.load() + part * wgt)
        cute.make_tensor(s_acc.iterator + kg * d + 8 * lr, v8).store(acc.load())
        _pdl.launch_dependents()
        cute.arch.sync_threads()
        if kg == 0:
            merged = cute.make_rmem_tensor((8,), f32)
            merged.fill(0.0)
            for g in cutlass.range_constexpr(groups):
                merged.store(merged.load() + cute.make_tensor(s_acc.iterator + g * d + 8 * lr, v8).load())
            o = (merged.load() * (f32(1.0) / total)).to(bf16).to(f32)
            gate = cute.make_tensor(x + cutlass.Int64(row) * stride + h * 2 * d + d + 8 * lr, v8).load().to(f32)
            sig = (f32(1.0) / (f32(1.0) + cute.math.exp(-gate, fastmath=True))).to(bf16).to(f32)
            cute.make_tensor(out + (cutlass.Int64(row) * hq + h) * d + 8 * lr, v8).store((o * sig).to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_attention_{variant.key}")

    @cute.jit
    def launch(o_part: cute.Pointer, lse: cute.Pointer, pos: cute.Pointer, x: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32, ns: cutlass.Int32, min_split: cutlass.Int32, stream: Any):
        kernel(o_part, lse, pos, x, out, m, ns, min_split).launch(
            grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"pos": 4, "lse": 4})
