"""The `moe` kernel family's NumPy references (cute_kernels/moe.py) against the model maths of
`runtime/model/reference_layers.py` (softmax over all experts, top-k, renormalise): routing,
ties, and the whole MLP."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import moe
from cute_kernels.bf16 import round_bf16
from runtime.model import reference_layers as ref


def _weights(rng, e=8, h=256, inter=64):
    def draw(*shape):
        return round_bf16((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    return draw(e, h), draw(1, h), draw(e + 1, 2 * inter, h), draw(e + 1, h, inter)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_matches_the_model_routing(renorm):
    rng = np.random.default_rng(0)
    x = round_bf16(rng.standard_normal((16, 256)).astype(np.float32))
    router, w_sg, _, _ = _weights(rng)
    ids, wts = moe.reference_route(moe.reference_logits(x, router), x, w_sg[0], 2, renorm)
    want_ids, want_wts = ref.route(x.astype(np.float64), router.astype(np.float64), 2, renorm)
    np.testing.assert_array_equal(ids[:, :2], want_ids)
    np.testing.assert_allclose(wts[:, :2], want_wts, rtol=1e-12)
    assert (ids[:, 2] == 8).all()  # the shared expert, stacked as expert E
    np.testing.assert_allclose(wts[:, 2], ref.sigmoid(x.astype(np.float64) @ w_sg[0].astype(np.float64)))


def test_route_ties_go_to_the_lowest_index_as_in_the_model():
    """Equal logits: the lower expert id is taken first, as the stable argsort of `ref.route`."""
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 2.0, 2.0],
                       [0.0] * 8,
                       [2.0, 2.0, 5.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    x = np.zeros((3, 256))
    ids, wts = moe.reference_route(logits, x, np.zeros(256), 3, True)
    assert ids[:, :3].tolist() == [[1, 2, 4], [0, 1, 2], [2, 0, 1]]
    # ref.route takes logits through x @ router^T: an identity router over the first 8 columns.
    eye = np.eye(8, 256)
    padded = np.zeros((3, 256))
    padded[:, :8] = logits
    want_ids, want_wts = ref.route(padded, eye, 3, True)
    np.testing.assert_array_equal(ids[:, :3], want_ids)
    np.testing.assert_allclose(wts[:, :3], want_wts, rtol=1e-12)
    np.testing.assert_allclose(wts[:, 3], 0.5)  # sigmoid(0)


def test_the_chained_kernels_equal_the_model_moe():
    """moe.reference (the four kernels, rounded where they round) against ref.moe in float64: the
    difference is bf16 rounding of the gate/up outputs and of the result, a few 1e-3 relative."""
    rng = np.random.default_rng(1)
    e, h, inter, k = 8, 256, 64, 2
    x = round_bf16(rng.standard_normal((12, h)).astype(np.float32))
    router, w_sg, gate_up, down = _weights(rng, e, h, inter)
    ours = moe.reference(x, router, w_sg[0], gate_up, down, k)
    f64 = [a.astype(np.float64) for a in (x, router, gate_up, down, w_sg)]
    xs, rs, gu, dn, sg = f64
    want = ref.moe(xs, rs, gu[:e], dn[:e], gu[e, :inter], gu[e, inter:], dn[e], sg, k, renormalize=True)
    rel = np.linalg.norm(ours - want) / np.linalg.norm(want)
    assert rel < 1e-2, rel
    # Rows are independent: one row alone gives its numbers in the batch exactly.
    np.testing.assert_array_equal(moe.reference(x[5:6], router, w_sg[0], gate_up, down, k), ours[5:6])


def test_a_bad_shape_is_named():
    with pytest.raises(ValueError, match="a row of 100 values does not split into 16-byte vectors"):
        moe.lanes_per_row(100)
