"""`infernix --messages` with image parts on a tiny vision+text model (CPU): the image changes
the answer, the same image gives the same answer, and bad media exits 2 naming the part."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from tests.e2e.test_cli import run_cli, token_ids
from tests.unit.test_media import png_bytes
from tools.make_tiny import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("vision") / "v.infernix", vision=True)


def ask(model, tmp_path, content, *flags) -> tuple[int, str, str]:
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": content}]))
    return run_cli(str(model), "--device", "cpu", "--messages", str(messages), "--max-new", "6",
                   "--no-thinking", "--seed", "3", "--temperature", "0", "--print-token-ids",
                   *flags)


def test_images_through_the_cli(model, tmp_path):
    rng = np.random.default_rng(5)
    first, second = (png_bytes(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8))
                     for _ in range(2))
    (tmp_path / "a.png").write_bytes(first)
    uri = "data:image/png;base64," + base64.b64encode(second).decode()
    by_path = ask(model, tmp_path, [{"type": "image", "image": str(tmp_path / "a.png")},
                                    {"type": "text", "text": "What is it?"}], "--vision")
    again = ask(model, tmp_path, [{"type": "image_url", "image_url": {"url": "file://" + str(tmp_path / "a.png")}},
                                  {"type": "text", "text": "What is it?"}], "--vision")
    other = ask(model, tmp_path, [{"type": "image_url", "image_url": uri},
                                  {"type": "text", "text": "What is it?"}], "--vision")
    assert by_path[0] == again[0] == other[0] == 0
    assert by_path[1] == again[1] and by_path[1] != other[1]
    # 50 x 70 px is raised to the tiny model's 64-token minimum: 224 x 320 px, 7 x 10 merged.
    text_only = ask(model, tmp_path, [{"type": "text", "text": "What is it?"}], "--vision")
    tokens = [int(re.search(r"prompt tokens (\d+)", run[2]).group(1)) for run in (by_path, text_only)]
    assert tokens[0] == tokens[1] + 2 + 70          # <|vision_start|>, 70 pads, <|vision_end|>


def test_bad_media_exits_2_naming_the_part(model, tmp_path):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken")
    code, _, err = ask(model, tmp_path, [{"type": "text", "text": "x"},
                                         {"type": "image", "image": str(tmp_path / "bad.png")}],
                       "--vision")
    assert code == 2 and "messages[0].content[1]: not a decodable image" in err
    code, _, err = ask(model, tmp_path, [{"type": "image", "image": str(tmp_path / "bad.png")}])
    assert code == 2 and "image input needs vision: start with --vision" in err
    code, _, err = ask(model, tmp_path, [{"type": "image", "image": "https://example.invalid/a.png"}],
                       "--vision")
    assert code == 2 and "remote media URLs are off" in err


def timestamp_tokens(model, stamps: tuple[str, ...]) -> int:
    """Tokens of the frame groups' `<t seconds>` texts."""
    from runtime.artifact import open_artifact
    from runtime.text.tokenizer import Tokenizer

    with open_artifact(model) as artifact:
        tokenizer = Tokenizer.from_artifact_resources(artifact.component("text").resources)
    return sum(len(tokenizer.encode(f"<{t} seconds>")) for t in stamps)


def test_video_through_the_cli(model, tmp_path):
    from tests.unit.test_media_video import moving_square, video_bytes

    clip = video_bytes(moving_square(20))
    (tmp_path / "clip.mp4").write_bytes(clip)
    uri = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    question = {"type": "text", "text": "What moves?"}
    by_path = ask(model, tmp_path, [{"type": "video", "video": str(tmp_path / "clip.mp4")},
                                    question], "--vision")
    by_uri = ask(model, tmp_path, [{"type": "video_url", "video_url": {"url": uri}}, question],
                 "--vision")
    text_only = ask(model, tmp_path, [question], "--vision")
    assert by_path[0] == by_uri[0] == 0, by_path[2]
    # The tiny random model's answer barely depends on which pixels it sees (the golden tests
    # check the tower); it does on whether a video is there.
    assert token_ids(by_path[2]) == token_ids(by_uri[2]) != token_ids(text_only[2])
    # 2.5 s at 2 fps: frames 0, 5, 10, 14, 19 of 48 x 64 px -> 3 groups of 64 x 64 px (inside
    # the tiny model's video budget), at (0 + 5) / 2 / 8 = 0.3 s, 1.5 s and 19 / 8 = 2.4 s: each
    # is <t seconds>, <|vision_start|>, 2 x 2 pads, <|vision_end|>, all inside the template's
    # <|vision_start|> ... <|vision_end|>.
    tokens = [int(re.search(r"prompt tokens (\d+)", run[2]).group(1))
              for run in (by_path, text_only)]
    stamps = timestamp_tokens(model, ("0.3", "1.5", "2.4"))
    assert tokens[0] == tokens[1] + 2 + stamps + 3 * (2 + 4)


def test_vision_max_merged_caps_a_video(model, tmp_path):
    """5 s at 8 fps of 128 x 160 px: 10 frames, 5 groups of 4 x 5 merged tokens (100, inside
    the tiny model's budget of 128). Capped at 64, the clip's 10 * H * W pixels must fit
    64 * 2 * 32 * 32: beta = 1.25, frames of 96 x 128 px, 5 groups of 3 x 4 = 60 tokens."""
    from tests.unit.test_media_video import moving_square, video_bytes

    (tmp_path / "long.mp4").write_bytes(video_bytes(moving_square(40, 128, 160)))
    content = [{"type": "video", "video": str(tmp_path / "long.mp4")}]
    runs = [ask(model, tmp_path, content, "--vision", *cap)
            for cap in ((), ("--vision-max-merged", "64"))]
    assert runs[0][0] == runs[1][0] == 0, runs[1][2]
    full, capped = (int(re.search(r"prompt tokens (\d+)", run[2]).group(1)) for run in runs)
    assert full - capped == 5 * (20 - 12)


def test_bad_video_exits_2_naming_the_part(model, tmp_path):
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 broken" * 4)
    video = {"type": "video", "video": str(tmp_path / "bad.mp4")}
    code, _, err = ask(model, tmp_path, [{"type": "text", "text": "x"}, video], "--vision")
    assert code == 2 and "messages[0].content[1]: not a decodable video" in err
    code, _, err = ask(model, tmp_path, [video])
    assert code == 2 and "video input needs vision: start with --vision" in err
    code, _, err = ask(model, tmp_path, [{"type": "video_url",
                                          "video_url": "https://example.invalid/a.mp4"}],
                       "--vision")
    assert code == 2 and "remote media URLs are off" in err
