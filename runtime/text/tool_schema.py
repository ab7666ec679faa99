"""Typing tool-call arguments from the tools' JSON Schemas.

The Qwen XML call format carries every parameter value as text. The declared schema decides what
the text becomes in the JSON arguments:

- `string` (and enums of strings): the text, unchanged, even when it looks like JSON or a number;
- `integer` / `number`: the number when the text is one, else the text;
- `boolean`: `true` / `false` in any letter case (Python's `True` / `False` too), else the text;
- `null` allowed: the text `null` becomes null;
- `object` / `array`: the JSON value (Python literal syntax accepted), else the text;
- unions (`type` lists, `anyOf` / `oneOf`, nullable) try the non-string types first, then fall
  back to the string; `$ref` is resolved inside the tool's parameters schema;
- no schema for the parameter (unknown tool or parameter, `{}`): JSON if the text is JSON, else
  the text.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

_ALL_TYPES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})
_STRING_ONLY = frozenset({"string"})
_INTEGER = re.compile(r"[+-]?\d+")
_MAX_REF_DEPTH = 32


@dataclass(frozen=True)
class ParamType:
    """The JSON types a parameter accepts; `types` empty means unconstrained."""

    types: frozenset[str] = frozenset()

    @property
    def is_string(self) -> bool:
        """Only strings: the raw text is the value, so it can stream as it arrives. (A nullable
        string waits for its end: the text `null` is null.)"""
        return self.types == _STRING_ONLY


ANY = ParamType()


@dataclass(frozen=True)
class ToolSpec:
    """What the parser knows of one declared tool: its name and its parameters' types."""

    name: str
    params: Mapping[str, ParamType]


def tool_specs(tools: Optional[Sequence[Mapping[str, Any]]]) -> dict[str, ToolSpec]:
    """name -> ToolSpec for OpenAI-style tools ({"type": "function", "function": {...}}), flat
    function tools ({"name", "parameters"}) and Anthropic tools ({"name", "input_schema"})."""
    specs: dict[str, ToolSpec] = {}
    for tool in tools or ():
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = function.get("name")
        if not isinstance(name, str) or not name:
            continue
        schema = function.get("parameters", function.get("input_schema"))
        specs[name] = ToolSpec(name, _properties(schema) if isinstance(schema, Mapping) else {})
    return specs


def _properties(root: Mapping[str, Any]) -> dict[str, ParamType]:
    """Parameter name -> type, merging the branches of a root anyOf / oneOf / allOf."""
    params: dict[str, ParamType] = {}

    def collect(schema: Any, depth: int) -> None:
        schema = _deref(schema, root, depth)
        if not isinstance(schema, Mapping) or depth > _MAX_REF_DEPTH:
            return
        properties = schema.get("properties")
        if isinstance(properties, Mapping):
            for name, prop in properties.items():
                found = param_type(prop, root)
                known = params.get(name)
                params[name] = found if known is None else _union(known, found)
        for key in ("anyOf", "oneOf", "allOf"):
            branches = schema.get(key)
            if isinstance(branches, list):
                for branch in branches:
                    collect(branch, depth + 1)

    collect(root, 0)
    return params


def _union(a: ParamType, b: ParamType) -> ParamType:
    if not a.types or not b.types:
        return ANY
    return ParamType(a.types | b.types)


def _deref(schema: Any, root: Mapping[str, Any], depth: int) -> Any:
    while (isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str)
           and depth < _MAX_REF_DEPTH):
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return {}
        target: Any = root
        for part in ref[1:].split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, Mapping) and part in target:
                target = target[part]
            else:
                return {}
        schema = target
        depth += 1
    return schema


def param_type(schema: Any, root: Mapping[str, Any] | None = None, depth: int = 0) -> ParamType:
    """The JSON types a (sub)schema accepts."""
    schema = _deref(schema, root or {}, depth)
    if not isinstance(schema, Mapping) or depth > _MAX_REF_DEPTH:
        return ANY
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if isinstance(declared, list):
        for name in declared:
            if isinstance(name, str):
                name = name.lower()
                types.add(name if name in _ALL_TYPES else "string" if name in ("str", "text")
                          else "integer" if name in ("int", "long") else "number"
                          if name == "float" else "boolean" if name == "bool" else "object"
                          if name == "dict" else "array" if name == "list" else name)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                sub = param_type(branch, root, depth + 1)
                if not sub.types:
                    return ANY
                types |= sub.types
    if not types:
        if "enum" in schema and isinstance(schema["enum"], list):
            types |= {_json_type(v) for v in schema["enum"]}
        elif "const" in schema:
            types.add(_json_type(schema["const"]))
        elif "properties" in schema:
            types.add("object")
        elif "items" in schema:
            types.add("array")
    types &= _ALL_TYPES
    return ParamType(frozenset(types))


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def convert_value(text: str, kind: ParamType) -> Any:
    """The JSON value for a parameter's raw text (see the module docstring)."""
    types = kind.types
    if not types:
        return _json_or_text(text)
    if types <= {"string", "null"}:
        if "null" in types and "string" in types and text.strip() == "null":
            return None
        return text if "string" in types else None
    value = text.strip()
    if "null" in types and value.lower() in ("null", "none"):
        return None
    if "boolean" in types and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if "integer" in types and _INTEGER.fullmatch(value):
        return int(value)
    if "number" in types or "integer" in types:
        number = _number(value, integral_only="number" not in types)
        if number is not None:
            return number
    for container, python_type in (("object", dict), ("array", list)):
        if container in types:
            parsed = _json_or_literal(value)
            if isinstance(parsed, python_type):
                return parsed
    if "string" in types:
        return text
    return _json_or_text(text)


def _number(value: str, integral_only: bool) -> int | float | None:
    try:
        number = float(value)
    except ValueError:
        return None
    if not math.isfinite(number):
        return None
    if _INTEGER.fullmatch(value):
        return int(value)
    if integral_only:
        return int(number) if number.is_integer() else None
    return number


_MISSING = object()


def _json_or_literal(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        return _MISSING
    return value if _is_json_value(value) else _MISSING


def _json_or_text(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, float) and not math.isfinite(value):
        return text
    return value


def _is_json_value(value: Any, depth: int = 0) -> bool:
    if depth > 256:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v, depth + 1) for k, v in value.items())
    return False


def tolerant_json(text: str, *, repair: bool = False, python_literals: bool = False) -> Any:
    """Decode JSON that models write slightly wrong: trailing commas; with `python_literals`,
    Python syntax (single quotes, True/False/None); with `repair`, a value cut short (unclosed
    strings, arrays and objects are closed). Returns `_MISSING`-free results or raises
    ValueError."""
    attempts = [text, _drop_trailing_commas(text)]
    if repair:
        attempts.append(_drop_trailing_commas(_close_json(text)))
    for attempt in attempts:
        try:
            return json.loads(attempt)
        except ValueError:
            continue
    if python_literals:
        for attempt in attempts:
            value = _json_or_literal(attempt)
            if value is not _MISSING:
                return value
    raise ValueError("not JSON")


def _drop_trailing_commas(text: str) -> str:
    # Only outside strings: walk the text, copying string literals unchanged.
    out, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
            continue
        if ch == ",":
            j = i + 1
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] in "]}":
                i += 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def _close_json(text: str) -> str:
    """Append what closes every open string, array and object of a JSON text cut short."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}" and stack:
            stack.pop()
    tail = text.rstrip()
    suffix = ""
    if in_string:
        suffix += ('\\' if escaped else "") + '"'
    elif tail.endswith(":"):
        suffix += " null"
    return text + suffix + "".join(reversed(stack))
