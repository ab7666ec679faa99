"""Anthropic Messages: request validation into a `GenerationJob`, and the encoder from parser
events to Messages stream events / the final `message`.

Stream order (protocols.md 1.4): `message_start`, then content blocks with contiguous indices,
one open at a time (`thinking` with `thinking_delta` and one `signature_delta` before its stop,
`text` with `text_delta`, `tool_use` with `input_json_delta` pieces forming one JSON object),
`message_delta` carrying the stop reason and cumulative usage, `message_stop`; `ping` may appear
anywhere. Every event has an `event:` line (anthropic-python drops events without one).

Usage follows Anthropic's convention: `input_tokens` excludes cache reads, which are reported
as `cache_read_input_tokens`. Claude Code's per-request `x-anthropic-billing-header:` system
block is dropped before rendering: it changes on every request and would defeat prefix reuse.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import orjson

from protocols.errors import ANTHROPIC, ApiError, error_type, invalid, unsupported
from protocols.generation import GenerationResult
from protocols.job import (Capabilities, GenerationJob, OutputFormat, ToolChoice, get_bool,
                           read_sampling,
                           get_dict, get_effort, get_int, get_list, get_stop,
                           get_str, template_kwargs, text_of_parts,
                           thinking_from_kwargs)
from protocols.media_parts import (VIDEO_TYPES, anthropic_image, content_with_images, image_part,
                                   joined)
from runtime.text.events import (ContentDelta, ParserEvent, ReasoningDelta, ToolCallArgsDelta,
                                 ToolCallEnd, ToolCallStart)

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
CLIENT_TOOL_TYPES = (None, "custom")


@dataclass(frozen=True)
class MessagesOptions:
    stream: bool = False
    show_thinking: bool = True  # thinking.display "omitted" sends empty thinking blocks


def parse_messages_request(body: dict, caps: Capabilities = Capabilities(), *,
                           count_only: bool = False) -> tuple[GenerationJob, MessagesOptions]:
    get_str(body, "model")
    # Required, as in Anthropic's API (count_tokens takes none): a client that forgets it must
    # not silently run to the server's default limit.
    max_tokens = None if count_only else get_int(body, "max_tokens", minimum=0, required=True)
    system = _system(body.get("system"))
    messages = _messages(get_list(body, "messages", required=True))
    if system:
        messages.insert(0, {"role": "system", "content": system})

    tools = _tools(get_list(body, "tools") or [])
    tool_choice, parallel = _tool_choice(get_dict(body, "tool_choice"), tools)
    if tool_choice.mode in ("required", "named") and not caps.constraints:
        raise unsupported("tool_choice", f"tool_choice {tool_choice.mode!r} needs constrained "
                                         "decoding, which is not available in this build")
    for key in ("mcp_servers",):
        if body.get(key):
            raise unsupported(key)
    if body.get("container") is not None:
        raise unsupported("container", "code-execution containers are not supported")

    enable: Optional[bool] = None
    budget: Optional[int] = None
    show_thinking = True
    thinking = get_dict(body, "thinking")
    if thinking is not None:
        kind = get_str(thinking, "type", "thinking.type", required=True)
        if kind == "disabled":
            enable = False
        elif kind in ("enabled", "adaptive", "between_tools"):
            enable = True
            if kind == "enabled":
                budget = get_int(thinking, "budget_tokens", "thinking.budget_tokens", minimum=1)
        else:
            raise invalid("thinking.type", f"unknown thinking type {kind!r}")
        display = get_str(thinking, "display", "thinking.display")
        if display not in (None, "summarized", "omitted", "full"):
            raise invalid("thinking.display", f"unknown display {display!r}")
        show_thinking = display != "omitted"

    kwargs = template_kwargs(body)
    kw_enable, preserve = thinking_from_kwargs(kwargs, "chat_template_kwargs")
    if kw_enable is not None:
        enable = kw_enable
    output_config = get_dict(body, "output_config") or {}
    effort = get_effort(output_config, "effort", "output_config.effort")
    if effort == "none":
        enable, effort = False, None
    output_format = None
    fmt = get_dict(output_config, "format", "output_config.format")
    if fmt is not None:
        if fmt.get("type") != "json_schema":
            raise unsupported("output_config.format.type")
        output_format = OutputFormat("json_schema", get_dict(
            fmt, "schema", "output_config.format.schema", required=True))
        if not caps.constraints:
            raise unsupported("output_config.format", "constrained output is not available in "
                                                      "this build")

    job = GenerationJob(
        api="messages",
        messages=tuple(messages),
        tools=tuple(tools) if tool_choice.mode != "none" else (),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        max_tokens=max_tokens,
        sampling=read_sampling(body, temperature_max=1.0, penalties=False),
        stop=get_stop(body, "stop_sequences"),
        enable_thinking=enable,
        reasoning_effort=effort,
        thinking_budget=budget,
        preserve_thinking=preserve,
        template_kwargs=kwargs,
        output_format=output_format,
        continue_final=(bool(messages) and messages[-1]["role"] == "assistant"
                        and not messages[-1].get("tool_calls")),
    )
    return job, MessagesOptions(stream=bool(get_bool(body, "stream")),
                                show_thinking=show_thinking)


def _system(raw) -> str:
    if raw is None:
        return ""
    if isinstance(raw, str):
        if raw.startswith(BILLING_HEADER_PREFIX):
            raw = raw.partition("\n")[2]
        return raw
    if not isinstance(raw, list):
        raise invalid("system", "must be a string or an array of text blocks")
    texts = []
    for index, block in enumerate(raw):
        where = f"system[{index}]"
        if not isinstance(block, dict) or block.get("type", "text") != "text":
            raise invalid(where, "must be a text block")
        text = block.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.text", "must be a string")
        if text.startswith(BILLING_HEADER_PREFIX):
            continue
        texts.append(text)
    return "\n\n".join(texts)


def _messages(raw: list) -> list[dict]:
    messages: list[dict] = []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object")
        role = get_str(message, "role", f"{where}.role", required=True)
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role", f"unknown role {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            blocks = content
        else:
            raise invalid(f"{where}.content", "must be a string or an array of blocks")
        if role == "assistant":
            _assistant(blocks, where, messages)
        elif role == "system":
            messages.append({"role": "system", "content": text_of_parts(blocks,
                                                                        f"{where}.content")})
        else:
            _user(blocks, where, messages)
    return messages


def _assistant(blocks: list, where: str, messages: list[dict]) -> None:
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        turn = messages[-1]  # consecutive assistant turns are merged
    else:
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    for number, block in enumerate(blocks):
        block_where = f"{where}.content[{number}]"
        if not isinstance(block, dict):
            raise invalid(block_where, "must be an object")
        kind = block.get("type")
        if kind == "text":
            text = get_str(block, "text", f"{block_where}.text", required=True)
            turn["content"] += text
        elif kind == "thinking":
            thinking = get_str(block, "thinking", f"{block_where}.thinking", required=True)
            turn["reasoning_content"] = turn.get("reasoning_content", "") + thinking
        elif kind == "redacted_thinking":
            continue  # opaque to us: nothing to render
        elif kind == "tool_use":
            name = get_str(block, "name", f"{block_where}.name", required=True)
            call_id = get_str(block, "id", f"{block_where}.id", required=True)
            arguments = get_dict(block, "input", f"{block_where}.input") or {}
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}})
        else:
            raise unsupported(f"{block_where}.type", f"content blocks of type {kind!r} are not "
                                                     "supported in assistant messages")


def _user(blocks: list, where: str, messages: list[dict]) -> None:
    parts: list[dict] = []      # text and image parts, in order
    for number, block in enumerate(blocks):
        block_where = f"{where}.content[{number}]"
        if not isinstance(block, dict):
            raise invalid(block_where, "must be an object")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text",
                          "text": get_str(block, "text", f"{block_where}.text", required=True)})
        elif kind == "image" or kind in VIDEO_TYPES:
            parts.append(image_part(anthropic_image(block, block_where), block_where))
        elif kind == "tool_result":
            call_id = get_str(block, "tool_use_id", f"{block_where}.tool_use_id", required=True)
            # Images in a tool result: passed with vision on, a short note with it off.
            content = content_with_images(block.get("content", ""), f"{block_where}.content",
                                          anthropic_image)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise unsupported(f"{block_where}.type", f"content blocks of type {kind!r} are not "
                                                     "supported by this model")
    if parts:
        # Without images the turn stays one string, as text-only prompts always rendered.
        content = parts if any(part["type"] == "image" for part in parts) else \
            "".join(part["text"] for part in parts)
        if messages and messages[-1]["role"] == "user":
            # consecutive user turns are merged
            messages[-1]["content"] = joined(messages[-1]["content"], "\n\n", content)
        else:
            messages.append({"role": "user", "content": content})


def _tools(raw: list) -> list[dict]:
    tools = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(where, "must be an object")
        if tool.get("type") not in CLIENT_TOOL_TYPES:
            continue  # server / versioned tools: accepted, never shown to the model
        name = get_str(tool, "name", f"{where}.name", required=True)
        schema = get_dict(tool, "input_schema", f"{where}.input_schema", required=True)
        declared: dict = {"name": name}
        description = get_str(tool, "description", f"{where}.description")
        if description is not None:
            declared["description"] = description
        declared["parameters"] = schema
        if get_bool(tool, "strict", f"{where}.strict"):
            declared["strict"] = True
        tools.append({"type": "function", "function": declared})
    return tools


def _tool_choice(raw: Optional[dict], tools: list[dict]) -> tuple[ToolChoice, bool]:
    if raw is None:
        return ToolChoice("auto"), True
    kind = get_str(raw, "type", "tool_choice.type", required=True)
    parallel = not get_bool(raw, "disable_parallel_tool_use",
                            "tool_choice.disable_parallel_tool_use")
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if kind == "none":
        return ToolChoice("none"), parallel
    if kind == "any":
        if not tools:
            raise invalid("tool_choice", "'any' needs at least one tool")
        return ToolChoice("required"), parallel
    if kind == "tool":
        name = get_str(raw, "name", "tool_choice.name", required=True)
        if name not in {tool["function"]["name"] for tool in tools}:
            raise invalid("tool_choice.name", f"no tool named {name!r} in tools")
        return ToolChoice("named", name), parallel
    raise invalid("tool_choice.type", f"unknown tool_choice type {kind!r}")


# --- response ---------------------------------------------------------------------------------

def usage_payload(result: GenerationResult) -> dict:
    return {"input_tokens": result.prompt_tokens - result.cached_prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": result.cached_prompt_tokens,
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"thinking_tokens": result.reasoning_tokens}}


def stop_reason(result: GenerationResult, made_tool_calls: bool) -> str:
    if result.finish_reason == "length":
        return "max_tokens"
    if result.finish_reason == "context":
        return "model_context_window_exceeded"
    if made_tool_calls:
        return "tool_use"
    if result.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def signature(thinking: str) -> str:
    """Opaque; clients send it back and we accept any value."""
    return "infernix-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


class MessagesEncoder:
    """Parser events -> Messages stream events; accumulates content blocks for the
    non-streaming message. Pure: no I/O."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, *,
                 show_thinking: bool = True):
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.show_thinking = show_thinking
        self.blocks: list[dict] = []
        self.open: Optional[dict] = None  # {"kind", "index", ...}
        self.tool_index: dict[int, int] = {}  # parser call index -> block index
        self.made_tool_calls = False

    def start(self) -> list[dict]:
        message = {"id": self.message_id, "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 1,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def heartbeat(self) -> dict:
        return {"type": "ping"}

    def events(self, events: list[ParserEvent]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, ReasoningDelta) and event.text:
                self._ensure("thinking", out)
                self.open["text"].append(event.text)
                if self.show_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, ContentDelta) and event.text:
                self._ensure("text", out)
                self.open["text"].append(event.text)
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCallStart):
                self._close(out)
                self.made_tool_calls = True
                index = len(self.blocks)
                block = {"type": "tool_use", "id": event.call_id, "name": event.name,
                         "input": {}}
                self.blocks.append(block)
                self.open = {"kind": "tool_use", "index": index, "text": [],
                             "call": event.index}
                self.tool_index[event.index] = index
                out.append({"type": "content_block_start", "index": index,
                            "content_block": dict(block)})
            elif isinstance(event, ToolCallArgsDelta):
                if (self.open is None or self.open["kind"] != "tool_use"
                        or self.open["call"] != event.index or not event.json_fragment):
                    continue
                self.open["text"].append(event.json_fragment)
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.json_fragment}))
            elif isinstance(event, ToolCallEnd):
                if self.open is not None and self.open.get("call") == event.index:
                    self._close(out)
        return out

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.open["index"], "delta": delta}

    def _ensure(self, kind: str, out: list[dict]) -> None:
        if self.open is not None and self.open["kind"] == kind:
            return
        self._close(out)
        index = len(self.blocks)
        if kind == "thinking":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        self.blocks.append(block)
        self.open = {"kind": kind, "index": index, "text": []}
        out.append({"type": "content_block_start", "index": index, "content_block": dict(block)})

    def _close(self, out: list[dict]) -> None:
        current, self.open = self.open, None
        if current is None:
            return
        block = self.blocks[current["index"]]
        text = "".join(current["text"])
        if current["kind"] == "thinking":
            block["thinking"] = text if self.show_thinking else ""
            block["signature"] = signature(text)
            out.append({"type": "content_block_delta", "index": current["index"],
                        "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif current["kind"] == "text":
            block["text"] = text
        else:
            block["input"] = _parse_input(text)
        out.append({"type": "content_block_stop", "index": current["index"]})

    def finish(self, result: GenerationResult) -> list[dict]:
        out: list[dict] = []
        self._close(out)
        usage = usage_payload(result)
        out.append({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(result, self.made_tool_calls),
                              "stop_sequence": result.stop_sequence},
                    "usage": usage})
        out.append({"type": "message_stop"})
        return out

    def response(self, result: GenerationResult) -> dict:
        self._close([])
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": self.blocks,
                "stop_reason": stop_reason(result, self.made_tool_calls),
                "stop_sequence": result.stop_sequence, "usage": usage_payload(result)}


def _parse_input(text: str) -> dict:
    if not text:
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def error_event(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": error_type(ANTHROPIC, error.status),
                                       "message": error.message}}
