"""Responses custom tools with a grammar (Lark or regex): the grammars reach the output
constraint (`protocols.job_preparation.constraint_spec`) in each tool_choice, non-strict tools
fall back to header-only checks, and a bad grammar or format is a 400 naming the tool."""

from __future__ import annotations

import re

import pytest

from protocols.openai_responses import parse_responses_request
from tests.unit.request_checks import BARE, FULL, rejects


def _custom(name: str, syntax: str, definition: str) -> dict:
    return {"type": "custom", "name": name, "description": "d",
            "format": {"type": "grammar", "syntax": syntax, "definition": definition}}


PLATE = _custom("plate", "regex", r"^\d{3}-[a-z]+$")
EXPR = _custom("calc", "lark", 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]+/\n')
SHELL = {"type": "function", "name": "shell", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def test_responses_custom_tool_grammars_reach_the_constraint():
    from protocols.job import ToolGrammar
    from protocols.job_preparation import constraint_spec

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
    from protocols.job_preparation import constraint_spec

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
    from protocols.job_preparation import constraint_spec

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
