"""The streaming Qwen output parser on the real vocabulary: reasoning / content / tool calls and
every edge case of research/protocols.md 4.4.

Model output is written as text and encoded with special-token parsing, so `<think>`,
`</think>`, `<tool_call>`, `</tool_call>` and `<|im_end|>` become their special ids exactly as
the model emits them. Each case is parsed token by token, all at once and in random chunks; the
results must agree, and every call's streamed arguments must be one valid JSON object.
"""

from __future__ import annotations

import json
import random

import pytest

from runtime.text.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, \
    ToolCallStart
from runtime.text.parser import OutputAccumulator, QwenOutputParser, prompt_ends_in_reasoning
from runtime.text.stops import StopConditions, StopHit

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


# --- reasoning and content -----------------------------------------------------------------

def test_reasoning_then_answer(qwen_tokenizer):
    acc, parser = parse(qwen_tokenizer, "Let me think.\nStep 2.\n</think>\n\nThe answer is 4."
                        "<|im_end|>", starts_in_reasoning=True)
    assert acc.reasoning == "Let me think.\nStep 2."
    assert acc.content == "The answer is 4."
    assert acc.tool_calls == []
    assert parser.stopped.kind == "eos" and parser.stopped.value == 248046


def test_prompt_ends_in_reasoning(qwen_tokenizer):
    tk = qwen_tokenizer
    assert prompt_ends_in_reasoning(tk.encode("<|im_start|>assistant\n<think>\n"), tk)
    assert not prompt_ends_in_reasoning(
        tk.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"), tk)
    assert not prompt_ends_in_reasoning(tk.encode("<|im_start|>assistant\n"), tk)


def test_plain_answer_without_thinking(qwen_tokenizer):
    acc, _ = parse(qwen_tokenizer, "Hello 世界 😀!\n<|im_end|>")
    assert acc.reasoning == "" and acc.content == "Hello 世界 😀!\n"


def test_reasoning_only_answer(qwen_tokenizer):
    acc, parser = parse(qwen_tokenizer, "Thinking until the budget runs out\n<|im_end|>",
                        starts_in_reasoning=True)
    assert acc.reasoning == "Thinking until the budget runs out"
    assert acc.content == "" and acc.tool_calls == []
    assert parser.stopped.kind == "eos"
    acc, parser = parse(qwen_tokenizer, "cut by the limit", starts_in_reasoning=True,
                        truncated=True)
    assert acc.reasoning == "cut by the limit" and parser.stopped is None


def test_think_token_in_content_opens_reasoning(qwen_tokenizer):
    acc, _ = parse(qwen_tokenizer, "<think>\nhidden\n</think>\n\nshown")
    assert acc.reasoning == "hidden" and acc.content == "shown"


def test_markers_spelled_in_text_are_text(qwen_tokenizer):
    tk = qwen_tokenizer
    spelled = "Use </think> and <tool_call> tags; <parameter=x> is not a call </function>."
    ids = tk.encode("plan\n</think>\n\n") + tk.encode(spelled, parse_special=False)
    acc, _ = parse(tk, "", ids=ids, starts_in_reasoning=True)
    assert acc.content == spelled and acc.tool_calls == []
    ids = tk.encode("reason about </think> the tag", parse_special=False)
    acc, _ = parse(tk, "", ids=ids, starts_in_reasoning=True)
    assert acc.reasoning == "reason about </think> the tag" and acc.content == ""


def test_split_utf8_is_never_emitted_half(qwen_tokenizer):
    tk = qwen_tokenizer
    ids = tk.encode("日本語 🎉 ok", parse_special=False)
    parser = QwenOutputParser(tk, starts_in_reasoning=False)
    texts = [e.text for i in ids for e in parser.feed([i])]
    assert "\ufffd" not in "".join(texts)
    assert "".join(texts) == "日本語 🎉 ok"
    # A cut inside a character flushes as U+FFFD at the end.
    emoji = tk.encode("🎉", parse_special=False)
    assert len(emoji) > 1
    parser = QwenOutputParser(tk, starts_in_reasoning=False)
    assert parser.feed(emoji[:1]) == []
    assert parser.finish(truncated=True) == [ContentDelta("\ufffd")]


# --- XML tool calls ----------------------------------------------------------------------

def test_call_after_reasoning_and_text(qwen_tokenizer):
    text = ("Need the weather.\n</think>\n\nI'll check.\n\n"
            + xml_call("get_weather", city="Paris", days="3") + "<|im_end|>")
    acc, parser = parse(qwen_tokenizer, text, starts_in_reasoning=True)
    assert acc.reasoning == "Need the weather."
    assert acc.content == "I'll check."
    assert calls(acc) == [("get_weather", {"city": "Paris", "days": 3})]
    assert acc.tool_calls[0]["id"].startswith("call_") and len(acc.tool_calls[0]["id"]) == 29
    assert acc.tool_calls[0]["arguments"] == '{"city": "Paris", "days": 3}'
    assert parser.tool_call_count == 1


def test_call_id_prefix_and_indices_across_blocks(qwen_tokenizer):
    text = (xml_call("get_weather", city="A") + "\n" + xml_call("get_weather", city="B")
            + "<|im_end|>")
    parser, events = _feed_all(qwen_tokenizer, qwen_tokenizer.encode(text), [], False,
                               tools=TOOLS, call_id_prefix="toolu_")
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == [0, 1]
    assert all(s.call_id.startswith("toolu_") for s in starts)
    assert starts[0].call_id != starts[1].call_id
    assert not any(isinstance(e, ContentDelta) for e in events)  # the "\n" between calls


def test_string_arguments_stream_before_the_value_ends(qwen_tokenizer):
    tk = qwen_tokenizer
    head = "<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline two"
    parser = QwenOutputParser(tk, tools=TOOLS, starts_in_reasoning=False)
    events = parser.feed(tk.encode(head))
    fragments = "".join(e.json_fragment for e in events if isinstance(e, ToolCallArgsDelta))
    assert fragments == '{"content": "line one\\nline two'
    events = parser.feed(tk.encode("\n</parameter>\n</function>\n</tool_call>"))
    fragments += "".join(e.json_fragment for e in events if isinstance(e, ToolCallArgsDelta))
    assert json.loads(fragments) == {"content": "line one\nline two"}


def test_literal_closing_tags_inside_a_value(qwen_tokenizer):
    content = ("<root>\n</parameter>\n<b>x</b>\n</function>\nmore\n</tool_call>\n"
               "<parameter=nope>\n</parameter>\n<tool_call>\n<think>x</think>\ntail\n")
    text = ("<tool_call>\n<function=write_file>\n<parameter=path>\ntests/a.xml\n</parameter>\n"
            f"<parameter=content>\n{content}\n</parameter>\n</function>\n</tool_call><|im_end|>")
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("write_file", {"path": "tests/a.xml", "content": content})]
    assert acc.content == ""


