"""The recurrent GDN kernels' column blocks on the CPU: the variant table, the property of the
delta rule they rest on, and the runner's choice of block count by batch size.

A column-block variant spreads a head's value columns (rows of the [dv, dk] state) over a cluster
of CTAs, each whole warps of the one-CTA layout (cute_kernels/gdn.py). tests/gpu/test_gdn_kernels.py
and test_gdn_verify.py then hold the kernels to bit identity with the one-block kernel on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import gdn
from cute_kernels.bf16 import round_bf16

from null_cuda import built_or_skip

_FUSED = [v for v in gdn.variants() if v.config["mode"] == "fused"]


def _shape(v):
    return tuple(v.config[k] for k in ("Hk", "Hv", "dk", "dv", "threads"))


def test_every_shape_has_the_one_block_kernel_under_its_old_key_and_column_blocks():
    by_shape: dict[tuple, dict[int, str]] = {}
    for v in _FUSED:
        by_shape.setdefault(_shape(v), {})[v.config["cols"]] = v.key
    assert {cols[1] for cols in by_shape.values()} == {"k2_v4_d32", "k16_v48_d128", "k16_v32_d128"}
    for shape, cols in by_shape.items():
        assert sorted(cols) == ([1, 2, 4] if shape[0] == 2 else [1, 2, 4, 8]), shape
        for n, key in cols.items():
            assert key == gdn.column_key(cols[1], n)


@pytest.mark.parametrize("variant", _FUSED, ids=lambda v: v.key)
def test_column_blocks_are_whole_warps_of_the_one_block_layout_in_one_cluster(variant):
    cfg = variant.config
    cols, threads, hv = cfg["cols"], cfg["threads"], cfg["Hv"]
    assert variant.block == (threads // cols, 1, 1)
    assert variant.block[0] % 32 == 0  # whole warps: the norm's per-warp partials are the one-block ones
    assert variant.grid == (hv * cols, "B", 1)  # a head's blocks are consecutive: one cluster
    assert variant.cluster == (cols, 1, 1) and cols <= gdn.MAX_COLS
    lanes = cfg["dk"] // 4
    assert (threads // lanes) % cols == 0 and cfg["dv"] % (threads // lanes) == 0  # row groups split evenly


@pytest.mark.parametrize("cols", [2, 4, 8])
def test_a_block_of_value_columns_needs_only_its_own_columns(cols):
    """The property column blocks rest on: o[:, :, J] and the state rows J of the delta rule
    depend only on v[:, :, J] and those state rows (q, k and the gates are shared), so a CTA that
    holds rows J computes them alone. Only the gated norm needs all of dv (the kernels exchange
    its partial sums)."""
    rng = np.random.default_rng(cols)
    t, hk, hv, dk, dv = 5, 2, 4, 16, 32
    key_dim = hk * dk
    qkv = round_bf16(rng.standard_normal((t, 2 * key_dim + hv * dv)).astype(np.float32))
    b, a = rng.standard_normal((t, hv)), rng.standard_normal((t, hv))
    a_log, dt_bias = rng.standard_normal(hv) * 0.5, rng.standard_normal(hv) * 0.5
    state = rng.standard_normal((hv, dv, dk)) * 0.1
    o, s = gdn.reference_core(qkv, b, a, a_log, dt_bias, state, hk=hk, exact=True)
    v = qkv[:, 2 * key_dim:].reshape(t, hv, dv)
    width = dv // cols
    for blk in range(cols):
        rows = slice(blk * width, (blk + 1) * width)
        part = np.concatenate([qkv[:, :2 * key_dim], v[:, :, rows].reshape(t, hv * width)], axis=1)
        o_blk, s_blk = gdn.reference_core(part, b, a, a_log, dt_bias, state[:, rows], hk=hk, exact=True)
        np.testing.assert_allclose(o_blk, o[:, :, rows], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(s_blk, s[:, rows], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("shape,want", [
    # Qwen3.6-27B (48 value heads): 8 blocks at batch 1 (384 CTAs), 4 at 2, 2 at 4, 1 from 8.
    ("QWEN36_27B", {1: 8, 2: 4, 3: 2, 4: 2, 5: 2, 6: 1, 8: 1, 16: 1}),
    # 35B-A3B (32 value heads): 8 at batch 1 (256 CTAs), 4 at 2, 2 at 4, 1 from 8.
    ("QWEN36_35B_A3B", {1: 8, 2: 4, 4: 2, 7: 2, 8: 1})])
def test_the_runner_picks_the_fewest_column_blocks_that_fill_the_gpu(shape, want):
    from runtime.cuda.kernels import KernelLibrary
    from runtime.cuda.null import NullDevice
    from runtime.model import shapes
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.kernels import GDN_MIN_CTAS, KernelChoice

    config = ModelConfig.from_dict(getattr(shapes, shape))
    lib = built_or_skip(lambda: KernelLibrary.open(NullDevice(), required=[]))
    choice = built_or_skip(lambda: KernelChoice(lib, config))
    assert sorted(choice.gdn_columns) == [1, 2, 4, 8]
    hv = config.linear_num_value_heads
    for nseq, cols in want.items():
        for verify in (False, True):
            key = choice.gdn_recurrent(nseq, verify)
            cfg = lib.manifest.kernels[("gdn", key)].config
            assert (cfg["mode"], cfg["cols"], cfg["Hv"]) == ("verify" if verify else "fused", cols, hv), (nseq, key)
            assert nseq * hv * cols >= GDN_MIN_CTAS or cols == 8
    # A benchmark's "before": no CTA target, the one-block kernels at every batch.
    choice.gdn_min_ctas = 0
    assert {choice.gdn_recurrent(n, v) for n in (1, 8) for v in (False, True)} == {choice.gdn, choice.gdn_verify}
    assert (choice.gdn, choice.gdn_verify) == choice.gdn_columns[1]
    assert set(choice.gdn_columns[8]) <= {key for _, key in choice.required()}
