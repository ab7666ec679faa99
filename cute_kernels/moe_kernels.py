"""The CuTe DSL code of the `moe` family: the `logits`, `route`, `up` and `down` kernels declared in
cute_kernels/moe.py (what each computes, and their layouts, are in that module's docstring)."""

from typing import Any

from .moe import UP_FEATURES, WARPS, lanes_per_row
from .variant import Variant


def build(variant: Variant) -> tuple[Any, list[Any]]:
    builder = {"logits": _logits, "route": _route, "up": _up, "down": _down}[variant.config["kind"]]
    return builder(variant)


def _dot(x_vecs: list, w_row: Any, lanes: int, j: Any) -> Any:
    """This lane's part of x . w_row (x_vecs: its fp32 vectors of x, vector c at column
    (c * lanes + j) * 8), summed over the row's `lanes` lanes in butterfly order."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    f32 = cutlass.Float32
    acc = f32(0.0)
    for c in range(len(x_vecs)):  # a plain helper: unrolled while tracing
        w = cute.make_tensor(w_row + (c * lanes + j) * 8, cute.make_layout((8,))).load().to(f32)
        acc = acc + (x_vecs[c] * w).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
    return _dsl.warp_sum(acc, lanes)


def _load_vecs(row: Any, count: int, lanes: int, j: Any) -> list:
    """This lane's `count` fp32 vectors of a bf16 row (vector c at column (c * lanes + j) * 8)."""
    import cutlass
    import cutlass.cute as cute

    return [cute.make_tensor(row + (c * lanes + j) * 8, cute.make_layout((8,))).load().to(cutlass.Float32)
            for c in range(count)]