def test_exactly_one_newline_is_stripped_each_side(qwen_tokenizer):
    text = ("<tool_call>\n<function=write_file>\n<parameter=content>\n\n  indented\n\n"
            "</parameter>\n<parameter=path>same line</parameter>\n</function>\n</tool_call>")
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("write_file", {"content": "\n  indented\n", "path": "same line"})]


def test_several_function_blocks_in_one_call(qwen_tokenizer):
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "</function>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>")
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]


def test_duplicate_parameter_first_wins(qwen_tokenizer):
    text = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
            "<parameter=path>\nb.txt\n</parameter>\n<parameter=content>\nx\n</parameter>\n"
            "</function>\n</tool_call>")
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("write_file", {"path": "a.txt", "content": "x"})]


def test_unknown_function_is_passed_through(qwen_tokenizer):
    text = xml_call("mcp__server__do", count="3", data='{"k": [1]}', word="plain") + "<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("mcp__server__do", {"count": 3, "data": {"k": [1]}, "word": "plain"})]
    acc, _ = parse(qwen_tokenizer, text, tools=None)
    assert calls(acc)[0][1]["count"] == 3


def test_missing_closing_tags(qwen_tokenizer):
    # </parameter> missing before </function>
    acc, _ = parse(qwen_tokenizer, "<tool_call>\n<function=write_file>\n<parameter=path>\n"
                   "a.py\n</function>\n</tool_call><|im_end|>")
    assert calls(acc) == [("write_file", {"path": "a.py"})]
    # </function> missing before </tool_call>
    acc, _ = parse(qwen_tokenizer, "<tool_call>\n<function=write_file>\n<parameter=path>\n"
                   "a.py\n</parameter>\n</tool_call><|im_end|>")
    assert calls(acc) == [("write_file", {"path": "a.py"})]
    # </parameter> missing before the next declared parameter
    acc, _ = parse(qwen_tokenizer, "<tool_call>\n<function=write_file>\n<parameter=path>\n"
                   "a.py\n<parameter=content>\nbody\n</parameter>\n</function>\n</tool_call>")
    assert calls(acc) == [("write_file", {"path": "a.py", "content": "body"})]
    # </tool_call> missing: the output ends after </function>
    acc, parser = parse(qwen_tokenizer, "<tool_call>\n<function=get_weather>\n"
                        "<parameter=city>\nLima\n</parameter>\n</function>\n<|im_end|>")
    assert calls(acc) == [("get_weather", {"city": "Lima"})]
    # Everything missing: the output ends inside the value (eos)
    acc, _ = parse(qwen_tokenizer, "<tool_call>\n<function=write_file>\n<parameter=content>\n"
                   "abc\n<|im_end|>")
    assert calls(acc) == [("write_file", {"content": "abc"})]


