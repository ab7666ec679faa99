"""The three API encoders on hand-made parser-event sequences, checked with the SDKs' own
pydantic types (every payload) and their own stream accumulators (the final object)."""

from __future__ import annotations

import typing

import orjson
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from protocols.anthropic_messages import MessagesEncoder, error_event
from protocols.errors import ApiError
from protocols.generation import GenerationResult
from protocols.openai_chat import ChatEncoder
from protocols.responses_encoder import ResponsesEncoder, decode_reasoning
from runtime.text.events import (ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd,
                                 ToolCallStart)



def _responses_event_classes() -> dict:
    union = ResponseStreamEvent
    if typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    return {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
            for cls in typing.get_args(union)}


RESPONSE_EVENT_CLASSES = _responses_event_classes()


class _ResponseEventValidator:
    """Validates a Responses stream payload with the concrete SDK class for its `type`."""

    @staticmethod
    def validate_python(payload: dict):
        return RESPONSE_EVENT_CLASSES[payload["type"]].model_validate(payload)


RESPONSE_EVENT = _ResponseEventValidator()
ANTHROPIC_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)

REASONING_TEXT_CALLS = [
    ReasoningDelta("I should "), ReasoningDelta("check the weather."),
    ContentDelta("Let me look."),
    ToolCallStart(0, "call_a", "get_weather"), ToolCallArgsDelta(0, '{"city": "Pa'),
    ToolCallArgsDelta(0, 'ris"}'), ToolCallEnd(0),
    ToolCallStart(1, "call_b", "get_time"), ToolCallArgsDelta(1, "{}"), ToolCallEnd(1),
]
TEXT_ONLY = [ReasoningDelta("hmm"), ContentDelta("Hello"), ContentDelta(", world")]
RESULT = GenerationResult(prompt_tokens=40, cached_prompt_tokens=16, completion_tokens=12,
                          reasoning_tokens=5)


def jsonable(payload: dict) -> dict:
    """What a client receives: the payload through the wire JSON."""
    return orjson.loads(orjson.dumps(payload))


# --- Chat Completions -------------------------------------------------------------------------

def chat_stream(events, result=RESULT, **kw):
    encoder = ChatEncoder("chatcmpl-1", "m", include_usage=True, **kw)
    payloads = encoder.start() + encoder.events(events[:3]) + [encoder.heartbeat()]
    payloads += encoder.events(events[3:]) + encoder.finish(result)
    return encoder, [jsonable(p) for p in payloads]


def test_chat_stream_validates_and_accumulates():
    _, payloads = chat_stream(REASONING_TEXT_CALLS)
    state = ChatCompletionStreamState()
    for payload in payloads:
        state.handle_chunk(ChatCompletionChunk.model_validate(payload))
    completion = state.get_final_completion()
    message = completion.choices[0].message
    assert message.content == "Let me look."
    assert message.model_extra["reasoning_content"] == "I should check the weather."
    assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("call_a", "get_weather", '{"city": "Paris"}'), ("call_b", "get_time", "{}")]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.usage.prompt_tokens == 40
    assert completion.usage.prompt_tokens_details.cached_tokens == 16
    assert completion.usage.completion_tokens_details.reasoning_tokens == 5


def test_chat_tool_call_deltas_follow_the_client_rules():
    _, payloads = chat_stream(REASONING_TEXT_CALLS)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    seen: dict[int, int] = {}
    for payload in payloads:
        for choice in payload["choices"]:
            for call in choice["delta"].get("tool_calls", []):
                assert None not in call.values() and None not in call["function"].values()
                first = call["index"] not in seen
                seen[call["index"]] = seen.get(call["index"], 0) + 1
                if first:  # id, type and name only on the first delta (AI SDK, openai-python)
                    assert call["id"] and call["type"] == "function" and call["function"]["name"]
                    assert call["function"]["arguments"] == ""
                else:
                    assert set(call) == {"index", "function"}
                    assert set(call["function"]) == {"arguments"}
    finish = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["total_tokens"] == 52
    assert all(p["usage"] is None for p in payloads[:-1])


