"""`GpuVisionTower` on a real GPU against the NumPy tower (`vision_reference.VisionTower`).

Tolerance: every launch stores bf16 (relative rounding 2^-9) and Hugging Face's tower does too,
so the GPU tower is compared with the exact (float64) or float32 NumPy tower by the merged
output's RMS error over its RMS and its largest error over the largest value. The same launch
sequence with each kernel replaced by its NumPy reference (`tests/unit/vision_emulator.py`)
measures 0.9% RMS / 1.1% max after 2 blocks and 1.4% / 1.5% after the 27B tower's 27: the
bounds below are about twice those. A misplaced patch, a wrong rotary pair or attention across
frames moves the output by tens of percent.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.gpu.vision import GpuVisionTower
from runtime.model.gpu.vision_synthetic import QWEN35_27B_VISION, synthetic_weights
from runtime.model.vision_reference import VisionConfig, VisionTower

pytestmark = pytest.mark.gpu

IDS = {"image_token_id": 9, "video_token_id": 10, "vision_start_token_id": 7, "vision_end_token_id": 8}


def errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    diff = got.astype(np.float64) - want
    return (float(np.sqrt(np.mean(diff ** 2) / np.mean(want ** 2))),
            float(np.abs(diff).max() / np.abs(want).max()))


def patches_for(config: VisionConfig, grid, seed: int) -> np.ndarray:
    t, h, w = grid
    return np.random.default_rng(seed).standard_normal((t * h * w, config.patch_dim)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny(device, library):
    from tools.make_tiny import TINY_VISION

    config = VisionConfig.from_dict(dict(TINY_VISION, **IDS))
    weights = synthetic_weights(config, seed=5)
    tower = GpuVisionTower(config, weights, device=device, library=library, max_patches=4096)
    yield tower, VisionTower(config, weights, dtype=np.float64)
    tower.close()


@pytest.mark.parametrize("grid", [(1, 2, 2), (1, 8, 12), (2, 4, 6), (1, 64, 40), (8, 6, 4)])
def test_tiny_tower(tiny, grid):
    tower, reference = tiny
    patches = patches_for(tower.config, grid, sum(grid))
    got, want = tower.encode(patches, grid), reference.encode(patches, grid)
    assert got.shape == want.shape
    rms, worst = errors(got, want)
    assert rms < 2e-2 and worst < 5e-2, f"grid {grid}: RMS {rms:.3e}, max {worst:.3e}"


def test_tiny_batch_keeps_items_apart(tiny):
    """Items of one call (an image, a 2-group video, a second image) give what each gives alone:
    no attention across images or frames (row-wise kernels and per-group attention)."""
    tower, _ = tiny
    grids = [(1, 8, 8), (2, 4, 6), (1, 10, 4)]
    patches = [patches_for(tower.config, g, i) for i, g in enumerate(grids)]
    together = tower.encode_many(patches, grids)
    for i, grid in enumerate(grids):
        alone = tower.encode(patches[i], grid)
        assert np.abs(together[i] - alone).max() <= 1e-2 * np.abs(alone).max(), f"item {i} {grid}"


def test_tiny_artifact_image_matches_cpu_tower(device, library, tmp_path):
    """The tiny vision artifact's own weights and a real preprocessed image: the GPU tower against
    the CPU backend's tower (float32, as `NumpyRunner.from_artifact(vision=True)` builds it)."""
    from runtime.artifact import open_artifact
    from runtime.media.image import ImageRules, prepare_image
    from runtime.model.weights import ComponentTensors
    from tools.make_tiny import make_tiny

    artifact = open_artifact(make_tiny(tmp_path / "v.infernix", vision=True))
    try:
        component = artifact.component("vision")
        config = VisionConfig.from_dict(component.config)
        weights = {name: np.asarray(value) for name, value in ComponentTensors(component).items()}
    finally:
        artifact.close()
    rules = ImageRules(patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                       merge_size=config.spatial_merge_size, min_pixels=64 * 32 * 32, max_pixels=256 * 32 * 32)
    pixels = np.random.default_rng(0).integers(0, 256, (300, 420, 3), dtype=np.uint8)
    image = prepare_image(pixels, rules)
    tower = GpuVisionTower(config, weights, device=device, library=library, max_patches=1024)
    try:
        got = tower.encode(image.patches, image.grid)
    finally:
        tower.close()
    want = VisionTower(config, weights).encode(image.patches, image.grid)
    rms, worst = errors(got, want)
    assert rms < 2e-2 and worst < 5e-2, f"RMS {rms:.3e}, max {worst:.3e}"


@pytest.mark.parametrize("depth,grid,exact", [(2, (1, 16, 24), True), (2, (2, 8, 8), True),
                                              (2, (1, 64, 48), False), (27, (1, 16, 16), False)],
                         ids=["image", "video", "3072_patches", "full_depth"])
