"""Decoding the legacy JSON tool-call form (`{"name": ..., "arguments": {...}}`, Qwen2.5/3 and
Qwen3-Next), which tool_calls.ToolCallBlock buffers to the end of its block.

Accepted: one call object or a list of them, optionally in a ``` (```json) fence; the name and
arguments at the top level or under "function"; "arguments" (or "parameters") as an object or as
a JSON string. Decoding is lenient (trailing commas); `tolerant` also takes Python literal syntax,
and `repair` closes a call cut by the output limit.
"""

from __future__ import annotations

from typing import Optional

from runtime.text.tool_schema import tolerant_json


def decode_json_calls(text: str, *, tolerant: bool,
                      repair: bool) -> Optional[list[tuple[str, dict]]]:
    """The (name, arguments) calls of a JSON block's text, or None when it is not one."""
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`").strip()
        if text.startswith("json"):
            text = text[4:]
    try:
        value = tolerant_json(text, repair=repair, python_literals=tolerant)
    except ValueError:
        value = None
    calls = value if isinstance(value, list) else [value]
    parsed = [_json_call(call, tolerant) for call in calls]
    if not calls or any(call is None for call in parsed):
        return None
    return parsed


def _json_call(call, tolerant: bool) -> Optional[tuple[str, dict]]:
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name:
        function = call.get("function")
        if isinstance(function, dict):
            return _json_call(function, tolerant)
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = tolerant_json(arguments, python_literals=tolerant) \
                if arguments.strip() else {}
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return name, arguments
