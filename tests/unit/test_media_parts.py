"""Each API's image parts (and Chat's video parts) become `{"type": "image", "image": SOURCE,
"where": WIRE_PATH}` (`"video"` likewise) in the job's messages, in the client's order and with
the client's own path; content without media stays one string."""

from __future__ import annotations

import pytest

from protocols.anthropic_messages import parse_messages_request
from protocols.errors import ApiError
from protocols.openai_chat import parse_chat_request
from protocols.openai_responses import parse_responses_request

URI = "data:image/png;base64,iVBORw0KGgo="


def image(where: str, source: str = URI) -> dict:
    return {"type": "image", "image": source, "where": where}


def test_chat_image_url_parts_in_user_and_tool_messages():
    job, _ = parse_chat_request({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is "},
                                     {"type": "image_url", "image_url": {"url": URI,
                                                                         "detail": "low"}},
                                     {"type": "text", "text": "?"}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "image_url", "image_url": "https://example.com/a.png"}]},
        {"role": "user", "content": [{"type": "text", "text": "plain"}]}]})
    assert job.messages[0]["content"] == [{"type": "text", "text": "What is "},
                                          image("messages[0].content[1]"),
                                          {"type": "text", "text": "?"}]
    assert job.messages[2]["content"] == [image("messages[2].content[0]",
                                                "https://example.com/a.png")]
    assert job.messages[3]["content"] == "plain"


def test_responses_input_image_in_messages_and_function_outputs():
    job, _ = parse_responses_request({"input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": URI},
                                     {"type": "input_text", "text": "describe"}]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here: "},
            {"type": "input_image", "image_url": URI, "detail": "auto"}]}]})
    assert job.messages[0]["content"] == [image("input[0].content[0]"),
                                          {"type": "text", "text": "describe"}]
    assert job.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": [
        {"type": "text", "text": "here: "}, image("input[2].output[1]")]}


def test_anthropic_image_blocks_base64_url_and_in_tool_results():
    job, _ = parse_messages_request({"max_tokens": 5, "messages": [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                         "data": "/9j/4AAQ"}},
            {"type": "text", "text": "and"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0KGgo="}}]}]}]})
    assert job.messages[0]["content"] == [
        image("messages[0].content[0]", "data:image/jpeg;base64,/9j/4AAQ"),
        {"type": "text", "text": "and"},
        image("messages[0].content[2]", "https://example.com/b.png")]
    assert job.messages[2] == {"role": "tool", "tool_call_id": "t1",
                               "content": [image("messages[2].content[0].content[0]")]}


def test_anthropic_consecutive_user_turns_merge_text_and_images():
    job, _ = parse_messages_request({"max_tokens": 5, "messages": [
        {"role": "user", "content": "first"},
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]},
        {"role": "user", "content": "last"}]})
    assert list(job.messages) == [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "\n\n"},
        image("messages[1].content[0]"), {"type": "text", "text": "\n\n"},
        {"type": "text", "text": "last"}]}]


@pytest.mark.parametrize("source", ["/etc/hostname", "file:///etc/hostname", "C:/x.png",
                                    "ftp://example.com/a.png"])
def test_sources_other_than_data_uris_and_http_are_refused_naming_the_part(source):
    """The runtime reads a path from the server's disk (the CLI's case): never for a client."""
    requests = [
        (parse_chat_request, {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": source}}]}]},
         "messages[0].content[1]"),
        (parse_responses_request, {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": source}]}]}, "input[0].content[0]"),
        (parse_messages_request, {"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "image", "source": {"type": "url", "url": source}}]}]}]},
         "messages[0].content[0].content[0]")]
    for parse, body, where in requests:
        with pytest.raises(ApiError) as error:
            parse(body)
        assert (error.value.status, error.value.param) == (400, where)
        assert "must be a base64 data URI" in error.value.message


def test_chat_video_url_parts_and_no_video_in_the_other_apis():
    video = "data:video/mp4;base64,AAAAGGZ0eXA="
    job, _ = parse_chat_request({"messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": video}},
                                     {"type": "image_url", "image_url": URI},
                                     {"type": "text", "text": "same?"}]}]})
    assert job.messages[0]["content"] == [
        {"type": "video", "video": video, "where": "messages[0].content[0]"},
        image("messages[0].content[1]"), {"type": "text", "text": "same?"}]
    with pytest.raises(ApiError, match=r"a video source must be a base64 data URI"):
        parse_chat_request({"messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": "/srv/clip.mp4"}}]}]})
    with pytest.raises(ApiError, match=r"video input is not part of the Responses API; send it "
                                       r"to /v1/chat/completions as a video_url part"):
        parse_responses_request({"input": [{"role": "user", "content": [
            {"type": "input_video", "video_url": video}]}]})
    with pytest.raises(ApiError, match=r"video input is not part of the Anthropic Messages API"):
        parse_messages_request({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "video", "source": {"type": "base64", "media_type": "video/mp4",
                                         "data": "AAAA"}}]}]})
