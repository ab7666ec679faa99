"""Causal depthwise conv1d + SiLU over the Gated DeltaNet `[q | k | v]` channels, with its window.

For B sequences of T new tokens each (prefill: B = 1 and T = the chunk; decode: T = 1), row
`b * T + t` of `x` holds the pre-conv projection of token t of sequence b (its first C columns;
`x` rows are `x_stride` wide because the GDN input projection also carries z, b and a). With the
window `win` of the Kc - 1 inputs before the chunk (zeros at a sequence start):

    out[b*T + t, c] = silu( sum_j w[c, j] * ext[t + j, c] ),   ext = [win ; x[b*T : b*T + T, :C]]

and the window of the sequence is replaced by the last Kc - 1 rows of `ext`. Maths in fp32, one
bf16 rounding of the output (the model rounds the conv output to bf16).

Windows live in the state-slot pool `[slots, Kc - 1, C]` bf16. The window is read from
`win_in[slots_in[b]]` and written to `win_out[slots_out[b]]`. One thread handles 8 channels (one
16-byte vector) of TB consecutive tokens, so long chunks spread over many threads; when T > TB
the thread that writes the new window is not the one that read the old one, so the caller must
then pass a `win_in` that does not alias `win_out` (the runner copies the slot's window into a
scratch buffer first). At decode (T = 1) they may alias: one thread reads, then writes.

Mode `verify` (keys `..._verify`; the modes above are `chunk`): a speculative verification step,
B sequences of T tokens with rows position-major (row t * B + b is token t of sequence b, as the
step lays them out). Every token's output and its window (the window after that token) go to
the row: the window is written to `win[slots_out[t * B + b]]`, the snapshot slot of that row,
and the window before the first token is read from `win[slots_in[b]]`. No token depends on
another's output, so one thread computes one (8 channels, token) pair from the old window and
the x rows, with the code a `chunk` launch uses: each output and window equals what T decode
launches (each reading the window the previous one wrote) give, bit for bit. Snapshot slots must
differ from the read slots (the runner's rows never share a slot).
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "conv1d"
THREADS = 128
TB = 8  # tokens per thread

# (key, C channels, x row stride, Kc): tiny dense model (make_tiny), Qwen3.6-27B, 35B-A3B.
_SHAPES = [
    ("c256_s392", 256, 392, 4),
    ("c10240_s16480", 10240, 16480, 4),
    ("c8192_s12352", 8192, 12352, 4),
]


VERIFY_SUFFIX = "_verify"  # the `verify` variant of each shape above: its key plus this


def _variant(key: str, c: int, stride: int, kc: int) -> Variant:
    vecs = c // 8
    return Variant(
        family=FAMILY,
        key=key,
        config={"mode": "chunk", "C": c, "x_stride": stride, "Kc": kc, "threads": THREADS,
                "tokens_per_thread": TB, "pdl": True},
        params=[ptr("x"), ptr("w"), ptr("win_in"), ptr("win_out"), ptr("slots_in"), ptr("slots_out"),
                ptr("out"), i32("B"), i32("T")],
        tensors={
            "x": tensor("bf16", "B * T", stride),
            "w": tensor("bf16", c, kc),
            "win_in": tensor("bf16", "NI", kc - 1, c),
            "win_out": tensor("bf16", "NO", kc - 1, c, role="inout"),
            "slots_in": tensor("i32", "B"),
            "slots_out": tensor("i32", "B"),
            "out": tensor("bf16", "B * T", c, role="out"),
        },
        sizes=("B", "T", "NI", "NO"),
        block=(THREADS, 1, 1),
        grid=(f"cdiv({vecs} * cdiv(T, {TB}), {THREADS})", "B", 1),
        requires=("B >= 1", "T >= 1", "B <= 65535", "NI >= 1", "NO >= 1"),
        arches=ALL_ARCHES,
        note=f"causal depthwise conv (Kc={kc}) + SiLU over {c} channels, window in/out",
        example_sizes={"B": 1, "T": 8192, "NI": 1, "NO": 1},
    )


def _verify_variant(key: str, c: int, stride: int, kc: int) -> Variant:
    vecs = c // 8
    return Variant(
        family=FAMILY,
        key=key + VERIFY_SUFFIX,
        config={"mode": "verify", "C": c, "x_stride": stride, "Kc": kc, "threads": THREADS, "pdl": True},
        params=[ptr("x"), ptr("w"), ptr("win"), ptr("slots_in"), ptr("slots_out"), ptr("out"), i32("B"), i32("T")],
        tensors={
            "x": tensor("bf16", "B * T", stride),
            "w": tensor("bf16", c, kc),
            "win": tensor("bf16", "NS", kc - 1, c, role="inout"),
            "slots_in": tensor("i32", "B"),
            "slots_out": tensor("i32", "B * T"),
            "out": tensor("bf16", "B * T", c, role="out"),
        },
        sizes=("B", "T", "NS"),
        block=(THREADS, 1, 1),
        grid=(f"cdiv({vecs} * T, {THREADS})", "B", 1),
        requires=("B >= 1", "T >= 1", "B <= 65535", "NS >= 1"),
        arches=ALL_ARCHES,
        note=f"causal depthwise conv (Kc={kc}) + SiLU over {c} channels, position-major rows, "
             "the window after each token to its row's slot",
        example_sizes={"B": 1, "T": 4, "NS": 1},
    )


def variants() -> list[Variant]:
    for key, c, stride, kc in _SHAPES:
        if c % 8 or stride % 8:
            raise ValueError(f"conv1d {key}: channels and stride must be multiples of 8")
    return [_variant(*s) for s in _SHAPES] + [_verify_variant(*s) for s in _SHAPES]


def reference(x: np.ndarray, window: np.ndarray, w: np.ndarray, *, exact: bool = False,
              snapshots: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(silu(conv) [B, T, C], new window [B, Kc-1, C]) for x [B, T, C], window [B, Kc-1, C],
    w [C, Kc]. exact=False rounds the output to bf16 (the same-precision baseline).
    snapshots: the second value is the window after every token, [B, T, Kc-1, C] (`verify`)."""
    ft = np.float64 if exact else np.float32
    kc = w.shape[1]
    steps = x.shape[1]
    ext = np.concatenate([window, x], axis=1).astype(ft)
    acc = np.zeros(x.shape, ft)
    for j in range(kc):
        acc = acc + ext[:, j:j + steps] * w[:, j].astype(ft)
    y = acc / (1.0 + np.exp(-acc))
    if snapshots:
        new_window = np.stack([ext[:, t + 1:t + kc] for t in range(steps)], axis=1)
    else:
        new_window = ext[:, steps:].copy()
    if exact:
        return y, new_window
    return round_bf16(y.astype(np.float32)), new_window.astype(np.float32)