def test_27b_tower_shape(device, library, depth, grid, exact):
    """The 27B tower's shapes (width 1152, 16 heads of 72, MLP 4304, merger 4608 -> 5120) with
    synthetic weights; depth 2 against the float64 tower, all 27 blocks against the float32 one
    (3072 patches: attention over 24 query tiles and 96 key tiles, float32 to keep NumPy quick)."""
    config = VisionConfig.from_dict(dict(QWEN35_27B_VISION, depth=depth))
    weights = synthetic_weights(config, seed=depth)
    patches = patches_for(config, grid, 1)
    tower = GpuVisionTower(config, weights, device=device, library=library, max_patches=4096)
    try:
        got = tower.encode(patches, grid)
    finally:
        tower.close()
    want = VisionTower(config, weights, dtype=np.float64 if exact else np.float32).encode(patches, grid)
    rms, worst = errors(got, want)
    bound = (2e-2, 5e-2) if depth == 2 else (3e-2, 6e-2)
    assert rms < bound[0] and worst < bound[1], f"depth {depth} grid {grid}: RMS {rms:.3e}, max {worst:.3e}"


def _image_prompt(path, seed: int):
    """Text, a 64 x 96 picture (6 merged tokens) and text of the tiny vision model, as ids and media."""
    from runtime.artifact import open_artifact
    from runtime.media.image import ImageRules, prepare_image
    from runtime.media.placement import expand_pads

    artifact = open_artifact(path)
    config = artifact.component("text").config
    artifact.close()
    rules = ImageRules(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=64 * 96)
    image = prepare_image(np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8), rules)
    text = [int(t) for t in np.random.default_rng(3).integers(20, 400, 80)]
    ids = text[:60] + [config["vision_start_token_id"], config["image_token_id"],
                       config["vision_end_token_id"]] + text[60:]
    return expand_pads(ids, [image], config["image_token_id"], 2)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_image_request_on_cuda_matches_cpu(device, library, tmp_path):
    """The CUDA runner with the tower against the CPU backend on the tiny vision model: prompt
    logits with an image (in two prefill pieces: the image block at 60..65 and text after it)
    as close to the NumPy runner's as those of the same ids without the image (the text path's own
    bf16 error), a different picture moving the logits far more than that, and the greedy
    tokens through the engine equal (a divergence only where the reference's top two are within
    the GPU's logit error there)."""
    from runtime.engine.api import EngineRequest, SamplingParams
    from runtime.engine.engine_loop import Engine, EngineConfig
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.numpy_runner import NumpyRunner
    from runtime.model.runner import PrefillChunk
    from tools.make_tiny import make_tiny

    from .engine_runs import run_engine

    path = make_tiny(tmp_path / "v.infernix", vision=True)
    ids, media = _image_prompt(path, 1)
    _, other = _image_prompt(path, 2)
    cuda = CudaRunner.from_artifact(path, vision=True, num_pages=16, num_slots=2, device=device, library=library,
                                    prefill_chunk=64)
    ref = NumpyRunner.from_artifact(path, num_pages=16, num_slots=2, vision=True)
    try:
        def logits(runner, spans):
            runner.reset_slot(0)
            return runner.prefill(PrefillChunk(slot=0, token_ids=list(ids), start_pos=0, page_table=[0, 1],
                                               all_logits=True, media=spans))

        got, want = logits(cuda, media), logits(ref, media)
        e_image, e_text = _rel(got, want), _rel(logits(cuda, ()), logits(ref, ()))
        moved = _rel(logits(ref, other), want)
        print(f"image logits error {e_image:.3e}, text-only {e_text:.3e}, another picture moves {moved:.3e}")
        assert e_image <= 2.0 * e_text + 5e-3, (e_image, e_text)
        assert moved > 5.0 * e_image, (moved, e_image)
        greedy = SamplingParams(greedy=True)
        request = EngineRequest("image", ids, greedy, 12, media=media)
        (ours,), _ = run_engine(cuda, [request], num_lanes=1, max_context=256, prefill_chunk=64)
        with Engine(ref, EngineConfig(num_lanes=1, max_context=256, prefill_chunk=64)) as engine:
            theirs = [t for out in engine.submit(request) for t in out.token_ids]
        if ours != theirs:
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            forced = list(ids) + theirs[:first]
            chunk = PrefillChunk(slot=0, token_ids=forced, start_pos=0, page_table=[0, 1], media=media)
            cuda.reset_slot(0)
            ref.reset_slot(0)
            mine, reference = cuda.prefill(chunk)[-1], ref.prefill(chunk)[-1]
            gap = reference[theirs[first]] - reference[ours[first]]
            assert gap <= 2.0 * np.abs(mine - reference).max(), (first, ours, theirs, gap)
    finally:
        cuda.close()