def test_chat_holds_back_an_arguments_prefix_that_already_parses():
    events = [ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "{}"),
              ToolCallArgsDelta(0, ""), ToolCallEnd(0)]
    encoder = ChatEncoder("x", "m")
    out = encoder.events(events[:2])
    assert len(out) == 1  # the header only: "{}" alone could be taken as finished
    out = encoder.events(events[2:])
    assert out[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == "{}"
    # A continuation after a parseable prefix is merged with the held piece.
    encoder = ChatEncoder("x", "m")
    encoder.events([ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, '{"a": {"b": 1}}')])
    more = encoder.events([ToolCallArgsDelta(0, " ")])
    assert more == [] or "arguments" in str(more)


def test_chat_non_streaming_response_validates():
    encoder = ChatEncoder("chatcmpl-2", "m")
    encoder.events(REASONING_TEXT_CALLS)
    completion = ChatCompletion.model_validate(jsonable(encoder.response(RESULT)))
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.choices[0].message.tool_calls[1].function.arguments == "{}"
    assert completion.choices[0].message.model_extra["reasoning_content"]
    text = ChatEncoder("c", "m")
    text.events(TEXT_ONLY)
    completion = ChatCompletion.model_validate(jsonable(text.response(
        GenerationResult(finish_reason="length"))))
    assert completion.choices[0].message.content == "Hello, world"
    assert completion.choices[0].finish_reason == "length"


def test_chat_without_usage_option_sends_no_usage_fields():
    encoder = ChatEncoder("c", "m")
    payloads = encoder.start() + encoder.events(TEXT_ONLY) + encoder.finish(RESULT)
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


# --- Responses --------------------------------------------------------------------------------

def responses_stream(events, result=RESULT, custom=frozenset(), include_encrypted=False):
    encoder = ResponsesEncoder("resp_1", "m", {"tools": [], "tool_choice": "auto",
                                               "parallel_tool_calls": True},
                               custom_tools=custom,
                               include_encrypted_reasoning=include_encrypted)
    payloads = encoder.start() + encoder.events(events[:2]) + [encoder.heartbeat()]
    payloads += encoder.events(events[2:]) + encoder.finish(result)
    return encoder, [jsonable(p) for p in payloads]


def test_responses_stream_validates_and_accumulates():
    _, payloads = responses_stream(REASONING_TEXT_CALLS, include_encrypted=True)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for number, payload in enumerate(payloads):
        assert payload["sequence_number"] == number
        state.handle_event(RESPONSE_EVENT.validate_python(payload))
    final = payloads[-1]
    assert final["type"] == "response.completed"
    response = Response.model_validate(final["response"])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "I should check the weather."
    assert decode_reasoning(response.output[0].encrypted_content) == response.output[0].content[0].text
    assert response.output[1].content[0].text == "Let me look."
    assert response.output[2].arguments == '{"city": "Paris"}'
    assert response.output[3].arguments == "{}"
    assert response.usage.input_tokens_details.cached_tokens == 16
    assert response.usage.output_tokens_details.reasoning_tokens == 5


def test_responses_items_open_before_content_and_close_before_completion():
    _, payloads = responses_stream(REASONING_TEXT_CALLS)
    added, done = [], []
    for payload in payloads:
        if payload["type"] == "response.output_item.added":
            assert payload["output_index"] == len(added)
            added.append(payload["item"]["id"])
        elif payload["type"] == "response.output_item.done":
            done.append(payload["item"]["id"])
        elif "output_index" in payload:
            assert payload["output_index"] < len(added)
            assert payload["item_id"] == added[payload["output_index"]]
    assert added == done
    assert payloads[0]["type"] == "response.created"
    assert payloads[1]["type"] == "response.in_progress"


def test_responses_length_limit_is_incomplete():
    _, payloads = responses_stream(TEXT_ONLY, GenerationResult(finish_reason="length"))
    assert payloads[-1]["type"] == "response.incomplete"
    response = Response.model_validate(payloads[-1]["response"])
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_responses_custom_tool_call_unwraps_the_input():
    events = [ToolCallStart(0, "call_p", "apply_patch"),
              ToolCallArgsDelta(0, '{"input": "*** Begin Patch\\n"}'), ToolCallEnd(0)]
    _, payloads = responses_stream(events, custom=frozenset({"apply_patch"}))
    for payload in payloads:
        RESPONSE_EVENT.validate_python(payload)
    response = Response.model_validate(payloads[-1]["response"])
    assert response.output[0].type == "custom_tool_call"
    assert response.output[0].input == "*** Begin Patch\n"


