"""The three streaming APIs as the client speaks them: request bodies built from one history
in Chat Completions shape, and stream readers that fill one `Answer`.

History messages: {role: user | assistant | tool, content, reasoning_content?, tool_calls?,
tool_call_id?}. Every API gets the same sampling (T 1.0, top-p 0.95, top-k 20: what agent
clients send to Qwen models) and the plan's `seed` (Infernix reads `seed` in every API; a
server that ignores it is still joined through the `x-request-tag` header).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Iterator

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}


@dataclass
class Answer:
    """What one streamed request produced. t_first: monotonic time of the first non-empty
    content, reasoning or tool-call delta. cached_tokens stays None when the server does not
    report it (the analysis counts that as 0)."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # Chat shape: {id, type, function}
    t_first: float | None = None
    finish: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None

    def first(self) -> None:
        if self.t_first is None:
            self.t_first = time.monotonic()

    def message(self) -> dict:
        """The answer as the agent appends it to its history."""
        message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def body(api: str, model: str, system: str, messages: list[dict], tools: list[dict],
         max_tokens: int, seed: int) -> dict:
    if api == "chat":
        out = {"model": model, "messages": [{"role": "system", "content": system}, *messages],
               "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, "seed": seed, **SAMPLING}
        if tools:
            out.update(tools=tools, tool_choice="auto")
        return out
    if api == "responses":
        out = {"model": model, "instructions": system, "input": _responses_input(messages),
               "max_output_tokens": max_tokens, "stream": True, "store": False, "seed": seed,
               "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"]}
        if tools:
            out.update(tools=[{"type": "function", **t["function"]} for t in tools],
                       tool_choice="auto")
        return out
    out = {"model": model, "system": system, "messages": _anthropic_messages(messages),
           "max_tokens": max_tokens, "stream": True, "seed": seed, **SAMPLING}
    if tools:
        out.update(tools=[{"name": t["function"]["name"],
                           "description": t["function"]["description"],
                           "input_schema": t["function"]["parameters"]} for t in tools],
                   tool_choice={"type": "auto"})
    return out


def _responses_input(messages: list[dict]) -> list[dict]:
    items: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        elif m["role"] == "assistant":
            if m.get("reasoning_content"):
                items.append({"type": "reasoning", "summary": [], "content": [
                    {"type": "reasoning_text", "text": m["reasoning_content"]}]})
            if m["content"]:
                items.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": m["content"]}]})
            for call in m.get("tool_calls", []):
                items.append({"type": "function_call", "call_id": call["id"],
                              "name": call["function"]["name"],
                              "arguments": call["function"]["arguments"]})
        else:
            items.append({"type": "message", "role": m["role"], "content": m["content"]})
    return items


def _anthropic_messages(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant":
            blocks: list[dict] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"],
                               "signature": "agentic-ab"})
            if m["content"]:
                blocks.append({"type": "text", "text": m["content"]})
            for call in m.get("tool_calls", []):
                blocks.append({"type": "tool_use", "id": call["id"],
                               "name": call["function"]["name"],
                               "input": _arguments(call["function"]["arguments"])})
            out.append({"role": "assistant", "content": blocks or [{"type": "text",
                                                                    "text": ""}]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id":
                                                     m["tool_call_id"], "content": m["content"]}]})
        else:
            out.append({"role": "user", "content": m["content"]})
    return out


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {"input": text}  # a cut-off call: keep its text
    return value if isinstance(value, dict) else {"input": value}


