"""Generation under pressure against the real server over the scripted fake backend: client
disconnects cancel the generation, concurrent streams, the full queue's 503 in each API's shape,
heartbeats through a slow prefill, in-band errors after the first byte, shutdown with streams
running, and context overflow."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from protocols.app import AppConfig
from protocols.fake import Script, default_script
from runtime.text.events import ContentDelta
from tests.e2e.conftest import run_concurrently
from tests.e2e.fake_server_support import USER, slow, wait_until


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


def test_context_overflow_is_a_400_with_the_code(fake_server, clients):
    server = fake_server(lambda job: Script(prompt_tokens=5000), max_context=4096)
    with pytest.raises(openai.BadRequestError) as info:
        clients.openai(server).chat.completions.create(model="m", messages=USER)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        clients.anthropic(server).messages.create(model="m", max_tokens=5, messages=USER)
