"""Constraint specs that force Qwen3.5/3.6 XML tool calls (tool_choice required / named, strict
tool arguments, JSON answer or tool calls).

The call format the template teaches (../shared/research/protocols.md section 4.1):

    <tool_call>\\n<function=NAME>\\n<parameter=K>\\nVALUE\\n</parameter>\\n</function>\\n
    </tool_call>

with several calls separated by "\\n". `<tool_call>` / `</tool_call>` are special tokens.
Parameters follow the schema's declared property order; required ones must appear, optional ones
may be skipped, undeclared ones are not allowed. A value is raw text when the property's schema
admits a string (the template writes strings raw), else compact JSON checked against the
property's schema; `enum` / `const` values are the exact rendered texts. A raw text value ends at
the first "\\n</parameter>\\n": no line of it can be exactly "</parameter>" (elsewhere in a line
the text is fine).

Value grammars (OpenAI Responses custom tools with a grammar format): a raw text parameter may be
given a regex or Lark grammar its value must match. A regex becomes one lazy lexeme
`/REGEX/ "\\n</parameter>\\n"` (the value ends at the first parameter end that follows a complete
match, so any regex can be closed, newlines included); a Lark grammar is nested as
`%lark { ... }` (its own `start`, rules and `%ignore`, in their own namespace) followed by the
parameter end. llguidance's lexer is greedy, so a Lark grammar whose last terminal can go on with
a newline (`/(?s:.+)/`, `/[^;]+/` at the very end) never lets the value close; end such grammars
with a terminal that cannot (docs/constraints.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional, Sequence

from runtime.text.constraints import (ConstraintError, ConstraintSpec, check_spec,
                                      json_schema_for_lark)

_PARAMETER_END = "\n</parameter>\n"

# A raw text value: lines, none of them exactly "</parameter>", then "\n</parameter>\n". The
# same language as a lazy `/(?s:.*)\n<\/parameter>\n/`, but as greedy line lexemes llguidance
# can shortcut whole token classes (slices) inside a line instead of walking the 248k-token trie
# on every change of lexer state: measured 5-10x lower mean mask time (docs/constraints.md).
_TEXT_VALUE_RULES = (
    "text_value: TEXT_FIRST_LINE? TEXT_NEXT_LINE* TEXT_END",
    r"TEXT_FIRST_LINE: /[^\n]+/ & ~/<\/parameter>/",
    r"TEXT_NEXT_LINE: /\n[^\n]*/ & ~/\n<\/parameter>/",
    r"TEXT_END: /\n<\/parameter>\n/",
)


@dataclass(frozen=True)
class ToolSchema:
    """A function tool as the constraint needs it (normalised from OpenAI / Anthropic forms).

    parameters: the JSON Schema of the arguments (an object schema; {} when absent).
    strict: enforce every schema keyword (an unsupported one is an error); non-strict tools
    ignore keywords llguidance cannot enforce.
    """

    name: str
    parameters: Mapping[str, Any]
    strict: bool = False


ValueGrammars = Mapping[tuple[str, str], ConstraintSpec]
"""(tool name, parameter name) -> the regex or Lark spec that parameter's raw text value must
match (OpenAI Responses custom tools: (name, "input"))."""

VALUE_GRAMMAR_KINDS = ("regex", "lark")


def value_grammar_spec(syntax: str, definition: str) -> ConstraintSpec:
    """The spec for a grammar given as (syntax, text): "regex" or "lark" (OpenAI custom tool
    `format.syntax`)."""
    if syntax == "regex":
        return ConstraintSpec.regex(definition)
    if syntax == "lark":
        return ConstraintSpec.lark(definition)
    raise ConstraintError(f"unknown grammar syntax {syntax!r}; expected regex or lark")


def check_value_grammar(spec: ConstraintSpec) -> list[str]:
    """Validate a value grammar on its own, without a tokenizer (request checking). Raises
    ConstraintError naming the problem; returns llguidance's warnings. Special tokens
    (`<name>`, `<[id]>`) are refused: a value is text, and an end-of-turn token inside one
    would end the answer mid-call."""
    if spec.kind not in VALUE_GRAMMAR_KINDS:
        raise ConstraintError(f"a value grammar must be a regex or Lark, not {spec.kind}")
    warnings = check_spec(spec)
    # Without a tokenizer llguidance can only warn about special-token references
    # ("no tokenizer - can't validate <special_token>", "... <[...]>", "... <any_token>").
    if any("can't validate <" in warning for warning in warnings):
        raise ConstraintError("invalid Lark grammar: special tokens (<...>) are not allowed in "
                              "a tool input grammar")
    return warnings


def _lark_regex_body(pattern: str) -> str:
    """`pattern` for the inside of a Lark `/.../` literal: every unescaped `/` escaped (`\\/`
    means `/` in the regex syntax too) and line breaks written as escapes."""
    out = []
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\" and index + 1 < len(pattern):
            out.append(pattern[index:index + 2])
            index += 2
            continue
        out.append({"/": "\\/", "\n": "\\n", "\r": "\\r"}.get(char, char))
        index += 1
    return "".join(out)


def normalize_tools(tools: Sequence[Any]) -> list[ToolSchema]:
    """Accepts ToolSchema, OpenAI Chat `{"type":"function","function":{...}}`, OpenAI Responses
    `{"type":"function","name":...,"parameters":...}` and Anthropic `{"name","input_schema"}`."""
    result = []
    for tool in tools:
        if isinstance(tool, ToolSchema):
            result.append(tool)
            continue
        if not isinstance(tool, Mapping):
            raise ConstraintError(f"tool definition must be an object, got {type(tool).__name__}")
        body = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(body, Mapping) or not isinstance(body.get("name"), str):
            raise ConstraintError(f"tool definition without a function name: {tool!r:.200}")
        schema = body.get("parameters", body.get("input_schema")) or {}
        if not isinstance(schema, Mapping):
            raise ConstraintError(f"tool {body['name']!r}: parameters must be a JSON Schema object")
        result.append(ToolSchema(body["name"], schema, bool(body.get("strict", False))))
    if len({tool.name for tool in result}) != len(result):
        raise ConstraintError("tool names must be unique")
    return result


def _regex(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else "\\x{%x}" % ord(c) for c in text)


def _resolve(schema: Any, root: Mapping[str, Any]) -> Any:
    """Follow local `#/$defs/...` / `#/definitions/...` references (to decide the value form)."""
    for _ in range(32):
        if not isinstance(schema, Mapping) or not isinstance(schema.get("$ref"), str):
            return schema
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        target: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                raise ConstraintError(f"tool schema reference {ref!r} does not resolve")
            target = target[part]
        schema = target
    raise ConstraintError("tool schema references form a loop")


def _admits_string(schema: Any, root: Mapping[str, Any]) -> bool:
    schema = _resolve(schema, root)
    if not isinstance(schema, Mapping):
        return schema is not False
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return any(_admits_string(branch, root) for branch in schema[key])
    kind = schema.get("type")
    if kind is None:
        return "properties" not in schema and "items" not in schema
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def schema_admits_nothing(schema: Any, root: Any = None, depth: int = 0) -> bool:
    """Whether a JSON Schema obviously has no valid value: `false`, `{"not": {}}`, an empty
    `enum`, a lower bound above its upper bound, `allOf` with such a branch, `anyOf` / `oneOf`
    with only such branches, a required property of such a schema. llguidance ignores some of
    these (`not` in a non-strict schema) and would let the model write any JSON instead.
    Conservative: False means "not shown empty", not "satisfiable"."""
    root = schema if root is None else root
    if depth > 64:
        return False
    try:
        schema = _resolve(schema, root)
    except ConstraintError:
        return False
    if schema is False:
        return True
    if not isinstance(schema, Mapping):
        return False
    if "not" in schema and (schema["not"] is True or schema["not"] == {}):
        return True
    if isinstance(schema.get("enum"), list) and not schema["enum"]:
        return True
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"),
                      ("minItems", "maxItems"), ("minProperties", "maxProperties")):
        lower, upper = schema.get(low), schema.get(high)
        if isinstance(lower, (int, float)) and isinstance(upper, (int, float)) and lower > upper:
            return True

    def empty(sub: Any) -> bool:
        return schema_admits_nothing(sub, root, depth + 1)

    if isinstance(schema.get("allOf"), list) and any(empty(b) for b in schema["allOf"]):
        return True
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches and all(empty(b) for b in branches):
            return True
    properties = schema.get("properties")
    required = schema.get("required")
    if isinstance(properties, Mapping) and isinstance(required, list):
        return any(empty(properties[key]) for key in required
                   if isinstance(key, str) and key in properties)
    return False


class _LarkBuilder:
    def __init__(self, value_grammars: Optional[ValueGrammars] = None,
                 loose: Collection[str] = ()) -> None:
        self.lines: list[str] = []
        self.count = 0
        self.text_value_rule: Optional[str] = None
        self.value_grammars = dict(value_grammars or {})
        self.loose = frozenset(loose)

    def add(self, prefix: str, body: str) -> str:
        self.count += 1
        name = f"{prefix}{self.count}"
        self.lines.append(f"{name}: {body}")
        return name

    def terminal(self, text: str) -> str:
        return self.add("T", f"/{_regex(text)}/")

    def grammar_value(self, spec: ConstraintSpec) -> str:
        """A raw text value matching `spec` (regex or Lark), then the parameter end."""
        end = self.terminal(_PARAMETER_END)
        if spec.kind == "regex":
            # One lazy lexeme: it ends at the first parameter end after a match of the regex
            # (the regex stays its own terminal, so its ^ / $ anchors keep their meaning).
            pattern = self.add("RX", f"/{_lark_regex_body(spec.payload)}/")
            self.count += 1
            name = f"rxvalue{self.count}"
            self.lines.append(f"{name}[lazy]: {pattern} {end}")
            return name
        if spec.kind == "lark":
            nested = self.add("input", "%lark {\n" + spec.payload.rstrip("\n") + "\n}")
            return self.add("p", f"{nested} {end}")
        raise ConstraintError(f"a value grammar must be a regex or Lark, not {spec.kind}")

    def value(self, schema: Any, root: Mapping[str, Any], strict: bool) -> str:
        resolved = _resolve(schema, root)
        if isinstance(resolved, Mapping) and ("enum" in resolved or "const" in resolved):
            values = resolved["enum"] if "enum" in resolved else [resolved["const"]]
            texts = [v if isinstance(v, str) else json.dumps(v, separators=(",", ":"),
                                                              ensure_ascii=False) for v in values]
            if not texts:
                raise ConstraintError("tool parameter enum is empty")
            alternatives = "|".join(_regex(text) for text in texts)
            return self.add("T", f"/(?:{alternatives}){_regex(_PARAMETER_END)}/")
        if _admits_string(schema, root):
            if self.text_value_rule is None:
                self.text_value_rule = "text_value"
                self.lines.extend(_TEXT_VALUE_RULES)
            return self.text_value_rule
        inline = dict(schema) if isinstance(schema, Mapping) else {}
        for key in ("$defs", "definitions"):
            if key in root and key not in inline:
                inline[key] = root[key]
        json_rule = self.add("v", f"%json {json_schema_for_lark(inline, strict=strict)}")
        return self.add("p", f"{json_rule} {self.terminal(_PARAMETER_END)}")

    def call(self, tool: ToolSchema) -> str:
        if tool.name in self.loose:
            # Only the header is checked; the body is any text up to `</tool_call>`.
            if "LOOSE_BODY: /(?s:.*)/" not in self.lines:
                self.lines.append("LOOSE_BODY: /(?s:.*)/")
            header = self.terminal(f"\n<function={tool.name}>")
            return self.add("call", f"<tool_call> {header} LOOSE_BODY </tool_call>")
        schema = tool.parameters
        # Absent or null is "none"; any other non-object / non-array is a broken schema.
        properties = {} if schema.get("properties") is None else schema["properties"]
        required = [] if schema.get("required") is None else schema["required"]
        if not isinstance(properties, Mapping) or not all(
                isinstance(prop, (Mapping, bool)) for prop in properties.values()):
            raise ConstraintError(f"tool {tool.name!r}: 'properties' must be an object of "
                                  "schemas")
        if not isinstance(required, list) or not all(isinstance(key, str) for key in required):
            raise ConstraintError(f"tool {tool.name!r}: 'required' must be an array of "
                                  "property names")
        required = set(required)
        unknown = required - set(properties)
        if unknown:
            raise ConstraintError(f"tool {tool.name!r}: required parameters {sorted(unknown)} "
                                  "are not declared in properties")
        parts = [self.terminal(f"\n<function={tool.name}>\n")]
        for key, prop in properties.items():
            grammar = self.value_grammars.pop((tool.name, key), None)
            if grammar is not None and not _admits_string(prop, schema):
                raise ConstraintError(f"tool {tool.name!r}: parameter {key!r} has an input "
                                      "grammar but is not a string")
            value = self.grammar_value(grammar) if grammar is not None \
                else self.value(prop, schema, tool.strict)
            param = self.add("p", f"{self.terminal(f'<parameter={key}>' + chr(10))} {value}")
            parts.append(param if key in required else f"{param}?")
        parts.append(self.terminal("</function>\n"))
        return self.add("call", f"<tool_call> {' '.join(parts)} </tool_call>")

    def calls(self, tools: Sequence[ToolSchema], parallel: bool) -> str:
        one = self.add("any_call", " | ".join(self.call(tool) for tool in tools))
        for tool_name, key in self.value_grammars:
            if not any(tool.name == tool_name for tool in tools):
                continue  # a tool this answer cannot call (a named tool_choice)
            raise ConstraintError(f"tool {tool_name!r} has an input grammar for {key!r}, "
                                  "which is not among its parameters")
        if not parallel:
            return one
        return self.add("calls", f"{one} ({self.terminal(chr(10))} {one})*")


def _select(tools: Sequence[Any], name: Optional[str]) -> list[ToolSchema]:
    normalized = normalize_tools(tools)
    if not normalized:
        raise ConstraintError("a forced tool call needs at least one tool")
    if name is None:
        return normalized
    chosen = [tool for tool in normalized if tool.name == name]
    if not chosen:
        raise ConstraintError(f"tool_choice names {name!r}, which is not among the tools "
                              f"({', '.join(tool.name for tool in normalized)})")
    return chosen


def tool_call_spec(tools: Sequence[Any], *, required: bool = True, name: Optional[str] = None,
                   parallel: bool = True, value_grammars: Optional[ValueGrammars] = None,
                   loose: Collection[str] = ()) -> ConstraintSpec:
    """A spec for the answer when tools constrain it.

    required=True (tool_choice "required" / Anthropic "any"): the answer is one or more tool
    calls and nothing else. name="f" (a named tool_choice / Anthropic "tool"): calls of that
    tool only. required=False and no name ("auto" with strict tools or value grammars): free
    text, optionally followed by tool calls whose arguments follow the schemas (the `<tool_call>`
    special token, which free text cannot contain, starts them). parallel=False: at most one
    call. value_grammars: raw text parameters whose values must match a regex or Lark grammar.
    loose: names of tools whose calls are checked only up to the `<function=NAME>` header (for
    the server's "auto" fallback when a non-strict tool's schema cannot be compiled).
    """
    builder = _LarkBuilder(value_grammars, loose)
    calls = builder.calls(_select(tools, name), parallel)
    if required or name is not None:
        start = f"start: {calls}"
    else:
        builder.lines.append("free_text: /(?s:.*)/")
        start = f"start: free_text ({calls})?"
    return ConstraintSpec.lark("\n".join(["%llguidance {}", start, *builder.lines]) + "\n")


def json_or_tool_calls_spec(answer: ConstraintSpec, tools: Sequence[Any], *,
                            parallel: bool = True,
                            value_grammars: Optional[ValueGrammars] = None) -> ConstraintSpec:
    """JSON mode with tools present: the answer is either the JSON value (as `answer`, a
    json_object or json_schema spec) or a tool-call sequence."""
    if answer.kind == "json_object":
        schema: Mapping[str, Any] = {"type": "object"}
        strict = True
    elif answer.kind == "json_schema":
        schema = json.loads(answer.payload)
        strict = answer.strict
    else:
        raise ConstraintError(f"only JSON answers can be combined with tools, not {answer.kind}")
    builder = _LarkBuilder(value_grammars)
    calls = builder.calls(_select(tools, None), parallel)
    json_rule = builder.add("answer", f"%json {json_schema_for_lark(schema, strict=strict)}")
    return ConstraintSpec.lark(
        "\n".join(["%llguidance {}", f"start: {json_rule} | {calls}", *builder.lines]) + "\n")
