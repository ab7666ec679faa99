"""Images through the server's three APIs with the official SDKs, on a tiny vision+text model
(CPU): the prompt counts the image's merged tokens, the greedy answer is the one `infernix
--messages` gives for the same image and text, images in tool results are passed (vision on)
or become the short note (vision off), and every bad image is a 400 naming its part in the
API's own error shape."""

from __future__ import annotations

import base64
import http.server
import json
import struct
import threading
import zlib

import httpx
import numpy as np
import pytest

from tests.e2e.model_serving import cpu_settings, serve_model, stop_model
from tests.e2e.test_cli import run_cli, token_ids
from tests.unit.test_media import png_bytes

QUESTION = "What is it?"
# 270 x 330 px: each side rounded to the nearest multiple of 32 (patch 16 x merge 2) is
# 256 x 320, inside the tiny model's budget of 64..1024 merged tokens, so no rescaling:
# (256 / 32) x (320 / 32) = 8 x 10 merged tokens, plus <|vision_start|> and <|vision_end|>.
HEIGHT, WIDTH = 270, 330
MERGED = round(HEIGHT / 32) * round(WIDTH / 32)
IMAGE_TOKENS = MERGED + 2
MAX_NEW = 6
PNG = png_bytes(np.random.default_rng(11).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))
B64 = base64.b64encode(PNG).decode()
URI = "data:image/png;base64," + B64


def start_server(model, *flags):
    return serve_model(cpu_settings(model, "--max-context", "1024", "--max-new", "8", *flags))


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory):
    from tools.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("vision-server") / "v.infernix", vision=True)


@pytest.fixture(scope="session")
def vision_server(vision_model):
    server = start_server(vision_model, "--vision")
    yield server
    stop_model(server)


@pytest.fixture(scope="session")
def plain_server(vision_model):
    """The same model served without --vision."""
    server = start_server(vision_model)
    yield server
    stop_model(server)


@pytest.fixture(scope="session")
def cli_answer(vision_model, tmp_path_factory):
    """(prompt tokens, answer ids, answer text) of `infernix --messages` on the image and the
    question, greedy, thinking off: what every API must reproduce."""
    messages = tmp_path_factory.mktemp("vision-cli") / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": [
        {"type": "image", "image": URI}, {"type": "text", "text": QUESTION}]}]))
    code, out, err = run_cli(vision_model, "--device", "cpu", "--vision", "--messages",
                             messages, "--max-new", MAX_NEW, "--no-thinking", "--greedy",
                             "--print-token-ids")
    assert code == 0, err
    prompt_tokens = int(err.split("prompt tokens ")[1].split()[0])
    return prompt_tokens, token_ids(err), out.removesuffix("\n")


def chat_image(uri: str = URI) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}


def anthropic_image(data: str = B64, media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": data}}


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_chat_image_counts_its_tokens_and_answers_as_the_cli(vision_server, clients,
                                                            cli_answer):
    prompt_tokens, ids, text = cli_answer
    client = clients.openai(vision_server)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [
            chat_image(), {"type": "text", "text": QUESTION}]}],
        max_tokens=MAX_NEW, temperature=0, logprobs=True, extra_body=NO_THINKING)
    text_only = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=1,
        extra_body=NO_THINKING)
    assert answer.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.choices[0].message.content == text
    # Token by token: the bytes of each answer token are those of the CLI's ids.
    tokenizer = vision_server.backend.session.tokenizer
    answered = [bytes(entry.bytes) for entry in answer.choices[0].logprobs.content]
    assert answered == [tokenizer.token_bytes[i] for i in ids[:len(answered)]]
    assert answer.usage.completion_tokens == len(ids)


