"""Tool-call round trips through each API's SDK against the real server over the scripted fake
backend: the call goes out, its result comes back, and the reasoning is fed back to the
template; `parallel_tool_calls: false` ends the generation after one call."""

from __future__ import annotations

from protocols.fake import Script
from runtime.text.events import ContentDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from tests.e2e.fake_server_support import (USER, WEATHER, WEATHER_ANTHROPIC, WEATHER_FLAT,
                                           wait_until)


def test_chat_tool_round_trip(fake_server, clients):
    server = fake_server()
    client = clients.openai(server)
    first = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "The tool said: sunny, 21 C"
    job = server.backend.jobs[-1]
    assert job.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert job.messages[1]["reasoning_content"] == "Let me think."  # reasoning fed back


def test_responses_tool_round_trip(fake_server, clients):
    server = fake_server()
    client = clients.openai(server)
    first = client.responses.create(model="m", input=USER, tools=[WEATHER_FLAT], store=False,
                                    include=["reasoning.encrypted_content"])
    call = next(item for item in first.output if item.type == "function_call")
    reasoning = next(item for item in first.output if item.type == "reasoning")
    assert reasoning.encrypted_content
    history = USER + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    for item in history:
        if item.get("type") == "reasoning":
            item.pop("content", None)  # stateless clients keep only the encrypted form
    second = client.responses.create(model="m", input=history, tools=[WEATHER_FLAT])
    assert second.output_text == "The tool said: rain"
    assert server.backend.jobs[-1].messages[1]["reasoning_content"] == "Let me think."


def test_messages_tool_round_trip(fake_server, clients):
    server = fake_server()
    client = clients.anthropic(server)
    first = client.messages.create(model="m", max_tokens=100, messages=USER,
                                   tools=[WEATHER_ANTHROPIC])
    tool_use = first.content[-1]
    history = USER + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                      {"role": "user", "content": [{"type": "tool_result",
                                                    "tool_use_id": tool_use.id,
                                                    "content": "snow"}]}]
    second = client.messages.create(model="m", max_tokens=100, messages=history,
                                    tools=[WEATHER_ANTHROPIC])
    assert second.content[-1].text == "The tool said: snow"
    assert server.backend.jobs[-1].messages[1]["reasoning_content"] == "Let me think."


def test_parallel_tool_calls_false_stops_after_one_call(fake_server, clients):
    def two_calls(job):
        return Script(events=[ToolCallStart(0, "c0", "get_weather"),
                              ToolCallArgsDelta(0, '{"city": "A"}'), ToolCallEnd(0),
                              ToolCallStart(1, "c1", "get_weather"),
                              ToolCallArgsDelta(1, '{"city": "B"}'), ToolCallEnd(1),
                              ContentDelta("never sent")], step_s=0.05)

    server = fake_server(two_calls)
    completion = clients.openai(server).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], parallel_tool_calls=False)
    assert len(completion.choices[0].message.tool_calls) == 1
    assert completion.choices[0].finish_reason == "tool_calls"
    assert wait_until(lambda: server.backend.cancelled)
