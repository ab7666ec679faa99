"""The three APIs through the official SDK helpers and raw HTTP, against the real server and
API layer over the scripted fake backend (no model): Chat Completions, Responses (store,
previous_response_id) and Messages (beta, count_tokens), streaming and not, with every SSE
payload validated against the SDKs' own types; Claude Code's billing header is dropped."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.fake_server_support import USER, WEATHER, WEATHER_ANTHROPIC


def test_chat_sdk_stream_and_non_stream(fake_server, clients):
    server = fake_server()
    client = clients.openai(server)
    completion = client.chat.completions.create(model="any", messages=USER)
    message = completion.choices[0].message
    assert message.content == "Hello from the fake."
    assert message.model_extra["reasoning_content"] == "Let me think."
    assert completion.usage.completion_tokens_details.reasoning_tokens == 2
    with client.chat.completions.stream(model="any", messages=USER, tools=[WEATHER],
                                        stream_options={"include_usage": True}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    call = final.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_fake0", "get_weather", {"city": "Paris"})
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens


def test_chat_raw_stream_framing(fake_server, wire):
    server = fake_server()
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={
            "model": "m", "messages": USER, "stream": True, "tools": [WEATHER],
            "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["x-request-id"].startswith("chatcmpl-")
        body = response.read()
    events = wire.events(body)
    assert events[-1] == (None, "[DONE]")
    ids = set()
    for name, data in events[:-1]:
        assert name is None
        chunk = wire.chat(json.loads(data))
        ids.add(chunk.id)
    assert len(ids) == 1


def test_responses_sdk_stream_store_and_previous_response(fake_server, clients, wire):
    server = fake_server()
    client = clients.openai(server)
    with client.responses.stream(model="m", input="hi", instructions="Be brief.",
                                 reasoning={"effort": "low", "summary": "auto"}) as stream:
        events = list(stream)
        first = stream.get_final_response()
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [item.type for item in first.output] == ["reasoning", "message"]
    assert first.output_text == "Hello from the fake."
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text
    second = client.responses.create(model="m", input="and again?",
                                     previous_response_id=first.id)
    assert second.status == "completed"
    job = server.backend.jobs[-1]
    assert [m["role"] for m in job.messages] == ["user", "assistant", "user"]
    assert job.messages[1]["reasoning_content"] == "Let me think."
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with httpx.stream("POST", server.base_url + "/v1/responses",
                      json={"model": "m", "input": "hi", "stream": True}) as response:
        body = response.read()
    numbers = []
    for name, data in wire.events(body):
        payload = json.loads(data)
        assert name == payload["type"]
        wire.responses(payload)
        numbers.append(payload["sequence_number"])
    assert numbers == list(range(len(numbers)))


def test_messages_sdk_stream_beta_and_count_tokens(fake_server, clients, wire):
    server = fake_server()
    client = clients.anthropic(server)
    with client.messages.stream(model="claude-sonnet-4-6", max_tokens=100, messages=USER,
                                tools=[WEATHER_ANTHROPIC],
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == "Calling a tool."
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    beta = client.beta.messages.create(model="m", max_tokens=50, messages=USER,
                                       betas=["interleaved-thinking-2025-05-14"])
    assert beta.content[-1].text == "Hello from the fake."
    count = client.beta.messages.count_tokens(model="m", messages=USER, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
        {"type": "text", "text": "You are helpful."}])
    assert count.input_tokens > 0
    with httpx.stream("POST", server.base_url + "/v1/messages?beta=true", json={
            "model": "m", "max_tokens": 10, "messages": USER, "stream": True}) as response:
        body = response.read()
    for name, data in wire.events(body):
        payload = json.loads(data)
        assert name == payload["type"]
        wire.anthropic(payload)


def test_billing_header_never_reaches_the_template(fake_server, clients):
    server = fake_server()
    clients.anthropic(server).messages.create(model="m", max_tokens=10, messages=USER, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=f00;"},
        {"type": "text", "text": "You are Claude Code."}])
    assert server.backend.jobs[-1].messages[0] == {"role": "system",
                                                   "content": "You are Claude Code."}
