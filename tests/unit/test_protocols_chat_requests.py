"""Chat Completions request validation (`protocols.openai_chat.parse_chat_request`): the fields
serious clients send become a `GenerationJob`; what the engine cannot honour is a 400 naming the
field; unknown harmless fields pass; reasoning sent back is kept."""

from __future__ import annotations

import pytest

from protocols.openai_chat import parse_chat_request
from tests.unit.request_checks import BARE, FULL, USER, rejects


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