def test_call_cut_by_the_output_limit(qwen_tokenizer):
    head = "<tool_call>\n<function=write_file>\n<parameter=path>\nx.txt\n</parameter>\n"
    # Inside a string value: the streamed string is closed; a cut closing tag is dropped.
    for tail in ("<parameter=content>\nhello wor", "<parameter=content>\nhello wor\n</para"):
        acc, parser = parse(qwen_tokenizer, head + tail, truncated=True)
        assert calls(acc) == [("write_file", {"path": "x.txt", "content": "hello wor"})]
        assert parser.stopped is None
    # Inside a non-string value: left out.
    acc, _ = parse(qwen_tokenizer, head + "<parameter=mode>\n64", truncated=True)
    assert calls(acc) == [("write_file", {"path": "x.txt"})]
    # Inside a parameter header: left out.
    acc, _ = parse(qwen_tokenizer, head + "<parameter=con", truncated=True)
    assert calls(acc) == [("write_file", {"path": "x.txt"})]
    # Right after the value's closing tag.
    acc, _ = parse(qwen_tokenizer, head + "<parameter=mode>\n7\n</parameter>\n", truncated=True)
    assert calls(acc) == [("write_file", {"path": "x.txt", "mode": 7})]


def test_call_cut_before_its_header_is_text_unless_tolerant(qwen_tokenizer):
    text = "Calling.\n\n<tool_call>\n<function=get_wea"
    acc, _ = parse(qwen_tokenizer, text, truncated=True)
    assert acc.tool_calls == [] and acc.content == "Calling.<tool_call>\n<function=get_wea"
    text = "<tool_call>\n<function=get_weather"
    acc, _ = parse(qwen_tokenizer, text, truncated=True, tolerant_tool_calls=True)
    assert calls(acc) == [("get_weather", {})]
    acc, _ = parse(qwen_tokenizer, text, truncated=True)
    assert acc.tool_calls == [] and acc.content == text


# --- markup quoted in prose or code ------------------------------------------------------

def test_call_quoted_in_a_markdown_fence_is_text(qwen_tokenizer):
    quoted = ("```xml\n<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
              "</function>\n</tool_call>\n```")
    text = "The format is:\n\n" + quoted + "\n\nDone.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == []
    assert acc.content == "The format is:\n\n" + quoted + "\n\nDone."
    # After the fence closes, a real call is a call.
    acc, _ = parse(qwen_tokenizer, "```\ncode\n```\n\n" + xml_call("get_weather", city="Y"))
    assert calls(acc) == [("get_weather", {"city": "Y"})] and acc.content == "```\ncode\n```"


