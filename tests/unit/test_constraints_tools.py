"""Tool-call constraint specs (runtime/text/constraints_tools.py) on the real Qwen3.5/3.6
vocabulary: forced and named calls, JSON or calls, tool input grammars, tool forms; walked at
random (constraint_walks.py) and checked on given texts.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from constraint_walks import SCHEMA, _assert_compact, run_walks
from runtime.text.constraints import ConstraintError, ConstraintSpec
from runtime.text.constraints_tools import (check_value_grammar, json_or_tool_calls_spec,
                                            tool_call_spec, value_grammar_spec)



# ---------------------------------------------------------------------------------------------
# tool calls

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["c", "f"]},
            "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}},
                     "required": ["hourly"], "additionalProperties": False},
        }, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "noop", "parameters": {}}},
]
_CALL_RE = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n(.*?)</function>\n</tool_call>",
                      re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)


def _check_calls(text: str, allowed_names=("get_weather", "noop")) -> None:
    pos = 0
    while True:
        match = _CALL_RE.match(text, pos)
        assert match, f"no tool call at {pos}"
        name, body = match.groups()
        assert name in allowed_names
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
        props = tool["parameters"].get("properties", {})
        params = _PARAM_RE.findall(body)
        assert "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params) == body
        keys = [k for k, _ in params]
        assert keys == sorted(keys, key=list(props).index)
        assert set(tool["parameters"].get("required", [])) <= set(keys)
        for key, raw in params:
            schema = props[key]
            value = raw if schema.get("type") == "string" else (
                raw if raw in schema.get("enum", ()) else json.loads(raw))
            jsonschema.validate(value, schema)
        pos = match.end()
        if pos == len(text):
            return
        assert text[pos] == "\n"
        pos += 1


def test_tool_call_required_walks(compiler, walker):
    run_walks(compiler, walker, tool_call_spec(TOOLS, required=True), _check_calls, seed=7)


def test_tool_call_named_single_walks(compiler, walker):
    spec = tool_call_spec(TOOLS, name="get_weather", parallel=False)

    def check(text):
        _check_calls(text, allowed_names=("get_weather",))
        assert text.count("<tool_call>") == 1

    run_walks(compiler, walker, spec, check, seed=8)


def test_json_or_tool_calls_walks(compiler, walker):
    spec = json_or_tool_calls_spec(ConstraintSpec.json_schema(SCHEMA), TOOLS)
    kinds = set()

    def check(text):
        if text.startswith("<tool_call>"):
            kinds.add("calls")
            _check_calls(text)
        else:
            kinds.add("json")
            jsonschema.validate(json.loads(text), SCHEMA)
            _assert_compact(text)

    run_walks(compiler, walker, spec, check, seed=9)
    assert kinds == {"calls", "json"}


def test_tool_call_auto_allows_text_then_calls(compiler):
    constraint = compiler.compile(tool_call_spec(TOOLS, required=False))
    tok = compiler.tokenizer
    text = ("Let me check.\n\n<tool_call>\n<function=noop>\n</function>\n</tool_call>")
    for token in tok.tokenize_str(text, parse_special=True):
        constraint.commit(token)
    assert constraint.is_accepting()
    assert compiler.compile(tool_call_spec(TOOLS, required=False)).is_accepting()  # text only


def test_tool_choice_errors():
    with pytest.raises(ConstraintError, match="'nope', which is not among the tools"):
        tool_call_spec(TOOLS, name="nope")
    with pytest.raises(ConstraintError, match="at least one tool"):
        tool_call_spec([], required=True)


# ---------------------------------------------------------------------------------------------
# tool input grammars (OpenAI Responses custom tools: one raw `input` parameter)

_INPUT = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
PLATE = r"^[0-9]{3}-[a-z]{1,6}$"  # `\d` would also take non-ASCII digits
CALC = 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]{1,3}/\n'
CUSTOM_TOOLS = [{"type": "function", "function": {"name": name, "parameters": _INPUT}}
                for name in ("plate", "calc", "note")] + [TOOLS[0]]
GRAMMARS = {("plate", "input"): ConstraintSpec.regex(PLATE),
            ("calc", "input"): ConstraintSpec.lark(CALC),
            ("note", "input"): ConstraintSpec.regex(r"(?s:.*)")}


def _calc(text: str) -> bool:
    """The language of CALC, checked without llguidance."""
    position = 0

    def expr() -> bool:
        nonlocal position
        number = re.match(r"[0-9]{1,3}", text[position:])
        if number:
            position += number.end()
            return True
        if not text.startswith("(", position):
            return False
        position += 1
        if not expr() or not text.startswith("+", position):
            return False
        position += 1
        if not expr() or not text.startswith(")", position):
            return False
        position += 1
        return True

    return expr() and position == len(text)


def _call(name: str, value: str) -> str:
    return (f"<tool_call>\n<function={name}>\n<parameter=input>\n{value}\n</parameter>\n"
            "</function>\n</tool_call>")


def _accepts(compiler, spec, text: str) -> bool:
    constraint = compiler.compile(spec)
    ids = compiler.tokenizer.tokenize_str(text, parse_special=True)
    if constraint.validate_tokens(ids) != len(ids):
        return False
    for token in ids:
        constraint.commit(token)
    return constraint.is_accepting()


def test_custom_tool_input_walks_match_their_grammars(compiler, walker):
    spec = tool_call_spec(CUSTOM_TOOLS[:2] + CUSTOM_TOOLS[3:], required=True,
                          value_grammars=GRAMMARS)
    seen = set()

    def check(text):
        pos = 0
        while True:
            match = _CALL_RE.match(text, pos)
            assert match, f"no tool call at {pos}"
            name, body = match.groups()
            if name == "get_weather":
                _check_calls(match.group(0), allowed_names=("get_weather",))
            else:
                params = _PARAM_RE.findall(body)
                assert [key for key, _ in params] == ["input"]
                assert "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params) == body
                value = params[0][1]
                assert re.fullmatch(PLATE, value) if name == "plate" else _calc(value), value
                seen.add(name)
            pos = match.end()
            if pos == len(text):
                return
            assert text[pos] == "\n"
            pos += 1

    run_walks(compiler, walker, spec, check, seed=11)
    assert seen == {"plate", "calc"}


def test_custom_tool_inputs_accepted_and_rejected(compiler):
    forced = tool_call_spec(CUSTOM_TOOLS, required=True, value_grammars=GRAMMARS)
    auto = tool_call_spec(CUSTOM_TOOLS, required=False, value_grammars=GRAMMARS)
    for spec in (forced, auto):
        assert _accepts(compiler, spec, _call("plate", "123-abc"))
        assert _accepts(compiler, spec, _call("calc", "(1+(22+333))"))
        assert _accepts(compiler, spec, _call("plate", "123-abc") + "\n" + _call("calc", "7"))
        for name, value in [("plate", "12-abc"), ("plate", "123-abcdefg"), ("plate", "123-ab\n"),
                            ("calc", "(1+2"), ("calc", "(1 + 2)"), ("calc", "1234")]:
            assert not _accepts(compiler, spec, _call(name, value)), (name, value)
    # auto: free text, then calls whose inputs are checked from `<tool_call>` on
    assert _accepts(compiler, auto, "Plain answer, no call.")
    assert _accepts(compiler, auto, "Let me check.\n\n" + _call("plate", "999-z"))
    assert not _accepts(compiler, auto, "Let me check.\n\n" + _call("plate", "99-z"))
    assert not _accepts(compiler, forced, "Let me check.\n\n" + _call("plate", "999-z"))


def test_regex_input_spans_lines_and_ends_at_the_first_parameter_end(compiler):
    spec = tool_call_spec(CUSTOM_TOOLS, required=True, value_grammars=GRAMMARS)
    # A regex that takes anything (newlines too) still lets the value close: the value is one
    # lazy lexeme ending at the first "\n</parameter>\n".
    assert _accepts(compiler, spec, _call("note", "line 1\n  x </parameter> y\n\nlast"))
    assert _accepts(compiler, spec, _call("note", ""))
    assert not _accepts(compiler, spec, _call("note", "a\n</parameter>\nb"))
    slash = tool_call_spec(CUSTOM_TOOLS[:1], value_grammars={
        ("plate", "input"): ConstraintSpec.regex(r"^[a-z]+/[0-9]+$")})
    assert _accepts(compiler, slash, _call("plate", "src/42"))
    assert not _accepts(compiler, slash, _call("plate", "src42"))


def test_lark_input_keeps_its_own_rules_ignore_and_optional_last_newline(compiler):
    # Rule names shared with the outer grammar (start, expr, T1) stay separate; %ignore applies
    # between the nested grammar's tokens; an optional final newline still lets it close.
    patch = ('start: "BEGIN" LF line+ "END" LF?\nline: ("+" | "-") T1 LF\nT1: /[^\\n]*/\n'
             "LF: /\\n/\n")
    words = 'start: expr\nexpr: WORD ("," WORD)*\nWORD: /[a-z]+/\n%ignore / +/\n'
    spec = tool_call_spec(CUSTOM_TOOLS[:2], value_grammars={
        ("plate", "input"): ConstraintSpec.lark(patch), ("calc", "input"): ConstraintSpec.lark(words)})
    assert _accepts(compiler, spec, _call("plate", "BEGIN\n+a line\n-old\nEND"))
    assert _accepts(compiler, spec, _call("plate", "BEGIN\n+x\nEND\n"))
    assert not _accepts(compiler, spec, _call("plate", "BEGIN\nEND"))
    assert _accepts(compiler, spec, _call("calc", "ab , cd,e"))
    assert not _accepts(compiler, spec, _call("calc", "ab,,cd"))


def test_lark_input_whose_last_terminal_takes_newlines_cannot_close(compiler):
    """The documented limit (docs/constraints.md): llguidance's lexer is greedy, so a final
    terminal that can go on with "\n" swallows the parameter end's first byte."""
    spec = tool_call_spec(CUSTOM_TOOLS[:1], value_grammars={
        ("plate", "input"): ConstraintSpec.lark("start: /[a-z\\n]+/\n")})
    assert not _accepts(compiler, spec, _call("plate", "abc"))


