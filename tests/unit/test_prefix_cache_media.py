"""The prefix cache with images (NumPy runner, tiny vision model): an image's pad tokens are
hashed by the image's content (`kv_blocks.media_key_ids`), so a follow-up with the same picture
resumes past it, and the same token ids with another picture never reuse anything past the
block where the picture starts; outputs equal the cache-off run either way."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.engine.kv_blocks import media_key_ids
from runtime.engine.sequence_cache import media_cache_keys

GREEDY = SamplingParams(greedy=True)
CACHE = dict(prefix_cache=True, snapshot_slots=4, host_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from runtime.artifact import open_artifact
    from runtime.media.image import ImageRules
    from runtime.model.vision_reference import VisionConfig
    from tools.make_tiny import make_tiny

    artifact = open_artifact(make_tiny(tmp_path_factory.mktemp("vision") / "v.infernix", vision=True))
    tower = VisionConfig.from_dict(artifact.component("vision").config)
    rules = ImageRules(patch_size=tower.patch_size, temporal_patch_size=tower.temporal_patch_size,
                       merge_size=tower.spatial_merge_size, min_pixels=16, max_pixels=64 * 64)
    yield artifact, rules, tower.spatial_merge_size
    artifact.close()


def prompt_with(model, seed: int, tail: int):
    """70 text tokens, one 64 x 64 picture (seeded pixels), `tail` more text tokens."""
    from runtime.media.image import prepare_image
    from runtime.media.placement import expand_pads

    artifact, rules, merge = model
    config = artifact.component("text").config
    rng = np.random.default_rng(3)
    text = [int(t) for t in rng.integers(0, 400, 70 + tail)]
    image = prepare_image(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8), rules)
    ids = text[:70] + [config["vision_start_token_id"], config["image_token_id"],
                       config["vision_start_token_id"] + 1] + text[70:]
    return expand_pads(ids, [image], config["image_token_id"], merge)


def run(artifact, prompts, **cache):
    from runtime.model.numpy_runner import NumpyRunner

    runner = NumpyRunner.from_artifact(artifact, num_pages=32, num_slots=6, vision=True)
    config = EngineConfig(num_lanes=1, max_context=1024, prefill_chunk=128, snapshot_interval=64, **cache)
    out = []
    with Engine(runner, config) as engine:
        for n, (ids, media) in enumerate(prompts):
            outputs = list(engine.submit(EngineRequest(f"r{n}", ids, GREEDY, 8, media=media)))
            out.append(([t for o in outputs for t in o.token_ids], outputs[-1].cached_prompt_tokens))
    return out


def test_the_same_picture_resumes_past_it(model):
    first, follow = prompt_with(model, 1, 100), prompt_with(model, 1, 180)
    assert follow[0][:len(first[0])] == first[0]
    (_, _), (ids, cached) = run(model[0], [first, follow], **CACHE)
    (_, _), (cold, _) = run(model[0], [first, follow])
    assert ids == cold
    # The first prompt's snapshots at 64, 128, ... up to its length; the picture ends before 128.
    end = follow[1][0].offset + media_cache_keys(follow[0], follow[1])[0][1]
    assert end < 128 and cached == len(first[0]) // 64 * 64


def test_another_picture_reuses_nothing_past_the_block_it_starts_in(model):
    first, other = prompt_with(model, 1, 180), prompt_with(model, 2, 180)
    assert first[0] == other[0] and first[1][0].digest != other[1][0].digest   # same ids
    (_, _), (ids, cached) = run(model[0], [first, other], **CACHE)
    (_, _), (cold, _) = run(model[0], [first, other])
    assert ids == cold
    assert cached == first[1][0].offset // 64 * 64 == 64


def test_the_key_ids_of_a_picture():
    digest = "00000001" "7fffffff" "ffffffff" "00000000" + "ab" * 16
    assert media_key_ids(digest) == (-2, -(1 << 31), -(1 << 31), -1)
    span = type("Span", (), {"offset": 2, "digest": digest})()
    assert media_cache_keys([5, 6, 9, 9, 9, 7], [span]) == ((2, 3, media_key_ids(digest)),)
    with pytest.raises(ValueError, match="the image at position 2 has no content digest"):
        media_cache_keys([5, 6, 9], [type("Span", (), {"offset": 2, "digest": ""})()])


def prompt_with_video(model, seed: int, tail: int):
    """70 text tokens, a 2.5 s clip (5 seeded 64 x 64 frames: 3 frame groups, each a block of
    2 text ids for its timestamp, <|vision_start|>, 4 pads, <|vision_end|>), `tail` more."""
    from runtime.media.placement import expand_pads
    from runtime.media.video import DecodedVideo, VideoRules, prepare_video

    artifact, rules, merge = model
    config = artifact.component("text").config
    rng = np.random.default_rng(3)
    text = [int(t) for t in rng.integers(0, 400, 70 + tail)]
    frames = np.random.default_rng(seed).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    video = prepare_video(DecodedVideo(frames, (0, 5, 10, 14, 19), 8.0),
                          VideoRules(min_pixels=16, max_pixels=6 * 64 * 64))
    start, pad = config["vision_start_token_id"], config["video_token_id"]
    ids = text[:70] + [7, 8, start, pad, start + 1] * 3 + text[70:]
    return expand_pads(ids, [video], config["image_token_id"], merge, pad)


def test_the_same_video_resumes_past_it_and_another_reuses_nothing_past_its_start(model):
    first, follow = prompt_with_video(model, 1, 100), prompt_with_video(model, 1, 180)
    other = prompt_with_video(model, 2, 180)
    assert len(first[1]) == 3 and follow[0][:len(first[0])] == first[0] and other[0] == follow[0]
    outputs = run(model[0], [first, follow, other], **CACHE)
    cold = run(model[0], [first, follow, other])
    assert [tokens for tokens, _ in outputs] == [tokens for tokens, _ in cold]
    # The first prompt (70 + 3 * 8 + 100 = 194 tokens) left snapshots at 64, 128 and 192: the
    # follow-up resumes at 192, past the clip; the other clip's first pads start at 73, inside
    # the second block, so only the first block (0..63) is reused.
    assert len(first[0]) == 194 and outputs[1][1] == 192 > first[1][-1].offset
    assert other[1][0].offset == 73 and outputs[2][1] == 64
