"""Request validation of the three APIs: the fields serious clients send become a
`GenerationJob`; what the engine cannot honour is a 400 naming the field; unknown harmless
fields pass; reasoning sent back is kept; Claude Code's billing header is dropped."""

from __future__ import annotations

import re

import pytest

from protocols.anthropic_messages import parse_messages_request
from protocols.app import MAX_JSON_DEPTH, json_depth, parse_json_body
from protocols.errors import ApiError
from protocols.job import Capabilities
from protocols.openai_chat import parse_chat_request
from protocols.openai_responses import ResponseStore, parse_responses_request

FULL = Capabilities(logprobs=False, constraints=True)
BARE = Capabilities()
USER = [{"role": "user", "content": "hi"}]


def rejects(call, param: str, status: int = 400, *, in_message: bool = True) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    assert info.value.status == status
    assert info.value.param == param, info.value.message
    if in_message:
        assert param in info.value.message
    return info.value


# --- JSON bodies ------------------------------------------------------------------------------

def nested(depth: int) -> bytes:
    return b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_json_depth_limit():
    assert json_depth(parse_json_body(nested(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    error = rejects(lambda: parse_json_body(nested(MAX_JSON_DEPTH + 1)), "body")
    assert str(MAX_JSON_DEPTH) in error.message
    rejects(lambda: parse_json_body(nested(5000)), "body")


@pytest.mark.parametrize("body", [b"", b"   ", b"{", b"[1, 2]", b'"text"', b"nul",
                                  b'{"a": 1,}', b"\xff\xfe"])
def test_bad_bodies_are_400(body):
    rejects(lambda: parse_json_body(body), "body")


# --- Chat Completions -------------------------------------------------------------------------

def test_chat_full_request_maps_every_field():
    body = {
        "model": "anything", "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                         {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny.", "reasoning": "Easy."},
            {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "d", "strict": True,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "max_completion_tokens": 50, "max_tokens": 999, "temperature": 0.5, "top_p": 0.9,
        "top_k": 20, "min_p": 0.05, "presence_penalty": 1.5, "frequency_penalty": 0.1,
        "seed": -5, "stop": ["END", "STOP"], "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True,
                                 "custom_flag": 1},
        "thinking_budget": 100, "reasoning_effort": "high",
        # accepted and ignored
        "metadata": {"a": "b"}, "store": False, "user": "u", "prompt_cache_key": "k",
        "safety_identifier": "s", "service_tier": "auto", "verbosity": "medium",
        "prediction": {"type": "content", "content": "x"}, "logit_bias": {"5": 0},
        "logprobs": False, "top_logprobs": 0, "n": 1, "some_future_field": {"x": 1},
        "repetition_penalty": 1.0, "modalities": ["text"],
    }
    job, options = parse_chat_request(body, FULL)
    assert options.stream and options.include_usage
    assert [m["role"] for m in job.messages] == ["system", "user", "assistant", "tool",
                                                 "assistant", "user"]
    assert job.messages[1]["content"] == "Weather in Paris?"
    call = job.messages[2]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris", "days": 2}
    assert job.messages[2]["reasoning_content"] == "Need the tool."
    assert job.messages[4]["reasoning_content"] == "Easy."
    assert job.tools[0]["function"]["strict"] is True
    assert job.max_tokens == 50 and job.sampling.temperature == 0.5 and job.sampling.top_k == 20
    assert job.sampling.seed == (-5) & ((1 << 63) - 1)
    assert job.stop == ("END", "STOP")
    assert job.enable_thinking is False and job.preserve_thinking is True
    assert job.template_kwargs == {"custom_flag": 1}
    assert job.reasoning_effort == "high" and job.thinking_budget == 100
    assert job.parallel_tool_calls is False and not job.continue_final


def test_chat_broken_history_arguments_stay_raw():
    body = {"messages": [USER[0], {"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}]}]}
    job, _ = parse_chat_request(body)
    assert job.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": '
    assert not job.continue_final  # a call awaiting its result is not a prefill
    job, _ = parse_chat_request({"messages": [USER[0], {"role": "assistant",
                                                        "content": "The answer is"}]})
    assert job.continue_final  # a final assistant text is continued


def test_chat_thinking_switches():
    job, _ = parse_chat_request({"messages": USER, "reasoning_effort": "none"})
    assert job.enable_thinking is False and job.reasoning_effort is None
    job, _ = parse_chat_request({"messages": USER, "enable_thinking": True,
                                 "chat_template_kwargs": {"enable_thinking": False}})
    assert job.enable_thinking is True
    job, _ = parse_chat_request({"messages": USER})
    assert job.enable_thinking is None and job.max_tokens is None


def test_chat_tool_choice_none_hides_the_tools():
    tools = [{"type": "function", "function": {"name": "f"}}]
    job, _ = parse_chat_request({"messages": USER, "tools": tools, "tool_choice": "none"})
    assert job.tools == () and job.tool_choice.mode == "none"
    job, _ = parse_chat_request({"messages": USER, "tools": tools, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, FULL)
    assert job.tool_choice.mode == "named" and job.tool_choice.name == "f"
    assert job.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": 40}, "top_k"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": "many"}, "max_completion_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"verbosity": "loud"}, "verbosity"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
])
def test_chat_rejections_name_the_field(extra, param):
    rejects(lambda: parse_chat_request({"messages": USER, **extra}, BARE), param)


@pytest.mark.parametrize("messages, param", [
    (None, "messages"),
    ([], "messages"),
    (["hi"], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                   {"type": "image_url", "image_url": {"detail": "auto"}}]}],
     "messages[0].content[1].image_url.url"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0].type"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_chat_message_rejections_name_the_field(messages, param):
    body = {} if messages is None else {"messages": messages}
    rejects(lambda: parse_chat_request(body), param)


# --- Responses --------------------------------------------------------------------------------

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


def _custom(name: str, syntax: str, definition: str) -> dict:
    return {"type": "custom", "name": name, "description": "d",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition}}


PLATE = _custom("plate", "regex", r"^\d{3}-[a-z]+$")
EXPR = _custom("calc", "lark", 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]+/\n')
SHELL = {"type": "function", "name": "shell", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def test_responses_custom_tool_grammars_reach_the_constraint():
    from protocols.job import ToolGrammar
    from protocols.session_backend import constraint_spec

    body = {"input": "hi", "tools": [PLATE, EXPR, SHELL, {"type": "custom", "name": "note"}]}
    job, options = parse_responses_request(body, FULL)
    assert job.tool_grammars == (
        ToolGrammar("plate", "regex", r"^\d{3}-[a-z]+$"),
        ToolGrammar("calc", "lark", EXPR["format"]["definition"]))
    assert options.custom_tools == {"plate", "calc", "note"}
    plate = next(t["function"] for t in job.tools if t["function"]["name"] == "plate")
    assert plate["parameters"]["properties"] == {
        "input": {"type": "string", "description": "the raw tool input"}}
    assert "regex grammar" in plate["description"]  # the model is told the format too

    # auto: free text, or calls whose inputs follow the grammars
    spec, param = constraint_spec(job)
    assert spec.kind == "lark" and param == "tools"
    assert spec.payload.splitlines()[1].startswith("start: free_text (")
    assert r"/^\d{3}-[a-z]+$/" in spec.payload
    assert "%lark {\nstart: expr\n" in spec.payload
    # forced: calls only; a named custom tool: that tool only
    job, _ = parse_responses_request({**body, "tool_choice": "required"}, FULL)
    spec, param = constraint_spec(job)
    assert param == "tool_choice" and "free_text" not in spec.payload
    job, _ = parse_responses_request({**body, "tool_choice": {"type": "custom", "name": "calc"}},
                                     FULL)
    spec, _ = constraint_spec(job)
    assert "%lark" in spec.payload and "plate" not in spec.payload
    # tool_choice none: no tools shown, nothing enforced
    job, _ = parse_responses_request({**body, "tool_choice": "none"}, FULL)
    assert job.tools == () and job.tool_grammars == () and constraint_spec(job)[0] is None


def test_responses_auto_fallback_leaves_non_strict_tools_unchecked():
    from protocols.session_backend import constraint_spec

    strict = {**SHELL, "name": "strict_shell", "strict": True}
    job, _ = parse_responses_request({"input": "hi", "tools": [PLATE, SHELL, strict]}, FULL)
    full, _ = constraint_spec(job)
    loose, param = constraint_spec(job, loose=True)
    assert param == "tools" and "LOOSE_BODY" not in full.payload
    assert loose.payload.count("LOOSE_BODY </tool_call>") == 1
    assert r"function\x{3d}shell\x{3e}/" in loose.payload  # header only: shell
    assert r"function\x{3d}strict\x{5f}shell\x{3e}\x{a}/" in loose.payload  # checked
    assert r"/^\d{3}-[a-z]+$/" in loose.payload  # and the grammar tool too


def test_responses_text_custom_tools_alone_leave_auto_unconstrained():
    from protocols.session_backend import constraint_spec

    job, _ = parse_responses_request({"input": "hi", "tools": [
        SHELL, {"type": "custom", "name": "note", "format": {"type": "text"}}]}, FULL)
    assert job.tool_grammars == () and constraint_spec(job)[0] is None


def test_responses_custom_tool_grammars_without_constraints_are_only_described():
    body = {"input": "hi", "tools": [_custom("x", "lark", "start: nope")]}
    job, _ = parse_responses_request(body, BARE)  # cannot be checked or enforced here
    assert job.tool_grammars[0].definition == "start: nope"


@pytest.mark.parametrize("tool, message", [
    (_custom("calc", "lark", "start: expr\n"), "invalid Lark grammar: .*expr"),
    (_custom("calc", "lark", 'start: "a" (\n'), "invalid Lark grammar"),
    (_custom("calc", "lark", ""), "invalid Lark grammar"),
    (_custom("calc", "lark", 'start: "a" <|im_end|>\n'), "special tokens"),
    (_custom("calc", "regex", "(ab"), "invalid regex: .*unclosed group"),
    (_custom("calc", "regex", r"(a)\1"), "invalid regex: .*backreferences"),
], ids=["lark-undefined", "lark-syntax", "lark-empty", "lark-special-token", "regex",
        "regex-backreference"])
def test_responses_bad_custom_tool_grammar_is_400_naming_the_tool(tool, message):
    error = rejects(lambda: parse_responses_request({"input": "hi", "tools": [SHELL, tool]},
                                                    FULL), "tools[1].format.definition")
    assert error.code == "invalid_constraint"
    assert "custom tool 'calc': " in error.message
    assert re.search(message, error.message), error.message


@pytest.mark.parametrize("fmt, param", [
    ({"type": "grammar", "syntax": "ebnf", "definition": "x"}, "tools[0].format.syntax"),
    ({"type": "grammar", "definition": "start: /a/"}, "tools[0].format.syntax"),
    ({"type": "grammar", "syntax": "lark"}, "tools[0].format.definition"),
    ({"type": "grammar", "syntax": "lark", "definition": 5}, "tools[0].format.definition"),
    ({"type": "json"}, "tools[0].format.type"),
])
def test_responses_custom_tool_format_rejections(fmt, param):
    body = {"input": "hi", "tools": [{"type": "custom", "name": "x", "format": fmt}]}
    rejects(lambda: parse_responses_request(body, FULL), param)


# --- Anthropic Messages -----------------------------------------------------------------------

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
