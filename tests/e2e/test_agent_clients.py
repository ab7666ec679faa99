"""Requests shaped as the coding agents send them, through the official SDKs, against the real
server and API layer over the scripted fake backend: OpenAI's Codex CLI (Responses), Claude
Code (Messages, beta), Qwen Code (Chat). Also the HTTP answers those clients act on: no retry
of a 4xx a retry cannot fix, 405 with `Allow`, a real `created` in /v1/models."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from protocols.app import AppConfig
from protocols.fake import Script
from runtime.text.events import (ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd,
                                 ToolCallStart)

SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "strict": False, "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}},
             "required": ["command"]}}
SEARCH_PARAMETERS = {"type": "object", "properties": {"query": {"type": "string"},
                                                      "limit": {"type": "number"}},
                     "required": ["query"], "additionalProperties": False}
# Codex's client-executed tool search: no name on the wire, `execution: "client"`.
TOOL_SEARCH = {"type": "tool_search", "execution": "client", "description": "Find tools",
               "parameters": SEARCH_PARAMETERS}
FILES = {"type": "namespace", "name": "mcp__files", "description": "File tools", "tools": [
    {"type": "function", "name": "read_file", "description": "Read a file", "strict": False,
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]}
NOTION = {"type": "namespace", "name": "mcp__notion", "description": "Notion", "tools": [
    {"type": "function", "name": "search", "description": "Search pages",
     "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]}


def calling(name: str, arguments: str):
    """A script: a little reasoning, then one call of `name`."""
    return Script(events=[ReasoningDelta("Need a tool."), ToolCallStart(0, "call_x1", name),
                          ToolCallArgsDelta(0, arguments), ToolCallEnd(0)])


def codex_request(input_items: list) -> dict:
    """The fields Codex 0.171 sends for its own catalog models (codex-rs ResponsesApiRequest)."""
    return dict(model="gpt-5.1-codex", instructions="You are Codex.", input=input_items,
                tools=[SHELL, TOOL_SEARCH, {"type": "web_search"}], tool_choice="auto",
                parallel_tool_calls=False, reasoning={"effort": "medium", "summary": "auto"},
                store=False, include=["reasoning.encrypted_content"],
                prompt_cache_key="thread-1", text={"verbosity": "low"})


def codex_first_turn() -> list:
    return [{"type": "additional_tools", "role": "developer", "tools": [FILES]},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>ask</permissions>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Find the notion tools."}]}]


# --- Codex CLI (Responses) --------------------------------------------------------------------

def test_codex_turn_with_verbosity_additional_tools_and_client_tool_search(fake_server,
                                                                           clients):
    server = fake_server(lambda job: calling("tool_search", '{"query": "notion"}'))
    client = clients.openai(server)
    with client.responses.stream(**codex_request(codex_first_turn())) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    job = server.backend.jobs[-1]
    # `additional_tools` joined the request's tools; the client tool search is a function.
    assert [tool["function"]["name"] for tool in job.tools] == [
        "shell", "tool_search", "mcp__files.read_file"]
    assert job.tools[1]["function"]["parameters"] == SEARCH_PARAMETERS
    assert [m["role"] for m in job.messages] == ["system", "system", "user"]
    assert kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" not in kinds  # no such events for searches
    assert response.text.verbosity == "low" and response.store is False
    reasoning, search = response.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    assert search.type == "tool_search_call" and search.execution == "client"
    assert (search.call_id, search.arguments, search.status) == (
        "call_x1", {"query": "notion"}, "completed")


def test_codex_next_turn_sends_the_search_back_and_calls_a_loaded_tool(fake_server, clients):
    server = fake_server(lambda job: calling("mcp__notion.search", '{"q": "roadmap"}'))
    client = clients.openai(server)
    history = codex_first_turn() + [
        {"type": "reasoning", "summary": [], "encrypted_content": None,
         "content": [{"type": "reasoning_text", "text": "Need a tool."}]},
        {"type": "tool_search_call", "call_id": "call_x1", "execution": "client",
         "status": "completed", "arguments": {"query": "notion"}},
        {"type": "tool_search_output", "call_id": "call_x1", "execution": "client",
         "status": "completed", "tools": [NOTION]}]
    response = client.responses.create(**codex_request(history))
    job = server.backend.jobs[-1]
    assert [tool["function"]["name"] for tool in job.tools] == [
        "shell", "tool_search", "mcp__files.read_file", "mcp__notion.search"]
    assistant, tool = job.messages[3], job.messages[4]
    assert assistant["reasoning_content"] == "Need a tool."
    assert assistant["tool_calls"][0]["function"] == {"name": "tool_search",
                                                      "arguments": {"query": "notion"}}
    assert tool == {"role": "tool", "tool_call_id": "call_x1",
                    "content": '{"loaded_tools":["mcp__notion"]}'}
    call = response.output[-1]
    assert (call.type, call.namespace, call.name, json.loads(call.arguments)) == (
        "function_call", "mcp__notion", "search", {"q": "roadmap"})


@pytest.mark.parametrize("verbosity", ["low", "medium", "high"])
def test_chat_accepts_every_documented_verbosity(fake_server, clients, verbosity):
    server = fake_server()
    completion = clients.openai(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], verbosity=verbosity)
    assert completion.choices[0].message.content == "Hello from the fake."


# --- Claude Code (Messages) -------------------------------------------------------------------

CLAUDE_BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14",
                "context-management-2025-06-27", "fine-grained-tool-streaming-2025-05-14"]


def test_claude_code_request(fake_server, clients):
    server = fake_server()
    client = clients.anthropic(server)
    with client.beta.messages.stream(
            model="claude-sonnet-4-5", max_tokens=32000, betas=CLAUDE_BETAS,
            system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                    {"type": "text", "text": "You are Claude Code.",
                     "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hi"},
                      {"role": "system", "content": "The user switched to plan mode."},
                      {"role": "user", "content": [{"type": "text", "text": "go on"}]}],
            thinking={"type": "adaptive"}, output_config={"effort": "high"},
            context_management={"edits": [{"type": "clear_thinking_20251015",
                                           "keep": "all"}]},
            metadata={"user_id": "user_abc"}) as stream:
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].text == "Hello from the fake."
    job = server.backend.jobs[-1]
    assert [m["role"] for m in job.messages] == ["system", "user", "system", "user"]
    assert job.messages[0]["content"] == "You are Claude Code."
    assert (job.enable_thinking, job.reasoning_effort, job.max_tokens) == (True, "high", 32000)


def test_messages_without_max_tokens_is_400_like_the_real_api(fake_server, clients):
    server = fake_server()
    with pytest.raises(anthropic.BadRequestError) as info:
        clients.anthropic(server).post("/v1/messages", cast_to=anthropic.types.Message, body={
            "model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}]})
    assert info.value.body["error"] == {"type": "invalid_request_error",
                                        "message": "max_tokens: is required"}
    assert server.backend.jobs == []


# --- Qwen Code (Chat) -------------------------------------------------------------------------

def test_qwen_code_history_with_reasoning_content(fake_server, clients):
    server = fake_server()
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    stream = clients.openai(server).chat.completions.create(
        model="qwen3-coder", stream=True, stream_options={"include_usage": True},
        tools=[weather], messages=[
            {"role": "system", "content": "You are Qwen Code."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "The tool said: sunny"
    assistant = server.backend.jobs[-1].messages[2]
    assert assistant["reasoning_content"] == "Call the tool."
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


# --- what clients read from errors and listings ----------------------------------------------

def test_a_bad_key_is_not_retried(fake_server, clients):
    """Claude Code retried a 401 for minutes: a 4xx a retry cannot fix says so."""
    server = fake_server(config=AppConfig(api_key="right"), request_log=True)
    client = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=3)
    with pytest.raises(anthropic.AuthenticationError) as info:
        client.messages.create(model="m", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert info.value.response.headers["x-should-retry"] == "false"
    records = [json.loads(line) for line in server.log_path.read_text().splitlines()]
    assert [(r["event"], r["status"]) for r in records] == [("request_rejected", 401)]


def test_x_should_retry_on_client_errors(fake_server, clients):
    server = fake_server()
    client = clients.openai(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       n=2)
    assert info.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_missing")
    assert info.value.response.headers["x-should-retry"] == "false"
    busy = fake_server(lambda job: Script(events=[ContentDelta("x")] * 50, step_s=0.05),
                       config=AppConfig(max_concurrency=1, max_pending_requests=0))
    with httpx.stream("POST", busy.base_url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}):
        refused = httpx.post(busy.base_url + "/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "x-should-retry" not in refused.headers  # retryable: the SDKs wait and try again


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v1/chat/completions", "POST"),
    ("POST", "/v1/models", "GET, HEAD"),
    ("DELETE", "/v1/models/fake-model", "GET"),
    ("POST", "/v1/responses/resp_1", "GET, DELETE"),
])
def test_405_names_the_allowed_methods(fake_server, method, path, allow):
    server = fake_server()
    response = httpx.request(method, server.base_url + path)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    assert response.headers["x-should-retry"] == "false"


def test_models_created_is_a_real_timestamp(fake_server, clients):
    before = int(time.time())
    server = fake_server()
    model = clients.openai(server).models.list().data[0]
    assert before - 1 <= model.created <= time.time()
    assert model.model_extra["created_at"] == time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                            time.gmtime(model.created))