def test_call_quoted_in_inline_code_is_text(qwen_tokenizer):
    text = "Write `<tool_call>` to start a call.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == [] and acc.content == "Write `<tool_call>` to start a call."


def test_a_stray_backtick_does_not_quote_the_next_line(qwen_tokenizer):
    text = "Run the ` command.\n\n" + xml_call("get_weather", city="Z") + "<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "Z"})]
    assert acc.content == "Run the ` command."


# --- calls inside unclosed thinking ------------------------------------------------------

def test_call_stranded_in_unclosed_thinking_is_recovered(qwen_tokenizer):
    text = "I should look it up.\n\n" + xml_call("get_weather", city="Kyiv") + "<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text, starts_in_reasoning=True)
    assert acc.reasoning == "I should look it up."
    assert calls(acc) == [("get_weather", {"city": "Kyiv"})]
    assert acc.content == ""


def test_call_drafted_inside_thinking_stays_reasoning(qwen_tokenizer):
    draft = xml_call("get_weather", city="Kyiv")
    text = "Maybe:\n" + draft + "\nNo, answer directly.\n</think>\n\nIt is sunny.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text, starts_in_reasoning=True)
    assert acc.tool_calls == []
    assert acc.reasoning == "Maybe:\n" + draft + "\nNo, answer directly."
    assert acc.content == "It is sunny."


def test_stranded_call_cut_by_the_limit(qwen_tokenizer):
    text = "Look up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKy"
    acc, _ = parse(qwen_tokenizer, text, starts_in_reasoning=True, truncated=True)
    assert acc.reasoning == "Look up."
    assert calls(acc) == [("get_weather", {"city": "Ky"})]


# --- legacy JSON form --------------------------------------------------------------------

def test_legacy_json_form(qwen_tokenizer):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
            '</tool_call><|im_end|>')
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "Oslo", "days": 2})]
    # Trailing commas and arguments given as a JSON string.
    text = ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\",}",}\n'
            '</tool_call>')
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "Oslo"})]


def test_broken_json_call_is_text_unless_tolerant(qwen_tokenizer):
    text = "<tool_call>\n{'name': 'get_weather', 'arguments': {'city': 'Oslo', 'ok': True}}\n</tool_call>"
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == [] and acc.content == text
    acc, _ = parse(qwen_tokenizer, text, tolerant_tool_calls=True)
    assert calls(acc) == [("get_weather", {"city": "Oslo", "ok": True})]
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    acc, _ = parse(qwen_tokenizer, cut, truncated=True, tolerant_tool_calls=True)
    assert calls(acc) == [("get_weather", {"city": "Os"})]
    acc, _ = parse(qwen_tokenizer, cut, truncated=True)
    assert acc.tool_calls == [] and acc.content == cut


# --- broken calls and --tolerant-tool-calls ------------------------------------------------

def test_text_before_the_function_header(qwen_tokenizer):
    text = ("<tool_call>\nI will call it now.\n<function=get_weather>\n<parameter=city>\nRiga\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>")
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == [] and acc.content == text.replace("<|im_end|>", "")
    acc, _ = parse(qwen_tokenizer, text, tolerant_tool_calls=True)
    assert calls(acc) == [("get_weather", {"city": "Riga"})]
    assert acc.content == "I will call it now."


def test_header_without_closing_bracket(qwen_tokenizer):
    text = ("<tool_call>\n<function=get_weather\n<parameter=city>\nRiga\n</parameter>\n"
            "</function>\n</tool_call>")
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == [] and acc.content == text
    acc, _ = parse(qwen_tokenizer, text, tolerant_tool_calls=True)
    assert calls(acc) == [("get_weather", {"city": "Riga"})]


