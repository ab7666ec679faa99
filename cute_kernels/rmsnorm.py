"""RMSNorm family: zero-centred RMSNorm, fused residual-add + RMSNorm, gated RMSNorm.

Three modes share one kernel skeleton (rows of `H` bf16 values, statistics in fp32):

- `zc`: `y = x * rsqrt(mean(x^2) + eps) * (1 + w)` (Qwen's zero-centred weights: input and
  post-attention norms, the final norm, q/k norms per head);
- `add_zc`: `r = bf16(x + residual)`; `residual <- r`; `y = zc(r)` (the pre-norm residual stream);
- `gated`: `y = bf16(w * bf16(x * rstd)) * silu(z)` with a plain weight (the GDN output norm,
  per value head over dv), rounded exactly where the Hugging Face reference rounds;
- `gated_x`: `gated` with z read in place from the GDN input projection: row r (token r // heads,
  value head r % heads) takes z from `z[token * z_stride + z_off + head * H]` (the prefill path
  after a `gdn` split kernel, which writes the un-normalised o).

Layout: each row is handled by `T` threads (a power of two); a CTA of `block` threads handles
`block // T` rows. Every thread loads its `H / (8 T)` 16-byte vectors once, keeps them in registers
while the sum of squares is reduced (shuffles, then shared memory across warps when `T > 32`), and
writes the normalised row. Rows are independent, so M (rows) is dynamic.
"""


from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "rmsnorm"
EPS = 1e-6

# (key, mode, H, threads per row, block): the row lengths of the models we serve.
_SHAPES = [
    ("zc_h5120", "zc", 5120, 128, 128),  # 27B hidden
    ("zc_h2048", "zc", 2048, 128, 128),  # 35B-A3B / 80B-A3B hidden
    ("zc_h256", "zc", 256, 32, 128),  # q/k norm per head (D = 256), rows = tokens * heads
    ("add_zc_h5120", "add_zc", 5120, 128, 128),
    ("add_zc_h2048", "add_zc", 2048, 128, 128),
    ("add_zc_h256", "add_zc", 256, 32, 128),  # tiny test model (tools/make_tiny.py) hidden
    ("gated_h128", "gated", 128, 16, 128),  # GDN output norm per value head (dv = 128)
]

# (key, H = dv, threads per row, block, Hk, Hv, dk): GDN output norms with z in the projection rows.
_GATED_X_SHAPES = [
    ("gated_x_h32_v4", 32, 4, 128, 2, 4, 32),  # tiny test model
    ("gated_x_h128_v48", 128, 16, 128, 16, 48, 128),  # 27B
    ("gated_x_h128_v32", 128, 16, 128, 16, 32, 128),  # 35B-A3B / 80B-A3B
]


def _gated_x_variant(key: str, h: int, t: int, block: int, hk: int, hv: int, dk: int) -> Variant:
    from .gdn import layout

    lay = layout(hk, hv, dk, h)
    rows_per_cta = block // t
    return Variant(
        family=FAMILY,
        key=key,
        config={"mode": "gated_x", "H": h, "threads_per_row": t, "block": block, "eps": EPS, "heads": hv,
                "z_off": lay["z_off"], "z_stride": lay["x_stride"], "pdl": True},
        params=[ptr("x"), ptr("z"), ptr("w"), ptr("out"), i32("M")],
        tensors={
            "x": tensor("bf16", "M", h),
            "z": tensor("bf16", f"M // {hv}", lay["x_stride"]),
            "w": tensor("bf16", h),
            "out": tensor("bf16", "M", h, role="out"),
        },
        sizes=("M",),
        block=(block, 1, 1),
        grid=(f"cdiv(M, {rows_per_cta})", 1, 1),
        requires=("M >= 1", f"M % {hv} == 0"),
        arches=ALL_ARCHES,
        note=f"gated RMSNorm over rows of {h} bf16, z from the GDN projection rows (Hv={hv})",
        example_sizes={"M": 2048 * hv},
    )


