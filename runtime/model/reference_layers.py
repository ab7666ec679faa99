"""The model maths in NumPy, one function per operation (research note qwen-arch.md section 2).

Every function computes in the dtype of its inputs (float32 by default, float64 in tests) and
never changes it; weights must already be in that dtype. Linear weights are in the checkpoint's
[out, in] layout, so a projection is `x @ w.T`.

Shapes use: B sequences, T tokens, H hidden, Hk/Hv GDN key/value heads (dk, dv their dims),
Hq/Hkv attention query/key-value heads of dim D, E experts.
"""

from __future__ import annotations

import numpy as np

L2NORM_EPS = 1e-6
"""Epsilon inside the GDN q/k L2 normalisation: x * rsqrt(sum(x^2) + eps)."""

GDN_CHUNK = 64
"""Chunk length of the chunked Gated DeltaNet form (as HF and FLA use for prefill)."""


# --- elementwise --------------------------------------------------------------------------------

def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a non-positive argument only, so large |x| neither overflows nor warns.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    # log(1 + e^x) = max(x, 0) + log1p(e^-|x|): exact for all x, no overflow.
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# --- norms --------------------------------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * (1 + w).

    Used for the layer norms, the final norm, attention q/k norms and the MTP norms; their stored
    weights are centred on 0.
    """
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale) * (1.0 + weight)


def gated_rms_norm(x: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """The GDN output norm, per head over the last axis: x * rsqrt(mean(x^2) + eps) * w * silu(z).

    Its stored weight is plain (centred on 1), unlike `rms_norm`.
    """
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale) * weight * silu(gate)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


# --- Gated DeltaNet -----------------------------------------------------------------------------

def causal_conv(x: np.ndarray, window: np.ndarray, weight: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv + SiLU over channels, continuing from a window of past inputs.

    x: [B, T, C] pre-conv inputs; window: [B, Kc-1, C] the Kc-1 inputs before x (zeros at the
    start of a sequence); weight: [C, Kc], column Kc-1 multiplies the current token.
    Returns (silu(conv) [B, T, C], the new window [B, Kc-1, C] = last Kc-1 inputs).
    """
    kernel = weight.shape[1]
    steps = x.shape[1]
    extended = np.concatenate([window, x], axis=1)            # [B, Kc-1+T, C]
    acc = extended[:, 0:steps] * weight[:, 0]
    for j in range(1, kernel):
        acc = acc + extended[:, j:j + steps] * weight[:, j]
    return silu(acc), extended[:, steps:].copy()