def test_empty_or_prose_call_block_is_text(qwen_tokenizer):
    for body in ("\n", "\nnot a call\n"):
        text = f"Hi\n<tool_call>{body}</tool_call>"
        for tolerant in (False, True):
            acc, _ = parse(qwen_tokenizer, text, tolerant_tool_calls=tolerant)
            assert acc.tool_calls == []
            assert acc.content == "Hi<tool_call>" + body + "</tool_call>"


def test_bare_function_block_after_a_call(qwen_tokenizer):
    text = (xml_call("get_weather", city="A") + "\n<function=get_weather>\n"
            "<parameter=city>\nB\n</parameter>\n</function>\n<|im_end|>")
    acc, _ = parse(qwen_tokenizer, text, tolerant_tool_calls=True)
    assert calls(acc) == [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "A"})]
    assert acc.content.startswith("<function=get_weather>")


def test_text_after_a_call_is_content(qwen_tokenizer):
    text = xml_call("get_weather", city="A") + "\n\nWaiting for the result.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "A"})]
    assert acc.content == "Waiting for the result."


# --- argument typing -----------------------------------------------------------------------

@pytest.mark.parametrize("name, raw, expected", [
    ("s", '{"looks": "like json"}', '{"looks": "like json"}'),
    ("s", "42", "42"),
    ("s", "null", "null"),
    ("i", "42", 42),
    ("i", "-7", -7),
    ("i", "4.0", 4),
    ("i", "four", "four"),
    ("f", "2.5", 2.5),
    ("f", "3", 3),
    ("f", "1e3", 1000.0),
    ("f", "nan", "nan"),
    ("b", "true", True),
    ("b", "False", False),
    ("b", "TRUE", True),
    ("b", "yes", "yes"),
    ("o", '{"a": [1, 2]}', {"a": [1, 2]}),
    ("o", "{'a': True}", {"a": True}),
    ("o", "{broken", "{broken"),
    ("a", "[1, \"x\"]", [1, "x"]),
    ("maybe_i", "null", None),
    ("maybe_i", "12", 12),
    ("maybe_s", "null", None),
    ("maybe_s", "12", "12"),
    ("one", "[true]", [True]),
    ("one", "null", None),
    ("ref", '{"x": 1.5}', {"x": 1.5}),
    ("color", "red", "red"),
    ("free", "[1]", [1]),
    ("free", "7", 7),
    ("free", "just text", "just text"),
    ("undeclared", "true", True),
    ("undeclared", "some words", "some words"),
])
def test_arguments_typed_from_the_schema(qwen_tokenizer, name, raw, expected):
    acc, _ = parse(qwen_tokenizer, xml_call("typed", **{name: raw}))
    assert calls(acc) == [("typed", {name: expected})]


def test_root_one_of_parameters(qwen_tokenizer):
    acc, _ = parse(qwen_tokenizer, xml_call("union", id="5", name="007"))
    assert calls(acc) == [("union", {"id": 5, "name": "007"})]


# --- stops ---------------------------------------------------------------------------------

def test_stop_string_is_never_leaked(qwen_tokenizer):
    tk = qwen_tokenizer
    stop = StopConditions.build(["STOP HERE"])
    acc, parser = parse(tk, "Answer text STOP HERE and more", stop=stop)
    # The text before the match, exactly (its trailing space included).
    assert acc.content == "Answer text " and parser.stopped.kind == "stop_string"
    assert parser.stopped.value == "STOP HERE"
    # Held back while it could still match, released when it cannot.
    parser = QwenOutputParser(tk, starts_in_reasoning=False, stop=stop)
    out = parser.feed(tk.encode("Go STOP"))
    assert "".join(e.text for e in out) == "Go"
    out = parser.feed(tk.encode(" THERE"))
    assert "".join(e.text for e in out) == " STOP THERE"
    assert parser.stopped is None