def softmax_denominator(tops: list, rest: list, lead: Any, renorm: bool) -> Any:
    """The routing softmax's denominator: exp(l - lead) summed over the k selected logits `tops`
    in rank order (renorm), or over all E logits: this lane's share `rest`, then a butterfly over
    the warp (every lane calls it). `route` and the decode form's `slot_weight` share it, so their
    weights are the same numbers."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    denom = cutlass.Float32(0.0)
    for v in tops if renorm else rest:
        denom = denom + cute.math.exp(v - lead, fastmath=True)
    return denom if renorm else _dsl.warp_sum(denom, 32)


def _at(ptr: Any, index: Any) -> Any:
    """A one-element view of ptr[index] (read with [0], written with [0] = ...)."""
    import cutlass
    import cutlass.cute as cute

    return cute.make_tensor(ptr + cutlass.Int64(index), cute.make_layout(1))


def _expert(ids: Any, slot: Any, e: int) -> Any:
    """The expert id of a slot, clamped into the stack [0, E] (E: the shared expert), so a bad id
    never reads outside the weights."""
    import cutlass

    return cutlass.max(cutlass.min(_at(ids, slot)[0], e), 0)


def _logits(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    e, h = variant.config["E"], variant.config["H"]
    vecs = h // 256

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        expert = tile * WARPS + warp
        xs = _load_vecs(x + cutlass.Int64(row) * h, vecs, 32, lane)
        total = _dot(xs, w + cutlass.Int64(expert) * h, 32, lane)
        if lane == 0:
            _at(out, row * e + expert)[0] = total

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
        kernel(x, w, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


def _route(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, k, h, p, renorm = cfg["E"], cfg["K"], cfg["H"], cfg["P"], cfg["renorm"]
    per = -(-e // 32)  # logits each lane holds
    vecs = h // 256
    f32, i32_t = cutlass.Float32, cutlass.Int32
    neg_inf = float("-inf")

    @cute.kernel
    def kernel(logits: cute.Pointer, x: cute.Pointer, w_sg: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer,
               m: cutlass.Int32):
        lane, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        src = cute.make_tensor(logits + cutlass.Int64(row) * e, cute.make_layout(e))
        vals = cute.make_rmem_tensor((per,), f32)
        for s in cutlass.range_constexpr(per):
            vals[s] = f32(neg_inf)
            if s * 32 + lane < e:
                vals[s] = src[s * 32 + lane]
        # Softmax over all E (no renormalisation) needs every logit after the top one is known.
        orig = cute.make_rmem_tensor((per,), f32)
        for s in cutlass.range_constexpr(per):
            orig[s] = vals[s]
        top_v = cute.make_rmem_tensor((k,), f32)
        top_i = cute.make_rmem_tensor((k,), i32_t)
        for r in cutlass.range_constexpr(k):
            # The lane's best (a lane's indices grow with s, so strict > keeps the lowest), then
            # the warp's by (value desc, index asc); every lane ends with the same winner.
            best_v = vals[0]
            best_i = i32_t(lane)
            for s in cutlass.range_constexpr(1, per):
                if vals[s] > best_v:
                    best_v = vals[s]
                    best_i = i32_t(s * 32) + lane
            for level in cutlass.range_constexpr(5):
                other_v = cute.arch.shuffle_sync_bfly(best_v, offset=16 >> level)
                other_i = cute.arch.shuffle_sync_bfly(best_i, offset=16 >> level)
                if other_v > best_v or (other_v == best_v and other_i < best_i):
                    best_v = other_v
                    best_i = other_i
            top_v[r] = best_v
            top_i[r] = best_i
            for s in cutlass.range_constexpr(per):
                if best_i == s * 32 + lane:
                    vals[s] = f32(neg_inf)
        lead = top_v[0]
        denom = softmax_denominator([top_v[r] for r in range(k)], [orig[s] for s in range(per)], lead, renorm)
        xs = _load_vecs(x + cutlass.Int64(row) * h, vecs, 32, lane)
        gate = _dot(xs, w_sg, 32, lane)
        if lane == 0:
            base = row * p
            for r in cutlass.range_constexpr(k):
                _at(ids, base + r)[0] = top_i[r]
                _at(wts, base + r)[0] = cute.math.exp(top_v[r] - lead, fastmath=True) / denom
            _at(ids, base + k)[0] = i32_t(e)
            _at(wts, base + k)[0] = f32(1.0) / (f32(1.0) + cute.math.exp(-gate, fastmath=True))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(logits: cute.Pointer, x: cute.Pointer, w_sg: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer,
               m: cutlass.Int32, stream: Any):
        kernel(logits, x, w_sg, ids, wts, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                    stream=stream)

    return launch, _dsl.example_args(variant)


def _up(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, h, inter, p = cfg["E"], cfg["H"], cfg["I"], cfg["P"]
    vecs = h // 256
    per_warp = UP_FEATURES // WARPS
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, act: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        slot, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        row = slot // p
        expert = _expert(ids, slot, e)
        xs = _load_vecs(x + cutlass.Int64(row) * h, vecs, 32, lane)
        block = w + cutlass.Int64(expert) * (2 * inter * h)
        for t in cutlass.range_constexpr(per_warp):
            f = tile * UP_FEATURES + warp * per_warp + t
            g = _dot(xs, block + cutlass.Int64(f) * h, 32, lane).to(bf16).to(f32)
            u = _dot(xs, block + cutlass.Int64(inter + f) * h, 32, lane).to(bf16).to(f32)
            s = _dsl.silu_f32(g).to(bf16).to(f32)
            if lane == 0:
                _at(act, slot * inter + f)[0] = (s * u).to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, act: cute.Pointer, m: cutlass.Int32,
               stream: Any):
        kernel(x, w, ids, act, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)


def _down(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl

    cfg = variant.config
    e, h, inter, p, rows = cfg["E"], cfg["H"], cfg["I"], cfg["P"], cfg["rows_per_warp"]
    lanes = lanes_per_row(inter)
    groups = 32 // lanes  # rows a warp works on at once
    vecs = inter // (8 * lanes)
    iters = rows // groups
    features = WARPS * rows  # per CTA
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(act: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        row, tile, _ = cute.arch.block_idx()
        warp, lane = tid // 32, tid % 32
        group, j = lane // lanes, lane % lanes
        first = tile * features + warp * rows + group  # this lane group's feature in iteration 0
        accs = [f32(0.0) for _ in range(iters)]
        for s in cutlass.range_constexpr(p):
            slot = row * p + s
            expert = _expert(ids, slot, e)
            weight = _at(wts, slot)[0]
            xs = _load_vecs(act + cutlass.Int64(slot) * inter, vecs, lanes, j)
            block = w + cutlass.Int64(expert) * (h * inter)
            for it in cutlass.range_constexpr(iters):
                f = first + it * groups
                accs[it] = accs[it] + weight * _dot(xs, block + cutlass.Int64(f) * inter, lanes, j)
        for it in cutlass.range_constexpr(iters):
            if j == 0:
                _at(out, row * h + first + it * groups)[0] = accs[it].to(bf16)

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_moe_{variant.key}")

    @cute.jit
    def launch(act: cute.Pointer, w: cute.Pointer, ids: cute.Pointer, wts: cute.Pointer, out: cute.Pointer,
               m: cutlass.Int32, stream: Any):
        kernel(act, w, ids, wts, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block),
                                                stream=stream)

    return launch, _dsl.example_args(variant)
