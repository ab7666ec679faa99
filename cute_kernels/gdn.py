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
the runner computes ahead and may still discard; see runtime/model/gpu/step.py). The CuTe DSL
code of every mode is in cute_kernels/gdn_kernel.py.

Three modes:

- `fused` (decode; keys `k16_v48_d128`, ...): one CTA per (value head, sequence) keeps its [dv, dk]
  state in registers for the whole chunk, each thread 4 columns of dv * dk / (4 * threads) rows,
  and applies the gated norm (a block reduction over dv per token) before writing `out`.
  Column blocks (keys `..._c2`, `_c4`, `_c8`; config `cols`): the head's rows ("value columns":
  row j of S is o_j's) are spread over a cluster of `cols` CTAs, each running whole warps of the
  one-CTA layout with the same rows per thread, so at batch 1 `cols` times more SMs share the
  work. The per-row arithmetic is the one-CTA kernel's, and the norm's per-warp partial sums go to
  every CTA of the cluster through distributed shared memory and are added in the one-CTA order:
  the output and the state are bit-identical to `cols = 1` (whose code and cubin are unchanged).
  The l2norms of q and k and q.k are recomputed by every CTA (a few shuffles) rather than shared.
- `verify` (a speculative verification step; keys `..._verify`): the `fused` kernel's code, so
  each token's arithmetic is that of a decode step, for B sequences of T tokens with rows
  position-major (row t * B + b is token t of sequence b, as the step lays them out). The state
  is read at `slots[b]` and, after each token, written to `slots_out[t * B + b]` (the snapshot
  slot of that row), so one launch leaves in every snapshot exactly the state T decode launches
  (each reading the snapshot the previous one wrote) would: `reference_snapshots`.
- `split` (prefill; keys `..._s8`): the rows of the delta rule are independent (row i of S only
  needs v_i, k, q and the gates), so each head's dv rows are split over `splits` CTAs (grid
  Hv * splits), with no block barrier in the token loop and the next token's inputs loaded while
  the current one is computed. It writes the un-normalised o (rounded to bf16 exactly as `fused`
  rounds it: `reference_core`) and the state; the gated norm and silu(z) gate then run as one
  `rmsnorm` launch (mode `gated_x`, which reads z from the projection rows). o and the state are
  the same arithmetic as `fused`, row for row; the norm's sum of squares is reduced in another order.