def test_stop_strings_skip_reasoning_and_reasoning_stops_skip_the_answer(qwen_tokenizer):
    stop = StopConditions.build(stop_strings=["END"], reasoning_stop_strings=["LOOP"])
    acc, parser = parse(qwen_tokenizer, "think END think\n</think>\n\nanswer LOOP END tail",
                        starts_in_reasoning=True, stop=stop)
    assert acc.reasoning == "think END think" and acc.content == "answer LOOP "
    assert parser.stopped.kind == "stop_string"
    acc, parser = parse(qwen_tokenizer, "think LOOP more", starts_in_reasoning=True, stop=stop)
    assert acc.reasoning == "think " and parser.stopped == StopHit("reasoning_stop", "LOOP")


def test_stop_token_ids_and_ignoring_later_ids(qwen_tokenizer):
    tk = qwen_tokenizer
    dot = tk.encode(".")[0]
    stop = StopConditions.build(stop_token_ids=[dot])
    parser = QwenOutputParser(tk, starts_in_reasoning=False, stop=stop)
    events = parser.feed(tk.encode("One. Two."))
    assert "".join(e.text for e in events) == "One"
    assert parser.stopped.kind == "stop_token" and parser.stopped.value == dot
    assert parser.feed(tk.encode("more")) == [] and parser.finish(False) == []


def test_stop_strings_never_fire_inside_a_call(qwen_tokenizer):
    # A server `--stop "="` used to cut `<function=` into the text "<tool_call>\n<function=g"
    # with finish "stop"; inside a call (markup and values) stop strings do not apply.
    stop = StopConditions.build(["=", "<<END>>"])
    text = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
            "<parameter=content>\nabc<<END>>def\n</parameter>\n</function>\n</tool_call>"
            "Done: x=1 more")
    acc, parser = parse(qwen_tokenizer, text, stop=stop)
    assert calls(acc) == [("write_file", {"path": "a.txt", "content": "abc<<END>>def"})]
    assert acc.content == "Done: x"  # the answer's content still stops at the first "="
    assert parser.stopped == StopHit("stop_string", "=")


def test_long_values_stream_correctly(qwen_tokenizer):
    # Values far longer than the block's compaction threshold, with tag-like text throughout.
    rng = random.Random(11)
    lines = []
    for i in range(1500):
        lines.append(rng.choice([f"line {i} <b>bold</b>", f"</parameter> in text {i}",
                                 f"<parameter=path> quoted {i}", "", "    indented < > <<"]))
    content = "\n".join(lines)
    settings = json.dumps({"k": list(range(2000))})
    text = ("<tool_call>\n<function=write_file>\n<parameter=content>\n" + content
            + "\n</parameter>\n<parameter=content>\n" + content + "\n</parameter>\n"
            + "<parameter=path>\nbig.txt\n</parameter>\n</function>\n</tool_call>\n"
            + xml_call("typed", o=settings, s=content) + "<|im_end|>")
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("write_file", {"content": content, "path": "big.txt"}),
                          ("typed", {"o": json.loads(settings), "s": content})]


def test_accumulated_output_round_trips_through_the_template(qwen_tokenizer):
    from runtime.text.chat import builtin_template_source, render_chat

    template = builtin_template_source("qwen3_5")
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = render_chat(template, history, tools=TOOLS)
    output = ("The user wants weather.\n</think>\n\nChecking.\n\n"
              + xml_call("get_weather", city="Oslo", days="2") + "<|im_end|>")
    acc, _ = parse(qwen_tokenizer, output, starts_in_reasoning=True)
    message = acc.as_message()
    assert message["reasoning_content"] == "The user wants weather."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo",
                                                                             "days": 2}
    # Re-rendering the history reproduces exactly what the model generated (prefix caching).
    again = render_chat(template, history + [message], tools=TOOLS, add_generation_prompt=False)
    assert again == prompt + output + "\n"


def test_tool_spec_forms(qwen_tokenizer):
    flat = {"type": "function", "name": "flat", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}
    anthropic = {"name": "anth", "input_schema": {
        "type": "object", "properties": {"n": {"type": "string"}}}}
    text = xml_call("flat", n="1") + xml_call("anth", n="1")
    acc, _ = parse(qwen_tokenizer, text, tools=[flat, anthropic])
    assert calls(acc) == [("flat", {"n": 1}), ("anth", {"n": "1"})]