def _variant(key: str, mode: str, h: int, t: int, block: int) -> Variant:
    rows_per_cta = block // t
    if mode == "zc":
        params = [ptr("x"), ptr("w"), ptr("out"), i32("M")]
        tensors = {"x": tensor("bf16", "M", h), "w": tensor("bf16", h), "out": tensor("bf16", "M", h, role="out")}
    elif mode == "add_zc":
        params = [ptr("x"), ptr("residual"), ptr("w"), ptr("out"), i32("M")]
        tensors = {
            "x": tensor("bf16", "M", h),
            "residual": tensor("bf16", "M", h, role="inout"),
            "w": tensor("bf16", h),
            "out": tensor("bf16", "M", h, role="out"),
        }
    else:
        params = [ptr("x"), ptr("z"), ptr("w"), ptr("out"), i32("M")]
        tensors = {
            "x": tensor("bf16", "M", h),
            "z": tensor("bf16", "M", h),
            "w": tensor("bf16", h),
            "out": tensor("bf16", "M", h, role="out"),
        }
    return Variant(
        family=FAMILY,
        key=key,
        config={"mode": mode, "H": h, "threads_per_row": t, "block": block, "eps": EPS, "pdl": True},
        params=params,
        tensors=tensors,
        sizes=("M",),
        block=(block, 1, 1),
        grid=("M" if rows_per_cta == 1 else f"cdiv(M, {rows_per_cta})", 1, 1),
        requires=("M >= 1",),
        arches=ALL_ARCHES,
        note=f"{mode} RMSNorm over rows of {h} bf16",
        example_sizes={"M": 8192 if h >= 1024 else 8192 * 8},
    )


def variants() -> list[Variant]:
    return [_variant(*s) for s in _SHAPES] + [_gated_x_variant(*s) for s in _GATED_X_SHAPES]