def test_responses_input_image_answers_as_the_cli(vision_server, clients, cli_answer):
    prompt_tokens, ids, text = cli_answer
    response = clients.openai(vision_server).responses.create(
        model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": URI, "detail": "auto"},
            {"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=MAX_NEW, temperature=0, reasoning={"effort": "none"})
    assert response.usage.input_tokens == prompt_tokens
    assert response.output_text == text
    assert response.usage.output_tokens == len(ids)


def test_anthropic_image_block_answers_as_the_cli(vision_server, clients, cli_answer):
    prompt_tokens, ids, text = cli_answer
    client = clients.anthropic(vision_server)
    messages = [{"role": "user", "content": [anthropic_image(),
                                             {"type": "text", "text": QUESTION}]}]
    # This SDK's create() has no temperature argument; the server reads it from the body.
    message = client.messages.create(model="m", max_tokens=MAX_NEW, messages=messages,
                                     thinking={"type": "disabled"},
                                     extra_body={"temperature": 0})
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == \
        prompt_tokens
    assert "".join(block.text for block in message.content if block.type == "text") == text
    assert message.usage.output_tokens == len(ids)
    count = client.messages.count_tokens(model="m", messages=messages,
                                         thinking={"type": "disabled"})
    assert count.input_tokens == prompt_tokens


def tool_round(image_part: dict) -> list[dict]:
    return [{"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "shot",
                                                               "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": [image_part]}]


def test_tool_result_images_passed_with_vision_a_note_without(vision_server, plain_server,
                                                             clients):
    from runtime.media.placement import VISION_OFF_NOTE

    def prompt_tokens(server, content) -> int:
        return clients.openai(server).chat.completions.create(
            model="tiny", messages=tool_round(content), max_tokens=1,
            extra_body=NO_THINKING).usage.prompt_tokens

    note = {"type": "text", "text": VISION_OFF_NOTE}
    with_note = prompt_tokens(plain_server, note)
    assert prompt_tokens(plain_server, chat_image()) == with_note
    empty = prompt_tokens(vision_server, {"type": "text", "text": ""})
    assert prompt_tokens(vision_server, chat_image()) == empty + IMAGE_TOKENS


def png_of_size(width: int, height: int) -> bytes:
    """A black grayscale PNG of any size: a few hundred KB for 8193 x 8193 (zeros compress)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + \
            struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)   # 8-bit gray, no filter
    rows = zlib.compress(b"\0" * ((width + 1) * height), 1)          # a filter byte per row
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + \
        chunk(b"IEND", b"")


# (case, image source: a data URI's base64 payload or a URL, what the 400 says)
BAD_MEDIA = {
    "corrupt base64": ("@@@ not base64 @@@", "the data URI's base64 payload is invalid"),
    "not an image": (base64.b64encode(b"%PDF-1.4 not an image at all" * 4).decode(),
                     "not a decodable image"),
    "oversized": (None, "the image is larger than 67108864 pixels"),   # 8193 x 8193 px
    "remote URL without the flag": ("https://example.invalid/a.png",
                                    "remote media URLs are off; start with --allow-remote-media"),
    "vision off": (B64, "image input needs vision: start with --vision"),
}


def bad_request(api: str, source: str) -> tuple[str, dict, str]:
    """(path, body, the part's wire path) of a request with the image as its second part."""
    remote = source.startswith("https://")
    uri = source if remote else "data:image/png;base64," + source
    text = {"type": "text", "text": QUESTION}
    if api == "chat":
        return "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": [text, chat_image(uri)]}]}, "messages[0].content[1]"
    if api == "responses":
        return "/v1/responses", {"model": "tiny", "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                         {"type": "input_image", "image_url": uri}]}]}, \
            "input[0].content[1]"
    image = {"type": "image", "source": {"type": "url", "url": uri}} if remote else \
        anthropic_image(source)
    return "/v1/messages", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [text, image]}]}, "messages[0].content[1]"


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("case", list(BAD_MEDIA))
def test_bad_media_is_a_400_naming_the_part(case, api, vision_server, plain_server):
    source, reason = BAD_MEDIA[case]
    if source is None:
        source = base64.b64encode(png_of_size(8193, 8193)).decode()
    server = plain_server if case == "vision off" else vision_server
    path, body, where = bad_request(api, source)
    response = httpx.post(server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(f"{where}: {reason}"), error["message"]
    if api == "messages":
        assert error["type"] == "invalid_request_error"
    else:
        assert (error["param"], error["type"]) == (where, "invalid_request_error")


def test_bad_media_in_a_stream_is_a_400_before_it_starts(vision_server):
    path, body, where = bad_request("chat", "@@@")
    response = httpx.post(vision_server.base_url + path, json=dict(body, stream=True),
                          timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == where


def test_responses_file_id_is_refused_naming_it(vision_server):
    response = httpx.post(vision_server.base_url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file_123"}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input[0].content[0].file_id"


def test_remote_image_with_allow_remote_media(vision_model, clients, cli_answer):
    """With the flag, an http:// image (served here on 127.0.0.1) is fetched and counted."""
    class OnePng(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args):   # keep the test output quiet
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OnePng)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    server = start_server(vision_model, "--vision", "--allow-remote-media")
    try:
        url = f"http://127.0.0.1:{images.server_address[1]}/a.png"
        answer = clients.openai(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [
                chat_image(url), {"type": "text", "text": QUESTION}]}],
            max_tokens=MAX_NEW, temperature=0, extra_body=NO_THINKING)
    finally:
        stop_model(server)
        images.shutdown()
        images.server_close()
    prompt_tokens, _, text = cli_answer
    assert answer.usage.prompt_tokens == prompt_tokens
    assert answer.choices[0].message.content == text


