"""The model maths of reference_layers against direct, naive restatements of the formulas
(research note qwen-arch.md section 2), mostly in float64 so differences are rounding only."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from runtime.model import reference_layers as ref

RNG = np.random.default_rng(20240501)


def _gdn_inputs(steps: int, heads: int = 3, dk: int = 8, dv: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = ref.l2_normalize(rng.standard_normal((steps, heads, dk))) * dk ** -0.5
    k = ref.l2_normalize(rng.standard_normal((steps, heads, dk)))
    v = rng.standard_normal((steps, heads, dv))
    g, beta = ref.gdn_gates(rng.standard_normal((steps, heads)),
                            rng.standard_normal((steps, heads)),
                            np.log(rng.uniform(0.05, 4.0, heads)), rng.standard_normal(heads))
    state = rng.standard_normal((heads, dk, dv))
    return q, k, v, g, beta, state


def test_gdn_step_is_the_closed_form_update():
    q, k, v, g, beta, state = _gdn_inputs(1)
    out, new = ref.gdn_step(q[0], k[0], v[0], g[0], beta[0], state)
    for h in range(state.shape[0]):
        kk = k[0, h][:, None]
        expected = (np.exp(g[0, h]) * (np.eye(len(kk)) - beta[0, h] * kk @ kk.T) @ state[h]
                    + beta[0, h] * kk @ v[0, h][None, :])
        np.testing.assert_allclose(new[h], expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(out[h], expected.T @ q[0, h], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("steps", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("chunk", [8, 64])
def test_chunked_form_equals_recurrent_form(steps, chunk):
    q, k, v, g, beta, state = _gdn_inputs(steps, seed=steps)
    out_r, state_r = ref.gdn_recurrent(q, k, v, g, beta, state)
    out_c, state_c = ref.gdn_chunked(q, k, v, g, beta, state, chunk=chunk)
    np.testing.assert_allclose(out_c, out_r, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state_c, state_r, rtol=1e-10, atol=1e-12)


def test_chunked_form_in_float32_stays_close():
    q, k, v, g, beta, state = (x.astype(np.float32) for x in _gdn_inputs(150, seed=3))
    out_c, state_c = ref.gdn_chunked(q, k, v, g, beta, state)
    assert out_c.dtype == np.float32 and state_c.dtype == np.float32
    out_r, state_r = ref.gdn_recurrent(*(x.astype(np.float64) for x in (q, k, v, g, beta, state)))
    assert np.max(np.abs(out_c - out_r)) / np.max(np.abs(out_r)) < 1e-5
    assert np.max(np.abs(state_c - state_r)) / np.max(np.abs(state_r)) < 1e-5


def test_gdn_gates():
    a, b = np.array([[-30.0, 0.0, 2.0]]), np.array([[-50.0, 0.0, 50.0]])
    a_log, dt_bias = np.log(np.array([0.5, 2.0, 16.0])), np.array([1.0, -1.0, 0.5])
    g, beta = ref.gdn_gates(a, b, a_log, dt_bias)
    expected_g = -np.exp(a_log) * np.log1p(np.exp(a + dt_bias))
    np.testing.assert_allclose(g, expected_g, rtol=1e-12)
    np.testing.assert_allclose(beta, 1 / (1 + np.exp(-b)), rtol=1e-12)
    assert np.all(g <= 0)


def test_causal_conv_matches_the_formula_and_continues_across_calls():
    steps, channels, kernel = 11, 6, 4
    x = RNG.standard_normal((1, steps, channels))
    weight = RNG.standard_normal((channels, kernel))
    window = np.zeros((1, kernel - 1, channels))
    out, last = ref.causal_conv(x, window, weight)
    padded = np.concatenate([np.zeros((kernel - 1, channels)), x[0]])
    for t in range(steps):
        acc = sum(weight[:, j] * padded[t + j] for j in range(kernel))
        np.testing.assert_allclose(out[0, t], acc / (1 + np.exp(-acc)), rtol=1e-12)
    np.testing.assert_array_equal(last[0], x[0, -(kernel - 1):])
    # Split in pieces of 1, 2 and 8 tokens: the window carries the history.
    pieces, window = [], np.zeros((1, kernel - 1, channels))
    for start, stop in ((0, 1), (1, 3), (3, 11)):
        piece, window = ref.causal_conv(x[:, start:stop], window, weight)
        pieces.append(piece)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), out, rtol=1e-14)


def test_zero_centred_versus_gated_norm():
    x = RNG.standard_normal((4, 16))
    z = RNG.standard_normal((4, 16))
    w = RNG.standard_normal(16) * 0.3
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6), normed * (1 + w), rtol=1e-12)
    np.testing.assert_allclose(ref.gated_rms_norm(x, z, w, 1e-6),
                               normed * w * z / (1 + np.exp(-z)), rtol=1e-12)
    # A zero weight is the identity scale for the zero-centred norm only.
    np.testing.assert_allclose(ref.rms_norm(x, np.zeros(16), 1e-6), normed, rtol=1e-12)


def test_l2_normalize_eps_inside_the_root():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(ref.l2_normalize(x), [[3 / np.sqrt(25 + 1e-6),
                                                      4 / np.sqrt(25 + 1e-6)], [0, 0]])


def test_elementwise_functions_are_stable_at_extremes():
    x = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s, sp, si = ref.sigmoid(x), ref.softplus(x), ref.silu(x)
    assert s.dtype == np.float32 and np.all(np.isfinite(s)) and s[0] == 0 and s[-1] == 1
    np.testing.assert_allclose(sp, [0, np.exp(-50), np.log(2), 50, 1000], rtol=1e-6)
    np.testing.assert_allclose(si, [0, -50 * np.exp(-50), 0, 50, 1000], rtol=1e-6, atol=1e-30)


def test_rope_rotate_half_and_relative_positions():
    rd, dim, theta = 8, 32, 1e7
    x = RNG.standard_normal((1, 3, 2, dim))
    positions = np.array([[0, 5, 1000]])
    cos, sin = ref.rope_cos_sin(positions, rd, theta, np.float64)
    out = ref.apply_rope(x, cos, sin)
    inv_freq = theta ** (-np.arange(0, rd, 2) / rd)
    for t, p in enumerate(positions[0]):
        for i in range(rd // 2):          # frequency i pairs dims (i, i + rd/2)
            c, s = np.cos(p * inv_freq[i]), np.sin(p * inv_freq[i])
            a, b = x[0, t, :, i], x[0, t, :, i + rd // 2]
            np.testing.assert_allclose(out[0, t, :, i], a * c - b * s, rtol=1e-12)
            np.testing.assert_allclose(out[0, t, :, i + rd // 2], b * c + a * s, rtol=1e-12)
    np.testing.assert_array_equal(out[..., rd:], x[..., rd:])     # partial rotary
    # Scores depend on the position difference only.
    q, k = RNG.standard_normal(dim), RNG.standard_normal(dim)

    def score(pq, pk):
        cq, sq = ref.rope_cos_sin(np.array([pq]), rd, theta, np.float64)
        ck, sk = ref.rope_cos_sin(np.array([pk]), rd, theta, np.float64)
        return ref.apply_rope(q[None, None], cq, sq).ravel() @ \
            ref.apply_rope(k[None, None], ck, sk).ravel()
    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-9)


def test_interleaved_mrope_reduces_to_plain_rope_for_text():
    """Qwen3.5's MRoPE picks each frequency's angle from the t, h or w position (the i % 3 rule,
    qwen-arch.md 2.4); with t = h = w, as for text tokens, that is exactly 1-D RoPE."""
    rd, theta, section = 64, 1e7, (11, 11, 10)
    pos = np.arange(50)
    inv_freq = theta ** (-np.arange(0, rd, 2) / rd)
    thw = {"t": pos, "h": pos, "w": pos}
    axis = ["h" if i % 3 == 1 and i < 3 * section[1] else
            "w" if i % 3 == 2 and i < 3 * section[2] else "t" for i in range(rd // 2)]
    angles = np.stack([thw[a] * inv_freq[i] for i, a in enumerate(axis)], axis=-1)
    cos, sin = ref.rope_cos_sin(pos, rd, theta, np.float64)
    np.testing.assert_allclose(cos, np.cos(angles), rtol=1e-14)
    np.testing.assert_allclose(sin, np.sin(angles), rtol=1e-14, atol=1e-15)


def test_attention_gqa_against_a_per_head_loop():
    batch, steps, keys, hq, hkv, dim = 2, 3, 7, 4, 2, 8
    q = RNG.standard_normal((batch, steps, hq, dim))
    k = RNG.standard_normal((batch, keys, hkv, dim))
    v = RNG.standard_normal((batch, keys, hkv, dim))
    visible = RNG.random((batch, steps, keys)) < 0.6
    visible[:, :, 0] = True
    out = ref.attention(q, k, v, visible)
    for b in range(batch):
        for t in range(steps):
            for h in range(hq):
                kv = h // (hq // hkv)
                idx = np.nonzero(visible[b, t])[0]
                s = k[b, idx, kv] @ q[b, t, h] / np.sqrt(dim)
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[b, t, h], p @ v[b, idx, kv], rtol=1e-12)


def test_attention_query_blocks(monkeypatch):
    q = RNG.standard_normal((1, 9, 2, 4))
    k = RNG.standard_normal((1, 9, 1, 4))
    v = RNG.standard_normal((1, 9, 1, 4))
    visible = np.tril(np.ones((9, 9), dtype=bool))[None]
    whole = ref.attention(q, k, v, visible)
    monkeypatch.setattr(ref, "ATTENTION_QUERY_BLOCK", 4)
    np.testing.assert_allclose(ref.attention(q, k, v, visible), whole, rtol=1e-14)


def test_moe_against_a_per_token_loop():
    tokens, hidden, experts, inter, shared, top_k = 6, 8, 5, 3, 4, 2
    x = RNG.standard_normal((tokens, hidden))
    router = RNG.standard_normal((experts, hidden))
    gate_up = RNG.standard_normal((experts, 2 * inter, hidden))
    down = RNG.standard_normal((experts, hidden, inter))
    sg, su, sd = (RNG.standard_normal(s) for s in ((shared, hidden), (shared, hidden),
                                                    (hidden, shared)))
    seg = RNG.standard_normal((1, hidden))

    def silu(a):
        return a / (1 + np.exp(-a))
    for renormalize in (True, False):
        out = ref.moe(x, router, gate_up, down, sg, su, sd, seg, top_k, renormalize)
        for n in range(tokens):
            logits = router @ x[n]
            p = np.exp(logits - logits.max())
            p /= p.sum()
            chosen = np.argsort(-p)[:top_k]
            w = p[chosen] / (p[chosen].sum() if renormalize else 1.0)
            expected = sum(w[j] * down[e] @ (silu(gate_up[e, :inter] @ x[n])
                                             * (gate_up[e, inter:] @ x[n]))
                           for j, e in enumerate(chosen))
            expected = expected + 1 / (1 + np.exp(-(seg @ x[n]))) * (
                sd @ (silu(sg @ x[n]) * (su @ x[n])))
            np.testing.assert_allclose(out[n], expected, rtol=1e-10)


def test_functions_keep_float32():
    x = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    w = np.zeros(8, np.float32)
    assert ref.rms_norm(x, w, 1e-6).dtype == np.float32
    assert ref.gated_rms_norm(x, x, w, 1e-6).dtype == np.float32
    assert ref.l2_normalize(x).dtype == np.float32
    cos, sin = ref.rope_cos_sin(np.arange(3), 4, 1e7, np.float32)
    assert ref.apply_rope(x.reshape(2, 3, 2, 4), cos, sin).dtype == np.float32
