"""Anthropic Messages request validation (`protocols.anthropic_messages.parse_messages_request`):
a Claude Code request becomes a `GenerationJob` (its billing header dropped), the thinking
controls, and what the engine cannot honour is a 400 naming the field."""

from __future__ import annotations

import pytest

from protocols.anthropic_messages import parse_messages_request
from tests.unit.request_checks import BARE, FULL, USER, rejects


def test_messages_claude_code_request():
    body = {
        "model": "claude-sonnet-4-6", "max_tokens": 32000, "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
            {"type": "text", "text": "You are Claude Code.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be careful."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "list files",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use Bash.", "signature": "anything"},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                 "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "a.py"}]},
                {"type": "text", "text": "now read it"}]}],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
            "properties": {"command": {"type": "string"}}, "additionalProperties": False}},
            {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "temperature": 1, "top_k": 20, "stop_sequences": ["\n\nHuman:"],
        "metadata": {"user_id": "u"}, "output_config": {"effort": "high"},
        "context_management": {"edits": []}, "service_tier": "auto",
    }
    job, options = parse_messages_request(body, FULL)
    assert job.messages[0] == {"role": "system",
                               "content": "You are Claude Code.\n\nBe careful."}
    assistant = job.messages[2]
    assert assistant["reasoning_content"] == "Use Bash."
    assert assistant["content"] == "Listing."
    assert assistant["tool_calls"][0]["function"] == {"name": "Bash",
                                                      "arguments": {"command": "ls"}}
    assert job.messages[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py"}
    assert job.messages[4] == {"role": "user", "content": "now read it"}
    assert [t["function"]["name"] for t in job.tools] == ["Bash"]
    assert job.parallel_tool_calls is False
    assert job.enable_thinking is True and job.thinking_budget == 2048
    assert job.reasoning_effort == "high" and job.stop == ("\n\nHuman:",)
    assert job.max_tokens == 32000 and options.stream


def test_messages_billing_header_in_a_plain_system_string():
    job, _ = parse_messages_request({"max_tokens": 5, "system": (
        "x-anthropic-billing-header: cc_version=1; cch=9;\nReal system."), "messages": USER})
    assert job.messages[0]["content"] == "Real system."


def test_messages_thinking_controls():
    job, options = parse_messages_request({"max_tokens": 5, "messages": USER,
                                           "thinking": {"type": "disabled"}})
    assert job.enable_thinking is False
    job, options = parse_messages_request({"max_tokens": 5, "messages": USER,
                                           "thinking": {"type": "adaptive",
                                                        "display": "omitted"}})
    assert job.enable_thinking is True and not options.show_thinking
    job, _ = parse_messages_request({"messages": USER}, count_only=True)
    assert job.max_tokens is None


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png"}}]}]}, "messages[0].content[0].source.data"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "file", "file_id": "file_1"}}]}]}, "messages[0].content[0].source.type"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"tool_choice": {"type": "any"}, "tools": [{"name": "f", "input_schema": {}}]},
     "tool_choice"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"stop_sequences": "END"}, None),
])
def test_messages_rejections_name_the_field(extra, param):
    body = {"max_tokens": 10, "messages": USER, **extra}
    if param is None:  # a single string is accepted as one stop sequence
        job, _ = parse_messages_request(body, BARE)
        assert job.stop == ("END",)
        return
    rejects(lambda: parse_messages_request(body, BARE), param)
