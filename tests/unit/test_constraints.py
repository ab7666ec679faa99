"""Output constraints on the real Qwen3.5/3.6 vocabulary (248,077 tokens padded to 248,320).

The core check is the random walk: sample a random allowed token from the mask, commit it, repeat
until EOS or a cap; every finished walk must parse / match. Random tokens are the worst case for
a mask (a model's outputs are at least plausible), so a wrong bit shows up quickly. To make walks
end, they prefer short tokens and, after a soft limit, token sequences that close structures
(quotes, brackets, tags) whenever the constraint accepts them.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from runtime.text.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec, check_spec
from runtime.text.constraints_tools import (check_value_grammar, json_or_tool_calls_spec,
                                            tool_call_spec, value_grammar_spec)

VOCAB = 248320
IM_END, ENDOFTEXT, THINK_END, TOOL_CALL = 248046, 248044, 248069, 248058
WALKS = 100

_CLOSERS = ['"', "}", "]", '"}', "0", "1", "true", "null", ")", ".", "Z", "\n</parameter>\n",
            "</function>\n", "</tool_call>"]


@pytest.fixture(scope="module")
def compiler(qwen_tokenizer_json):
    return ConstraintCompiler(qwen_tokenizer_json, vocab_size=VOCAB, eos_ids=[IM_END])


class Walker:
    """Seeded random walks through a constraint's masks."""

    def __init__(self, compiler: ConstraintCompiler):
        tok = compiler.tokenizer
        self.tok = tok
        n = compiler.vocab.tokenizer_size
        lengths = np.array([99 if tok.is_special_token(i) else len(tok.decode_bytes([i]))
                            for i in range(n)])
        self.short_ids = np.flatnonzero(lengths <= 2)
        self.closers = [tok.tokenize_str(text, parse_special=True) for text in _CLOSERS]

    def walk(self, constraint, rng, *, cap: int = 160, soft: int = 30) -> tuple[list[int], bool]:
        """Returns (committed ids, ended with EOS)."""
        ids: list[int] = []
        while len(ids) < cap:
            mask = constraint.allowed_mask(VOCAB)
            assert mask is not None and mask.shape == (VOCAB,) and mask.dtype == np.bool_
            assert not mask[248077:].any(), "padding id allowed"
            if constraint.is_finished():
                assert np.flatnonzero(mask).tolist() == [IM_END]
            if mask[IM_END] and (len(ids) >= soft or rng.random() < 0.3):
                assert constraint.is_accepting()
                constraint.commit(IM_END)
                return ids, True
            assert constraint.is_accepting() == bool(mask[IM_END])
            if len(ids) >= soft:
                # validate_tokens accepts any tokenization; the mask keeps forced text canonical,
                # so it is stricter: follow a closer only while the mask allows it.
                fitting = [seq for seq in self.closers
                           if mask[seq[0]] and constraint.validate_tokens(seq) == len(seq)]
                if fitting:
                    for token in fitting[rng.integers(len(fitting))]:
                        if not constraint.allowed_mask(VOCAB)[token]:
                            break
                        constraint.commit(token)
                        ids.append(token)
                    continue
            short = self.short_ids[mask[self.short_ids]]
            pool = short if len(short) and rng.random() < 0.7 else np.flatnonzero(mask)
            assert len(pool), "dead end: the mask allows nothing"
            token = int(pool[rng.integers(len(pool))])
            constraint.commit(token)
            if token == IM_END:
                return ids, True
            ids.append(token)
        return ids, False

    def text(self, ids: list[int]) -> str:
        return self.tok.decode_bytes([i for i in ids if i != IM_END]).decode("utf-8")


@pytest.fixture(scope="module")
def walker(compiler):
    return Walker(compiler)


def run_walks(compiler, walker, spec, check, *, seed: int, walks: int = WALKS, **kw) -> int:
    """`walks` seeded walks; every finished one must pass `check(text)`. Returns how many
    finished (most must: a walk that hits the cap is the engine's `length` case)."""
    rng = np.random.default_rng(seed)
    finished = 0
    for _ in range(walks):
        constraint = compiler.compile(spec)
        ids, ended = walker.walk(constraint, rng, **kw)
        if ended:
            finished += 1
            text = walker.text(ids)
            try:
                check(text)
            except Exception as exc:
                raise AssertionError(f"invalid output {text!r}: {exc}") from exc
    assert finished >= walks * 0.9, f"only {finished}/{walks} walks finished"
    return finished


