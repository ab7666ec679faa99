"""Video on the NumPy vision path against transformers' Qwen3.5 (golden data,
tools/make_golden_video.py; the model is the one of test_vision_golden).

Our decoding, frame sampling, timestamps, resize and patch layout are compared with the
processor's outputs; the tower on the processor's patches, the MRoPE positions of the frame
groups, the full-prompt logits and one cached decode step with the model's, within the
tolerance of test_model_golden.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.media.placement import expand_pads
from runtime.media.video import PreparedVideo, VideoRules, decode_video, prepare_video
from runtime.model import mrope
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.runner import DecodeItem, MediaSpan, PrefillChunk
from tests.unit.test_model_golden import TOLERANCE, relative_error
from tests.unit.test_vision_golden import GOLDEN as VISION_GOLDEN
from tests.unit.test_vision_golden import artifact  # noqa: F401 (the shared model fixture)

GOLDEN = VISION_GOLDEN.parent / "video"
RULES = VideoRules(min_pixels=4 * 32 * 32 * 2, max_pixels=16 * 32 * 32 * 2)  # as the generator's
VIDEO_PAD = 506


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN / "golden.npz") as data:
        return dict(data)


def spans(golden) -> tuple[MediaSpan, ...]:
    """One one-frame block per frame group, on the processor's patches."""
    grid = tuple(int(v) for v in golden["grid"])
    video = PreparedVideo(patches=golden["pixel_values"], grid=grid,
                          timestamps=tuple(golden["timestamps"]), digest="golden-video")
    ids = golden["ids"]
    starts = [i for i in np.flatnonzero(ids == VIDEO_PAD) if ids[i - 1] != VIDEO_PAD]
    out = []
    for g, start in enumerate(starts):
        patches, grid, digest = video.group(g)
        out.append(MediaSpan(offset=int(start), grid=grid, patches=patches, digest=digest))
    return tuple(out)


def test_decoding_sampling_and_preprocessing_match_the_processor(golden):
    decoded = decode_video(golden["video"].tobytes(), "video", RULES)
    assert decoded.indices == tuple(golden["indices"]) == (0, 5, 10, 14, 19)   # 2.5 s at 2 fps
    assert decoded.fps == golden["fps"]
    np.testing.assert_array_equal(decoded.frames, golden["frames"])
    video = prepare_video(decoded, RULES)
    assert video.grid == tuple(golden["grid"]) == (3, 4, 6)     # 5 frames padded to 6
    np.testing.assert_allclose(video.timestamps, golden["timestamps"], rtol=0, atol=1e-12)
    # Both resizes round to uint8 before normalising, so values agree to float32 rounding
    # (a one-level difference would be 2/255 ~ 8e-3).
    np.testing.assert_allclose(video.patches, golden["pixel_values"], rtol=0, atol=1e-6)
    assert video.prompt_text().startswith("<|vision_start|><0.3 seconds><|vision_start|>"
                                          "<|video_pad|><|vision_end|><1.5 seconds>")


def test_expand_pads_gives_the_golden_layout(golden):
    """The rendered prompt's one pad per group widened to 6: the oracle's ids and offsets."""
    ids = golden["ids"].tolist()
    video = prepare_video(decode_video(golden["video"].tobytes(), "video", RULES), RULES)
    single = [t for i, t in enumerate(ids) if t != VIDEO_PAD or ids[i - 1] != VIDEO_PAD]
    expanded, placed = expand_pads(single, [video], image_pad=505, merge=2, video_pad=VIDEO_PAD)
    assert list(expanded) == ids
    assert [s.offset for s in placed] == [s.offset for s in spans(golden)]
    assert all(s.grid == (1, 4, 6) for s in placed)
    assert len({s.digest for s in placed}) == 3


def test_mrope_positions_match_transformers(golden):
    ids = golden["ids"]
    ours = mrope.mrope_positions(np.arange(len(ids)), spans(golden), merge=2)
    np.testing.assert_array_equal(ours, golden["positions"])
    # Each group of 2 x 3 merged tokens advances the positions by its extent 3, not 6.
    assert ours[0, -1] - (len(ids) - 1) == 3 * (3 - 6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tower_logits_and_decode_match_transformers(golden, artifact, dtype):  # noqa: F811
    runner = NumpyRunner.from_artifact(artifact, num_pages=2, num_slots=2, dtype=dtype,
                                       vision=True)
    media = spans(golden)
    whole = runner.vision.tower.encode(golden["pixel_values"], tuple(golden["grid"]))
    assert relative_error(whole, golden["video_embeds"]) <= TOLERANCE
    # Group by group (what placement feeds the tower) equals the whole clip: attention never
    # crosses a frame group.
    groups = np.concatenate([runner.vision.tower.encode(s.patches, s.grid) for s in media])
    assert relative_error(groups, golden["video_embeds"]) <= TOLERANCE
    ids = golden["ids"].tolist()
    logits = runner.prefill(PrefillChunk(0, ids, 0, [0], all_logits=True, media=media))
    assert relative_error(logits, golden["logits"]) <= TOLERANCE
    runner.reset_slot(1)
    # The prefix in two chunks (the first ends inside the second frame group), then a decode.
    cut = media[1].offset + 2
    runner.prefill(PrefillChunk(1, ids[:cut], 0, [1], media=media))
    runner.prefill(PrefillChunk(1, ids[cut:-1], cut, [1], media=media))
    decode = runner.decode([DecodeItem(1, ids[-1], len(ids) - 1, [1], media=media)])[0]
    assert relative_error(decode, golden["decode_logits"]) <= TOLERANCE


def test_golden_catches_swapped_frame_groups(golden, artifact):  # noqa: F811
    """The groups' embeddings in the wrong order move the logits far beyond the tolerance: the
    comparison above does test which frame lands where."""
    media = spans(golden)
    swapped = (MediaSpan(media[0].offset, media[0].grid, media[1].patches, "a"),
               MediaSpan(media[1].offset, media[1].grid, media[0].patches, "b"), media[2])
    runner = NumpyRunner.from_artifact(artifact, num_pages=1, num_slots=1, vision=True)
    logits = runner.prefill(PrefillChunk(0, golden["ids"].tolist(), 0, [0], all_logits=True,
                                         media=swapped))
    assert relative_error(logits, golden["logits"]) > 100 * TOLERANCE
