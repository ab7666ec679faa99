"""The output parser on tool calls (runtime/text/tool_calls.py and its helpers), on the real
vocabulary: the XML form, the legacy JSON form, broken calls and their tolerant recovery, argument
typing from the schema. Each case is parsed three ways (parser_harness.parse).
"""

from __future__ import annotations

import json
import random

import pytest

from parser_harness import TOOLS, _feed_all, calls, parse, xml_call
from runtime.text.events import ContentDelta, ToolCallArgsDelta, ToolCallStart
from runtime.text.parser import QwenOutputParser


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


# --- long values and tool forms -----------------------------------------------------------

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


def test_tool_spec_forms(qwen_tokenizer):
    flat = {"type": "function", "name": "flat", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}
    anthropic = {"name": "anth", "input_schema": {
        "type": "object", "properties": {"n": {"type": "string"}}}}
    text = xml_call("flat", n="1") + xml_call("anth", n="1")
    acc, _ = parse(qwen_tokenizer, text, tools=[flat, anthropic])
    assert calls(acc) == [("flat", {"n": 1}), ("anth", {"n": "1"})]