def test_loose_tools_check_only_the_header(compiler):
    # The server's "auto" fallback for a non-strict tool whose schema cannot be compiled.
    broken = {"type": "function", "function": {"name": "mcp", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}
    with pytest.raises(ConstraintError, match="required parameters"):
        tool_call_spec([broken], required=False)
    spec = tool_call_spec(CUSTOM_TOOLS + [broken], required=False, value_grammars=GRAMMARS,
                          loose=["mcp"])
    assert _accepts(compiler, spec, "Hm.\n\n<tool_call>\n<function=mcp>\n<parameter=x>\n1\n"
                                    "</parameter>\n</function>\n</tool_call>")
    assert _accepts(compiler, spec, "<tool_call>\n<function=mcp>anything</tool_call>")
    assert not _accepts(compiler, spec, "<tool_call>\n<function=other>\n</function>\n"
                                        "</tool_call>")
    assert _accepts(compiler, spec, _call("plate", "123-abc"))
    assert not _accepts(compiler, spec, _call("plate", "123-ABC"))  # the others stay checked


def test_value_grammar_errors():
    with pytest.raises(ConstraintError, match="special tokens"):
        check_value_grammar(ConstraintSpec.lark('start: "a" <|im_end|>\n'))
    with pytest.raises(ConstraintError, match="special tokens"):
        check_value_grammar(ConstraintSpec.lark("start: <[1234]>\n"))
    with pytest.raises(ConstraintError, match="invalid Lark grammar: .*nope"):
        check_value_grammar(ConstraintSpec.lark("start: nope\n"))
    with pytest.raises(ConstraintError, match="invalid regex"):
        check_value_grammar(ConstraintSpec.regex("[a-"))
    with pytest.raises(ConstraintError, match="regex or Lark"):
        check_value_grammar(ConstraintSpec.json_object())
    assert check_value_grammar(ConstraintSpec.lark(CALC)) == []
    assert value_grammar_spec("regex", PLATE) == ConstraintSpec.regex(PLATE)
    with pytest.raises(ConstraintError, match="unknown grammar syntax"):
        value_grammar_spec("ebnf", "x")
    with pytest.raises(ConstraintError, match="'days' has an input grammar but is not a string"):
        tool_call_spec(TOOLS, value_grammars={("get_weather", "days"): ConstraintSpec.regex("1")})
    with pytest.raises(ConstraintError, match="grammar for 'nope', which is not among"):
        tool_call_spec(CUSTOM_TOOLS, value_grammars={("plate", "nope"): ConstraintSpec.regex("")})
    # a grammar of a tool the answer cannot call (named tool_choice) is not an error
    tool_call_spec(CUSTOM_TOOLS, name="calc", value_grammars=GRAMMARS)


def test_tool_forms_normalise_to_the_same_grammar():
    chat = tool_call_spec(TOOLS, required=True)
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    anthropic = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                  "strict": t["function"].get("strict", False)} for t in TOOLS]
    assert tool_call_spec(flat, required=True) == chat
    assert tool_call_spec(anthropic, required=True) == chat
