"""OpenAI Responses encoder: parser events -> semantic stream events and the final `response`.

Order (protocols.md 1.3, enforced by openai-python's `responses.stream()` and by Codex):
`response.created`, `response.in_progress`, then per output item `output_item.added`, its
content-part / delta / done events, `output_item.done`, and finally exactly one of
`response.completed`, `response.incomplete` (length limit) or `response.failed`. Every event has
a `sequence_number` counting from 0 and is framed with an `event:` line equal to its `type`.
Output indices follow the order items are added (the SDK indexes its snapshot by position).
"""

from __future__ import annotations

import base64
import time
from typing import Optional

import orjson

from protocols.errors import ApiError
from protocols.generation import GenerationResult
from runtime.text.events import (ContentDelta, ParserEvent, ReasoningDelta, ToolCallArgsDelta,
                                 ToolCallEnd, ToolCallStart)

ENCRYPTED_PREFIX = "infernix-raw:"
"""Our `encrypted_content` is the raw reasoning, base64-encoded, NOT encrypted: it lets stateless
clients (Codex with store:false) hand the reasoning back so the template can render it."""


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: str) -> Optional[str]:
    if not blob.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(ENCRYPTED_PREFIX):], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def usage_payload(result: GenerationResult) -> dict:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_prompt_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class ResponsesEncoder:
    """Stateful, I/O-free. `echo` holds the request fields a response object repeats
    (instructions, tools, tool_choice, parallel_tool_calls, temperature, top_p, text, reasoning,
    metadata, max_output_tokens, previous_response_id, store, ...). `custom_tools` names the
    tools whose calls are `custom_tool_call` items (their single `input` string is unwrapped),
    `tool_searches` the client tool_search tools, whose calls are `tool_search_call` items
    (arguments as an object, `execution: "client"`; no delta events exist for them), and
    `namespaces` maps a model-facing tool name to (namespace, name)."""

    def __init__(self, response_id: str, model: str, echo: dict, *,
                 custom_tools: frozenset = frozenset(), tool_searches: frozenset = frozenset(),
                 namespaces: Optional[dict] = None,
                 include_encrypted_reasoning: bool = False, created_at: Optional[int] = None):
        self.response_id = response_id
        self.model = model
        self.echo = echo
        self.custom_tools = custom_tools
        self.tool_searches = tool_searches
        self.namespaces = namespaces or {}
        self.include_encrypted = include_encrypted_reasoning
        self.created_at = int(time.time()) if created_at is None else created_at
        self.sequence = 0
        self.output: list[dict] = []       # finished items, in output order
        self.current: Optional[dict] = None  # the open reasoning or message item
        self.calls: dict[int, dict] = {}   # parser call index -> open call item state
        self.ids = 0

    # --- framing helpers --------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return payload

    def _new_id(self, prefix: str) -> str:
        self.ids += 1
        return f"{prefix}_{self.response_id.removeprefix('resp_')}_{self.ids}"

    def snapshot(self, status: str, result: Optional[GenerationResult] = None,
                 error: Optional[ApiError] = None) -> dict:
        response = {"id": self.response_id, "object": "response", "created_at": self.created_at,
                    "status": status, "model": self.model,
                    "output": [item for item in self.output if item],
                    "error": None, "incomplete_details": None, "usage": None}
        response.update(self.echo)
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            response["error"] = {"code": error.code or "server_error", "message": error.message}
        if result is not None:
            response["usage"] = usage_payload(result)
            if status in ("completed", "incomplete"):
                response["completed_at"] = int(time.time())
        return response

    # --- stream -----------------------------------------------------------------------------

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.snapshot("in_progress")),
                self._event("response.in_progress", response=self.snapshot("in_progress"))]

    def heartbeat(self) -> dict:
        """`response.in_progress` again: a parsed event, harmless to the SDK and Codex."""
        return self._event("response.in_progress", response=self.snapshot("in_progress"))

    def events(self, events: list[ParserEvent]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            if isinstance(event, ReasoningDelta) and event.text:
                self._open("reasoning", out)
                self.current["text"].append(event.text)
                out.append(self._event("response.reasoning_text.delta",
                                       item_id=self.current["id"],
                                       output_index=self.current["index"], content_index=0,
                                       delta=event.text))
            elif isinstance(event, ContentDelta) and event.text:
                self._open("message", out)
                self.current["text"].append(event.text)
                out.append(self._event("response.output_text.delta", item_id=self.current["id"],
                                       output_index=self.current["index"], content_index=0,
                                       delta=event.text, logprobs=[]))
            elif isinstance(event, ToolCallStart):
                self._close_current(out)
                self._start_call(event, out)
            elif isinstance(event, ToolCallArgsDelta):
                call = self.calls.get(event.index)
                if call is None or not event.json_fragment:
                    continue
                call["arguments"].append(event.json_fragment)
                if call["kind"] == "function":
                    out.append(self._event("response.function_call_arguments.delta",
                                           item_id=call["id"], output_index=call["index"],
                                           delta=event.json_fragment))
            elif isinstance(event, ToolCallEnd):
                self._end_call(event.index, out)
        return out

    def _open(self, kind: str, out: list[dict]) -> None:
        if self.current is not None and self.current["kind"] == kind:
            return
        self._close_current(out)
        index = self._next_index()
        if kind == "reasoning":
            item_id = self._new_id("rs")
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item_id = self._new_id("msg")
            item = {"id": item_id, "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.current = {"kind": kind, "id": item_id, "index": index, "text": []}
        self._reserve(index)
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        out.append(self._event("response.content_part.added", item_id=item_id,
                               output_index=index, content_index=0, part=part))

    def _next_index(self) -> int:
        return len(self.output)

    def _reserve(self, index: int) -> None:
        self.output.append({})  # filled when the item is done; keeps indices positional

    def _close_current(self, out: list[dict]) -> None:
        current, self.current = self.current, None
        if current is None:
            return
        text = "".join(current["text"])
        item_id, index = current["id"], current["index"]
        if current["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.reasoning_text.done", item_id=item_id,
                                   output_index=index, content_index=0, text=text))
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": [part],
                    "status": "completed"}
            if self.include_encrypted:
                item["encrypted_content"] = encode_reasoning(text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", item_id=item_id,
                                   output_index=index, content_index=0, text=text, logprobs=[]))
            item = {"id": item_id, "type": "message", "role": "assistant",
                    "status": "completed", "content": [part]}
        out.append(self._event("response.content_part.done", item_id=item_id,
                               output_index=index, content_index=0, part=part))
        self.output[index] = item
        out.append(self._event("response.output_item.done", output_index=index, item=item))

    def _start_call(self, event: ToolCallStart, out: list[dict]) -> None:
        index = self._next_index()
        self._reserve(index)
        kind = ("custom" if event.name in self.custom_tools else
                "search" if event.name in self.tool_searches else "function")
        namespace, name = self.namespaces.get(event.name, (None, event.name))
        prefix = {"custom": "ctc", "search": "tsc", "function": "fc"}[kind]
        call = {"id": self._new_id(prefix), "index": index, "kind": kind,
                "call_id": event.call_id, "name": name, "namespace": namespace,
                "arguments": []}
        self.calls[event.index] = call
        out.append(self._event("response.output_item.added", output_index=index,
                               item=self._call_item(call, "in_progress")))

    def _call_item(self, call: dict, status: str) -> dict:
        arguments = "".join(call["arguments"])
        if call["kind"] == "search":
            item = {"id": call["id"], "type": "tool_search_call", "call_id": call["call_id"],
                    "execution": "client", "status": status,
                    "arguments": _search_arguments(arguments) if status == "completed" else {}}
        elif call["kind"] == "custom":
            item = {"id": call["id"], "type": "custom_tool_call", "call_id": call["call_id"],
                    "name": call["name"], "input": _custom_input(arguments) if status ==
                    "completed" else ""}
        else:
            item = {"id": call["id"], "type": "function_call", "call_id": call["call_id"],
                    "name": call["name"], "arguments": arguments if status == "completed"
                    else "", "status": status}
        if call["namespace"]:
            item["namespace"] = call["namespace"]
        return item

    def _end_call(self, parser_index: int, out: list[dict]) -> None:
        call = self.calls.pop(parser_index, None)
        if call is None:
            return
        item = self._call_item(call, "completed")
        if call["kind"] == "custom":
            if item["input"]:
                out.append(self._event("response.custom_tool_call_input.delta",
                                       item_id=call["id"], output_index=call["index"],
                                       delta=item["input"]))
            out.append(self._event("response.custom_tool_call_input.done", item_id=call["id"],
                                   output_index=call["index"], input=item["input"]))
        elif call["kind"] == "function":
            if not call["arguments"]:
                item["arguments"] = "{}"
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=call["id"], output_index=call["index"],
                                       delta="{}"))
            out.append(self._event("response.function_call_arguments.done", item_id=call["id"],
                                   output_index=call["index"], arguments=item["arguments"],
                                   name=call["name"]))
        self.output[call["index"]] = item
        out.append(self._event("response.output_item.done", output_index=call["index"],
                               item=item))

    def close_items(self) -> list[dict]:
        out: list[dict] = []
        self._close_current(out)
        for parser_index in sorted(self.calls):
            self._end_call(parser_index, out)
        return out

    def finish(self, result: GenerationResult) -> list[dict]:
        out = self.close_items()
        if result.finish_reason in ("length", "context"):
            out.append(self._event("response.incomplete",
                                   response=self.snapshot("incomplete", result)))
        else:
            out.append(self._event("response.completed",
                                   response=self.snapshot("completed", result)))
        return out

    def failed(self, error: ApiError, result: Optional[GenerationResult] = None) -> list[dict]:
        out = self.close_items()
        out.append(self._event("response.failed",
                               response=self.snapshot("failed", result, error)))
        return out

    def response(self, result: GenerationResult) -> dict:
        """The final response object (non-streaming, and what the store keeps)."""
        self.close_items()
        status = "incomplete" if result.finish_reason in ("length", "context") else "completed"
        return self.snapshot(status, result)


def _custom_input(arguments: str) -> str:
    """A custom tool is shown to the model as a function with one string parameter `input`."""
    try:
        value = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict):
        text = value.get("input", "")
        return text if isinstance(text, str) else orjson.dumps(text).decode()
    return arguments


def _search_arguments(arguments: str):
    """A tool_search_call carries its arguments as a JSON object, not as JSON text."""
    try:
        return orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        return arguments  # a broken generation: the raw text, as function calls keep it
