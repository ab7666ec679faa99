"""The protocol-neutral request record every API parser produces, and field-checking helpers.

A `GenerationJob` is what the three APIs have in common once validated: a chat in the form the
Qwen chat template takes (role / content / reasoning_content / tool_calls / tool_call_id), tool
declarations, tool choice, limits, sampling overrides, stops, thinking controls and an optional
output format. The backend turns it into an `EngineRequest`; the API encoders never see it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import orjson

from protocols.errors import invalid, unsupported
from runtime.engine.presets import SamplingOverrides

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
VERBOSITIES = ("low", "medium", "high")
MAX_STOP_STRINGS = 16
MAX_ARGUMENT_DEPTH = 256  # deeper tool-call argument text stays a string (the template's
# tojson is json.dumps, which has no depth limit; answers never echo parsed arguments)
MAX_STOP_CHARS = 1024
# Template variables the server sets from the request itself (or names the renderer's own
# arguments): a client value for them would clash (once a TypeError, a 500).
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenizer",
                                      "self"})


@dataclass(frozen=True)
class ToolChoice:
    """auto: the model decides; none: no calls; required: at least one call; named: call
    `name` (one call)."""

    mode: str = "auto"
    name: Optional[str] = None


@dataclass(frozen=True)
class OutputFormat:
    """A constrained answer: kind "json_object" or "json_schema" (with `schema`)."""

    kind: str
    schema: Optional[dict] = None
    name: Optional[str] = None
    strict: bool = False


@dataclass(frozen=True)
class ToolGrammar:
    """A grammar a tool's raw text parameter must match: an OpenAI Responses custom tool with
    `format: {"type": "grammar", "syntax", "definition"}` (its one parameter `input`).
    syntax: "lark" (llguidance's Lark dialect) or "regex" (Rust regex syntax, the whole value)."""

    tool: str
    syntax: str
    definition: str
    parameter: str = "input"


@dataclass(frozen=True)
class GenerationJob:
    """One validated generation request, independent of the API it came from.

    messages: chat messages for the template: {"role": system|user|assistant|tool, "content":
        str or list of {"type": "text", "text"} parts, "reasoning_content"?, "tool_calls"?:
        [{"id", "type": "function", "function": {"name", "arguments": dict or raw str}}],
        "tool_call_id"?}. Assistant `arguments` are parsed from JSON text when possible (the
        template iterates them); unparseable history arguments stay the raw string.
    tools: [{"type": "function", "function": {"name", "description", "parameters"}}, ...].
    tool_grammars: grammars that tools' raw text parameters must match (enforced with the
        tool-call constraint whenever those tools can be called).
    max_tokens: output limit asked for; None = the server default. It is clamped to the room
        left in the context, never rejected for being large.
    Sampling fields left None take the model's preset for the thinking mode.
    enable_thinking / reasoning_effort / thinking_budget / preserve_thinking: None = server
        default.
    template_kwargs: other `chat_template_kwargs` the client sent (passed to the template).
    parallel_tool_calls=False and max_tool_calls end the generation once that many calls are
        complete (the model's later output is not produced).
    continue_final: the last message is an assistant prefill to continue.
    """

    api: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    tool_grammars: tuple[ToolGrammar, ...] = ()
    parallel_tool_calls: bool = True
    max_tool_calls: Optional[int] = None
    max_tokens: Optional[int] = None
    sampling: SamplingOverrides = SamplingOverrides()
    stop: tuple[str, ...] = ()
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    thinking_budget: Optional[int] = None
    preserve_thinking: Optional[bool] = None
    template_kwargs: dict = field(default_factory=dict)
    output_format: Optional[OutputFormat] = None
    top_logprobs: Optional[int] = None
    continue_final: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What the backend can honour; a request asking for more is refused with a 400."""

    logprobs: bool = False
    constraints: bool = False



# --- field helpers: every failure is a 400 naming the field ----------------------------------

_MISSING = object()


def get_type(obj: dict, key: str, kinds, where: str, *, required: bool = False,
             allow_none: bool = True) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or (value is None and allow_none):
        if required:
            raise invalid(where, "is required", "missing_required_parameter")
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in _tuple(kinds)):
        raise invalid(where, f"must be {_describe(kinds)}, got {_json_type(value)}")
    return value


def _tuple(kinds) -> tuple:
    return kinds if isinstance(kinds, tuple) else (kinds,)


def _describe(kinds) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
             list: "an array", dict: "an object"}
    parts = [names.get(kind, kind.__name__) for kind in _tuple(kinds)]
    if parts == ["an integer", "a number"] or parts == ["a number", "an integer"]:
        return "a number"
    return " or ".join(parts)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def get_str(obj: dict, key: str, where: Optional[str] = None, **kw) -> Optional[str]:
    return get_type(obj, key, str, where or key, **kw)


def get_bool(obj: dict, key: str, where: Optional[str] = None, **kw) -> Optional[bool]:
    return get_type(obj, key, bool, where or key, **kw)


def get_dict(obj: dict, key: str, where: Optional[str] = None, **kw) -> Optional[dict]:
    return get_type(obj, key, dict, where or key, **kw)


def get_list(obj: dict, key: str, where: Optional[str] = None, **kw) -> Optional[list]:
    return get_type(obj, key, list, where or key, **kw)


def get_int(obj: dict, key: str, where: Optional[str] = None, *, minimum: Optional[int] = None,
            maximum: Optional[int] = None, **kw) -> Optional[int]:
    where = where or key
    value = get_type(obj, key, (int, float), where, **kw)
    if value is None:
        return None
    if isinstance(value, float):
        if not value.is_integer():
            raise invalid(where, f"must be an integer, got {value}")
        value = int(value)
    if not -(1 << 63) <= value < (1 << 63):
        raise invalid(where, "is out of the 64-bit integer range")
    _check_range(where, value, minimum, maximum)
    return value


def get_number(obj: dict, key: str, where: Optional[str] = None, *,
               minimum: Optional[float] = None, maximum: Optional[float] = None,
               **kw) -> Optional[float]:
    where = where or key
    value = get_type(obj, key, (int, float), where, **kw)
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise invalid(where, "must be a finite number")
    _check_range(where, value, minimum, maximum)
    return value


def _check_range(where: str, value, minimum, maximum) -> None:
    if minimum is not None and value < minimum:
        raise invalid(where, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise invalid(where, f"must be <= {maximum}, got {value}")


def get_effort(obj: dict, key: str, where: str) -> Optional[str]:
    value = get_str(obj, key, where)
    if value is not None and value not in EFFORTS:
        raise invalid(where, f"must be one of {', '.join(EFFORTS)}, got {value!r}")
    return value


def get_verbosity(obj: dict, key: str, where: str) -> Optional[str]:
    """OpenAI's `verbosity` style hint (Codex sends "low" for its own models): every documented
    value is accepted; the model is not steered by it."""
    value = get_str(obj, key, where)
    if value is not None and value not in VERBOSITIES:
        raise invalid(where, f"must be one of {', '.join(VERBOSITIES)}, got {value!r}")
    return value


def get_top_k(body: dict, key: str, where: Optional[str] = None) -> Optional[int]:
    value = get_int(body, key, where, minimum=-1)
    if value is None or value == -1:
        return None  # -1 = "no top-k" in the vLLM convention: the preset applies
    if value > 20:
        raise unsupported(where or key, f"top_k above 20 is not supported (got {value})")
    return value


def get_stop(obj: dict, key: str, where: Optional[str] = None,
             max_items: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
    """Stop strings, bounded in count and length: each one is matched against every token of
    the answer, and a huge one (megabytes) took seconds to compile."""
    where = where or key
    value = obj.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise invalid(where, "must be a string or an array of strings")
    if len(value) > max_items:
        raise invalid(where, f"at most {max_items} stop sequences are allowed")
    for item in value:
        if len(item) > MAX_STOP_CHARS:
            raise invalid(where, f"a stop sequence may have at most {MAX_STOP_CHARS} "
                                 f"characters (got {len(item)})")
    return tuple(item for item in value if item)


def read_sampling(body: dict, *, temperature_max: float = 2.0,
                  penalties: bool = True) -> SamplingOverrides:
    """The sampling fields the three APIs share (each API's own range for temperature; Anthropic
    has no penalty fields). A negative seed wraps into the engine's 63-bit range."""
    seed = get_int(body, "seed")
    return SamplingOverrides(
        temperature=get_number(body, "temperature", minimum=0.0, maximum=temperature_max),
        top_p=get_number(body, "top_p", minimum=0.0, maximum=1.0),
        top_k=get_top_k(body, "top_k"),
        min_p=get_number(body, "min_p", minimum=0.0, maximum=1.0),
        presence_penalty=(get_number(body, "presence_penalty", minimum=-2.0, maximum=2.0)
                          if penalties else None),
        frequency_penalty=(get_number(body, "frequency_penalty", minimum=-2.0, maximum=2.0)
                           if penalties else None),
        seed=None if seed is None else seed & ((1 << 63) - 1))


def openai_tool_choice_mode(raw: Any, has_tools: bool, what: str = "tool") -> Optional["ToolChoice"]:
    """The OpenAI string forms of `tool_choice` (absent, auto, none, required); None when `raw`
    is an object, which each API then reads in its own shape."""
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"must be auto, none, required or an object, got {raw!r}")
        if raw == "required" and not has_tools:
            raise invalid("tool_choice", f"'required' needs at least one {what}")
        return ToolChoice(raw)
    if not isinstance(raw, dict):
        raise invalid("tool_choice", "must be a string or an object")
    return None


