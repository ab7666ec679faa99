"""Shared by the output parser tests (test_parser*.py): the tools the cases call, and `parse`,
which parses model output token by token, all at once and in random chunks, checks that the
results agree and that every call's streamed arguments form one valid JSON object.
"""

from __future__ import annotations

import json
import random

from runtime.text.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, \
    ToolCallStart
from runtime.text.parser import OutputAccumulator, QwenOutputParser

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                   "mode": {"type": "integer"}, "append": {"type": "boolean"}},
    "required": ["path", "content"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TYPED = {"type": "function", "function": {"name": "typed", "parameters": {
    "type": "object",
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    "properties": {
        "s": {"type": "string"}, "i": {"type": "integer"}, "f": {"type": "number"},
        "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
        "maybe_i": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "maybe_s": {"type": ["string", "null"]},
        "one": {"oneOf": [{"type": "array"}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/Point"},
        "color": {"enum": ["red", "green"]},
        "free": {},
    }}}}
ROOT_UNION = {"type": "function", "function": {"name": "union", "parameters": {
    "oneOf": [{"type": "object", "properties": {"id": {"type": "integer"}}},
              {"type": "object", "properties": {"name": {"type": "string"}}}]}}}
TOOLS = [WRITE, WEATHER, TYPED, ROOT_UNION]


def _feed_all(tokenizer, ids, chunks, truncated, **options):
    options.setdefault("tools", TOOLS)
    options.setdefault("starts_in_reasoning", False)
    parser = QwenOutputParser(tokenizer, **options)
    events = []
    position = 0
    for size in chunks:
        events += parser.feed(ids[position:position + size])
        position += size
    events += parser.feed(ids[position:])
    events += parser.finish(truncated)
    return parser, events


def _check_events(events):
    """Streaming invariants: starts before args, args of each call form one JSON object."""
    open_calls, args = set(), {}
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index >= 0 and event.call_id and event.name
            assert event.index not in args
            open_calls.add(event.index)
            args[event.index] = ""
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index in open_calls
            args[event.index] += event.json_fragment
        elif isinstance(event, ToolCallEnd):
            open_calls.remove(event.index)
            assert isinstance(json.loads(args[event.index]), dict), args[event.index]
        elif isinstance(event, (ReasoningDelta, ContentDelta)):
            assert event.text
    assert not open_calls, "a call was left open"


def parse(tokenizer, text, *, truncated=False, ids=None, **options):
    """Parse `text` (model output) three ways; return (accumulator, parser) of the first."""
    ids = tokenizer.encode(text) if ids is None else ids
    results = []
    rng = random.Random(len(ids))
    for chunks in ([1] * len(ids), [], [rng.randint(1, 7) for _ in range(len(ids))]):
        parser, events = _feed_all(tokenizer, ids, chunks, truncated, **options)
        _check_events(events)
        accumulator = OutputAccumulator()
        accumulator.add(events)
        results.append((accumulator, parser))
    first = results[0][0]
    for other, _ in results[1:]:
        assert other.reasoning == first.reasoning
        assert other.content == first.content
        assert [(c["name"], c["arguments"]) for c in other.tool_calls] == \
            [(c["name"], c["arguments"]) for c in first.tool_calls]
    return results[0]


def calls(accumulator):
    return [(c["name"], json.loads(c["arguments"])) for c in accumulator.tool_calls]


def xml_call(function, /, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"
