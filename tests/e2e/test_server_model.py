"""The server over the real tiny model (real Qwen vocabulary, random weights, CPU): the
official SDKs' stream helpers and plain calls, forced tool calls and their round trips,
cancellation by disconnect, 8 concurrent streams, logprobs, token counting, the request log,
and `infernix-serve` itself as a process (API key, request log, SIGTERM).

The weights are random, so texts are noise; the tests check shapes, accounting and control
flow. Outputs are kept short (a few tokens) to keep the suite fast on two cores, so most end
at the length limit; openai-python's `get_final_completion()` raises on that by design, so
the chat stream tests read the helper's accumulated snapshot instead."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import run_concurrently

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "Say hello."}]
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The current time",
    "parameters": {"type": "object", "properties": {}}}}


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_chat_plain_and_stream_helper(model_server, clients, wire):
    client = clients.openai(model_server)
    completion = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                                extra_body=NO_THINKING, seed=7)
    usage = completion.usage
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert usage.completion_tokens <= 4 and usage.prompt_tokens > 5
    assert usage.completion_tokens_details.reasoning_tokens == 0
    again = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                           extra_body=NO_THINKING, seed=7)
    assert again.choices[0].message.content == completion.choices[0].message.content
    with client.chat.completions.stream(model="tiny", messages=USER, max_tokens=4,
                                        stream_options={"include_usage": True}) as stream:
        for event in stream:
            if event.type == "chunk":
                wire.chat(event.chunk.model_dump(exclude_unset=True))
        # get_final_completion() raises on finish_reason "length" by design; read the snapshot.
        final = stream.current_completion_snapshot
    # Thinking on (the template default): the output starts as reasoning.
    assert final.choices[0].message.model_extra.get("reasoning_content")
    assert final.usage.completion_tokens_details.reasoning_tokens == final.usage.completion_tokens


def test_responses_stream_and_create(model_server, clients, wire):
    client = clients.openai(model_server)
    with httpx.stream("POST", model_server.base_url + "/v1/responses", json={
            "model": "tiny", "input": "hi", "max_output_tokens": 3, "stream": True},
            timeout=60) as response:
        body = response.read()
    events = [json.loads(data) for _, data in wire.events(body)]
    for payload in events:
        wire.responses(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.incomplete", "response.completed")
    response = client.responses.create(model="tiny", input="hi", max_output_tokens=3,
                                       reasoning={"effort": "none"})
    assert response.status in ("incomplete", "completed")
    assert response.usage.output_tokens <= 3
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_messages_stream_helper_with_thinking(model_server, clients):
    client = clients.anthropic(model_server)
    with client.messages.stream(model="claude-sonnet-4-6", max_tokens=4, messages=USER,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        for _ in stream:
            pass
        message = stream.get_final_message()
    assert message.content[0].type == "thinking"
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens <= 4
    count = client.messages.count_tokens(model="m", messages=USER,
                                         thinking={"type": "enabled", "budget_tokens": 1024})
    assert count.input_tokens == message.usage.input_tokens + \
        (message.usage.cache_read_input_tokens or 0)


def test_forced_tool_call_round_trip_chat(model_server, clients):
    client = clients.openai(model_server)
    first = client.chat.completions.create(model="tiny", messages=USER, tools=[CLOCK],
                                           tool_choice="required", max_tokens=30,
                                           extra_body=NO_THINKING)
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert calls and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {}
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": calls[0].id, "content": "12:00"}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=[CLOCK],
                                            max_tokens=3, extra_body=NO_THINKING)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_forced_tool_call_round_trip_anthropic(model_server, clients):
    client = clients.anthropic(model_server)
    tool = {"name": "get_time", "description": "The time",
            "input_schema": {"type": "object", "properties": {}}}
    with client.messages.stream(model="m", max_tokens=30, messages=USER, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_time"},
                                thinking={"type": "disabled"}) as stream:
        for _ in stream:
            pass
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "get_time" and use.input == {} and use.id.startswith("toolu_")
    second = client.messages.create(model="m", max_tokens=3, tools=[tool], messages=USER + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "12:00"}]}], thinking={"type": "disabled"})
    # Anthropic's input_tokens leaves out what the prefix cache served: compare whole prompts.
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens \
        > first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_forced_tool_call_responses(model_server, clients):
    client = clients.openai(model_server)
    with client.responses.stream(model="tiny", input="time?", tool_choice="required",
                                 tools=[{"type": "function", "name": "get_time",
                                         "parameters": {"type": "object", "properties": {}}}],
                                 reasoning={"effort": "none"}, max_output_tokens=30) as stream:
        for _ in stream:
            pass
        response = stream.get_final_response()
    call = next(item for item in response.output if item.type == "function_call")
    assert call.name == "get_time" and json.loads(call.arguments) == {}


# Custom tools with a grammar format: the input of every call must match. The regex is bounded,
# so every request finishes; the recursive Lark grammar nests as deep as the random model likes,
# so a request may hit the output limit, and its (incomplete) input must then be a prefix of the
# language.
PLATE = r"[0-9]{3}-[a-z]{1,6}"  # [0-9]: the regex `\d` is Unicode-wide (docs)
NESTED = 'start: item (", " item)*\nitem: "yes" | "no" | "[" start "]"\n'
CUSTOM_SEEDS = 20


def _nested(text: str, *, prefix: bool = False) -> bool:
    """Whether `text` is in the language of NESTED (or, with `prefix`, starts a word of it);
    checked without llguidance."""
    depth, position, want_item = 0, 0, True
    while position < len(text):
        rest = text[position:]
        if want_item:
            word = next((w for w in ("yes", "no", "[") if rest.startswith(w)), None)
            if word is None:
                return prefix and any(w.startswith(rest) for w in ("yes", "no"))
            position += len(word)
            depth += word == "["
            want_item = word == "["
        elif rest.startswith(", "):
            position += 2
            want_item = True
        elif rest.startswith("]") and depth:
            position += 1
            depth -= 1
        else:
            return prefix and rest == ","
    return prefix or (not want_item and depth == 0)


def _custom_tool_calls(server, clients, tool: dict, tool_choice) -> list:
    """CUSTOM_SEEDS seeded responses that must call `tool`: (status, input) in seed order."""
    client = clients.openai(server, timeout=180)

    def one(seed: int):
        return client.responses.create(
            model="tiny", input="Use the tool.", tools=[tool], tool_choice=tool_choice,
            parallel_tool_calls=False, reasoning={"effort": "none"}, max_output_tokens=128,
            extra_body={"seed": seed})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(CUSTOM_SEEDS)))
    calls = []
    for response in responses:
        assert [item.type for item in response.output] == ["custom_tool_call"]
        call = response.output[0]
        assert call.name == tool["name"] and call.call_id
        calls.append((response.status, call.input))
    return calls


def test_custom_tool_regex_grammar_is_enforced(model_server, clients):
    tool = {"type": "custom", "name": "plate", "description": "Look up a plate.",
            "format": {"type": "grammar", "syntax": "regex", "definition": f"^{PLATE}$"}}
    calls = _custom_tool_calls(model_server, clients, tool, "required")
    assert {status for status, _ in calls} == {"completed"}
    inputs = [text for _, text in calls]
    assert [text for text in inputs if not re.fullmatch(PLATE, text)] == []
    assert len(set(inputs)) > 1  # seeds really vary the output


def test_custom_tool_lark_grammar_is_enforced(model_server, clients):
    tool = {"type": "custom", "name": "vote", "description": "Cast nested votes.",
            "format": {"type": "grammar", "syntax": "lark", "definition": NESTED}}
    calls = _custom_tool_calls(model_server, clients, tool, {"type": "custom", "name": "vote"})
    done = [text for status, text in calls if status == "completed"]
    cut = [text for status, text in calls if status == "incomplete"]
    assert len(done) + len(cut) == CUSTOM_SEEDS and len(done) >= CUSTOM_SEEDS * 3 // 4
    assert [text for text in done if not _nested(text)] == []
    assert [text for text in cut if not _nested(text, prefix=True)] == []
    assert len(set(done)) > 1 and any("[" in text for text in done)  # recursion used


def test_custom_tool_broken_grammar_is_400(model_server, clients):
    client = clients.openai(model_server)
    for syntax, definition, problem in [("lark", "start: expr\n", "invalid Lark grammar"),
                                        ("regex", "[0-9", "invalid regex")]:
        tool = {"type": "custom", "name": "calc",
                "format": {"type": "grammar", "syntax": syntax, "definition": definition}}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="tiny", input="hi", tools=[tool],
                                    max_output_tokens=4)
        assert info.value.status_code == 400 and info.value.code == "invalid_constraint"
        assert info.value.param == "tools[0].format.definition"
        assert f"custom tool 'calc': {problem}" in info.value.body["message"]
    assert model_server.backend.healthy()


def test_custom_tool_grammar_with_a_sloppy_function_schema_is_served(model_server, clients):
    """A grammar tool makes "auto" constrained; a non-strict function tool whose schema the
    tool-call grammar cannot take (required but undeclared) must not turn that into a 400."""
    sloppy = {"type": "function", "name": "mcp_lookup", "parameters": {
        "type": "object", "properties": {}, "required": ["query"]}}
    plate = {"type": "custom", "name": "plate",
             "format": {"type": "grammar", "syntax": "regex", "definition": PLATE}}
    response = clients.openai(model_server).responses.create(
        model="tiny", input="hi", tools=[plate, sloppy], max_output_tokens=3,
        reasoning={"effort": "none"})
    assert response.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as info:  # forced: the schema must compile
        clients.openai(model_server).responses.create(
            model="tiny", input="hi", tools=[plate, sloppy], max_output_tokens=3,
            tool_choice="required", reasoning={"effort": "none"})
    assert info.value.param == "tool_choice" and "required parameters" in info.value.body[
        "message"]


def test_json_schema_output(model_server, clients):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    completion = clients.openai(model_server).chat.completions.create(
        model="tiny", messages=USER, max_tokens=20, extra_body=NO_THINKING,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert json.loads(completion.choices[0].message.content) in ({"ok": True}, {"ok": False})
    with pytest.raises(openai.BadRequestError) as info:
        clients.openai(model_server).chat.completions.create(
            model="tiny", messages=USER, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}})
    assert info.value.param == "response_format"


def test_disconnect_frees_the_lane(model_server, clients):
    backend = model_server.backend
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", model_server.base_url + "/v1/chat/completions", json={
                "model": "tiny", "messages": USER, "max_tokens": 500, "stream": True,
                **NO_THINKING}) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert backend.gauges()["engine_requests_running"] + \
                backend.gauges()["requests_waiting"] >= 1
    assert wait_until(lambda: backend.gauges()["engine_requests_running"] == 0
                      and backend.gauges()["requests_waiting"] == 0)
    assert backend.gauges()["kv_pages_in_use"] == 0
    completion = clients.openai(model_server).chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, extra_body=NO_THINKING)
    assert completion.usage.completion_tokens <= 2


def test_eight_concurrent_streams(model_server, clients):
    def run(number):
        client = clients.openai(model_server, timeout=120)
        with client.chat.completions.stream(
                model="tiny", messages=[{"role": "user", "content": f"count {number}"}],
                max_tokens=4, seed=number, stream_options={"include_usage": True},
                extra_body=NO_THINKING) as stream:
            for _ in stream:
                pass
            return stream.current_completion_snapshot

    results = run_concurrently(run, 8, timeout=180)
    assert len(results) == 8
    assert all(0 < r.usage.completion_tokens <= 4 for r in results)


def test_logprobs(model_server, clients):
    completion = clients.openai(model_server).chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, logprobs=True, top_logprobs=2,
        extra_body=NO_THINKING)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == completion.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in entries)


def test_context_overflow_and_max_tokens_zero(model_server, clients):
    client = clients.openai(model_server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "word " * 1500}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        clients.anthropic(model_server).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "word " * 1500}])
    empty = client.chat.completions.create(model="tiny", messages=USER, max_tokens=0)
    assert empty.usage.completion_tokens == 0 and empty.choices[0].finish_reason == "length"


def test_stop_strings_end_the_answer(model_server, clients):
    client = clients.openai(model_server)
    # Seed 0 is also the server's default seed, so the Anthropic request (no seed field)
    # samples the same text from the same prompt.
    request = dict(model="tiny", messages=USER, max_tokens=8, seed=0, extra_body=NO_THINKING)
    text = client.chat.completions.create(**request).choices[0].message.content
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text.index(stop)
    stopped = client.chat.completions.create(**request, stop=[stop])
    assert stopped.choices[0].message.content == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    message = clients.anthropic(model_server).messages.create(
        model="m", max_tokens=8, messages=USER, stop_sequences=[stop],
        thinking={"type": "disabled"})
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert "".join(b.text for b in message.content if b.type == "text") == text[:cut]


def test_final_assistant_message_is_continued(model_server, clients):
    session = model_server.backend.session
    history = USER + [{"role": "assistant", "content": "The answer is"}]
    completion = clients.openai(model_server).chat.completions.create(
        model="tiny", messages=history, max_tokens=2, extra_body=NO_THINKING)
    closed = session.render(history, enable_thinking=False, add_generation_prompt=False)
    tail = session.tokenizer.decode(closed.ids[-3:])
    assert tail.endswith("<|im_end|>\n")
    # The prompt is the closed rendering minus the turn end: "<|im_end|>" and "\n".
    assert completion.usage.prompt_tokens == len(closed.ids) - 2
    assert completion.choices[0].message.model_extra.get("reasoning_content") is None


def test_request_log_has_one_line_per_request(model_server, clients, model_log):
    client = clients.openai(model_server)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, seed=4242,
                                   extra_body=NO_THINKING)
    lines = [json.loads(line) for line in Path(model_log).read_text().splitlines()]
    record = next(line for line in lines if line.get("seed") == 4242)
    assert record["event"] == "request_done" and record["finish_reason"] in ("length", "stop")
    assert record["completion_tokens"] <= 2 and record["prompt_tokens"] > 0
    for key in ("cached_tokens", "queue_wait_s", "ttft_s", "decode_tok_s", "id"):
        assert key in record


def test_infernix_serve_process(tiny_real_vocab_path, tmp_path):
    """The console entry point: --api-key, --request-log, --port 0, graceful SIGTERM."""
    log_path = tmp_path / "requests.jsonl"
    config = tmp_path / "serve.toml"
    config.write_text('[serve]\nmax-concurrency = 2\nmax-context = 512\n')
    process = subprocess.Popen(
        [sys.executable, "-c", "import sys; from protocols.serve import main; sys.exit(main())",
         str(tiny_real_vocab_path), "--device", "cpu", "--port", "0", "--api-key", "k1",
         "--request-log", str(log_path), "--config", str(config)],
        stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            lines.append(line)
            match = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if match:
                port = int(match.group(1))
        assert port, "".join(lines)
        base = f"http://127.0.0.1:{port}"
        assert any("options from" in line and "max-concurrency" in line for line in lines)
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401
        models = httpx.get(base + "/v1/models", headers={"x-api-key": "k1"}).json()
        assert models["data"][0]["max_model_len"] == 512
        client = openai.OpenAI(base_url=base + "/v1", api_key="k1", max_retries=0, timeout=60)
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                       extra_body=NO_THINKING)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["server_start", "request_rejected",
                                             "request_done"]
    assert records[1]["status"] == 401
    assert "k1" not in log_path.read_text()


def test_bad_options_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-c",
                             "import sys; from protocols.serve import main; sys.exit(main())",
                             "--max-concurrency", "99"], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--max-concurrency" in result.stderr