def _events(lines: Iterator[str]) -> Iterator[dict]:
    """SSE `data:` payloads as JSON objects, `[DONE]` ends the stream."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            yield json.loads(data)


def read_stream(api: str, lines: Iterator[str], answer: Answer) -> None:
    """Fill `answer` from the stream; an in-band error sets answer.error."""
    reader = {"chat": _read_chat, "responses": _read_responses, "messages": _read_messages}[api]
    reader(_events(lines), answer)


def _read_chat(events: Iterator[dict], answer: Answer) -> None:
    calls: dict[int, dict] = {}
    for event in events:
        if "error" in event:
            answer.error = str(event["error"].get("message", event["error"]))
            return
        usage = event.get("usage")
        if usage:
            answer.prompt_tokens = usage.get("prompt_tokens")
            answer.completion_tokens = usage.get("completion_tokens")
            answer.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens")
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                answer.first()
                answer.reasoning += reasoning
            if delta.get("content"):
                answer.first()
                answer.content += delta["content"]
            for piece in delta.get("tool_calls") or []:
                answer.first()
                call = calls.setdefault(piece.get("index", 0), {
                    "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = piece.get("id") or call["id"]
                function = piece.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                answer.finish = choice["finish_reason"]
    answer.tool_calls = [calls[i] for i in sorted(calls)]


def _read_responses(events: Iterator[dict], answer: Answer) -> None:
    for event in events:
        kind = event.get("type", "")
        if kind.endswith(".delta") and event.get("delta"):
            answer.first()
        elif kind == "response.output_item.added" and \
                event.get("item", {}).get("type") == "function_call":
            answer.first()
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            response = event["response"]
            if kind == "response.failed":
                answer.error = str((response.get("error") or {}).get("message", "failed"))
            answer.finish = {"response.completed": "stop", "response.incomplete": "length",
                             "response.failed": "error"}[kind]
            for item in response.get("output", []):
                if item["type"] == "reasoning":
                    answer.reasoning += "".join(p.get("text", "") for p in item.get("content")
                                                or [])
                elif item["type"] == "message":
                    answer.content += "".join(p.get("text", "") for p in item["content"])
                elif item["type"] == "function_call":
                    answer.tool_calls.append({"id": item["call_id"], "type": "function",
                                              "function": {"name": item["name"],
                                                           "arguments": item["arguments"]}})
            if answer.tool_calls and kind == "response.completed":
                answer.finish = "tool_calls"
            usage = response.get("usage") or {}
            answer.prompt_tokens = usage.get("input_tokens")
            answer.completion_tokens = usage.get("output_tokens")
            answer.cached_tokens = (usage.get("input_tokens_details") or {}).get(
                "cached_tokens")
        elif kind == "error":
            answer.error = str(event.get("message", event))


def _read_messages(events: Iterator[dict], answer: Answer) -> None:
    blocks: dict[int, dict] = {}
    usage: dict = {}
    for event in events:
        kind = event.get("type")
        if kind == "message_start":
            usage.update(event["message"].get("usage") or {})
        elif kind == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"], text_in="")
            if event["content_block"]["type"] == "tool_use":
                answer.first()
        elif kind == "content_block_delta":
            delta = event["delta"]
            piece = delta.get("text") or delta.get("thinking") or delta.get("partial_json")
            if piece:
                answer.first()
                blocks[event["index"]]["text_in"] += piece
        elif kind == "message_delta":
            usage.update(event.get("usage") or {})
            reason = (event.get("delta") or {}).get("stop_reason")
            answer.finish = {"end_turn": "stop", "max_tokens": "length", "tool_use":
                             "tool_calls", "stop_sequence": "stop"}.get(reason, reason)
        elif kind == "error":
            answer.error = str((event.get("error") or {}).get("message", event))
    for index in sorted(blocks):
        block = blocks[index]
        if block["type"] == "thinking":
            answer.reasoning += block["text_in"]
        elif block["type"] == "text":
            answer.content += block["text_in"]
        elif block["type"] == "tool_use":
            answer.tool_calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": block["text_in"] or "{}"}})
    if "input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens")
        # Anthropic's input_tokens excludes the cache reads; the report wants the whole prompt.
        answer.prompt_tokens = usage["input_tokens"] + (cached or 0)
        answer.cached_tokens = cached
    answer.completion_tokens = usage.get("output_tokens")
