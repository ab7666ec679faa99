"""Accounting of the server over the real tiny model (CPU): what the request log, /metrics and
the answers report when a client cuts a stream, when `max_tokens` exceeds the context, and
what `server_start` records."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import httpx

from protocols.serve import start_record


def metric(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def logged(model_log, request_id: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in model_log.read_text().splitlines():
            record = json.loads(line)
            if record.get("id") == request_id and record["event"] == "request_done":
                return record
        time.sleep(0.05)
    raise AssertionError(f"no request_done for {request_id}")


def test_a_cancelled_stream_keeps_its_reasoning_tokens_and_queue_wait(model_server, model_log,
                                                                      clients):
    reasoning_before = metric(model_server, "infernix_reasoning_tokens_total")
    waits_before = metric(model_server, "infernix_queue_wait_seconds_count")
    stream = clients.openai(model_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Think."}], max_tokens=400,
        stream=True)
    reasoning_chunks = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.model_extra.get("reasoning_content"):
            reasoning_chunks += 1
        if reasoning_chunks == 6:
            break
    request_id = chunk.id
    stream.close()  # the client goes away mid-thinking
    record = logged(model_log, request_id)
    assert record["finish_reason"] == "cancelled"
    # The tiny model thinks from its first token: at least one token per reasoning chunk seen.
    assert record["reasoning_tokens"] >= 6
    assert record["reasoning_tokens"] <= record["completion_tokens"] < 400
    assert record["queue_wait_s"] is not None and 0 <= record["queue_wait_s"] < 5
    assert metric(model_server, "infernix_reasoning_tokens_total") - reasoning_before == \
        record["reasoning_tokens"]
    assert metric(model_server, "infernix_queue_wait_seconds_count") - waits_before == 1


def test_chat_max_tokens_above_the_context_ends_with_length(model_server, clients):
    client = clients.openai(model_server)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    messages = [{"role": "user", "content": "go " * 990}]
    probe = client.chat.completions.create(model="tiny", messages=messages, max_tokens=0,
                                           extra_body=no_thinking)
    room = model_server.backend.max_context - probe.usage.prompt_tokens
    assert 0 < room < 60, "the prompt should leave a small room in the 1024-token context"
    completion = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=100000, temperature=0.0,
        extra_body=no_thinking)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == room


def test_server_start_records_the_resolved_device(model_server, model_settings):
    settings = dataclasses.replace(model_settings, device="auto")
    record = start_record(settings, model_server.backend)
    assert record["device"] == "cpu" == model_server.backend.session.device
    assert record["max_context"] == 1024 and record["auth"] is False


def test_engine_preemptions_are_a_counter(model_server):
    text = httpx.get(model_server.base_url + "/metrics").text
    assert "# TYPE infernix_engine_preemptions_total counter" in text
    assert re.search(r"^infernix_engine_preemptions_total 0$", text, re.MULTILINE)
    assert "# TYPE infernix_kv_pages_in_use gauge" in text