def test_responses_failure_closes_open_items():
    encoder = ResponsesEncoder("resp_2", "m", {"tools": [], "tool_choice": "auto",
                                               "parallel_tool_calls": True})
    payloads = encoder.start() + encoder.events(TEXT_ONLY)
    payloads += encoder.failed(ApiError(500, "boom", code="server_error"))
    for payload in payloads:
        RESPONSE_EVENT.validate_python(jsonable(payload))
    assert payloads[-1]["type"] == "response.failed"
    assert payloads[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}


# --- Anthropic Messages -----------------------------------------------------------------------

def messages_stream(events, result=RESULT, show_thinking=True):
    encoder = MessagesEncoder("msg_1", "m", 40, show_thinking=show_thinking)
    payloads = encoder.start() + [encoder.heartbeat()] + encoder.events(events)
    payloads += encoder.finish(result)
    return encoder, [jsonable(p) for p in payloads]


def accumulate(payloads):
    snapshot = None
    json_bufs: dict = {}  # the SDK's buffers of partial tool input JSON, per block index
    for payload in payloads:
        event = ANTHROPIC_EVENT.validate_python(payload) if payload["type"] != "ping" else None
        if event is not None:
            snapshot = accumulate_event(event=event, current_snapshot=snapshot,
                                        json_bufs=json_bufs)
    return snapshot


def test_messages_stream_validates_and_accumulates():
    _, payloads = messages_stream(REASONING_TEXT_CALLS)
    message = accumulate(payloads)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use",
                                                          "tool_use"]
    assert message.content[0].thinking == "I should check the weather."
    assert message.content[0].signature
    assert message.content[2].input == {"city": "Paris"}
    assert message.content[3].input == {}
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 24 and message.usage.cache_read_input_tokens == 16
    assert message.usage.output_tokens == 12


def test_messages_block_indices_are_contiguous_and_never_interleave():
    _, payloads = messages_stream(REASONING_TEXT_CALLS)
    open_index = None
    next_index = 0
    for payload in payloads:
        if payload["type"] == "content_block_start":
            assert open_index is None and payload["index"] == next_index
            open_index = payload["index"]
            next_index += 1
        elif payload["type"] == "content_block_delta":
            assert payload["index"] == open_index
        elif payload["type"] == "content_block_stop":
            assert payload["index"] == open_index
            open_index = None
    assert open_index is None
    signature = [p for p in payloads if p["type"] == "content_block_delta"
                 and p["delta"]["type"] == "signature_delta"]
    assert len(signature) == 1 and signature[0]["index"] == 0
    assert payloads[-2]["type"] == "message_delta" and payloads[-1]["type"] == "message_stop"


@pytest.mark.parametrize("result, reason", [
    (GenerationResult(finish_reason="length"), "max_tokens"),
    (GenerationResult(finish_reason="context"), "model_context_window_exceeded"),
    (GenerationResult(stop_sequence="END"), "stop_sequence"),
    (GenerationResult(), "end_turn"),
])
def test_messages_stop_reasons(result, reason):
    encoder, payloads = messages_stream(TEXT_ONLY, result)
    assert accumulate(payloads).stop_reason == reason
    assert Message.model_validate(jsonable(encoder.response(result))).stop_reason == reason


def test_messages_omitted_thinking_sends_an_empty_thinking_block():
    _, payloads = messages_stream(TEXT_ONLY, show_thinking=False)
    message = accumulate(payloads)
    assert message.content[0].type == "thinking" and message.content[0].thinking == ""
    assert message.content[1].text == "Hello, world"


def test_messages_error_event_validates():
    payload = jsonable(error_event(ApiError(503, "Overloaded")))
    assert payload == {"type": "error", "error": {"type": "overloaded_error",
                                                  "message": "Overloaded"}}