def gdn_gates(a: np.ndarray, b: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Per token and value head: (g, beta) with g = -exp(A_log) * softplus(a + dt_bias) <= 0 the
    log-decay (decay alpha = exp(g)) and beta = sigmoid(b) the delta-rule step size."""
    g = -np.exp(a_log) * softplus(a + dt_bias)
    return g, sigmoid(b)


def gdn_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
             state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token of the gated delta rule for N independent (sequence, head) rows.

    q, k: [..., dk] (q already scaled), v: [..., dv], g, beta: [...], state: [..., dk, dv].
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.  Returns (o [..., dv], new S).
    """
    state = np.exp(g)[..., None, None] * state
    predicted = (k[..., None, :] @ state)[..., 0, :]                  # S^T k, [..., dv]
    delta = beta[..., None] * (v - predicted)
    state = state + k[..., :, None] * delta[..., None, :]
    out = (q[..., None, :] @ state)[..., 0, :]
    return out, state


def gdn_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                  state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The recurrent form over a sequence: q, k [T, Hv, dk], v [T, Hv, dv], g, beta [T, Hv],
    state [Hv, dk, dv]. Returns (o [T, Hv, dv], final state)."""
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        out[t], state = gdn_step(q[t], k[t], v[t], g[t], beta[t], state)
    return out, state


def gdn_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                state: np.ndarray, chunk: int = GDN_CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """The chunked (WY) form of `gdn_recurrent`, same arguments and results.

    Inside a chunk of L tokens (rows i, j), with gamma = cumsum(g) and
    Gam_ij = exp(gamma_i - gamma_j) for i >= j (else 0):
      A = strict_lower(diag(beta) K K^T * Gam),  Tm = (I + A)^-1,
      U = Tm diag(beta) V,  W = Tm diag(beta exp(gamma)) K,  Vn = U - W S,
      O = (Q * exp(gamma)) S + ((Q K^T) * Gam) Vn,
      S' = exp(gamma_L) S + (K * exp(gamma_L - gamma))^T Vn.
    A ragged last chunk is simply shorter (the same as zero-padding with g = beta = 0).
    """
    steps = q.shape[0]
    # Heads first: [Hv, T, d].
    qh, kh, vh = (np.swapaxes(x, 0, 1) for x in (q, k, v))
    gh, bh = g.T, beta.T
    out = np.empty_like(vh)
    for start in range(0, steps, chunk):
        stop = min(start + chunk, steps)
        length = stop - start
        qc, kc, vc = qh[:, start:stop], kh[:, start:stop], vh[:, start:stop]
        bc = bh[:, start:stop]
        gamma = np.cumsum(gh[:, start:stop], axis=-1)                # [Hv, L]
        lower = np.tril(np.ones((length, length), dtype=bool))
        diff = gamma[:, :, None] - gamma[:, None, :]
        # Masked before exp: above the diagonal diff > 0 could overflow.
        decay = np.exp(np.where(lower, diff, -np.inf))               # Gam, [Hv, L, L]
        strict = np.tril(np.ones((length, length), dtype=bool), k=-1)
        a_mat = np.where(strict, bc[:, :, None] * (kc @ np.swapaxes(kc, -1, -2)) * decay, 0)
        system = a_mat + np.eye(length, dtype=q.dtype)
        exp_gamma = np.exp(gamma)
        rhs = np.concatenate([bc[:, :, None] * vc, (bc * exp_gamma)[:, :, None] * kc], axis=-1)
        solved = np.linalg.solve(system, rhs)                        # Tm [beta V | beta e^g K]
        u_mat, w_mat = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]
        v_new = u_mat - w_mat @ state                                # [Hv, L, dv]
        out[:, start:stop] = ((qc * exp_gamma[:, :, None]) @ state
                              + ((qc @ np.swapaxes(kc, -1, -2)) * decay) @ v_new)
        last = gamma[:, -1]
        tail = np.exp(last[:, None] - gamma)                          # [Hv, L]
        state = (np.exp(last)[:, None, None] * state
                 + np.swapaxes(kc * tail[:, :, None], -1, -2) @ v_new)
    return np.swapaxes(out, 0, 1), state


# --- attention ----------------------------------------------------------------------------------

def rope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float, dtype: np.dtype
                 ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [..., rotary_dim/2] of angle pos * theta^(-2i/rotary_dim), computed in float64.

    Qwen3.5's interleaved MRoPE takes each frequency's angle from the t, h or w position; for text
    tokens the three are equal, so this plain 1-D form is exact for both families.
    """
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half (NeoX) RoPE on the first 2*len(freq) dims of x [..., T, heads, D];
    cos, sin [..., T, rd/2] pair dims (i, i + rd/2)."""
    half = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], axis=-1)


ATTENTION_QUERY_BLOCK = 256
"""Queries per block in `attention`, bounding the score matrix for long prefill chunks."""


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Softmax attention with GQA (q head h reads kv head h // (Hq/Hkv)), scale D^-0.5.

    q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; visible: [B, T, S] bool (each query sees at least one
    key). Returns [B, T, Hq, D].
    """
    batch, steps, q_heads, dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    qg = q.reshape(batch, steps, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)  # [B,Hkv,r,T,D]
    kt = k.transpose(0, 2, 3, 1)[:, :, None]                                    # [B,Hkv,1,D,S]
    vt = v.transpose(0, 2, 1, 3)[:, :, None]                                    # [B,Hkv,1,S,D]
    out = np.empty_like(qg)
    for start in range(0, steps, ATTENTION_QUERY_BLOCK):
        rows = slice(start, start + ATTENTION_QUERY_BLOCK)
        scores = (qg[:, :, :, rows] @ kt) * (dim ** -0.5)                      # [B,Hkv,r,t,S]
        scores = np.where(visible[:, None, None, rows], scores, -np.inf)
        out[:, :, :, rows] = softmax(scores, axis=-1) @ vt
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, steps, q_heads, dim)


# --- feed-forward -------------------------------------------------------------------------------

def swiglu(x: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray) -> np.ndarray:
    """Dense MLP: down(silu(gate x) * up x)."""
    return (silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def route(x: np.ndarray, router_w: np.ndarray, top_k: int, renormalize: bool
          ) -> tuple[np.ndarray, np.ndarray]:
    """MoE routing for x [N, H]: softmax over all experts, top-k, optional renormalisation.
    Returns (expert ids [N, k], weights [N, k])."""
    probs = softmax(x @ router_w.T, axis=-1)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return experts, weights


def moe(x: np.ndarray, router_w: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
        shared_gate_w: np.ndarray, shared_up_w: np.ndarray, shared_down_w: np.ndarray,
        shared_expert_gate_w: np.ndarray, top_k: int, renormalize: bool) -> np.ndarray:
    """Routed experts + sigmoid-gated shared expert for x [N, H].

    gate_up: [E, 2I, H] (gate rows first), down: [E, H, I]; shared_expert_gate_w: [1, H].
    """
    experts, weights = route(x, router_w, top_k, renormalize)
    inter = down.shape[2]
    out = np.zeros_like(x)
    for expert in np.unique(experts):
        rows, picks = np.nonzero(experts == expert)   # each token picks an expert at most once
        hidden = x[rows] @ gate_up[expert].T
        act = silu(hidden[:, :inter]) * hidden[:, inter:]
        out[rows] += weights[rows, picks][:, None] * (act @ down[expert].T)
    shared = swiglu(x, shared_gate_w, shared_up_w, shared_down_w)
    return out + sigmoid(x @ shared_expert_gate_w.T) * shared
