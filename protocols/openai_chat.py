"""OpenAI Chat Completions: request validation into a `GenerationJob`, and the encoder from
parser events to `chat.completion.chunk` payloads / the final `chat.completion`.

Stream order (protocols.md 1.2): a role chunk at once; `reasoning_content` deltas; `content`
deltas; tool calls whose first delta per index carries id, type and name with empty arguments and
whose later deltas carry only argument pieces; a finish chunk with an empty delta; a usage chunk
with `choices: []` when `stream_options.include_usage`; `data: [DONE]`. Null fields are never
sent in deltas, and an arguments prefix that is already valid JSON is held back until the call
continues or ends (the AI SDK treats parseable arguments as a finished call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import orjson

from protocols.errors import ApiError, invalid, unsupported
from protocols.generation import GenerationResult, LogprobsDelta
from protocols.job import (Capabilities, GenerationJob, OutputFormat, ToolChoice, get_bool,
                           openai_tool_choice_mode, read_sampling,
                           get_dict, get_effort, get_int, get_list, get_number, get_stop,
                           get_str, get_verbosity, parse_arguments, template_kwargs,
                           text_of_parts, thinking_from_kwargs)
from protocols.media_parts import chat_image, chat_video, content_with_images
from runtime.text.events import (ContentDelta, ParserEvent, ReasoningDelta, ToolCallArgsDelta,
                                 ToolCallEnd, ToolCallStart)

MAX_STOP = 4


@dataclass(frozen=True)
class ChatOptions:
    """Chat-specific response options (not part of the generation itself)."""

    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


# --- request ----------------------------------------------------------------------------------

def parse_chat_request(body: dict, caps: Capabilities = Capabilities()
                       ) -> tuple[GenerationJob, ChatOptions]:
    get_str(body, "model")
    messages = _messages(get_list(body, "messages", required=True))
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if body.get("functions"):
        raise unsupported("functions", "legacy functions are not supported; use tools")
    if body.get("function_call") not in (None, "none", "auto"):
        raise unsupported("function_call", "legacy function_call is not supported; use "
                                           "tool_choice")
    n = get_int(body, "n", minimum=1)
    if n not in (None, 1):
        raise unsupported("n", "only n=1 is supported")
    _neutral_only(body)

    max_tokens = get_int(body, "max_completion_tokens", minimum=0)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", minimum=0)

    kwargs = template_kwargs(body)
    enable, preserve = thinking_from_kwargs(kwargs, "chat_template_kwargs")
    top_enable = get_bool(body, "enable_thinking")
    if top_enable is not None:
        enable = top_enable
    top_preserve = get_bool(body, "preserve_thinking")
    if top_preserve is not None:
        preserve = top_preserve
    effort = get_effort(body, "reasoning_effort", "reasoning_effort")
    if effort is None and "reasoning_effort" in kwargs:
        effort = get_effort(kwargs, "reasoning_effort", "chat_template_kwargs.reasoning_effort")
        kwargs.pop("reasoning_effort")
    if effort == "none":
        enable, effort = False, None

    logprobs = bool(get_bool(body, "logprobs"))
    top_logprobs = get_int(body, "top_logprobs", minimum=0, maximum=20)
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs", "requires logprobs: true")
    if logprobs and not caps.logprobs:
        raise unsupported("logprobs", "log probabilities are not available from this engine")

    output_format = _response_format(body.get("response_format"))
    if output_format is not None and not caps.constraints:
        raise unsupported("response_format", "constrained output is not available in this build")
    if tool_choice.mode in ("required", "named") and not caps.constraints:
        raise unsupported("tool_choice", f"tool_choice {tool_choice.mode!r} needs constrained "
                                         "decoding, which is not available in this build")

    stream = bool(get_bool(body, "stream"))
    stream_options = get_dict(body, "stream_options") or {}
    include_usage = bool(get_bool(stream_options, "include_usage",
                                  "stream_options.include_usage"))
    parallel = get_bool(body, "parallel_tool_calls")

    job = GenerationJob(
        api="chat",
        messages=tuple(messages),
        tools=tuple(tools) if tool_choice.mode != "none" else (),
        tool_choice=tool_choice,
        parallel_tool_calls=True if parallel is None else parallel,
        max_tokens=max_tokens,
        sampling=read_sampling(body),
        stop=get_stop(body, "stop", max_items=MAX_STOP),
        enable_thinking=enable,
        reasoning_effort=effort,
        thinking_budget=get_int(body, "thinking_budget", minimum=1),
        preserve_thinking=preserve,
        template_kwargs=kwargs,
        output_format=output_format,
        top_logprobs=(top_logprobs or 0) if logprobs else None,
        continue_final=(messages[-1]["role"] == "assistant"
                        and not messages[-1].get("tool_calls")),
    )
    return job, ChatOptions(stream=stream, include_usage=include_usage, logprobs=logprobs)


def _neutral_only(body: dict) -> None:
    """Fields accepted only at their neutral value (anything else cannot be honoured)."""
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise invalid("logit_bias", "must be an object")
        if any(value != 0 for value in bias.values()):
            raise unsupported("logit_bias")
    rep = get_number(body, "repetition_penalty")
    if rep is not None and rep != 1.0:
        raise unsupported("repetition_penalty", "only 1.0 is supported")
    get_verbosity(body, "verbosity", "verbosity")
    modalities = get_list(body, "modalities")
    if modalities and any(item != "text" for item in modalities):
        raise unsupported("modalities", "only text output is supported")
    if body.get("audio") is not None:
        raise unsupported("audio")
    if body.get("web_search_options") is not None:
        raise unsupported("web_search_options")


def _messages(raw: list) -> list[dict]:
    if not raw:
        raise invalid("messages", "must contain at least one message")
    messages: list[dict] = []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(where, "must be an object")
        role = get_str(message, "role", f"{where}.role", required=True)
        if role in ("system", "developer"):
            messages.append({"role": "system", "content": text_of_parts(
                message.get("content"), f"{where}.content")})
        elif role == "user":
            messages.append({"role": "user", "content": content_with_images(
                message.get("content"), f"{where}.content", chat_image, video_source=chat_video)})
        elif role == "assistant":
            messages.append(_assistant(message, where))
        elif role in ("tool", "function"):
            call_id = message.get("tool_call_id") if role == "tool" else message.get("name")
            if not isinstance(call_id, str):
                key = "tool_call_id" if role == "tool" else "name"
                raise invalid(f"{where}.{key}", "is required and must be a string")
            # Media in a tool result: passed with vision on, a short note with it off.
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": content_with_images(message.get("content"),
                                                            f"{where}.content", chat_image,
                                                            video_source=chat_video)})
        else:
            raise invalid(f"{where}.role", f"unknown role {role!r}")
    return messages


def _assistant(message: dict, where: str) -> dict:
    out: dict = {"role": "assistant", "content": text_of_parts(
        message.get("content"), f"{where}.content", allowed=("text", "refusal"))}
    if isinstance(message.get("content"), list):
        out["content"] = "".join(part.get("text") or part.get("refusal") or ""
                                 for part in message["content"] if isinstance(part, dict))
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = message.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise invalid(f"{where}.reasoning_content", "must be a string")
        out["reasoning_content"] = reasoning
    calls = get_list(message, "tool_calls", f"{where}.tool_calls")
    if calls:
        out["tool_calls"] = []
        for number, call in enumerate(calls):
            call_where = f"{where}.tool_calls[{number}]"
            if not isinstance(call, dict):
                raise invalid(call_where, "must be an object")
            function = get_dict(call, "function", f"{call_where}.function", required=True)
            name = get_str(function, "name", f"{call_where}.function.name", required=True)
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, (str, dict)):
                raise invalid(f"{call_where}.function.arguments", "must be a JSON string")
            out["tool_calls"].append({
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{number}",
                "type": "function",
                "function": {"name": name, "arguments": parse_arguments(arguments)}})
    return out


def _tools(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("tools", "must be an array")
    tools = []
    names = set()
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise invalid(where, "must be an object")
        kind = tool.get("type", "function")
        if kind != "function":
            raise unsupported(f"{where}.type", f"tools of type {kind!r} are not supported "
                                               "(only function tools)")
        function = get_dict(tool, "function", f"{where}.function", required=True)
        name = get_str(function, "name", f"{where}.function.name", required=True)
        if not name:
            raise invalid(f"{where}.function.name", "must not be empty")
        if name in names:
            raise invalid(f"{where}.function.name", f"duplicate tool name {name!r}")
        names.add(name)
        description = get_str(function, "description", f"{where}.function.description")
        parameters = get_dict(function, "parameters", f"{where}.function.parameters")
        strict = get_bool(function, "strict", f"{where}.function.strict")
        declared: dict = {"name": name}
        if description is not None:
            declared["description"] = description
        declared["parameters"] = parameters if parameters is not None else {
            "type": "object", "properties": {}}
        if strict:
            declared["strict"] = True
        tools.append({"type": "function", "function": declared})
    return tools


def _tool_choice(raw, tools: list[dict]) -> ToolChoice:
    mode = openai_tool_choice_mode(raw, bool(tools))
    if mode is not None:
        return mode
    names = {tool["function"]["name"] for tool in tools}
    kind = raw.get("type")
    if kind == "function":
        function = get_dict(raw, "function", "tool_choice.function", required=True)
        name = get_str(function, "name", "tool_choice.function.name", required=True)
        if name not in names:
            raise invalid("tool_choice.function.name", f"no tool named {name!r} in tools")
        return ToolChoice("named", name)
    if kind == "allowed_tools":
        raise unsupported("tool_choice.type", "allowed_tools is not supported")
    raise unsupported("tool_choice.type", f"tool_choice of type {kind!r} is not supported")


def _response_format(raw) -> Optional[OutputFormat]:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid("response_format", "must be an object")
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object")
    if kind == "json_schema":
        spec = get_dict(raw, "json_schema", "response_format.json_schema", required=True)
        schema = get_dict(spec, "schema", "response_format.json_schema.schema")
        return OutputFormat("json_schema", schema if schema is not None else {},
                            get_str(spec, "name", "response_format.json_schema.name"),
                            bool(get_bool(spec, "strict", "response_format.json_schema.strict")))
    raise unsupported("response_format.type", f"response_format {kind!r} is not supported")


# --- response ---------------------------------------------------------------------------------

def usage_payload(result: GenerationResult) -> dict:
    return {"prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens}}


def finish_reason(result: GenerationResult, made_tool_calls: bool) -> str:
    if result.finish_reason in ("length", "context"):
        return "length"
    return "tool_calls" if made_tool_calls else "stop"


class ChatEncoder:
    """Turns parser events into Chat Completions payloads; accumulates the whole message for
    the non-streaming response. Pure: no I/O, the caller frames and sends."""

    def __init__(self, completion_id: str, model: str, *, created: Optional[int] = None,
                 include_usage: bool = False, reasoning_field: str = "reasoning_content"):
        self.completion_id = completion_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.include_usage = include_usage
        self.reasoning_field = reasoning_field
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}  # index -> {"id", "name", "arguments"}
        self.logprobs: list[dict] = []
        self._held: dict[int, str] = {}

    def _chunk(self, delta: dict, finish: Optional[str] = None) -> dict:
        chunk = {"id": self.completion_id, "object": "chat.completion.chunk",
                 "created": self.created, "model": self.model, "system_fingerprint": None,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def heartbeat(self) -> dict:
        """An empty-delta chunk: parsed by clients, so it resets chunk-based idle watchdogs."""
        return self._chunk({})

    def events(self, events: list[ParserEvent]) -> list[dict]:
        chunks = []
        for event in events:
            if isinstance(event, LogprobsDelta):
                self.logprobs.extend(event.entries)
                chunk = self._chunk({})
                chunk["choices"][0]["logprobs"] = {"content": list(event.entries),
                                                   "refusal": None}
                chunks.append(chunk)
                continue
            delta = self._delta(event)
            if delta is not None:
                chunks.append(self._chunk(delta))
        return chunks

    def _delta(self, event: ParserEvent) -> Optional[dict]:
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return None
            self.reasoning.append(event.text)
            return {self.reasoning_field: event.text}
        if isinstance(event, ContentDelta):
            if not event.text:
                return None
            self.content.append(event.text)
            return {"content": event.text}
        if isinstance(event, ToolCallStart):
            self.calls[event.index] = {"id": event.call_id, "name": event.name, "arguments": ""}
            return {"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        if isinstance(event, ToolCallArgsDelta):
            call = self.calls.get(event.index)
            if call is None or not event.json_fragment:
                return None
            fragment = self._held.pop(event.index, "") + event.json_fragment
            call["arguments"] += event.json_fragment
            if _parses(call["arguments"]):
                self._held[event.index] = fragment  # looks finished; wait for more or the end
                return None
            return _args_delta(event.index, fragment)
        if isinstance(event, ToolCallEnd):
            fragment = self._held.pop(event.index, "")
            return _args_delta(event.index, fragment) if fragment else None
        return None

    def finish(self, result: GenerationResult) -> list[dict]:
        chunks = []
        for index in sorted(self._held):  # calls cut short without an end event
            chunks.append(self._chunk(_args_delta(index, self._held.pop(index))))
        chunks.append(self._chunk({}, finish_reason(result, bool(self.calls))))
        if self.include_usage:
            chunks.append({"id": self.completion_id, "object": "chat.completion.chunk",
                           "created": self.created, "model": self.model,
                           "system_fingerprint": None, "choices": [],
                           "usage": usage_payload(result)})
        return chunks

    def response(self, result: GenerationResult) -> dict:
        """The whole `chat.completion` object (non-streaming)."""
        message: dict = {"role": "assistant", "content": "".join(self.content) or (
            None if self.calls else ""), "refusal": None}
        if self.reasoning:
            message[self.reasoning_field] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"] or "{}"}}
                for _, call in sorted(self.calls.items())]
        return {"id": self.completion_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": [{"index": 0, "message": message,
                             "logprobs": ({"content": self.logprobs, "refusal": None}
                                          if self.logprobs else None),
                             "finish_reason": finish_reason(result, bool(self.calls))}],
                "usage": usage_payload(result)}


def _args_delta(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def _parses(text: str) -> bool:
    stripped = text.rstrip()
    if not stripped.endswith("}"):
        return False
    try:
        orjson.loads(stripped)
    except orjson.JSONDecodeError:
        return False
    return True


def error_chunk(error: ApiError) -> dict:
    """In-band error after the stream started: openai-python raises APIError on it."""
    return {"error": {"message": error.message, "type": "server_error" if error.status >= 500
                      else "invalid_request_error", "param": error.param, "code": error.code}}
