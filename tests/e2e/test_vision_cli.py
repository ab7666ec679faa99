"""`infernix --messages` with image parts on a tiny vision+text model (CPU): the image changes
the answer, the same image gives the same answer, and bad media exits 2 naming the part."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from tests.e2e.test_cli import run_cli
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
