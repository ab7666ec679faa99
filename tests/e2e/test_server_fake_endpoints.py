"""The small endpoints, auth and the request log against the real server over the scripted fake
backend: models, health, metrics, input-token counting, routes and methods, the API key, request
log lines (a request cancelled before generation included), and unknown harmless fields."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import anthropic
import httpx
import openai
import pytest

from protocols.app import AppConfig
from tests.e2e.fake_server_support import USER, wait_until


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


def test_responses_input_tokens(fake_server):
    server = fake_server()
    response = httpx.post(server.base_url + "/v1/responses/input_tokens",
                          json={"model": "m", "input": "hello there", "instructions": "x"})
    assert response.status_code == 200
    assert response.json()["object"] == "response.input_tokens"
    assert response.json()["input_tokens"] > 0


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