def _taps(w: Any, ch: Any, kc: int) -> list:
    """The kc taps of channels ch .. ch + 7 as fp32 vectors: element (j, e) = w[ch + e, j]."""
    import cutlass
    import cutlass.cute as cute

    gw = cute.make_tensor(w + ch * kc, cute.make_layout((kc, 8), stride=(1, kc)))
    return [gw[j, None].load().to(cutlass.Float32) for j in range(kc)]


def _silu_conv(taps: list, ext: list, first: int) -> Any:
    """silu(sum_j taps[j] * ext[first + j]) of 8 channels in fp32, summed in tap order: the one
    definition both modes use, so a `verify` token's output is a decode launch's bit for bit."""
    import cutlass
    import cutlass.cute as cute

    acc = taps[0] * ext[first].load()
    for j in range(1, len(taps)):
        acc = acc + taps[j] * ext[first + j].load()
    return acc / (cutlass.Float32(1.0) + cute.math.exp(-acc, fastmath=True))


def build(variant: Variant) -> tuple[Any, list[Any]]:
    if variant.config["mode"] == "verify":
        return _build_verify(variant)
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    c, stride, kc = cfg["C"], cfg["x_stride"], cfg["Kc"]
    vecs = c // 8
    hist = kc - 1
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, win_in: cute.Pointer, win_out: cute.Pointer,
               slots_in: cute.Pointer, slots_out: cute.Pointer, out: cute.Pointer,
               nb: cutlass.Int32, nt: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        item = bx * THREADS + tid
        vec = item % vecs
        t0 = (item // vecs) * TB
        ch = vec * 8
        # PDL (cute_kernels/_pdl.py): the taps (weights, any thread's channels are in range) load
        # while the previous kernel drains; x, the slots and the windows after the wait.
        taps = _taps(w, ch, kc)
        _pdl.wait()
        if t0 < nt:
            v8 = cute.make_layout((8,))
            gsi = cute.make_tensor(slots_in, cute.make_layout(nb))
            gso = cute.make_tensor(slots_out, cute.make_layout(nb))
            slot_in = gsi[b]
            slot_out = gso[b]
            row0 = cutlass.Int64(b) * nt
            win_base_in = win_in + cutlass.Int64(slot_in) * (hist * c) + ch
            win_base_out = win_out + cutlass.Int64(slot_out) * (hist * c) + ch
            # ext[i] = input of token t0 - hist + i.
            ext = []
            for i in cutlass.range_constexpr(hist):
                tok = t0 - hist + i
                val = cute.make_rmem_tensor((8,), f32)
                if tok >= 0:
                    val.store(cute.make_tensor(x + (row0 + tok) * stride + ch, v8).load().to(f32))
                else:
                    old = cute.make_tensor(win_base_in + (hist + tok) * c, v8).load()
                    val.store(old.to(f32))
                ext.append(val)
            for i in cutlass.range_constexpr(TB):
                val = cute.make_rmem_tensor((8,), f32)
                val.fill(0.0)
                tok = t0 + i
                if tok < nt:
                    val.store(cute.make_tensor(x + (row0 + tok) * stride + ch, v8).load().to(f32))
                ext.append(val)
            # Old window rows that stay in the window (only when T < Kc - 1; then t0 == 0).
            for i in cutlass.range_constexpr(hist):
                tok = t0 - hist + i
                if tok < 0:
                    dst = i - nt
                    if dst >= 0:
                        cute.make_tensor(win_base_out + dst * c, v8).store(ext[i].load().to(bf16))
            for i in cutlass.range_constexpr(TB):
                tok = t0 + i
                if tok < nt:
                    y = _silu_conv(taps, ext, i)
                    cute.make_tensor(out + (row0 + tok) * c + ch, v8).store(y.to(bf16))
                    dst = tok - (nt - hist)
                    if dst >= 0:
                        cute.make_tensor(win_base_out + dst * c, v8).store(ext[i + hist].load().to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_conv1d_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, win_in: cute.Pointer, win_out: cute.Pointer,
               slots_in: cute.Pointer, slots_out: cute.Pointer, out: cute.Pointer,
               nb: cutlass.Int32, nt: cutlass.Int32, stream: Any):
        kernel(x, w, win_in, win_out, slots_in, slots_out, out, nb, nt).launch(
            grid=_dsl.grid(variant, {"B": nb, "T": nt}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"slots_in": 4, "slots_out": 4})


def _build_verify(variant: Variant) -> tuple[Any, list[Any]]:
    """The `verify` kernel: thread item of CTA (bx, b) computes 8 channels (vector item % C/8)
    of token item // (C/8) of sequence b, and writes that token's window snapshot."""
    import cutlass
    import cutlass.cute as cute

    from . import _dsl, _pdl

    cfg = variant.config
    c, stride, kc = cfg["C"], cfg["x_stride"], cfg["Kc"]
    vecs = c // 8
    hist = kc - 1
    f32, bf16 = cutlass.Float32, cutlass.BFloat16

    @cute.kernel
    def kernel(x: cute.Pointer, w: cute.Pointer, win: cute.Pointer, slots_in: cute.Pointer,
               slots_out: cute.Pointer, out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32):
        tid, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        item = bx * THREADS + tid
        vec = item % vecs
        t = item // vecs
        ch = vec * 8
        taps = _taps(w, ch, kc)  # before the wait, as in the chunk kernel
        _pdl.wait()
        if t < nt:
            v8 = cute.make_layout((8,))
            one = cute.make_layout(1)
            row = cutlass.Int64(t) * nb + b
            slot_in = cute.make_tensor(slots_in + b, one)[0]
            slot_out = cute.make_tensor(slots_out + row, one)[0]
            win_in = win + cutlass.Int64(slot_in) * (hist * c) + ch
            win_out = win + cutlass.Int64(slot_out) * (hist * c) + ch
            # ext[i] = input of token t - hist + i: an x row of this step, else the old window.
            ext = []
            for i in cutlass.range_constexpr(hist):
                tok = t - hist + i
                val = cute.make_rmem_tensor((8,), f32)
                if tok >= 0:
                    val.store(cute.make_tensor(x + (cutlass.Int64(tok) * nb + b) * stride + ch, v8).load().to(f32))
                else:
                    val.store(cute.make_tensor(win_in + (hist + tok) * c, v8).load().to(f32))
                ext.append(val)
            cur = cute.make_rmem_tensor((8,), f32)
            cur.store(cute.make_tensor(x + row * stride + ch, v8).load().to(f32))
            ext.append(cur)
            y = _silu_conv(taps, ext, 0)
            cute.make_tensor(out + row * c + ch, v8).store(y.to(bf16))
            for i in cutlass.range_constexpr(hist):
                cute.make_tensor(win_out + i * c, v8).store(ext[i + 1].load().to(bf16))

    kernel.set_name_prefix(f"{_dsl.NAME_PREFIX}_conv1d_{variant.key}")

    @cute.jit
    def launch(x: cute.Pointer, w: cute.Pointer, win: cute.Pointer, slots_in: cute.Pointer,
               slots_out: cute.Pointer, out: cute.Pointer, nb: cutlass.Int32, nt: cutlass.Int32, stream: Any):
        kernel(x, w, win, slots_in, slots_out, out, nb, nt).launch(
            grid=_dsl.grid(variant, {"B": nb, "T": nt}), block=list(variant.block), stream=stream)

    return launch, _dsl.example_args(variant, aligns={"slots_in": 4, "slots_out": 4})
