"""The `moe_grouped` family's NumPy references (cute_kernels/moe_grouped.py): the counting sort's
layout (stable, padded segments, tile list, inverse map), the capacity bound, and the whole prefill
MLP against the decode chain of `moe`'s references (same routing, roundings and slot order)."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import moe, moe_grouped
from cute_kernels.bf16 import round_bf16
from cute_kernels.moe_grouped import BM


def _ids(rng, m, e, k, mode):
    """Routed ids (distinct per row) then the shared expert e: random, every row to one set, or
    every row routed into the first k experts (the rest empty)."""
    if mode == "random":
        routed = np.stack([rng.permutation(e)[:k] for _ in range(m)])
    elif mode == "one_set":
        routed = np.broadcast_to(rng.permutation(e)[:k], (m, k))
    else:
        routed = np.broadcast_to(np.arange(k), (m, k))
    return np.concatenate([routed, np.full((m, 1), e)], 1).astype(np.int32)


@pytest.mark.parametrize("m", [1, 7, 65, 300])
@pytest.mark.parametrize("mode", ["random", "one_set", "first_k"])
def test_perm_is_a_stable_padded_counting_sort(m, mode):
    e, k = 8, 2
    rng = np.random.default_rng(m)
    ids = _ids(rng, m, e, k, mode)
    c = moe_grouped.capacity(m, k + 1, e + 1)
    pos, src, tiles = moe_grouped.reference_perm(ids, e + 1, c)
    used = tiles[0] * BM
    assert used <= c and c % BM == 0
    # Each entry lands on a row of its expert's tile, and src points back at its row.
    for r in range(m):
        for s in range(k + 1):
            q = pos[r, s]
            assert tiles[1 + q // BM] == ids[r, s] and src[q] == r
    # Within a tile's expert the rows ascend; padding (-1) only after a segment's rows.
    for t in range(tiles[0]):
        seg = src[t * BM:(t + 1) * BM]
        real = seg[seg >= 0]
        assert (np.diff(real) > 0).all()
        assert (seg[len(real):] == -1).all()
    counts = np.bincount(ids.reshape(-1), minlength=e + 1)
    assert tiles[0] == (-(-counts // BM)).sum()
    assert (src[used:] == -2).all() and (tiles[1 + tiles[0]:] == -2).all()  # not written


def test_capacity_covers_the_worst_padding():
    """Every non-empty segment padded by BM - 1: the bound is reached when each segment holds
    one entry past a whole tile."""
    for m, p, e1 in [(1, 3, 9), (7, 3, 9), (2048, 9, 257), (5, 9, 257)]:
        c = moe_grouped.capacity(m, p, e1)
        worst = m * p + min(e1, m * p) * (BM - 1)
        assert c >= worst and c - worst < BM and c % BM == 0
    assert moe_grouped.capacity(2048, 9, 257) == 51072


def _weights(rng, e, h, inter):
    def draw(*shape):
        return round_bf16((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    return draw(e + 1, 2 * inter, h), draw(e + 1, h, inter)


@pytest.mark.parametrize("mode", ["random", "one_set", "first_k"])
def test_the_prefill_mlp_is_the_decode_chain(mode):
    """Sorting the rows changes nothing but the fp32 summation order of each dot product: the
    grouped reference equals the decode chain's to within one bf16 rounding of the output."""
    e, k, h, inter, m = 8, 2, 256, 64, 37
    rng = np.random.default_rng(3)
    gate_up, down = _weights(rng, e, h, inter)
    x = round_bf16(rng.standard_normal((m, h)).astype(np.float32))
    ids = _ids(rng, m, e, k, mode)
    wts = rng.uniform(0.05, 1.0, (m, k + 1)).astype(np.float32)
    got = moe_grouped.reference(x, ids, wts, gate_up, down)
    want = moe.reference_down(moe.reference_up(x, gate_up, ids), down, ids, wts)
    exact = moe.reference_down(moe.reference_up(x, gate_up, ids), down, ids, wts, exact=True)
    scale = np.abs(exact).max()
    assert np.abs(got - exact).max() <= 2 ** -7 * scale
    assert np.abs(got - want).max() <= 2 ** -7 * scale
    assert np.mean(got == want) > 0.9


def test_variants_cover_the_moe_shapes():
    """One perm, gather, combine and two grouped GEMMs per `moe` shape, their N a multiple of
    the N tile (so a weight tile never straddles two experts)."""
    keys = {v.key for v in moe_grouped.variants()}
    for name, h, e, k, inter, _, _ in moe.SHAPES:
        tail = f"h{h}_e{e}_k{k}_i{inter}"
        assert {f"perm_{tail}", f"gather_{tail}", f"combine_{tail}", f"gemm_gate_up_e{e + 1}_n{2 * inter}_k{h}",
                f"gemm_down_e{e + 1}_n{h}_k{inter}"} <= keys, name
    for v in moe_grouped.variants():
        if v.config["kind"] == "gemm":
            assert v.config["N"] % v.config["tile"][1] == 0 and v.config["tile"][0] == BM
