"""Where time to first token goes: every request through each API on the tiny real-vocabulary
model (CPU) logs its phases (`protocols.generation.PHASES`) in order, each non-negative, summing
to no more than the time to first token the client measures, and /metrics sums them.

The client clock starts before the request is sent and stops when the first output event
arrives; the server's phases run from the request's head parsed to the first output bytes
written, inside that window, so their sum must be smaller whatever the machine's load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from protocols.generation import PHASES
from tests.e2e.model_serving import cpu_settings, serve_model, stop_model

SYSTEM = "You are a careful assistant; answer briefly and cite file names. " * 6
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ENGINE = ("queue", "match", "resume", "prefill")
# The log rounds `ttft_s` to 0.1 ms and phases to 1 us.
ROUNDING_S = 1e-4


@pytest.fixture(scope="module")
def phase_server(tiny_real_vocab_path, tmp_path_factory):
    settings = cpu_settings(tiny_real_vocab_path, "--max-context", "1024", "--max-concurrency", "2",
                            "--max-new", "8")
    server = serve_model(settings, tmp_path_factory.mktemp("phases") / "requests.jsonl")
    yield server
    stop_model(server)


def request_body(api: str, turns: list[str], stream: bool) -> tuple[str, dict]:
    """A conversation of user turns (earlier answers "ok") for one API: path and body. Each
    API has its own system text: a shared one would be a cached prefix for the next API."""
    system = f"[{api}] {SYSTEM}"
    messages = []
    for n, text in enumerate(turns):
        if n:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": text})
    if api == "chat":
        return "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "system", "content": system}, *messages],
            "max_tokens": 8, "seed": 5, "stream": stream, **NO_THINKING}
    if api == "responses":
        return "/v1/responses", {"model": "tiny", "instructions": system, "input": messages,
                                 "max_output_tokens": 8, "seed": 5, "stream": stream,
                                 **NO_THINKING}
    return "/v1/messages", {"model": "tiny", "system": system, "messages": messages,
                            "max_tokens": 8, "temperature": 0, "stream": stream,
                            "thinking": {"type": "disabled"}}


def is_output(api: str, data: dict) -> bool:
    """Whether an SSE payload carries generated output (not the stream's opening frames)."""
    if api == "chat":      # (the opening chunk: role and an empty content)
        return any({k for k, v in choice.get("delta", {}).items() if v and k != "role"}
                   or choice.get("finish_reason") for choice in data.get("choices", []))
    if api == "responses":
        return data.get("type") not in ("response.created", "response.in_progress")
    return data.get("type") not in ("message_start", "ping")


def send(server, api: str, turns: list[str], tag: str, stream: bool = True) -> float:
    """Send one request tagged `tag`; the seconds from sending to the first output event
    (streams) or to the whole answer."""
    path, body = request_body(api, turns, stream)
    headers = {"x-request-tag": tag, "x-api-key": "test"}
    sent = time.perf_counter()
    with httpx.stream("POST", server.base_url + path, json=body, headers=headers,
                      timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        first = None
        for line in reply.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]" \
                    and is_output(api, json.loads(line[6:])):
                first = time.perf_counter() - sent
        return first if first is not None else time.perf_counter() - sent


def logged(server, tag: str) -> dict:
    for line in Path(server.log_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("tag") == tag:
            return record
    raise AssertionError(f"no request_done line tagged {tag}")


def check_phases(record: dict, client_ttft_s: float, stream: bool) -> dict:
    phases = record["phases"]
    expected = [name for name in PHASES if stream or name != "first_write"]
    assert list(phases) == expected, (list(phases), record)
    assert all(seconds >= 0 for seconds in phases.values()), phases
    # From the body's last byte to the engine's first token fits in the logged TTFT (counted
    # from there); all of it, in the client's.
    up_to_engine = sum(phases[name] for name in
                       PHASES[PHASES.index("parse"):PHASES.index("prefill") + 1])
    assert up_to_engine <= record["ttft_s"] + ROUNDING_S, (phases, record["ttft_s"])
    assert sum(phases.values()) <= client_ttft_s, (phases, client_ttft_s)
    assert record["prefill_steps"] >= 1
    assert 0 < record["prefill_compute_s"] <= phases["prefill"] + 1e-6, record
    # Tokenizing and rendering did real work (a prompt of ~100 tokens takes microseconds,
    # never exactly 0 on a nanosecond clock).
    assert phases["render"] > 0 and phases["tokenize"] > 0
    return phases


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_phases_of_a_conversation_through_each_api(phase_server, api):
    first_turn = ["Which file defines the scheduler? Answer in one line."]
    ttft = send(phase_server, api, first_turn, f"{api}-1")
    cold = check_phases(logged(phase_server, f"{api}-1"), ttft, stream=True)
    assert cold["resume"] == 0.0                     # nothing of this prompt was cached
    second_turn = first_turn + ["And which one defines the prefix cache? " * 12]
    ttft = send(phase_server, api, second_turn, f"{api}-2")
    record = logged(phase_server, f"{api}-2")
    warm = check_phases(record, ttft, stream=True)
    assert record["resume_path"] == "prefix" and record["cached_tokens"] >= 64, record
    # A resume looked the prompt up and copied a snapshot into the lane: both took time.
    assert warm["match"] > 0 and warm["resume"] > 0


def test_phases_of_a_plain_request_and_metrics(phase_server):
    elapsed = send(phase_server, "chat", ["A plain, unstreamed request."], "plain", stream=False)
    record = logged(phase_server, "plain")
    check_phases(record, elapsed, stream=False)
    text = httpx.get(phase_server.base_url + "/metrics").text
    samples = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    records = [json.loads(line) for line in Path(phase_server.log_path).read_text().splitlines()]
    done = [r for r in records if r["event"] == "request_done"]
    for phase in PHASES:
        with_phase = [r["phases"][phase] for r in done if phase in r["phases"]]
        assert samples[f'infernix_request_phase_seconds_count{{phase="{phase}"}}'] == \
            len(with_phase), phase
        assert samples[f'infernix_request_phase_seconds_sum{{phase="{phase}"}}'] == \
            pytest.approx(sum(with_phase), abs=1e-5 * len(with_phase)), phase
    assert samples["infernix_prefill_steps_total"] == sum(r["prefill_steps"] for r in done)