def parse_arguments(text: Any) -> Any:
    """History tool-call arguments (a JSON string from OpenAI clients) -> a dict for the template;
    invalid JSON (a past broken generation) stays the raw string."""
    if isinstance(text, dict):
        return text
    if not isinstance(text, str):
        return text
    try:
        value = orjson.loads(text) if text.strip() else {}
    except orjson.JSONDecodeError:
        return text
    if text.count("{") + text.count("[") > MAX_ARGUMENT_DEPTH and \
            json_depth(value) > MAX_ARGUMENT_DEPTH:
        return text  # the template would recurse through it: rendered as the string instead
    return value if isinstance(value, dict) else text


def json_depth(value) -> int:
    """Nesting depth of containers (a scalar is 0, `{}` is 1), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return deepest


def template_kwargs(body: dict, where: str = "chat_template_kwargs") -> dict:
    """The client's template variables; the ones the server sets itself are refused."""
    value = get_dict(body, "chat_template_kwargs", where)
    for key in value or ():
        if key in RESERVED_TEMPLATE_KWARGS:
            raise invalid(f"{where}.{key}", f"{key!r} is set by the server (use the request's "
                                            "own fields)")
    return dict(value) if value else {}


def thinking_from_kwargs(kwargs: dict, where: str) -> tuple[Optional[bool], Optional[bool]]:
    """`enable_thinking` and `preserve_thinking` out of chat_template_kwargs (popped)."""
    enable = kwargs.pop("enable_thinking", None)
    if enable is not None and not isinstance(enable, bool):
        raise invalid(f"{where}.enable_thinking", "must be a boolean")
    preserve = kwargs.pop("preserve_thinking", None)
    if preserve is not None and not isinstance(preserve, bool):
        raise invalid(f"{where}.preserve_thinking", "must be a boolean")
    return enable, preserve


def text_of_parts(content: Any, where: str, allowed=("text",), *, text_key: str = "text") -> str:
    """Join a string or a list of text parts into one string (adjacent parts, no separator).

    Parts of a type outside `allowed` are rejected naming them (this server has no vision or
    audio input)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "must be a string or an array of content parts")
    pieces = []
    for index, part in enumerate(content):
        part_where = f"{where}[{index}]"
        if isinstance(part, str):
            pieces.append(part)
            continue
        if not isinstance(part, dict):
            raise invalid(part_where, "must be an object")
        kind = part.get("type")
        if kind not in allowed:
            raise unsupported(f"{part_where}.type",
                              f"content parts of type {kind!r} are not supported by this model "
                              f"(supported: {', '.join(allowed)})")
        text = part.get(text_key, "")
        if not isinstance(text, str):
            raise invalid(f"{part_where}.{text_key}", "must be a string")
        pieces.append(text)
    return "".join(pieces)
