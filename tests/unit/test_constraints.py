"""Output constraints on the real Qwen3.5/3.6 vocabulary (248,077 tokens padded to 248,320).

The constraint kinds (JSON, regex, choice, GBNF) walked at random (constraint_walks.py), and the
errors that name the problem. Tool-call specs: test_constraints_tools.py; thinking, rollback,
masks and the compilation cache: test_constraints_state.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from constraint_walks import ARITH, IM_END, SCHEMA, VOCAB, _assert_compact, run_walks
from runtime.text.constraints import ConstraintError, ConstraintSpec, check_spec



# ---------------------------------------------------------------------------------------------
# JSON


def test_json_object_walks(compiler, walker):
    def check(text):
        assert isinstance(json.loads(text), dict)
        _assert_compact(text)

    run_walks(compiler, walker, ConstraintSpec.json_object(), check, seed=1)


def test_json_schema_walks_valid_compact_ordered(compiler, walker):
    declared = list(SCHEMA["properties"])

    def check(text):
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA, format_checker=jsonschema.FormatChecker())
        _assert_compact(text)
        keys = list(value)
        assert keys == sorted(keys, key=declared.index), "properties out of declared order"

    run_walks(compiler, walker, ConstraintSpec.json_schema(SCHEMA), check, seed=2)


# ---------------------------------------------------------------------------------------------
# regex and choice

REGEXES = [
    r"(BUG|TASK)-[0-9]{4}",
    r"[A-Z][a-z]{0,8}( [A-Z][a-z]{0,8}){0,3}\.",
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9]{2}:[0-9]{2}(:[0-9]{2})?Z)?",
    r"[α-ω]{1,5}|日本|x\n?y",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks(compiler, walker, pattern):
    def check(text):
        assert re.fullmatch(pattern, text)

    run_walks(compiler, walker, ConstraintSpec.regex(pattern), check, seed=3, walks=25)


def test_regex_walks_hundred(compiler, walker):
    pattern = r"(yes|no|maybe)( because [a-z ]{1,20})?"
    run_walks(compiler, walker, ConstraintSpec.regex(pattern),
              lambda text: re.fullmatch(pattern, text), seed=4)


def test_empty_regex_allows_only_empty_answer(compiler):
    constraint = compiler.compile(ConstraintSpec.regex(""))
    assert np.flatnonzero(constraint.allowed_mask(VOCAB)).tolist() == [IM_END]
    assert constraint.is_accepting() and constraint.is_finished()


def test_choice_walks_exact(compiler, walker):
    options = ["positive", "neutral", "negative", "", "très bien", "a\nb"]
    run_walks(compiler, walker, ConstraintSpec.choice(options),
              lambda text: options.index(text), seed=5)
    start = compiler.compile(ConstraintSpec.choice(options))
    assert start.is_accepting() and not start.is_finished()  # '' is a candidate


# ---------------------------------------------------------------------------------------------
# GBNF (translator details: test_constraints_gbnf.py)


def _check_arith(text: str) -> None:
    pos = 0

    def expect_factor():
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            expect_expr()
            assert text[pos:pos + 1] == ")"
            pos += 1
        else:
            match = re.compile(r"[0-9]{1,3}").match(text, pos)
            assert match
            pos = match.end()

    def expect_expr():
        nonlocal pos
        expect_factor()
        while text[pos:pos + 1] in ("+", "-", "*", "/") and pos < len(text):
            pos += 1
            expect_factor()

    expect_expr()
    assert pos == len(text)


LIST = r"""
root ::= item ("," " "? item){0,4}
item ::= [a-zа-я]{1,6} | "\u00e9t\u00e9" | [^\x00-\x7f,]{2}
"""
LIST_ITEM = r"(?:[a-zа-я]{1,6}|été|[^\x00-\x7f,]{2})"
LIST_RE = rf"{LIST_ITEM}(?:, ?{LIST_ITEM}){{0,4}}"

JSONISH = r"""
root   ::= value
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( string ":" value ("," string ":" value)* )? "}"
array  ::= "[" ( value ("," value)* )? "]"
string ::= "\"" [a-z ]* "\""
number ::= "-"? ("0" | [1-9] [0-9]{0,5})
"""


@pytest.mark.parametrize("grammar, check", [
    ('root ::= "yes" | "no"\n', lambda text: text in ("yes", "no")),
    (ARITH, _check_arith),
    (LIST, lambda text: re.fullmatch(LIST_RE, text)),
    (JSONISH, json.loads),
], ids=["yes-no", "recursive-arith", "unicode-list", "recursive-json"])
def test_gbnf_walks(compiler, walker, grammar, check):
    run_walks(compiler, walker, ConstraintSpec.grammar(grammar), check, seed=6)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("spec, message", [
    (lambda: ConstraintSpec.json_schema({"type": "foo"}), "invalid JSON schema: .*foo"),
    (lambda: ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}),
     "invalid JSON schema: .*uniqueItems"),
    (lambda: ConstraintSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 3}),
     "invalid JSON schema: .*minimum"),
    (lambda: ConstraintSpec.json_schema('{"type": '), "not valid JSON"),
    (lambda: ConstraintSpec.json_schema([1]), "expected an object"),
    (lambda: ConstraintSpec.regex("(ab"), "invalid regex: .*unclosed group"),
    (lambda: ConstraintSpec.regex(r"(a)\1"), "invalid regex: .*backreferences"),
    (lambda: ConstraintSpec.grammar('root ::= "a" b\n'),
     "invalid grammar: .*'b' is used but never"),
    (lambda: ConstraintSpec.grammar('root ::= "a\n'), "invalid grammar: GBNF line 1"),
    (lambda: ConstraintSpec.grammar('start ::= "a"\n'), "no 'root' rule"),
    (lambda: ConstraintSpec.choice([]), "at least one candidate"),
    (lambda: ConstraintSpec.lark("start: nope"), "invalid Lark grammar: .*nope"),
], ids=["schema-type", "schema-unsupported", "schema-unsatisfiable", "schema-json",
        "schema-not-object", "regex", "regex-backref", "gbnf-undefined", "gbnf-syntax",
        "gbnf-root", "choice-empty", "lark"])
def test_errors_name_the_problem(compiler, spec, message):
    with pytest.raises(ConstraintError, match=message):
        compiler.compile(spec())
    with pytest.raises(ConstraintError, match=message):
        check_spec(spec())  # the same message without a tokenizer (CLI argument checking)


def test_non_strict_schema_warns_instead(compiler):
    spec = ConstraintSpec.json_schema({"type": "array", "uniqueItems": True}, strict=False)
    constraint = compiler.compile(spec)
    assert any("uniqueItems" in warning for warning in constraint.warnings)
    assert check_spec(spec) and "uniqueItems" in check_spec(spec)[0]
