"""The GPU vision tower's host side on the CPU: the per-call plan, the kernel families'
references against the NumPy tower's maths, and `GpuVisionTower` run end to end on the null
device with every launch emulated by its family's reference (`vision_emulator`), against the
exact NumPy tower. `tests/gpu/test_vision_cuda.py` runs the same comparisons with the real
kernels."""

from __future__ import annotations

import numpy as np
import pytest

from cute_kernels import vision_attention, vision_bias, vision_norm, vision_pos, vision_rope
from runtime.cuda.errors import KernelMissing
from runtime.model.gpu.vision import GpuVisionTower
from runtime.model.gpu.vision_plan import plan_items
from runtime.model.gpu.vision_synthetic import QWEN35_27B_VISION, synthetic_weights
from runtime.model.vision_reference import (VisionConfig, VisionTower, gelu_exact, gelu_tanh, layer_norm,
                                            resampled_positions, window_order_rows_cols)
from tools.make_tiny import TINY_VISION

from vision_emulator import EmulatedLibrary

IDS = {"image_token_id": 9, "video_token_id": 10, "vision_start_token_id": 7, "vision_end_token_id": 8}
TINY = VisionConfig.from_dict(dict(TINY_VISION, **IDS))


def merged_error(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(RMS error / RMS of want, max error / max |want|)."""
    diff = got.astype(np.float64) - want
    return (float(np.sqrt(np.mean(diff ** 2) / np.mean(want ** 2))),
            float(np.abs(diff).max() / np.abs(want).max()))


def test_plan_groups_positions_and_rotary():
    weights = synthetic_weights(TINY, seed=3)
    table = weights["pos_embed.weight"]
    plan = plan_items(TINY, [(2, 4, 6), (1, 8, 8)])
    assert plan.cu.tolist() == [0, 24, 48, 112] and plan.groups == 3 and plan.longest == 64
    assert plan.merged == ((0, 12), (12, 28)) and plan.rows == 112
    # The corners and weights blend the table into the NumPy tower's resampled rows.
    rows, cols = window_order_rows_cols(8, 8, 2)
    blended = vision_pos.reference(table, plan.pos_idx[48:], plan.pos_wts[48:], exact=True)
    np.testing.assert_allclose(blended, resampled_positions(table.astype(np.float64), rows, cols, 8, 8),
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(plan.pos_wts.sum(axis=1), 1.0, rtol=1e-6)
    assert plan.pos_idx.min() >= 0 and plan.pos_idx.max() < TINY.num_position_embeddings
    # The first frame's rows repeat for the second frame of the video.
    np.testing.assert_array_equal(plan.pos_idx[:24], plan.pos_idx[24:48])
    cos, sin = VisionTower(TINY, weights)._rotary(rows, cols)
    half = TINY.head_dim // 2
    np.testing.assert_allclose(plan.cos[48:], cos[:, :half], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(plan.sin[48:], sin[:, :half], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(cos[:, :half], cos[:, half:])   # the pairing the kernel relies on
    with pytest.raises(ValueError, match="merge size"):
        plan_items(TINY, [(1, 5, 6)])


def test_position_corners_of_a_large_grid():
    """The 27B table (48 x 48) at a 256 x 256 grid: corners and weights against the NumPy
    resampling (what used to be a 150 MB host computation is 8 numbers a patch)."""
    config = VisionConfig.from_dict(QWEN35_27B_VISION)
    table = np.random.default_rng(0).uniform(-0.5, 0.5, (2304, 3))
    plan = plan_items(config, [(1, 256, 256)])
    rows, cols = window_order_rows_cols(256, 256, 2)
    np.testing.assert_allclose(vision_pos.reference(table, plan.pos_idx, plan.pos_wts, exact=True),
                               resampled_positions(table, rows, cols, 256, 256), rtol=1e-6, atol=1e-7)


def test_references_match_the_numpy_tower_maths():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)) * 3 + 1
    w, b = rng.uniform(0.8, 1.2, 64), rng.uniform(-0.1, 0.1, 64)
    np.testing.assert_allclose(vision_norm.reference(x, w, b, exact=True), layer_norm(x, w, b), rtol=1e-12)
    y = rng.standard_normal((3, 16)) * 3
    zero = np.zeros(16)
    np.testing.assert_allclose(vision_bias.reference(y, zero, mode="gelu_tanh", exact=True), gelu_tanh(y),
                               rtol=1e-12)
    np.testing.assert_allclose(vision_bias.reference(y, zero, mode="gelu_erf", exact=True), gelu_exact(y),
                               rtol=1e-12)
    np.testing.assert_allclose(vision_bias.reference(y, zero + 1, mode="residual", res=y, exact=True),
                               2 * y + 1, rtol=1e-12)
    # Rotary: the kernel's pairs (i, i + D/2) with the half table equal the tower's rotate-half.
    heads, d, m = 2, 32, 6
    qkv = rng.standard_normal((m, 3 * heads * d))
    angles = rng.uniform(0, 6, (m, d // 2))
    got = vision_rope.reference(qkv, np.cos(angles), np.sin(angles), heads=heads, exact=True)
    full_cos, full_sin = np.cos(np.concatenate([angles] * 2, 1)), np.sin(np.concatenate([angles] * 2, 1))
    q = qkv.reshape(m, 3, heads, d)
    turned = np.concatenate([-q[..., d // 2:], q[..., :d // 2]], axis=-1)
    want = q * full_cos[:, None, None] + turned * full_sin[:, None, None]
    want[:, 2] = q[:, 2]
    np.testing.assert_allclose(got, want.reshape(m, -1), rtol=1e-12, atol=1e-12)
    # Attention: groups never see each other (a group alone gives the same rows).
    cu = np.array([0, 4, 9])
    both = vision_attention.reference(qkv[:9], cu, heads=heads, exact=True)
    alone = vision_attention.reference(qkv[4:9], np.array([0, 5]), heads=heads, exact=True)
    np.testing.assert_allclose(both[4:9], alone, rtol=1e-12)
    v = qkv[:4].reshape(4, 3, heads, d)[:, 2].reshape(4, -1)
    assert np.all(both[:4] <= v.max(0) + 1e-12) and np.all(both[:4] >= v.min(0) - 1e-12)


@pytest.fixture(scope="module")
def tiny_tower():
    from runtime.cuda.null import NullDevice

    weights = synthetic_weights(TINY, seed=5)
    device = NullDevice(total_memory=1 << 30)
    library = EmulatedLibrary(device)
    tower = GpuVisionTower(TINY, weights, device=device, library=library, max_patches=512)
    yield tower, VisionTower(TINY, weights, dtype=np.float64), library
    tower.close()


@pytest.mark.parametrize("grid", [(1, 8, 12), (2, 4, 6), (1, 2, 2)])
def test_emulated_tower_matches_numpy_tower(tiny_tower, grid):
    tower, reference, library = tiny_tower
    t, h, w = grid
    patches = np.random.default_rng(sum(grid)).standard_normal((t * h * w, TINY.patch_dim)).astype(np.float32)
    library.launched.clear()
    got = tower.encode(patches, grid)
    want = reference.encode(patches, grid)
    assert got.shape == want.shape == (t * h * w // 4, TINY.out_hidden_size)
    rms, worst = merged_error(got, want)
    # bf16 storage between every launch (relative rounding 2^-9) over two blocks: about 1% at most.
    assert rms < 2e-2 and worst < 5e-2, (rms, worst)
    assert len(library.launched) == 3 + 12 * TINY.depth + 5
    assert library.launched[:2] == [("vision_pos", "w64_p64"), ("gemm_sm90", "tiny_vit_patch_n64_k1536")]
    assert [f for f, _ in library.launched].count("vision_attention") == TINY.depth


def test_emulated_batch_keeps_items_apart(tiny_tower):
    tower, reference, _ = tiny_tower
    rng = np.random.default_rng(11)
    grids = [(1, 4, 8), (2, 4, 4), (1, 6, 6)]
    patches = [rng.standard_normal((t * h * w, TINY.patch_dim)).astype(np.float32) for t, h, w in grids]
    together = tower.encode_many(patches, grids)
    for item, grid in zip(together, grids):
        np.testing.assert_array_equal(item, tower.encode(patches[grids.index(grid)], grid))
    with pytest.raises(ValueError, match="max_patches"):
        tower.encode(rng.standard_normal((576, TINY.patch_dim)), (1, 24, 24))
    with pytest.raises(ValueError, match="do not fit"):
        tower.encode(patches[0][:-1], grids[0])


def test_missing_shape_names_the_family():
    from runtime.cuda.null import NullDevice

    config = VisionConfig.from_dict(dict(QWEN35_27B_VISION, hidden_size=128, num_heads=2))
    device = NullDevice(total_memory=1 << 30)
    with pytest.raises(KernelMissing, match="vision_norm"):
        GpuVisionTower(config, {}, device=device, library=EmulatedLibrary(device), max_patches=64)


def test_27b_shape_is_compiled():
    """Every kernel the 27B tower needs has a declared variant (the build compiles them all)."""
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.vision import VisionKernels

    config = VisionConfig.from_dict(QWEN35_27B_VISION)
    assert config.head_dim == 72 and config.patch_dim == 1536
    kernels = VisionKernels(EmulatedLibrary(NullDevice()), config)
    assert kernels.attention == "h16_d72" and kernels.norm == "layer_norm_w1152"
    assert sorted(kernels.gemm) == [(1152, 1152), (1152, 1536), (1152, 4304), (3456, 1152), (4304, 1152),
                                    (4608, 4608), (5120, 4608)]
