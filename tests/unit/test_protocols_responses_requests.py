"""Responses request validation (`protocols.openai_responses.parse_responses_request`): input
items become template messages, encrypted reasoning comes back, `previous_response_id`
prepends the stored history, and what the engine cannot honour is a 400 naming the field."""

from __future__ import annotations

import pytest

from protocols.openai_responses import ResponseStore, parse_responses_request
from tests.unit.request_checks import BARE, FULL, rejects


def test_responses_items_become_template_messages():
    body = {
        "model": "m", "instructions": "You are Codex.", "input": [
            {"role": "user", "content": "fix it"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Look first."}]},
            {"type": "function_call", "call_id": "c1", "name": "shell",
             "arguments": '{"cmd": ["ls"]}'},
            {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch",
             "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "ok"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Done."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}],
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"},
             "strict": False},
            {"type": "custom", "name": "apply_patch", "description": "patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
            {"type": "web_search"},
            {"type": "namespace", "name": "mcp", "description": "x", "tools": [
                {"type": "function", "name": "read", "parameters": {"type": "object"}}]}],
        "tool_choice": "auto", "parallel_tool_calls": True, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "medium",
                                                                  "summary": "auto"},
        "text": {"verbosity": "medium"}, "prompt_cache_key": "thread", "client_metadata": {},
        "service_tier": "auto", "truncation": "disabled", "max_output_tokens": 100,
    }
    job, options = parse_responses_request(body, FULL)
    roles = [m["role"] for m in job.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant",
                     "user"]
    assistant = job.messages[2]
    assert assistant["reasoning_content"] == "Look first."
    assert assistant["tool_calls"][0]["function"] == {"name": "shell",
                                                      "arguments": {"cmd": ["ls"]}}
    assert job.messages[4]["tool_calls"][0]["function"] == {
        "name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}
    assert job.messages[5]["content"] == "ok"
    assert job.messages[6] == {"role": "assistant", "content": "Done."}
    names = [t["function"]["name"] for t in job.tools]
    assert names == ["shell", "apply_patch", "mcp.read"]  # web_search is never shown
    assert options.custom_tools == {"apply_patch"}
    assert options.namespaces == {"mcp.read": ("mcp", "read")}
    assert options.include_encrypted_reasoning and options.stream and not options.store
    assert job.max_tokens == 100 and job.reasoning_effort == "medium"


def test_responses_encrypted_reasoning_round_trip():
    from protocols.responses_encoder import encode_reasoning
    body = {"input": [{"role": "user", "content": "q"},
                      {"type": "reasoning", "summary": [],
                       "encrypted_content": encode_reasoning("raw thoughts")},
                      {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "q2"}]}
    job, _ = parse_responses_request(body)
    assert job.messages[1] == {"role": "assistant", "content": "a",
                               "reasoning_content": "raw thoughts"}
    # Someone else's encrypted blob is opaque: nothing is fed back.
    body["input"][1]["encrypted_content"] = "gAAAA-opaque"
    job, _ = parse_responses_request(body)
    assert "reasoning_content" not in job.messages[1]


def test_responses_previous_response_id_prepends_the_stored_history():
    store = ResponseStore()
    store.put({"id": "resp_old", "output": [
        {"type": "message", "role": "assistant", "id": "m", "status": "completed",
         "content": [{"type": "output_text", "text": "4", "annotations": []}]}]},
        [{"type": "message", "role": "user", "content": "2+2?"}])
    job, options = parse_responses_request(
        {"previous_response_id": "resp_old", "input": "and 3+3?", "instructions": "new"},
        store=store)
    assert [(m["role"], m["content"]) for m in job.messages] == [
        ("system", "new"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?")]
    assert len(options.items) == 3
    error = rejects(lambda: parse_responses_request(
        {"previous_response_id": "resp_missing", "input": "x"}, store=store),
        "previous_response_id", in_message=False)  # OpenAI's own wording
    assert error.code == "previous_response_not_found"


@pytest.mark.parametrize("extra, param", [
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search"}]},
     "tool_choice.type"),
    ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"temperature": -1}, "temperature"),
    ({"reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "local_shell_call"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id"),
    ({"input": [{"role": "developer", "content": [{"type": "input_image",
                                                  "image_url": "data:,"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
])
def test_responses_rejections_name_the_field(extra, param):
    body = {"input": "hi", **extra}
    rejects(lambda: parse_responses_request(body, BARE), param)
