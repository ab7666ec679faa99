"""Media input: sources and their limits, decoding, the resize rule, patches, pad placement, and
every bad-media case naming its part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from runtime.media.image import ImageRules, decode_image, prepare_image, resize, smart_resize
from runtime.media.placement import VISION_OFF_NOTE, MediaRules, expand_pads, resolve_media
from runtime.media.sources import MediaError, SourceLimits, read_source
from runtime.media.video import VideoRules

RULES = ImageRules(min_pixels=4 * 32 * 32, max_pixels=16 * 32 * 32)


def png_bytes(pixels: np.ndarray) -> bytes:
    import av
    fmt = "rgba" if pixels.shape[2] == 4 else "rgb24"
    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = pixels.shape[1], pixels.shape[0], fmt
    frame = av.VideoFrame.from_ndarray(pixels, format=fmt)
    return b"".join(bytes(p) for p in codec.encode(frame) + codec.encode(None))


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_png_alpha_is_dropped_not_composited():
    rgba = np.random.default_rng(0).integers(0, 256, (7, 9, 4), dtype=np.uint8)
    rgba[..., 3] = 0                                 # fully transparent
    decoded = decode_image(png_bytes(rgba), "p")
    np.testing.assert_array_equal(decoded, rgba[..., :3])


def test_sources_path_data_uri_and_refusals(tmp_path):
    data = png_bytes(np.zeros((4, 4, 3), np.uint8))
    (tmp_path / "a.png").write_bytes(data)
    limits = SourceLimits(max_bytes=len(data))
    assert read_source(str(tmp_path / "a.png"), "p", limits) == data
    assert read_source(data_uri(data), "p", limits) == data
    with pytest.raises(MediaError, match=r"^m\[0\]: .*over the 10 byte limit"):
        read_source(str(tmp_path / "a.png"), "m[0]", SourceLimits(max_bytes=10))
    with pytest.raises(MediaError, match=r"^m\[1\]: remote media URLs are off; .*--allow-remote"):
        read_source("https://example.invalid/x.png", "m[1]", limits)
    with pytest.raises(MediaError, match="base64 payload is invalid"):
        read_source("data:image/png;base64,@@@", "p", limits)
    with pytest.raises(MediaError, match="does not exist"):
        read_source(str(tmp_path / "none.png"), "p", limits)
    with pytest.raises(MediaError, match="unsupported media URL scheme 'ftp'"):
        read_source("ftp://host/x.png", "p", limits)


def test_corrupt_and_unsupported_files_are_named_errors():
    with pytest.raises(MediaError, match=r"^messages\[2\]\.content\[0\]: not a decodable image"):
        decode_image(png_bytes(np.zeros((8, 8, 3), np.uint8))[:40], "messages[2].content[0]")
    with pytest.raises(MediaError, match="not a decodable image"):
        decode_image(b"%PDF-1.4 not an image at all" * 4, "p")


def test_smart_resize_rule():
    assert smart_resize(60, 90, RULES) == (64, 96)           # rounded to multiples of 32
    assert smart_resize(10, 10, RULES) == (64, 64)           # raised to the minimum
    h, w = smart_resize(1000, 2000, RULES)                   # lowered under the maximum
    assert (h, w) == (64, 160) and h * w <= RULES.max_pixels
    assert smart_resize(1000, 2000, RULES.capped(4)) == (32, 64)   # --vision-max-merged 4
    with pytest.raises(MediaError, match="aspect ratio"):
        smart_resize(1, 500, RULES)


def test_resize_keeps_constants_and_averages_when_downscaling():
    flat = np.full((50, 70, 3), 200, np.uint8)
    np.testing.assert_allclose(resize(flat, 32, 64), 200.0, atol=1e-9)
    stripes = np.zeros((4, 64, 3), np.uint8)
    stripes[:, ::2] = 255                                    # 1-pixel stripes
    halved = resize(stripes, 4, 32)
    np.testing.assert_allclose(halved[:, 2:-2], 127.5, atol=1e-6)   # antialiased, not aliased


def test_patches_layout_and_normalisation():
    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[:32, 32:, 0] = 255                                # top-right quadrant red
    image = prepare_image(pixels, RULES)
    assert image.grid == (1, 4, 4) and image.patches.shape == (16, 3 * 2 * 16 * 16)
    red = image.patches.reshape(16, 3, 2, 16, 16)[:, 0]
    # Window-major order: window (0, 1) holds patches 4..7, all of them red (+1 after norm).
    assert np.all(red[4:8] == 1.0) and np.all(red[:4] == -1.0) and np.all(red[8:] == -1.0)


def test_resolve_media_and_vision_off_rules(tmp_path):
    data = png_bytes(np.zeros((40, 40, 3), np.uint8))
    messages = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                             {"type": "image_url", "image_url": {"url": data_uri(data)}}]},
                {"role": "tool", "content": [{"type": "image", "image": data_uri(data)}]}]
    resolved, images = resolve_media(messages, MediaRules(RULES, VideoRules()), SourceLimits())
    assert [p["type"] for p in resolved[0]["content"]] == ["text", "image"] and len(images) == 2
    off, none = resolve_media(messages[1:], None, SourceLimits())
    assert off[0]["content"] == [{"type": "text", "text": VISION_OFF_NOTE}] and none == []
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[1\]: image input needs vision"):
        resolve_media(messages, None, SourceLimits())
    with pytest.raises(MediaError, match=r"^input\[3\]: video input needs vision"):
        resolve_media([{"role": "user", "content": [{"type": "video", "video": "v.mp4",
                                                      "where": "input[3]"}]}], None, SourceLimits())


def test_expand_pads_places_each_image_in_order():
    small = prepare_image(np.zeros((40, 40, 3), np.uint8), RULES)      # 64 x 64: 2 x 2 merged
    wide = prepare_image(np.zeros((40, 130, 3), np.uint8), RULES)      # 32 x 128: 1 x 4 merged
    assert (small.grid, wide.grid) == ((1, 4, 4), (1, 2, 8))
    ids, spans = expand_pads([1, 9, 2, 9, 3], [small, wide], image_pad=9, merge=2)
    assert ids == (1, 9, 9, 9, 9, 2, 9, 9, 9, 9, 3)
    assert [s.offset for s in spans] == [1, 6] and spans[1].grid == wide.grid
    with pytest.raises(MediaError, match="placed 1 image"):
        expand_pads([1, 9], [small, wide], image_pad=9, merge=2)
