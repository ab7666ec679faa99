"""The NumPy references of the conv1d, Gated DeltaNet and attention kernel families agree with
the model's reference layers (`runtime.model.reference_layers`, which the golden tests tie to
Hugging Face transformers), so the GPU tests compare the kernels with the right maths."""

from __future__ import annotations

import numpy as np

from cute_kernels import attention, conv1d, gdn
from runtime.model import reference_layers as ref


def test_conv1d_reference_matches_model():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 24))
    window = rng.standard_normal((2, 3, 24))
    w = rng.standard_normal((24, 4))
    got, got_win = conv1d.reference(x, window, w, exact=True)
    want, want_win = ref.causal_conv(x, window, w)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got_win, want_win)


def test_gdn_reference_matches_model():
    rng = np.random.default_rng(1)
    hk, hv, dk, dv, t = 2, 4, 8, 6, 9
    qkv = rng.standard_normal((t, 2 * hk * dk + hv * dv))
    z = rng.standard_normal((t, hv, dv))
    b, a = rng.standard_normal((t, hv)), rng.standard_normal((t, hv))
    a_log, dt_bias, norm_w = rng.standard_normal(hv), rng.standard_normal(hv), 1 + 0.1 * rng.standard_normal(dv)
    state_kv = rng.standard_normal((hv, dk, dv))
    got, got_state = gdn.reference(qkv, z, b, a, a_log, dt_bias, norm_w, np.swapaxes(state_kv, 1, 2), hk=hk,
                                   exact=True)
    q = qkv[:, :hk * dk].reshape(t, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)
    v = qkv[:, 2 * hk * dk:].reshape(t, hv, dv)
    q = np.repeat(ref.l2_normalize(q) * dk ** -0.5, hv // hk, axis=1)
    k = np.repeat(ref.l2_normalize(k), hv // hk, axis=1)
    g, beta = ref.gdn_gates(a, b, a_log, dt_bias)
    out, state = ref.gdn_recurrent(q, k, v, g, beta, state_kv)
    want = ref.gated_rms_norm(out, z, norm_w, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(np.swapaxes(got_state, 1, 2), state, rtol=1e-10, atol=1e-10)
    chunked, chunked_state = ref.gdn_chunked(q, k, v, g, beta, state_kv, chunk=4)
    np.testing.assert_allclose(chunked, out, rtol=1e-9, atol=1e-9)


def test_attention_references_match_model():
    rng = np.random.default_rng(2)
    hq, hkv, d, rd, t = 4, 2, 16, 8, 7
    x = rng.standard_normal((t, hq * 2 * d + 2 * hkv * d))
    qn_w, kn_w = 0.1 * rng.standard_normal(d), 0.1 * rng.standard_normal(d)
    pos = np.arange(t)
    cos, sin = ref.rope_cos_sin(np.arange(64), rd, 1e4, np.float64)
    q, k, v = attention.reference_prep(x, qn_w, kn_w, cos, sin, pos, hq=hq, hkv=hkv, d=d, exact=True)
    qg = x[:, :hq * 2 * d].reshape(t, hq, 2 * d)
    c, s = ref.rope_cos_sin(pos, rd, 1e4, np.float64)
    want_q = ref.apply_rope(ref.rms_norm(qg[..., :d], qn_w, 1e-6), c, s)
    kx = x[:, hq * 2 * d:hq * 2 * d + hkv * d].reshape(t, hkv, d)
    want_k = ref.apply_rope(ref.rms_norm(kx, kn_w, 1e-6), c, s)
    np.testing.assert_allclose(q, want_q, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(k, want_k, rtol=1e-10, atol=1e-10)
    gate = qg[..., d:]
    got = attention.reference_attention(q, k, v, pos, gate, exact=True)
    visible = (np.arange(t)[None, :] <= pos[:, None])[None]
    att = ref.attention(q[None], k[None], v[None], visible)[0]
    want = att.reshape(t, hq * d) * ref.sigmoid(gate.reshape(t, hq * d))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
