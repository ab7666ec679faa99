"""Gated DeltaNet prefill in the chunked (WY) form on tensor cores.

Computes what the `split` kernel of cute_kernels/gdn.py computes: from the fp32 state in the slot,
the un-normalised o (bf16, [B*T, Hv*dv]) and the final fp32 state ([slots, Hv, dv, dk], v-major);
the gated RMSNorm then runs as the `rmsnorm` launch in mode `gated_x`, exactly as after `split`.
Same parameters and grid semantics (B sequences of T tokens, sequence b uses slot `slots[b]`).

The chunked form. Per value head, with q, k L2-normalised (q scaled by dk^-1/2), log-decay
g_t = -exp(A_log) softplus(a_t + dt_bias) and beta_t = sigmoid(b_t), the recurrence
`S_t = a_t S_{t-1} + d_t k_t^T`, `d_t = beta_t (v_t - a_t S_{t-1} k_t)`, `o_t = S_t q_t` over one
chunk of C = 64 tokens starting from the state S (S: [dv, dk]) unrolls, with the cumulative
log-decay G_t = sum_{s<=t} g_s inside the chunk, to

    S_t = e^{G_t} S + sum_{s<=t} e^{G_t - G_s} d_s k_s^T
    (I + A) D = R,  A[t,s] = beta_t e^{G_t - G_s} k_t.k_s (s < t),  R = diag(beta) (V - diag(e^G) K S^T)
    O   = diag(e^G) Q S^T + (Q K^T * e^{G_t - G_s}, s <= t) D
    S'  = e^{G_C} S + (diag(e^{G_C - G}) D)^T K

(rows of D, R, O, V, K, Q are the chunk's tokens; D holds the deltas d_t). The WY factors of the
usual formulation are D = U - W S^T with U = T diag(beta) V, W = T diag(beta e^G) K,
T = (I + A)^-1; the kernel applies T to R directly (one 64x128x64 product instead of two, as
FlashInfer's SM90 kernel does) — `reference_core` checks the algebra against the recurrence in
float64 (tests/unit/test_ref_gdn_chunked.py).

The kernel (`fwd_*`; its CuTe DSL code is cute_kernels/gdn_chunked_kernel.py): one CTA of 8 warps
per (value head, sequence) walks the sequence's chunks.
The fp32 state lives in registers as the accumulator of the state-update product for the whole
sequence; a bf16 copy of it sits in shared memory as the B operand of Q S^T and K S^T. Per chunk:
cp.async loads of the raw q, k (key head h // (Hv/Hk)) and v rows; L2 norms in place (bf16); the
gates and their prefix sum in one warp; K K^T, Q K^T, K S^T, Q S^T as warp-level mma.sync m16n8k16
BF16 with fp32 accumulators (swizzled shared memory, ldmatrix, transposing ldmatrix for the
MN-major operands); T = (I + A)^-1 by forward substitution in fp32 (one thread per column of T,
the matrix in shared memory), rounded to bf16; D = T R; O and the state update. Rows past the end
of the sequence get beta = 0, g = 0 and zero q/k/v, so they change nothing.

Forms (`_FORMS`; config `vsplit`, `prefetch`, `tinv`), both with the same launch interface:
- `fwd_*`: the plain form above (vsplit 1, no prefetch, T by substitution); kept as the baseline
  the fast form is timed and tested against.
- `fwd_*_v2pt`, the one the runner uses, three changes to it:
  vsplit = 2: the rows of D, R, O, V are independent along the value columns and the state update
  only needs its own rows of S, so each head's dv columns (rows of its [dv, dk] state) go to 2
  CTAs, grid (2 Hv, B); each recomputes the k side (q/k loads and norms, gates, K K^T, Q K^T, T).
  Tiles of dv / 2 = 64 columns keep the 4 x 2-warp tiling; the state tile is (64, 128).
  prefetch: the next chunk's q, k rows load by cp.async into staging tiles during the current
  chunk (issued after the first barrier), and its v rows right after R is formed (the last read
  of V); the raw gate inputs of the next chunk load into warp 0's registers. At the top of a chunk
  each thread normalises the q, k rows it copied itself (dk / 8 lanes per row, 16-byte accesses)
  from staging into the working tiles, so no barrier separates the wait from the norms.
  tinv = "blocked": T by 16 x 16 blocks: the diagonal blocks by forward substitution (one thread
  per (block, column), 15 steps instead of 63), then by distance d = i - j
  T_ij = -T_ii sum_{j<=k<i} A_ik T_kj, all 8 warps (warp w: columns 2w, 2w + 1 of each block, a lane
  one entry; T_ii X gathers X's column by shuffles); fp32 throughout, as the substitution.
  Measured on the H200 (27B shape, one 8192-token sequence, bench.prefill): 2.17 ms plain, 1.78
  with vsplit alone, 1.35 with prefetch added, 1.28 with blocked T (fla 0.6.0: 1.74 in that run).

Precision: mma operands are bf16 (q, k after the norm, the state copy, R, T, D, the masked Q K^T),
accumulation and the master state fp32 — the roundings FLA's Triton kernels make. `reference_core`
with `kernel_rounding=True` emulates them; the GPU test bounds the kernel's error by that model's.

Variants need dk = dv = 128 (64-column swizzled tiles, 8-warp tiles of the 128 x 128 state); the
tiny model (dk = dv = 32) keeps the `split` path.
"""

