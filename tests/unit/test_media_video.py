"""Video input: the frame rule, the budget and its cap, odd-count padding, the patch layout,
the prompt's frame-group blocks, and every bad-video case naming its part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from runtime.media.image import ImageRules
from runtime.media.placement import MediaRules, expand_pads, resolve_media, video_replacements
from runtime.media.sources import MediaError, SourceLimits
from runtime.media.video import (DecodedVideo, VideoRules, decode_video, group_timestamps,
                                 prepare_video, sample_indices, smart_resize_video)

SMALL = VideoRules(min_pixels=4 * 32 * 32 * 2, max_pixels=64 * 32 * 32 * 2)
RULES = MediaRules(ImageRules(min_pixels=4 * 32 * 32, max_pixels=16 * 32 * 32), SMALL)


def video_bytes(frames: np.ndarray, fps: int = 8, codec: str = "mpeg4",
                container: str = "mp4") -> bytes:
    """Frames uint8 [n, H, W, 3] encoded with `av` (lossless with codec "ffv1", "matroska")."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        out.start_encoding()
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def moving_square(count: int, height: int = 48, width: int = 64) -> np.ndarray:
    frames = np.zeros((count, height, width, 3), np.uint8)
    for t in range(count):
        frames[t, 8:24, 2 * t:2 * t + 16] = (250, 40, 40)
    return frames


def data_uri(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def test_the_frame_rule():
    rules = VideoRules()                                      # 2 fps, 4..768 frames
    # 2.5 s at 8 fps: 5 frames, evenly spaced, rounded half to even (4.75 * 3 = 14.25 -> 14).
    assert sample_indices(20, 8.0, rules).tolist() == [0, 5, 10, 14, 19]
    # 1 s at 30 fps is 2 frames by fps, raised to min_frames 4.
    assert sample_indices(30, 30.0, rules).tolist() == [0, 10, 19, 29]
    # Fewer frames than min_frames: all of them.
    assert sample_indices(3, 30.0, rules).tolist() == [0, 1, 2]
    # 10 minutes at 25 fps: 1200 frames by fps, capped at max_frames 768.
    assert len(sample_indices(15000, 25.0, rules)) == 768


def test_group_timestamps_average_each_pair_and_pad_an_odd_count():
    assert group_timestamps((0, 5, 10), 8.0, 2) == (0.3125, 1.25)
    assert group_timestamps((0, 4, 8, 12), 4.0, 2) == (0.5, 2.5)


def test_the_budget_counts_every_frame():
    # 8 frames of 480 x 640 over 8 * 64 * 32 * 32 pixels: beta = sqrt(8 * 480 * 640 / budget)
    # = 2.165, so floor(480 / beta / 32) = 6 by floor(640 / beta / 32) = 9 windows of 32 px.
    assert smart_resize_video(8, 480, 640, VideoRules(max_pixels=8 * 64 * 32 * 32)) == (192, 288)
    # The same frame alone (padded to a pair) keeps its size, a multiple of 32.
    assert smart_resize_video(1, 480, 640, VideoRules()) == (480, 640)
    # A clip smaller than one 32 px window is first scaled up to it.
    assert smart_resize_video(4, 10, 20, VideoRules(min_pixels=1)) == (32, 64)


@pytest.mark.parametrize("cap", [4, 16, 40])
def test_vision_max_merged_caps_a_video(cap):
    """A 20 s clip of 240 x 320 frames would cost hundreds of merged tokens; capped, the whole
    video (all frame groups) fits `cap`."""
    rules = VideoRules().capped(cap)
    indices = sample_indices(20 * 30, 30.0, rules)
    frames = np.zeros((len(indices), 240, 320, 3), np.uint8)
    video = prepare_video(DecodedVideo(frames, tuple(indices.tolist()), 30.0), rules)
    gt, gh, gw = video.grid
    assert gt * (gh // 2) * (gw // 2) <= cap and gt == min(20 * 2, 2 * cap) // 2


def test_an_odd_frame_count_repeats_the_last_frame():
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255]], np.uint8)
    frames = np.broadcast_to(colours[:, None, None], (3, 64, 64, 3)).copy()
    video = prepare_video(DecodedVideo(frames, (0, 4, 8), 8.0), SMALL)
    assert video.grid == (2, 4, 4)
    cubes = video.patches.reshape(2, 16, 3, 2, 16, 16)      # group, patch, channel, time, y, x
    normalised = colours / 255.0 * 2 - 1
    for group, frames_in_group in ((0, (0, 1)), (1, (2, 2))):
        for t, frame in enumerate(frames_in_group):
            for c in range(3):
                assert np.all(cubes[group, :, c, t] == np.float32(normalised[frame, c]))


def test_decoding_any_container_samples_the_same_frames():
    frames = moving_square(20)
    lossless = decode_video(video_bytes(frames, codec="ffv1", container="matroska"), "v", SMALL)
    assert lossless.indices == (0, 5, 10, 14, 19) and lossless.fps == 8.0
    np.testing.assert_array_equal(lossless.frames, frames[[0, 5, 10, 14, 19]])
    for codec, container in (("mpeg4", "mp4"), ("libvpx", "webm")):
        lossy = decode_video(video_bytes(frames, codec=codec, container=container), "v", SMALL)
        assert lossy.indices == lossless.indices
        assert np.abs(lossy.frames.astype(int) - lossless.frames).mean() < 8