def reference(
    x: np.ndarray,
    w: np.ndarray,
    *,
    mode: str = "zc",
    residual: np.ndarray | None = None,
    z: np.ndarray | None = None,
    eps: float = EPS,
    exact: bool = False,
) -> tuple[np.ndarray, np.ndarray | None]:
    """(y, new_residual) for bf16-valued float inputs.

    exact=False emulates the bf16 model (fp32 maths, bf16 roundings where Hugging Face rounds),
    the same-precision baseline; exact=True computes in float64 with no rounding at all.
    new_residual is None except in mode "add_zc".
    """
    ft = np.float64 if exact else np.float32
    rnd = (lambda a: a) if exact else round_bf16
    x = x.astype(ft)
    w = w.astype(ft)
    new_res = None
    if mode == "add_zc":
        assert residual is not None
        x = x + residual.astype(ft) if exact else rnd((x + residual.astype(ft)).astype(np.float32)).astype(ft)
        new_res = x
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + ft(eps))
    if mode in ("zc", "add_zc"):
        y = x * rstd * (ft(1.0) + w)
    elif mode in ("gated", "gated_x"):
        assert z is not None
        if exact:
            t = w * (x * rstd)
        else:
            xn = rnd((x * rstd).astype(np.float32)).astype(ft)
            t = rnd((w * xn).astype(np.float32)).astype(ft)
        zf = z.astype(ft)
        y = t * (zf / (ft(1.0) + np.exp(-zf)))
    else:
        raise ValueError(f"unknown rmsnorm mode {mode!r}")
    if exact:
        return y, new_res
    return rnd(y.astype(np.float32)), (None if new_res is None else new_res.astype(np.float32))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    mode, h, t, block = cfg["mode"], cfg["H"], cfg["threads_per_row"], cfg["block"]
    eps = float(cfg["eps"])
    gated = mode in ("gated", "gated_x")
    heads, z_off, z_stride = cfg.get("heads", 1), cfg.get("z_off", 0), cfg.get("z_stride", h)
    vecs = h // (8 * t)  # 16-byte vectors per thread
    rows = block // t
    warps_per_row = max(t // 32, 1)
    if h % (8 * t) or t & (t - 1) or block % t:
        raise ValueError(f"{variant.name}: H={h} must split into 16-byte vectors over {t} threads")
    bf16, f32 = cutlass.BFloat16, cutlass.Float32

    @cute.jit
    def body(x_ptr: cute.Pointer, aux_ptr: cute.Pointer, w_ptr: cute.Pointer, out_ptr: cute.Pointer, m: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        lane_in_row = tid % t
        row = bid * rows + tid // t
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(f32, cute.make_layout(max(block // 32, 1)), byte_alignment=16)
        # Rows past M take part in the barrier only; their loads and stores are skipped.
        valid = row < m
        # Element e of vector v of thread j (within the row) sits at j*8 + v*T*8 + e: each vector
        # step is one fully coalesced 16-byte-per-thread sweep over the row.
        row_layout = cute.make_layout((8, vecs, t), stride=(1, t * 8, 8))
        offset = cutlass.Int64(row) * h
        gx = cute.make_tensor(x_ptr + offset, row_layout)
        gw = cute.make_tensor(w_ptr, row_layout)
        if cutlass.const_expr(mode == "gated_x"):
            z_at = cutlass.Int64(row // heads) * z_stride + z_off + (row % heads) * h
            gaux = cute.make_tensor(aux_ptr + z_at, row_layout)
        else:
            gaux = cute.make_tensor(aux_ptr + offset, row_layout)
        gout = cute.make_tensor(out_ptr + offset, row_layout)
        # PDL (cute_kernels/_pdl.py): the weight is no earlier kernel's output; it is loaded while the
        # previous kernel drains (every thread: w has H elements whatever the row), x and z after
        # the wait.
        ws = cute.make_rmem_tensor((8, vecs), bf16)
        for v in cutlass.range_constexpr(vecs):
            ws[None, v].store(gw[None, v, lane_in_row].load())
        _pdl.wait()
        xs = cute.make_rmem_tensor((8, vecs), f32)
        xs.fill(0.0)
        sumsq = f32(0.0)
        if valid:
            for v in cutlass.range_constexpr(vecs):
                xv = gx[None, v, lane_in_row].load().to(f32)
                if cutlass.const_expr(mode == "add_zc"):
                    rv = (xv + gaux[None, v, lane_in_row].load().to(f32)).to(bf16)
                    gaux[None, v, lane_in_row].store(rv)
                    xv = rv.to(f32)
                xs[None, v].store(xv)
                sumsq = sumsq + (xv * xv).reduce(cute.ReductionOp.ADD, f32(0.0), 0)
        sumsq = _dsl.warp_sum(sumsq, min(t, 32))
        if cutlass.const_expr(warps_per_row > 1):
            warp = tid // 32
            if tid % 32 == 0:
                red[warp] = sumsq
            cute.arch.sync_threads()
            sumsq = f32(0.0)
            for i in cutlass.range_constexpr(warps_per_row):
                sumsq = sumsq + red[(warp // warps_per_row) * warps_per_row + i]
        rstd = cute.math.rsqrt(sumsq * f32(1.0 / h) + f32(eps))
        _pdl.launch_dependents()  # the rows are in registers: only the stores are left
        if valid:
            for v in cutlass.range_constexpr(vecs):
                wv = ws[None, v].load().to(f32)
                xv = xs[None, v].load()
                if cutlass.const_expr(gated):
                    zv = gaux[None, v, lane_in_row].load().to(f32)
                    xn = (xv * rstd).to(bf16).to(f32)
                    tv = (wv * xn).to(bf16).to(f32)
                    sig = zv / (f32(1.0) + cute.math.exp(-zv, fastmath=True))
                    gout[None, v, lane_in_row].store((tv * sig).to(bf16))
                else:
                    gout[None, v, lane_in_row].store((xv * rstd * (wv + f32(1.0))).to(bf16))

    @cute.kernel
    def kernel_zc(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        body(x, w, w, out, m)

    @cute.kernel
    def kernel_aux(x: cute.Pointer, aux: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32):
        body(x, aux, w, out, m)

    kernel = kernel_zc if mode == "zc" else kernel_aux
    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_rmsnorm_{variant.key}")

    if mode == "zc":

        @cute.jit
        def launch(x: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any):
            kernel(x, w, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    else:

        @cute.jit
        def launch(
            x: cute.Pointer, aux: cute.Pointer, w: cute.Pointer, out: cute.Pointer, m: cutlass.Int32, stream: Any
        ):
            kernel(x, aux, w, out, m).launch(grid=_dsl.grid(variant, {"M": m}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant)