# --- video: Chat `video_url` parts; the Responses and Anthropic APIs have no video part -------

def clip_uri() -> str:
    from tests.unit.test_media_video import moving_square, video_bytes

    return "data:video/mp4;base64," + base64.b64encode(video_bytes(moving_square(20))).decode()


def test_chat_video_answers_as_the_cli(vision_model, vision_server, clients, tmp_path):
    uri = clip_uri()
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": [
        {"type": "video", "video": uri}, {"type": "text", "text": QUESTION}]}]))
    code, out, err = run_cli(vision_model, "--device", "cpu", "--vision", "--messages",
                             messages, "--max-new", MAX_NEW, "--no-thinking", "--greedy",
                             "--print-token-ids")
    assert code == 0, err
    answer = clients.openai(vision_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": uri}},
            {"type": "text", "text": QUESTION}]}],
        max_tokens=MAX_NEW, temperature=0, extra_body=NO_THINKING)
    assert answer.usage.prompt_tokens == int(err.split("prompt tokens ")[1].split()[0])
    assert answer.choices[0].message.content == out.removesuffix("\n")


@pytest.mark.parametrize("api, part, where, name", [
    ("responses", {"type": "input_video", "video_url": "data:video/mp4;base64,AAAA"},
     "input[0].content[1].type", "Responses"),
    ("messages", {"type": "video", "source": {"type": "base64", "media_type": "video/mp4",
                                              "data": "AAAA"}},
     "messages[0].content[1].type", "Anthropic Messages")])
def test_video_outside_chat_is_a_400_pointing_to_chat(vision_server, api, part, where, name):
    if api == "responses":
        path, body = "/v1/responses", {"model": "tiny", "max_output_tokens": 2, "input": [
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}, part]}]}
    else:
        path, body = "/v1/messages", {"model": "m", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": QUESTION}, part]}]}
    response = httpx.post(vision_server.base_url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == (
        f"{where}: video input is not part of the {name} API; send it to /v1/chat/completions "
        "as a video_url part")


@pytest.mark.parametrize("case, source, reason", [
    ("corrupt", "data:video/mp4;base64," + base64.b64encode(b"\0\0\0\x18ftypmp42" * 9).decode(),
     "not a decodable video"),
    ("a path on the server", "/etc/hostname", "a video source must be a base64 data URI"),
    ("remote without the flag", "https://example.invalid/a.mp4",
     "remote media URLs are off; start with --allow-remote-media"),
    ("vision off", None, "video input needs vision: start with --vision")])
def test_bad_chat_video_is_a_400_naming_the_part(case, source, reason, vision_server,
                                                 plain_server):
    server = plain_server if source is None else vision_server
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "video_url", "video_url": {"url": source or clip_uri()}}]}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(f"messages[0].content[1]: {reason}"), error["message"]
    assert error["param"] == "messages[0].content[1]"