def test_resolve_and_expand_a_video_into_frame_group_blocks():
    data = video_bytes(moving_square(20))
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": data_uri(data)},
                                             {"type": "text", "text": "what moves?"}]}]
    resolved, items = resolve_media(messages, RULES, SourceLimits())
    assert resolved[0]["content"][0] == {"type": "video"}
    (video,) = items
    # 5 frames -> 3 groups; 48 x 64 px rounds to 64 x 64 (48 / 32 = 1.5 rounds half to even).
    assert video.grid == (3, 4, 4)
    (old, new), = video_replacements(items)
    assert old == "<|vision_start|><|video_pad|><|vision_end|>"
    # The template's outer markers stay around the groups (as transformers' processor does).
    assert new == "<|vision_start|>" + "".join(
        f"<{t} seconds><|vision_start|><|video_pad|><|vision_end|>"
        for t in ("0.3", "1.5", "2.4")) + "<|vision_end|>"
    # The template's rendering with one pad per group (ids: start 3, pad 9, end 4).
    ids, spans = expand_pads([1, 3, 9, 4, 7, 3, 9, 4, 7, 3, 9, 4, 2], items, image_pad=8,
                             merge=2, video_pad=9)
    assert ids == (1, 3, *[9] * 4, 4, 7, 3, *[9] * 4, 4, 7, 3, *[9] * 4, 4, 2)  # 2 x 2 merged
    assert [s.offset for s in spans] == [2, 9, 16] and {s.grid for s in spans} == {(1, 4, 4)}
    assert [s.digest for s in spans] == [f"{video.digest}:{g}" for g in range(3)]
    with pytest.raises(MediaError, match="placed 2 video frame group"):
        expand_pads([3, 9, 4, 3, 9, 4], items, image_pad=8, merge=2, video_pad=9)


def bad(data: bytes, rules: MediaRules = RULES, limits: SourceLimits = SourceLimits(),
        source: str | None = None) -> str:
    part = {"type": "video", "video": source or data_uri(data), "where": "messages[2].content[1]"}
    with pytest.raises(MediaError) as caught:
        resolve_media([{"role": "user", "content": [part]}], rules, limits)
    assert caught.value.where == "messages[2].content[1]"
    return caught.value.reason


def test_every_bad_video_is_refused_naming_the_part(tmp_path, monkeypatch):
    from runtime.media import video as video_module

    import av

    good = video_bytes(moving_square(20))
    assert bad(b"\x00\x01garbage" * 50).startswith("not a decodable video")
    assert bad(b"just some text, not a video at all " * 8).startswith("not a decodable video")
    buffer = io.BytesIO()                                 # a WAV file: audio, no video
    with av.open(buffer, "w", format="wav") as out:
        out.add_stream("pcm_s16le", rate=8000)
        out.start_encoding()
    assert bad(buffer.getvalue()) == "the file holds no video frames (no video stream)"
    assert bad(video_bytes(moving_square(0))) == "the file holds no video frames (no video stream)"
    assert bad(good, limits=SourceLimits(max_bytes=1000)) == \
        "media is larger than the 1000 byte limit"
    short = MediaRules(RULES.image, VideoRules(max_seconds=2.0))
    assert bad(good, rules=short) == "the video lasts 2.5 s, over the 2 s limit"
    monkeypatch.setattr(video_module, "MAX_SAMPLED_BYTES", 4 * 48 * 64 * 3)    # 4 frames' worth
    assert bad(good) == "the 5 sampled frames need 0.0 GiB decoded, over the 0 GiB limit " \
                        "(send a shorter or smaller video)"
    monkeypatch.undo()
    assert bad(b"", source="https://example.invalid/clip.mp4").startswith(
        "remote media URLs are off; start with --allow-remote-media")
    # An MP4 with its index first states 20 frames; cut, the later sampled frames are missing.
    with av.open(str(tmp_path / "c.mp4"), "w", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for frame in moving_square(20):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    whole = (tmp_path / "c.mp4").read_bytes()
    assert bad(whole[:len(whole) * 5 // 6]) == \
        "only 3 of the 5 sampled frames could be decoded (truncated or corrupt video)"


def test_a_video_in_a_tool_result_without_vision_becomes_a_note():
    messages = [{"role": "tool", "content": [{"type": "video", "video": "clip.mp4"}]}]
    resolved, items = resolve_media(messages, None, SourceLimits())
    assert resolved[0]["content"] == [{"type": "text", "text": "[video omitted: vision is off]"}]
    assert items == []
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[0\]: video input needs "
                                         r"vision: start with --vision"):
        resolve_media([dict(messages[0], role="user")], None, SourceLimits())


def test_the_converter_keeps_the_video_processor_and_vision_max_merged_caps_it(tmp_path):
    from runtime.artifact import open_artifact
    from runtime.config import parse_settings
    from runtime.engine.speculative import SpeculativeConfig
    from runtime.session.engine_settings import vision_settings
    from tools.make_tiny import make_tiny

    path = make_tiny(tmp_path / "v.infernix", vision=True)
    with open_artifact(path) as artifact:
        assert artifact.component("vision").config["video_processor"] == {
            "min_pixels": 8 * 32 * 32 * 2, "max_pixels": 128 * 32 * 32 * 2, "fps": 2,
            "min_frames": 4, "max_frames": 16, "mean": [0.5] * 3, "std": [0.5] * 3}
        for flags, max_frames, max_pixels in (((), 16, 128 * 2048),
                                              (("--vision-max-merged", "64"), 16, 64 * 2048)):
            settings = parse_settings("serve", [str(path), "--device", "cpu", "--vision", *flags])
            tower, rules = vision_settings(settings, "cpu", artifact, SpeculativeConfig())
            assert tower.video_token_id == artifact.component("text").config["video_token_id"]
            assert (rules.video.fps, rules.video.min_frames, rules.video.max_frames,
                    rules.video.max_pixels) == (2.0, 4, max_frames, max_pixels)
