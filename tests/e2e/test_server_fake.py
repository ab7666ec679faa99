"""The real server and API layer against the official SDKs and raw HTTP, with the scripted
fake backend (no model): every protocol path, streaming and not, tool round trips,
cancellation, concurrency, queue limits, heartbeats, errors, auth, request log, fuzzing."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import socket
import threading
import time

import anthropic
import httpx
import openai
import orjson
import pytest

from protocols.app import AppConfig
from protocols.fake import Script, default_script
from runtime.text.events import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from tests.e2e.conftest import run_concurrently

USER = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER_FLAT = {"type": "function", "name": "get_weather", "description": "Weather",
                "parameters": WEATHER["function"]["parameters"]}
WEATHER_ANTHROPIC = {"name": "get_weather", "description": "Weather",
                     "input_schema": WEATHER["function"]["parameters"]}


def slow(step_s=0.05, prefill_s=0.0, n=200):
    return lambda job: Script(events=[ContentDelta(f"w{i} ") for i in range(n)], step_s=step_s,
                              prefill_s=prefill_s)


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# --- the three APIs through the SDK helpers ---------------------------------------------------

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


# --- tool-call round trips --------------------------------------------------------------------

def test_chat_tool_round_trip(fake_server, clients):
    server = fake_server()
    client = clients.openai(server)
    first = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "The tool said: sunny, 21 C"
    job = server.backend.jobs[-1]
    assert job.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert job.messages[1]["reasoning_content"] == "Let me think."  # reasoning fed back


def test_responses_tool_round_trip(fake_server, clients):
    server = fake_server()
    client = clients.openai(server)
    first = client.responses.create(model="m", input=USER, tools=[WEATHER_FLAT], store=False,
                                    include=["reasoning.encrypted_content"])
    call = next(item for item in first.output if item.type == "function_call")
    reasoning = next(item for item in first.output if item.type == "reasoning")
    assert reasoning.encrypted_content
    history = USER + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    for item in history:
        if item.get("type") == "reasoning":
            item.pop("content", None)  # stateless clients keep only the encrypted form
    second = client.responses.create(model="m", input=history, tools=[WEATHER_FLAT])
    assert second.output_text == "The tool said: rain"
    assert server.backend.jobs[-1].messages[1]["reasoning_content"] == "Let me think."


def test_messages_tool_round_trip(fake_server, clients):
    server = fake_server()
    client = clients.anthropic(server)
    first = client.messages.create(model="m", max_tokens=100, messages=USER,
                                   tools=[WEATHER_ANTHROPIC])
    tool_use = first.content[-1]
    history = USER + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                      {"role": "user", "content": [{"type": "tool_result",
                                                    "tool_use_id": tool_use.id,
                                                    "content": "snow"}]}]
    second = client.messages.create(model="m", max_tokens=100, messages=history,
                                    tools=[WEATHER_ANTHROPIC])
    assert second.content[-1].text == "The tool said: snow"
    assert server.backend.jobs[-1].messages[1]["reasoning_content"] == "Let me think."


def test_parallel_tool_calls_false_stops_after_one_call(fake_server, clients):
    def two_calls(job):
        return Script(events=[ToolCallStart(0, "c0", "get_weather"),
                              ToolCallArgsDelta(0, '{"city": "A"}'), ToolCallEnd(0),
                              ToolCallStart(1, "c1", "get_weather"),
                              ToolCallArgsDelta(1, '{"city": "B"}'), ToolCallEnd(1),
                              ContentDelta("never sent")], step_s=0.05)

    server = fake_server(two_calls)
    completion = clients.openai(server).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], parallel_tool_calls=False)
    assert len(completion.choices[0].message.tool_calls) == 1
    assert completion.choices[0].finish_reason == "tool_calls"
    assert wait_until(lambda: server.backend.cancelled)


# --- cancellation, concurrency, limits --------------------------------------------------------

@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "stream": True}),
    ("/v1/responses", {"input": "hi", "stream": True}),
    ("/v1/messages", {"messages": USER, "max_tokens": 500, "stream": True}),
])
def test_disconnect_cancels_the_generation_and_frees_the_lane(fake_server, clients, path,
                                                              body):
    server = fake_server(slow())
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", server.base_url + path, json={"model": "m", **body}) as resp:
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
    assert wait_until(lambda: server.backend.cancelled), "the generation was not cancelled"
    assert wait_until(lambda: not server.backend.active)
    server.backend.script_for = default_script  # the lane is free: the next request runs
    completion = clients.openai(server, timeout=5).chat.completions.create(model="m",
                                                                           messages=USER)
    assert completion.choices[0].message.content == "Hello from the fake."


def test_eight_concurrent_streams(fake_server, clients):
    server = fake_server(lambda job: Script(events=[ContentDelta(f"{i},") for i in range(20)],
                                            step_s=0.01), lanes=4)

    def run(number):
        client = clients.openai(server)
        with client.chat.completions.stream(model="m", messages=USER,
                                            stream_options={"include_usage": True}) as s:
            for _ in s:
                pass
            return s.get_final_completion()

    results = run_concurrently(run, 8, timeout=30)
    assert len(results) == 8
    assert all(r.choices[0].message.content == "".join(f"{i}," for i in range(20))
               for r in results)


def test_full_queue_is_503_in_each_api_shape(fake_server):
    server = fake_server(slow(step_s=0.1), config=AppConfig(max_concurrency=1,
                                                            max_pending_requests=1))
    streams = []
    client = httpx.Client(timeout=10)
    for _ in range(2):
        request = client.build_request("POST", server.base_url + "/v1/chat/completions",
                                       json={"messages": USER, "stream": True})
        streams.append(client.send(request, stream=True))
    busy = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": USER})
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "server_overloaded"
    busy = httpx.post(server.base_url + "/v1/messages", json={"messages": USER,
                                                              "max_tokens": 5})
    assert busy.status_code == 503
    assert busy.json()["type"] == "error"
    assert busy.json()["error"]["type"] == "overloaded_error"
    for stream in streams:
        stream.close()
    client.close()


def test_first_chunk_is_prompt_and_heartbeats_cover_a_slow_prefill(fake_server, wire):
    script = lambda job: Script(events=[ContentDelta("done")], prefill_s=1.2)  # noqa: E731
    server = fake_server(script, config=AppConfig(heartbeat_s=0.3))
    cases = [("/v1/chat/completions", {"messages": USER}),
             ("/v1/responses", {"input": "hi"}),
             ("/v1/messages", {"messages": USER, "max_tokens": 5})]
    for path, body in cases:
        started = time.monotonic()
        with httpx.stream("POST", server.base_url + path,
                          json={"stream": True, **body}, timeout=10) as response:
            chunks = response.iter_raw()
            next(chunks)
            assert time.monotonic() - started < 0.6, f"{path}: first byte came late"
            rest = b"".join(chunks)
        events = [json.loads(data) for _, data in wire.events(rest) if data != "[DONE]"]
        if path == "/v1/chat/completions":
            beats = [e for e in events if e["choices"] and e["choices"][0]["delta"] == {}
                     and e["choices"][0]["finish_reason"] is None]
        elif path == "/v1/responses":
            beats = [e for e in events if e["type"] == "response.in_progress"]
        else:
            beats = [e for e in events if e["type"] == "ping"]
        assert len(beats) >= 2, f"{path}: no heartbeats during the prefill"


def test_generation_errors_go_in_band_after_the_first_byte(fake_server, clients):
    script = lambda job: Script(events=[ContentDelta("partial")], finish_reason="error",  # noqa: E731
                                error="the lane failed")
    server = fake_server(script)
    with pytest.raises(openai.APIError, match="the lane failed"):
        with clients.openai(server).chat.completions.stream(model="m", messages=USER) as s:
            for _ in s:
                pass
    with pytest.raises(anthropic.APIStatusError):
        with clients.anthropic(server).messages.stream(model="m", max_tokens=5,
                                                       messages=USER) as s:
            for _ in s:
                pass
    with clients.openai(server).responses.stream(model="m", input="hi") as s:
        kinds = [event.type for event in s]
    assert kinds[-1] == "response.failed"
    response = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": USER})
    assert response.status_code == 500 and response.headers["x-should-retry"] == "false"
    assert response.json()["error"]["message"] == "the lane failed"


def test_shutdown_ends_running_streams_in_band_and_refuses_new_connections(fake_server):
    server = fake_server(slow(step_s=0.05))
    with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                      json={"messages": USER, "stream": True}, timeout=10) as response:
        lines = response.iter_lines()
        next(lines)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        rest = "\n".join(lines)
    stopper.join(10)
    assert '"error"' in rest and "shutting down" in rest
    assert "[DONE]" not in rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=2)


def test_responses_input_tokens(fake_server):
    server = fake_server()
    response = httpx.post(server.base_url + "/v1/responses/input_tokens",
                          json={"model": "m", "input": "hello there", "instructions": "x"})
    assert response.status_code == 200
    assert response.json()["object"] == "response.input_tokens"
    assert response.json()["input_tokens"] > 0


def test_context_overflow_is_a_400_with_the_code(fake_server, clients):
    server = fake_server(lambda job: Script(prompt_tokens=5000), max_context=4096)
    with pytest.raises(openai.BadRequestError) as info:
        clients.openai(server).chat.completions.create(model="m", messages=USER)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        clients.anthropic(server).messages.create(model="m", max_tokens=5, messages=USER)


# --- small endpoints, auth, logging -----------------------------------------------------------

def test_models_health_metrics(fake_server, clients):
    server = fake_server()
    models = clients.openai(server).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert clients.openai(server).models.retrieve("fake-model").id == "fake-model"
    page = clients.anthropic(server).models.list()
    assert page.data[0].id == "fake-model" and page.data[0].display_name == "fake-model"
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    clients.openai(server).chat.completions.create(model="m", messages=USER)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("infernix_requests_total{api=\"chat\",outcome=\"stop\"} 1",
                 "infernix_prompt_tokens_total", "infernix_generation_tokens_total",
                 "infernix_time_to_first_token_seconds_bucket",
                 "infernix_decode_tokens_per_second_count", "infernix_queue_depth",
                 "infernix_kv_pages_in_use"):
        assert name in text
    server.backend.unhealthy = True
    assert httpx.get(server.base_url + "/health").status_code == 503


def test_routes_methods_and_doubled_prefix(fake_server):
    server = fake_server()
    assert httpx.get(server.base_url + "/v1/v1/models").status_code == 200
    assert httpx.post(server.base_url + "/v1/v1/chat/completions",
                      json={"messages": USER}).status_code == 200
    missing = httpx.get(server.base_url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    assert httpx.get(server.base_url + "/v1/chat/completions").status_code == 405
    wrong = httpx.get(server.base_url + "/v1/messages")
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"


def test_api_key(fake_server, clients):
    server = fake_server(config=AppConfig(api_key="sekret"))
    with pytest.raises(openai.AuthenticationError):
        clients.openai(server, api_key="wrong").chat.completions.create(model="m",
                                                                        messages=USER)
    with pytest.raises(anthropic.AuthenticationError):
        clients.anthropic(server, api_key="wrong").messages.create(model="m", max_tokens=5,
                                                                   messages=USER)
    assert clients.openai(server, api_key="sekret").chat.completions.create(
        model="m", messages=USER).choices[0].message.content
    assert clients.anthropic(server, api_key="sekret").messages.create(
        model="m", max_tokens=5, messages=USER).content
    assert httpx.post(server.base_url + "/v1/messages", headers={"x-api-key": "sekret"},
                      json={"messages": USER, "max_tokens": 5}).status_code == 200
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 401
    assert httpx.get(server.base_url + "/metrics",
                     headers={"authorization": "Bearer sekret"}).status_code == 200


def test_request_log_lines(fake_server, clients):
    server = fake_server(request_log=True)
    client = clients.openai(server)
    client.chat.completions.create(model="m", messages=USER, seed=1234)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=USER, n=3)
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines()]
    done = [line for line in lines if line["event"] == "request_done"]
    rejected = [line for line in lines if line["event"] == "request_rejected"]
    assert len(done) == 1 and len(rejected) == 1
    record = done[0]
    assert record["seed"] == 1234 and record["api"] == "chat" and not record["stream"]
    assert record["prompt_tokens"] == 12 and record["completion_tokens"] == 5
    assert record["finish_reason"] == "stop" and record["error"] is None
    assert record["ttft_s"] is not None and record["queue_wait_s"] is not None
    assert rejected[0]["status"] == 400 and rejected[0]["param"] == "n"


def test_a_request_cancelled_before_generation_is_counted_and_logged(fake_server, monkeypatch):
    """The client leaves while its prompt is still being prepared (rendered and tokenized, off
    the event loop on the model server): no generation ever exists, and the request must still
    appear in requests_total and in the request log (issue 23)."""
    server = fake_server(request_log=True)
    preparing = threading.Event()

    async def prompt_still_preparing(job, request_id, received_at):
        preparing.set()
        await asyncio.sleep(30)  # the disconnect cancels this long before

    monkeypatch.setattr(server.backend, "start", prompt_still_preparing)
    body = json.dumps({"model": "m", "messages": USER, "stream": True}).encode()
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert preparing.wait(5)
    cancelled = 'infernix_requests_total{api="chat",outcome="cancelled"} 1'
    assert wait_until(lambda: cancelled in httpx.get(server.base_url + "/metrics").text)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert "infernix_requests_running 0" in metrics.splitlines()
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines()]
    done = [line for line in lines if line["event"] == "request_done"]
    assert len(done) == 1, lines
    assert done[0]["id"].startswith("chatcmpl-") and done[0]["api"] == "chat"
    assert done[0]["finish_reason"] == "cancelled" and done[0]["completion_tokens"] == 0
    assert done[0]["prompt_tokens"] is None and done[0]["total_s"] >= 0

def test_unknown_harmless_fields_are_accepted(fake_server, clients):
    server = fake_server()
    completion = clients.openai(server).chat.completions.create(
        model="m", messages=USER, prompt_cache_key="thread-1", metadata={"a": "b"},
        store=False, user="u", service_tier="auto", safety_identifier="s",
        extra_body={"some_new_field": {"x": 1}, "top_k": 20, "min_p": 0.0,
                    "chat_template_kwargs": {"enable_thinking": False}})
    assert completion.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        clients.openai(server).chat.completions.create(model="m", messages=USER,
                                                       logit_bias={"100": 5})
    assert info.value.param == "logit_bias"


# --- a few hundred malformed requests ---------------------------------------------------------

def _mutations(rng: random.Random) -> list[bytes]:
    valid = {"/v1/chat/completions": {"model": "m", "messages": USER, "max_tokens": 5},
             "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 5},
             "/v1/messages": {"model": "m", "messages": USER, "max_tokens": 5}}
    junk = [None, True, -1, 1e308, "", "x" * 50, [], {}, [None], {"type": None},
            [{"role": 5}], {"role": "user"}, [[[]]], "\u0000\ud7ff", 2 ** 70]
    bodies = []
    for path, body in valid.items():
        for _ in range(90):
            mutated = json.loads(json.dumps(body))
            for _ in range(rng.randint(1, 3)):
                target = mutated
                key = rng.choice(list(target))
                if isinstance(target[key], list) and target[key] and rng.random() < 0.5:
                    target = target[key][0] if isinstance(target[key][0], dict) else target
                    key = rng.choice(list(target)) if target else key
                if rng.random() < 0.2:
                    target.pop(key, None)
                else:
                    target[key] = copy.deepcopy(rng.choice(junk))
                if rng.random() < 0.3:
                    target[rng.choice(["tools", "tool_choice", "stream", "system", "stop",
                                       "thinking", "temperature", "input", "response_format",
                                       "reasoning", "text", "messages"])] = copy.deepcopy(rng.choice(junk))
            bodies.append((path, json.dumps(mutated).encode()))
        raw = orjson.dumps(body)
        for _ in range(20):
            cut = rng.randrange(len(raw))
            bodies.append((path, raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]))
        bodies.append((path, b"[" * 300 + b"]" * 300))
        bodies.append((path, b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}"))
        bodies.append((path, rng.randbytes(200)))
    return bodies


def test_a_few_hundred_malformed_bodies_never_take_the_server_down(fake_server):
    server = fake_server()
    rng = random.Random(1234)
    statuses = {}
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        for path, body in _mutations(rng):
            response = client.post(path, content=body,
                                   headers={"content-type": "application/json"})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code in (200, 400), (path, body[:200], response.text)
            payload = response.json()
            if response.status_code == 400:
                if path == "/v1/messages":
                    assert payload["type"] == "error"
                    assert payload["error"]["type"] == "invalid_request_error"
                else:
                    assert payload["error"]["type"] == "invalid_request_error"
                    assert payload["error"]["message"]
        assert client.get("/health").json() == {"status": "ok"}
    assert sum(statuses.values()) >= 300 and statuses.get(400, 0) > 200