from typing import Any

import numpy as np

from . import gdn
from .bf16 import round_bf16
from .variant import HOPPER, Variant

FAMILY = "gdn_chunked"
C = 64  # tokens per chunk
THREADS = 256
L2_EPS = gdn.L2_EPS

# (key, Hk, Hv, dk, dv): Qwen3.6-27B, Qwen3.6-35B-A3B.
_SHAPES = [
    ("fwd_k16_v48_d128", 16, 48, 128, 128),
    ("fwd_k16_v32_d128", 16, 32, 128, 128),
]

# (key suffix, vsplit, prefetch, tinv). vsplit: CTAs per value head (each owns dv / vsplit value
# columns and recomputes the k side); prefetch: the next chunk's q, k, v (cp.async into staging
# tiles) and gate inputs load while the current chunk computes; tinv: how T = (I + A)^-1 is formed
# ("subst": forward substitution, one thread per column; "blocked": 16 x 16 diagonal blocks, then
# the off-diagonal blocks on all warps).
_FORMS = [
    ("", 1, False, "subst"),
    ("_v2pt", 2, True, "blocked"),
]


def _variant(key: str, hk: int, hv: int, dk: int, dv: int, vsplit: int = 1, prefetch: bool = False,
             tinv: str = "subst") -> Variant:
    if dk != 128 or dv != 128 or hv % hk:
        raise ValueError(f"gdn_chunked {key}: needs dk = dv = 128 and Hv a multiple of Hk")
    if dv % vsplit or (dv // vsplit) % 64 or tinv not in ("subst", "blocked"):
        raise ValueError(f"gdn_chunked {key}: vsplit={vsplit} must leave a multiple of 64 value columns "
                         f"per CTA; tinv={tinv!r}")
    lay = gdn.layout(hk, hv, dk, dv)
    form = f"{vsplit} CTA(s) per head" + (", prefetch" if prefetch else "") + f", T by {tinv}"
    return Variant(
        family=FAMILY,
        key=key,
        config={"mode": "chunked", "Hk": hk, "Hv": hv, "dk": dk, "dv": dv, "threads": THREADS, "chunk": C,
                "vsplit": vsplit, "prefetch": prefetch, "tinv": tinv, **lay, "l2_eps": L2_EPS},
        **gdn.prefill_interface(lay, hv, dk, dv),
        block=(THREADS, 1, 1),
        grid=(hv * vsplit, "B", 1),
        requires=("B >= 1", "T >= 1", "B <= 65535", "NS >= 1"),
        arches=HOPPER,
        note=f"chunked (WY) Gated DeltaNet prefill on tensor cores (mma.sync), C={C}, Hk={hk} Hv={hv} "
             f"dk={dk} dv={dv}, {form}, fp32 state, un-normalised bf16 o (gated norm: rmsnorm gated_x)",
        example_sizes={"B": 1, "T": 64, "NS": 1},
    )


def variants() -> list[Variant]:
    return [_variant(key + suffix, hk, hv, dk, dv, vsplit, prefetch, tinv)
            for key, hk, hv, dk, dv in _SHAPES for suffix, vsplit, prefetch, tinv in _FORMS]


def reference_core(qkv: np.ndarray, b: np.ndarray, a: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
                   state: np.ndarray, *, hk: int, chunk: int = C,
                   kernel_rounding: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The chunked form of `gdn.reference_core` for one sequence: (o [T, Hv, dv], new state).

    float64 throughout; kernel_rounding=True rounds to bf16 where the kernel feeds tensor cores
    (q and k after the norm, the state copy, R, T, D, the masked Q K^T) and o at the end."""
    rb = (lambda v: round_bf16(np.asarray(v, np.float32)).astype(np.float64)) if kernel_rounding \
        else (lambda v: v)
    f64 = np.float64
    hv, dv, dk = state.shape
    steps = qkv.shape[0]
    key_dim = hk * dk
    q = qkv[:, :key_dim].reshape(steps, hk, dk).astype(f64)
    k = qkv[:, key_dim:2 * key_dim].reshape(steps, hk, dk).astype(f64)
    v = qkv[:, 2 * key_dim:].reshape(steps, hv, dv).astype(f64)
    q = rb(q / np.sqrt(np.sum(q * q, -1, keepdims=True) + L2_EPS) * dk ** -0.5)
    k = rb(k / np.sqrt(np.sum(k * k, -1, keepdims=True) + L2_EPS))
    rep = hv // hk
    g = -np.exp(a_log.astype(f64)) * gdn._softplus(a.astype(f64) + dt_bias.astype(f64))  # [T, Hv]
    beta = 1.0 / (1.0 + np.exp(-b.astype(f64)))
    s_all = state.astype(f64).copy()
    out = np.empty((steps, hv, dv), f64)
    for h in range(hv):
        kh = h // rep
        s = s_all[h]
        for t0 in range(0, steps, chunk):
            n = min(chunk, steps - t0)
            qc, kc, vc = q[t0:t0 + n, kh], k[t0:t0 + n, kh], v[t0:t0 + n, h]
            gam = np.cumsum(g[t0:t0 + n, h])
            bc = beta[t0:t0 + n, h]
            decay = np.exp(gam[:, None] - gam[None, :])  # [t, s], used only where s <= t
            lower = np.tril(np.ones((n, n)), -1)
            amat = bc[:, None] * (kc @ kc.T) * np.where(lower > 0, decay, 0.0)
            tinv = rb(np.linalg.solve(np.eye(n) + amat, np.eye(n)))
            sb = rb(s)
            r = rb(bc[:, None] * (vc - np.exp(gam)[:, None] * (kc @ sb.T)))
            d = tinv @ r
            incl = np.tril(np.ones((n, n)))
            p = rb((qc @ kc.T) * np.where(incl > 0, decay, 0.0))
            o = np.exp(gam)[:, None] * (qc @ sb.T) + p @ rb(d)
            out[t0:t0 + n, h] = rb(o)
            s = np.exp(gam[-1]) * s + rb(np.exp(gam[-1] - gam)[:, None] * d).T @ kc
        s_all[h] = s
    return out, s_all


# --------------------------------------------------------------------------- kernel


def build(variant: Variant) -> tuple[Any, list[Any]]:
    """The kernel and its launcher: the CuTe DSL code is in cute_kernels/gdn_chunked_kernel.py."""
    from . import gdn_chunked_kernel

    return gdn_chunked_kernel.build(variant)
