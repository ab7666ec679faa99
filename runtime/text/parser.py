"""The streaming Qwen output parser, shared by the CLI and the three APIs.

Generated token ids go in; `ReasoningDelta`, `ContentDelta`, `ToolCallStart`,
`ToolCallArgsDelta` and `ToolCallEnd` events come out (events.py). Nobody downstream re-parses
text.

Modes, switched by the special-token ids (never by text that merely spells a marker):

- reasoning: the start mode when the prompt ended inside `<think>`. Text is reasoning; newlines
  at its start and end are dropped (the template writes them). `</think>` ends it. `<|im_end|>`
  before `</think>` is a reasoning-only answer.
- content: answer text; whitespace right after `</think>` or a call is dropped, and so is the
  whitespace before a `<tool_call>`.
- tool: a `<tool_call>` block, parsed by `tool_calls.ToolCallBlock` (XML or legacy JSON form,
  arguments typed from the tools' JSON Schemas). A `<tool_call>` token inside Markdown code
  (an open ``` fence, or an inline code span on the current line) is quoted, not called: it stays
  content text.
- A `<tool_call>` inside an unclosed think block is held back: if `</think>` follows, it was part
  of the reasoning and comes out as reasoning text; if the output ends first, the reasoning ended
  at the call and it is recovered as a tool call ("stranded" calls).

Stop conditions (stops.py) are applied here, on the text: stop strings to the answer's content
(never inside a tool call or the reasoning), reasoning-stop strings to the reasoning, stop token
ids and the tokenizer's eos ids end the output. `stopped` tells the caller why the output ended
early, so it can cancel the request.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Mapping, Optional, Sequence

from runtime.text.detokenizer import Detokenizer
from runtime.text.events import (ContentDelta, ParserEvent, ReasoningDelta, ToolCallArgsDelta,
                                 ToolCallStart)
from runtime.text.stops import StopConditions, StopHit, StopStringMatcher
from runtime.text.tokenizer import Tokenizer
from runtime.text.tool_call_markup import FUNCTION_OPEN
from runtime.text.tool_calls import END_STOP, END_TAG, END_TRUNCATED, ToolCallBlock
from runtime.text.tool_schema import tool_specs

_REASONING, _CONTENT, _TOOL, _STRANDED, _DONE = range(5)
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_BACKTICKS = re.compile(r"`+")


def prompt_ends_in_reasoning(prompt_ids: Sequence[int], tokenizer: Tokenizer) -> bool:
    """True when the prompt leaves a think block open (the generation prompt ended with
    `<think>\\n`): the output then starts as reasoning."""
    think, think_end = tokenizer.special.think, tokenizer.special.think_end
    for token_id in reversed(prompt_ids):
        if token_id == think:
            return True
        if token_id == think_end or token_id == tokenizer.special.im_start:
            return False
    return False


class _MarkdownCode:
    """Whether the answer text written so far leaves Markdown code open: a ``` / ~~~ fence, or
    an inline code span on the current line (a backtick never reaches past its line)."""

    __slots__ = ("fence", "line_parts")

    def __init__(self):
        self.fence = ""
        self.line_parts: list[str] = []

    def update(self, text: str) -> None:
        if "\n" not in text:
            self.line_parts.append(text)
            return
        lines = text.split("\n")
        self.line_parts.append(lines[0])
        self._end_line("".join(self.line_parts))
        for line in lines[1:-1]:
            self._end_line(line)
        self.line_parts = [lines[-1]]

    def _end_line(self, line: str) -> None:
        match = _FENCE.match(line)
        if match is None:
            return
        marker = match.group(1)
        if not self.fence:
            self.fence = marker
        elif (marker[0] == self.fence[0] and len(marker) >= len(self.fence)
              and not line[match.end():].strip()):
            self.fence = ""

    def inside(self) -> bool:
        if self.fence:
            return True
        line = "".join(self.line_parts)
        if _FENCE.match(line):
            return True  # on a fence's opening line
        open_run = 0
        for run in _BACKTICKS.findall(line):
            if not open_run:
                open_run = len(run)
            elif len(run) == open_run:
                open_run = 0
        return open_run > 0


class QwenOutputParser:
    """Turns generated token ids into parser events.

    tokenizer: the model's tokenizer (special ids, token bytes).
    tools: the request's tools (OpenAI-style function specs, flat or Anthropic forms accepted);
        they type the arguments. Calls to undeclared names are passed through.
    starts_in_reasoning: the prompt ended inside `<think>` (see `prompt_ends_in_reasoning`).
    tolerant_tool_calls: recover malformed calls instead of returning them as text.
    call_id_prefix: ids are this prefix + 24 random hex digits.
    stop: stop strings / reasoning-stop strings / stop token ids of the request.

    `feed(ids)` returns the events those ids complete; `finish(truncated)` flushes and closes
    whatever is open (truncated: the output limit, the context window or a cancellation cut the
    output). After an end condition (eos, stop token, stop string) `stopped` is set, later ids
    are ignored, and `finish()` returns nothing more.
    """

    def __init__(self, tokenizer: Tokenizer, *, tools: Optional[Sequence[Mapping[str, Any]]] = None,
                 starts_in_reasoning: bool, tolerant_tool_calls: bool = False,
                 call_id_prefix: str = "call_", stop: Optional[StopConditions] = None):
        special = tokenizer.special
        stop = stop or StopConditions()
        self._think = special.think
        self._think_end = special.think_end
        self._tool_call = special.tool_call
        self._tool_call_end = special.tool_call_end
        self._eos_ids = frozenset(tokenizer.eos_ids)
        self._end_ids = stop.end_ids(tokenizer.eos_ids)
        self._special_ids = frozenset(tokenizer.special_ids) | self._end_ids
        self._spellings = {i: tokenizer.token_bytes[i].decode("utf-8", "replace")
                           for i in tokenizer.special_ids if i not in self._end_ids}
        self._detok = Detokenizer(tokenizer.token_bytes)
        self._token_bytes = tokenizer.token_bytes
        self._specs = tool_specs(tools)
        self._tolerant = tolerant_tool_calls
        self._call_id_prefix = call_id_prefix
        # None when the request has no such strings (the common case costs one test).
        self._answer_stops = StopStringMatcher(stop.stop_strings) if stop.stop_strings else None
        self._reasoning_stops = (StopStringMatcher(stop.reasoning_stop_strings)
                                 if stop.reasoning_stop_strings else None)

        self._mode = _REASONING if starts_in_reasoning else _CONTENT
        self._reasoning_started = False   # leading newlines of the reasoning are dropped
        self._reasoning_newlines = ""     # trailing newlines held back
        self._content_lstrip = True       # drop whitespace at the start of the answer
        self._content_space = ""          # trailing whitespace held back
        self._after_call = False
        self._bare_prefix = ""            # tolerant: text that may start a bare <function=
        self._markdown = _MarkdownCode()
        self._block: Optional[ToolCallBlock] = None
        self._stranded: list[object] = []  # ids (special) and text, held inside reasoning
        self._calls = 0
        self.stopped: Optional[StopHit] = None

    # --- public ------------------------------------------------------------------------------

    @property
    def tool_call_count(self) -> int:
        return self._calls

    @property
    def in_reasoning(self) -> bool:
        return self._mode in (_REASONING, _STRANDED)

    def feed(self, token_ids: Sequence[int]) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        if self._mode == _DONE:
            return events
        # The hot path: locals only, one dict-free branch per ordinary token.
        special_ids = self._special_ids
        decode = self._detok.decode_bytes
        table = self._token_bytes
        size = len(table)
        for token_id in token_ids:
            if token_id in special_ids:
                self._special(token_id, events)
            elif 0 <= token_id < size:
                text = decode(table[token_id])
                if not text:
                    continue
                self._text(text, events)
            else:
                continue
            if self._mode == _DONE:
                break
        return events

    def finish(self, truncated: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        if self._mode != _DONE:
            self._end(events, END_TRUNCATED if truncated else END_STOP)
        return events

    # --- text --------------------------------------------------------------------------------

    def _text(self, text: str, events: list[ParserEvent]) -> None:
        if self._mode == _TOOL:
            # A call's markup and arguments are not answer text: a stop string there would cut
            # the call into broken text (`<tool_call>\n<function=g` with finish "stop").
            self._route(text, events)
            return
        if self._mode == _REASONING or self._mode == _STRANDED:
            matcher, kind = self._reasoning_stops, "reasoning_stop"
        else:
            matcher, kind = self._answer_stops, "stop_string"
        if matcher is not None and matcher.matched is None:
            text, hit = matcher.push(text)
            if text:
                self._route(text, events)
            if hit is not None:
                self.stopped = StopHit(kind, hit)
                self._end(events, END_STOP, flush=False)  # what follows the match is dropped
            return
        self._route(text, events)

    def _route(self, text: str, events: list[ParserEvent]) -> None:
        mode = self._mode
        if mode == _REASONING:
            self._reasoning_text(text, events)
        elif mode == _CONTENT:
            self._content_text(text, events)
        elif mode == _TOOL:
            events.extend(self._block.feed(text))
        elif mode == _STRANDED:
            self._stranded.append(text)

    def _reasoning_text(self, text: str, events: list[ParserEvent]) -> None:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            if not text:
                return
            self._reasoning_started = True
        if self._reasoning_newlines:
            text = self._reasoning_newlines + text
        body = text.rstrip("\n")
        self._reasoning_newlines = text[len(body):]
        if body:
            events.append(ReasoningDelta(body))

    def _content_text(self, text: str, events: list[ParserEvent]) -> None:
        if self._content_lstrip:
            if self._bare_prefix:
                text = self._bare_prefix + text
                self._bare_prefix = ""
            text = text.lstrip()
            if not text:
                return
            if self._after_call and self._tolerant:
                # Tolerant: a `<function=...>` block written right after a call, without its
                # own <tool_call> token, is a call too.
                if text.startswith(FUNCTION_OPEN):
                    self._after_call = False
                    self._open_block(events, raw_prefix="")
                    events.extend(self._block.feed(text))
                    return
                if FUNCTION_OPEN.startswith(text):
                    self._bare_prefix = text
                    return
            self._content_lstrip = False
            self._after_call = False
        self._markdown.update(text)
        if self._content_space:
            text = self._content_space + text
        body = text.rstrip()
        self._content_space = text[len(body):]
        if body:
            events.append(ContentDelta(body))

    def _flush_text(self, events: list[ParserEvent]) -> None:
        """Before a special token or the end: text held for UTF-8 or stop matching goes out."""
        tail = self._detok.flush()
        if tail:
            self._text(tail, events)
        for matcher in (self._answer_stops, self._reasoning_stops):
            held = matcher.release() if matcher is not None else ""
            if held and self._mode != _DONE:
                self._route(held, events)

    # --- special tokens ----------------------------------------------------------------------

    def _special(self, token_id: int, events: list[ParserEvent]) -> None:
        self._flush_text(events)
        if self._mode == _DONE:
            return
        if token_id in self._end_ids:
            kind = "eos" if token_id in self._eos_ids else "stop_token"
            self.stopped = StopHit(kind, token_id)
            self._end(events, END_STOP, flush=False)  # flushed above
            return
        mode = self._mode
        if mode == _REASONING:
            if token_id == self._think_end:
                self._leave_reasoning()
            elif token_id == self._tool_call:
                self._mode = _STRANDED
                self._stranded = [token_id]
        elif mode == _STRANDED:
            if token_id == self._think_end:
                # The call was part of the thinking: it is reasoning text after all.
                text = "".join(item if isinstance(item, str) else self._spellings.get(item, "")
                               for item in self._stranded)
                self._stranded = []
                self._mode = _REASONING
                self._reasoning_text(text, events)
                self._leave_reasoning()
            else:
                self._stranded.append(token_id)
        elif mode == _CONTENT:
            self._content_special(token_id, events)
        elif mode == _TOOL:
            self._tool_special(token_id, events)

    def _tool_special(self, token_id: int, events: list[ParserEvent]) -> None:
        if self._block.in_value:
            # Inside a parameter value special tokens are text: files and tests that contain
            # tool-call markup. A `</tool_call>` there still ends the block if nothing but
            # whitespace follows it before the output ends (ToolCallBlock decides).
            spelling = self._spellings.get(token_id)
            if spelling:
                events.extend(self._block.feed(spelling))
        elif token_id == self._tool_call_end:
            self._close_block(events, END_TAG)
        elif token_id == self._tool_call:
            self._close_block(events, END_TAG)
            self._open_block(events)

    def _leave_reasoning(self) -> None:
        self._reasoning_newlines = ""
        self._mode = _CONTENT
        self._content_lstrip = True

    def _content_special(self, token_id: int, events: list[ParserEvent]) -> None:
        if token_id == self._tool_call:
            if self._markdown.inside():
                self._content_text(self._spellings[token_id], events)
            else:
                if self._bare_prefix:  # a "<func..." that turned out not to be a call
                    events.append(ContentDelta(self._bare_prefix))
                    self._bare_prefix = ""
                self._content_space = ""
                self._open_block(events)
        elif token_id == self._tool_call_end:
            if self._markdown.inside():
                self._content_text(self._spellings[token_id], events)
        elif token_id == self._think:
            self._mode = _REASONING
            self._reasoning_started = False

    def _open_block(self, events: list[ParserEvent], raw_prefix: Optional[str] = None) -> None:
        if raw_prefix is None:
            raw_prefix = self._spellings.get(self._tool_call, "<tool_call>")
        self._block = ToolCallBlock(self._specs, self._start_call, tolerant=self._tolerant,
                                    raw_prefix=raw_prefix)
        self._mode = _TOOL

    def _close_block(self, events: list[ParserEvent], how: str) -> None:
        block, self._block = self._block, None
        events.extend(block.close(how))
        self._mode = _CONTENT
        self._content_lstrip = True
        self._after_call = block.committed

    def _start_call(self, name: str) -> tuple[int, str]:
        index = self._calls
        self._calls += 1
        return index, f"{self._call_id_prefix}{secrets.token_hex(12)}"

    # --- the end -----------------------------------------------------------------------------

    def _end(self, events: list[ParserEvent], how: str, flush: bool = True) -> None:
        if self._mode == _DONE:
            return
        if flush:
            self._flush_text(events)
            if self._mode == _DONE:
                return
        mode = self._mode
        if mode == _STRANDED:
            self._replay_stranded(events, how)
        elif mode == _TOOL:
            self._close_block(events, how)
        if self._mode == _CONTENT:
            tail = self._bare_prefix or self._content_space
            if tail:
                events.append(ContentDelta(tail))
            self._bare_prefix = self._content_space = ""
        self._mode = _DONE

    def _replay_stranded(self, events: list[ParserEvent], how: str) -> None:
        """The output ended inside the think block after a `<tool_call>`: the reasoning ended
        at the call; what followed is parsed as answer (calls, text)."""
        held, self._stranded = self._stranded, []
        self._leave_reasoning()
        for item in held:
            if isinstance(item, str):
                self._route(item, events)
            elif self._mode == _TOOL:
                self._tool_special(item, events)
            elif self._mode == _CONTENT:
                self._content_special(item, events)
        if self._mode == _TOOL:
            self._close_block(events, how)


class OutputAccumulator:
    """Collects parser events into whole strings: for non-streaming responses and the CLI.

    reasoning, content: the concatenated deltas; tool_calls: [{"id", "name", "arguments"}] with
    `arguments` the JSON text of each call."""

    def __init__(self):
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self.tool_calls: list[dict[str, str]] = []
        self._by_index: dict[int, int] = {}

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def add(self, events: Sequence[ParserEvent]) -> None:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self._reasoning.append(event.text)
            elif isinstance(event, ContentDelta):
                self._content.append(event.text)
            elif isinstance(event, ToolCallStart):
                self._by_index[event.index] = len(self.tool_calls)
                self.tool_calls.append({"id": event.call_id, "name": event.name,
                                        "arguments": ""})
            elif isinstance(event, ToolCallArgsDelta):
                self.tool_calls[self._by_index[event.index]]["arguments"] += event.json_fragment

    def as_message(self) -> dict[str, Any]:
        """The output as an assistant message for the chat history (the shape the templates and
        OpenAI clients use): content, reasoning_content, tool_calls."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self._reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}
                for call in self.tool_calls]
        return message