All three are serial in T; prefill runs the chunked (WY) tensor-core form, `gdn_chunked`, where
one was compiled for the shape (docs/kernels.md).
"""

from typing import Any

import numpy as np

from .bf16 import round_bf16
from .variant import ALL_ARCHES, Variant, i32, ptr, tensor

FAMILY = "gdn"
L2_EPS = 1e-6
NORM_EPS = 1e-6

# (key, Hk, Hv, dk, dv, threads, column blocks): tiny dense model, Qwen3.6-27B, Qwen3.6-35B-A3B /
# Next-80B. threads: per head (over all its column blocks). Each shape has a `fused` and a `verify`
# variant per column-block count; the runner picks the count by batch size (gpu/kernels.py).
_SHAPES = [
    ("k2_v4_d32", 2, 4, 32, 32, 128, (1, 2, 4)),
    ("k16_v48_d128", 16, 48, 128, 128, 512, (1, 2, 4, 8)),
    ("k16_v32_d128", 16, 32, 128, 128, 512, (1, 2, 4, 8)),
]
VERIFY_SUFFIX = "_verify"  # the `verify` variant of each `fused` variant: its key plus this
MAX_COLS = 8  # the largest portable cluster: the column blocks of a head form one cluster

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


def column_key(key: str, cols: int) -> str:
    """The key of a shape's `fused` variant with `cols` column blocks (one block: the shape's key)."""
    return key if cols == 1 else f"{key}_c{cols}"


def _variant(key: str, hk: int, hv: int, dk: int, dv: int, threads: int, cols: int, verify: bool = False) -> Variant:
    """A `fused` variant with `cols` column blocks, or (verify) the `verify` variant of the same."""
    lay = layout(hk, hv, dk, dv)
    lanes = dk // 4
    groups = threads // lanes
    if dk % 4 or 32 % lanes or threads % 32 or dv % groups or hv % hk:
        raise ValueError(f"gdn {key}: dk={dk}, dv={dv}, threads={threads} do not tile")
    # Each column block is whole warps of the one-block layout (so its norm partials are that
    # layout's), and the blocks of a head fit one portable cluster.
    if not 1 <= cols <= MAX_COLS or (threads // 32) % cols:
        raise ValueError(f"gdn {key}: {threads} threads do not split into {cols} column blocks of whole warps")
    return Variant(
        family=FAMILY,
        key=column_key(key, cols) + (VERIFY_SUFFIX if verify else ""),
        config={"mode": "verify" if verify else "fused", "Hk": hk, "Hv": hv, "dk": dk, "dv": dv, "threads": threads,
                "cols": cols, **lay, "l2_eps": L2_EPS, "norm_eps": NORM_EPS, "pdl": True},
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
            "slots_out": tensor("i32", "B * T" if verify else "B"),
            "out": tensor("bf16", "B * T", hv * dv, role="out"),
        },
        sizes=("B", "T", "NS"),
        block=(threads // cols, 1, 1),
        grid=(hv * cols, "B", 1),
        cluster=(cols, 1, 1),
        requires=("B >= 1", "T >= 1", "B <= 65535", "NS >= 1"),
        arches=ALL_ARCHES,
        note=f"recurrent Gated DeltaNet, Hk={hk} Hv={hv} dk={dk} dv={dv}, fp32 state, gated norm fused"
             + (f", value columns over a cluster of {cols} CTAs per head" if cols > 1 else "")
             + (", position-major rows, the state after each token to its row's slot" if verify else ""),
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
    fused = [(*shape, cols) for *shape, all_cols in _SHAPES for cols in all_cols]
    return ([_variant(*s) for s in fused] + [_split_variant(*s) for s in _SPLIT_SHAPES]
            + [_variant(*s, verify=True) for s in fused])


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


def reference_snapshots(qkv: np.ndarray, z: np.ndarray, b: np.ndarray, a: np.ndarray, a_log: np.ndarray,
                        dt_bias: np.ndarray, norm_w: np.ndarray, state: np.ndarray, *, hk: int,
                        exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """`reference` for one sequence of a `verify` launch: (out [T, Hv, dv], the state after
    each token [T, Hv, dv, dk]), the snapshots the kernel writes to the rows' slots."""
    o, states = reference_core(qkv, b, a, a_log, dt_bias, state, hk=hk, exact=exact, snapshots=True)
    return gated_norm(o, z, norm_w, exact=exact), states


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
                   state: np.ndarray, *, hk: int, exact: bool = False,
                   snapshots: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The delta rule without the norm: (o [T, Hv, dv], new state); exact=False rounds o to bf16.
    snapshots: the second value is the state after every token, [T, Hv, dv, dk] (kept only on
    request: at a prefill chunk's length it would not fit in memory)."""
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
    states = np.empty((steps, hv, dv, dk), ft) if snapshots else None
    for t in range(steps):
        alpha = np.exp(g[t])[:, None, None]
        s = alpha * s
        pred = np.einsum("hvk,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - pred)
        s = s + delta[:, :, None] * k[t][:, None, :]
        out[t] = rnd(np.einsum("hvk,hk->hv", s, q[t]))
        if states is not None:
            states[t] = s
    return out, (s if states is None else states)


def build(variant: Variant) -> tuple[Any, list[Any]]:
    """The kernel and its launcher: the CuTe DSL code is in cute_kernels/gdn_kernel.py."""
    from . import gdn_kernel

    return gdn_kernel.build(variant)