# ---------------------------------------------------------------------------------------------
# JSON


def _assert_compact(text: str) -> None:
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings), "whitespace outside strings"


def test_json_object_walks(compiler, walker):
    def check(text):
        assert isinstance(json.loads(text), dict)
        _assert_compact(text)

    run_walks(compiler, walker, ConstraintSpec.json_object(), check, seed=1)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y"]},
        "score": {"type": ["number", "null"]},
        "when": {"type": "string", "format": "date"},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                   "required": ["ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


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

ARITH = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*      # left-associative sums
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""


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


# ---------------------------------------------------------------------------------------------
# thinking, rollback, masks, cache


def test_thinking_then_constrained_answer(compiler, walker):
    pattern = r"(BUG|TASK)-[0-9]{4}"
    spec = ConstraintSpec.regex(pattern)
    rng = np.random.default_rng(10)
    separators = 0
    for _ in range(20):
        constraint = compiler.compile(spec, starts_in_thinking=True, think_end_id=THINK_END)
        for _ in range(int(rng.integers(0, 5))):
            assert constraint.allowed_mask(VOCAB) is None and constraint.in_thinking
            assert not constraint.is_accepting() and not constraint.is_finished()
            constraint.commit(int(rng.integers(0, 248000)))  # anything goes while thinking
        constraint.commit(THINK_END)
        mask = constraint.allowed_mask(VOCAB)
        separator = compiler.vocab.separator_id
        assert mask[separator] and not mask[IM_END]
        if rng.random() < 0.5:
            constraint.commit(separator)  # the "\n\n" the parser drops, once
            separators += 1
            assert not constraint.allowed_mask(VOCAB)[separator]
        ids, ended = walker.walk(constraint, rng)
        assert ended and re.fullmatch(pattern, walker.text(ids))
    assert 0 < separators < 20


def test_thinking_banned_ids_mask(compiler):
    constraint = compiler.compile(ConstraintSpec.json_object(), starts_in_thinking=True,
                                  think_end_id=THINK_END, thinking_banned_ids=[TOOL_CALL])
    mask = constraint.allowed_mask(VOCAB)
    assert not mask[TOOL_CALL] and not mask[248077:].any() and mask[:248077].sum() == 248076
    with pytest.raises(ConstraintError, match="not allowed while thinking"):
        constraint.commit(TOOL_CALL)
    constraint.commit(THINK_END)
    assert constraint.allowed_mask(VOCAB)[compiler.tokenizer.tokenize_str("{")[0]]


def _mask_copy(constraint):
    mask = constraint.allowed_bitmask_u32(VOCAB)
    return None if mask is None else mask.copy()


def _masks_along(constraint, ids):
    masks = []
    for token in ids:
        masks.append(_mask_copy(constraint))
        constraint.commit(token)
    masks.append(_mask_copy(constraint))
    return masks


def test_rollback_restores_every_state(compiler):
    tok = compiler.tokenizer
    text = '{"name":"Ada","age":36,"kind":"y","nested":{"ok":true}}'
    ids = [THINK_END, compiler.vocab.separator_id] + tok.tokenize_str(text) + [IM_END]
    constraint = compiler.compile(ConstraintSpec.json_schema(SCHEMA), starts_in_thinking=True,
                                  think_end_id=THINK_END)
    constraint.commit(5)  # a thinking token
    masks = _masks_along(constraint, ids)
    assert constraint.is_finished()
    rng = np.random.default_rng(11)
    position = len(ids)
    while position > 0:
        back = int(rng.integers(1, min(position, 6) + 1))
        constraint.rollback(back)
        position -= back
        if masks[position] is None:
            assert constraint.allowed_bitmask_u32(VOCAB) is None
        else:
            np.testing.assert_array_equal(constraint.allowed_bitmask_u32(VOCAB), masks[position])
    assert constraint.in_thinking and constraint.num_committed == 1
    assert _masks_along(constraint, ids)[-1].tolist() == masks[-1].tolist()  # replay matches
    with pytest.raises(ValueError):
        constraint.rollback(constraint.num_committed + 1)


def test_bitmask_matches_bool_mask_and_batch_fill(compiler):
    tok = compiler.tokenizer
    specs = [ConstraintSpec.json_object(), ConstraintSpec.regex("[a-z]+!"),
             ConstraintSpec.choice(["yes", "no"]), ConstraintSpec.grammar(ARITH)]
    constraints = [compiler.compile(spec) for spec in specs]
    constraints[0].commit(tok.tokenize_str("{")[0])
    constraints[1].commit(tok.tokenize_str("abc")[0])
    constraints.append(compiler.compile(specs[0], starts_in_thinking=True, think_end_id=THINK_END))
    words = (VOCAB + 31) // 32
    out = np.full((len(constraints) + 1, words), 0x5A5A5A5A, dtype=np.uint32)  # poisoned
    rows = [(constraint, index + 1) for index, constraint in enumerate(constraints)]
    written = compiler.fill_bitmasks(rows, out)
    assert written == [True, True, True, True, False]
    assert (out[0] == 0x5A5A5A5A).all() and (out[-1] == 0x5A5A5A5A).all()
    for index, constraint in enumerate(constraints[:-1]):
        packed = constraint.allowed_bitmask_u32(VOCAB)
        np.testing.assert_array_equal(out[index + 1], packed)
        bools = constraint.allowed_mask(VOCAB)
        unpacked = np.array([(int(packed[i // 32]) >> (i % 32)) & 1 for i in range(VOCAB)],
                            dtype=bool)
        np.testing.assert_array_equal(bools, unpacked)
        assert bools.any() and not bools[248077:].any()
    row = np.empty(words, dtype=np.int32)
    assert constraints[0].fill_bitmask(row)
    np.testing.assert_array_equal(row.view(np.uint32), constraints[0].allowed_bitmask_u32())


def test_cache_shares_compilation_not_state(compiler):
    spec = ConstraintSpec.json_schema(SCHEMA)
    first = compiler.compile(spec)
    second = compiler.compile(ConstraintSpec.json_schema(json.dumps(SCHEMA)))
    assert second.spec == spec and hash(second.spec) == hash(spec)  # same cache entry
    assert compiler._compiled(spec)[2] is None  # a hit: no new validation
    first.commit(compiler.tokenizer.tokenize_str("{")[0])
    assert second.num_committed == 0 and not np.array_equal(
        first.allowed_bitmask_u32(), second.allowed_bitmask_u32())


def test_cannot_finish_within_limit_reports_not_accepting(compiler, walker):
    constraint = compiler.compile(ConstraintSpec.regex("[0-9]{40}"))
    ids, ended = walker.walk(constraint, np.random.default_rng(12), cap=5)
    assert not ended and len(ids) == 5
    assert not constraint.is_accepting() and not constraint.is_finished()
    assert not constraint.allowed_mask(VOCAB)[IM_END]  # the engine ends with `length`
    with pytest.raises(ConstraintError, match="before the constraint is complete"):
        constraint.commit(IM_END)


def test_disallowed_token_raises_and_keeps_state(compiler):
    constraint = compiler.compile(ConstraintSpec.choice(["yes", "no"]))
    before = constraint.allowed_bitmask_u32().copy()
    with pytest.raises(ConstraintError, match="not allowed by the choice"):
        constraint.commit(compiler.tokenizer.tokenize_str("maybe")[0])
    with pytest.raises(ConstraintError):
        constraint.commit(248100)  # a padding id
    np.testing.assert_array_equal(constraint.allowed_bitmask_u32(), before)
    constraint.commit(compiler.tokenizer.tokenize_str("yes")[0])
    assert constraint.is_accepting()


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


def test_tool_forms_normalise_to_the_same_grammar():
    chat = tool_call_spec(TOOLS, required=True)
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    anthropic = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                  "strict": t["function"].get("strict", False)} for t in TOOLS]
    assert tool_call_spec(flat, required=True) == chat
    assert tool_call_spec(anthropic, required=True) == chat
