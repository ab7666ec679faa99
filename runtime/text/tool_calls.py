"""Streaming parser for the body of one `<tool_call>` ... `</tool_call>` block.

The XML form (Qwen3.5/3.6, Qwen3-Coder):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

- A call is committed (ToolCallStart, then the `{` of its arguments) as soon as its
  `<function=NAME>` header is complete. From then on it always ends with a valid JSON object,
  whatever happens to the text (missing tags, cut by the output limit or a stop).
- Several `<function=...>` blocks in one `<tool_call>` are separate calls.
- A value loses exactly one leading and one trailing newline. Where it ends (a `</parameter>`
  inside the value, a missing `</parameter>`): tool_call_value_end.py.
- String parameters stream as JSON string pieces while they arrive; others are typed from the
  schema when complete (tool_schema.py). Duplicate parameter names: the first one wins.

The legacy JSON form (`{"name": ..., "arguments": {...}}`, Qwen2.5/3 and Qwen3-Next) is buffered
to the end of the block and decoded leniently (trailing commas, arguments as a JSON string;
tool_call_json.py).

Broken blocks (text before the header, a malformed header, no function at all, undecodable JSON,
a header cut by the end of the output) come back as content text. With `tolerant` recovery: text
before the header is kept as content and the call parsed, a header ended by a newline instead of
`>` is accepted, JSON may use Python literal syntax and a JSON call cut by the output limit is
repaired, and a header cut by the output limit that names a declared tool becomes a call with
empty arguments. A committed call is never turned back into text: its events are already out.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring as _encode_basestring
from typing import Callable, Optional

from runtime.text.events import (ContentDelta, ParserEvent, ToolCallArgsDelta, ToolCallEnd,
                                 ToolCallStart)
from runtime.text.tool_call_json import decode_json_calls
from runtime.text.tool_call_markup import (FUNCTION_CLOSE, FUNCTION_OPEN, MAX_HEADER, PARAM_CLOSE,
                                           PARAM_OPEN, WHITESPACE)
from runtime.text.tool_call_value_end import ValueEndScanner
from runtime.text.tool_schema import ANY, ParamType, ToolSpec, convert_value

_COMPACT_AT = 8192  # buffer size from which consumed text is dropped

# Block states
_EXPECT_FUNCTION, _PARAMS, _VALUE, _JSON, _BROKEN = range(5)

# How a block ended
END_TAG = "end"          # the </tool_call> token (or a new <tool_call>)
END_STOP = "stop"        # eos, a stop token or a stop string
END_TRUNCATED = "truncated"  # output limit, context window or cancellation


def _escape(text: str) -> str:
    """`text` as the inside of a JSON string (json.dumps(ensure_ascii=False) without quotes)."""
    return _encode_basestring(text)[1:-1]


class ToolCallBlock(ValueEndScanner):
    """One `<tool_call>` block. `feed(text)` and `close(how)` return parser events.

    start_call(name) -> (index, call_id) allocates the next call of the response.
    raw_prefix: the text that opened the block (returned verbatim if the block is broken).
    """

    def __init__(self, specs: dict[str, ToolSpec], start_call: Callable[[str], tuple[int, str]],
                 *, tolerant: bool, raw_prefix: str = "<tool_call>"):
        self._specs = specs
        self._start_call = start_call
        self._tolerant = tolerant
        self._raw_prefix = raw_prefix
        self._buf = ""
        self._pos = 0
        self._state = _EXPECT_FUNCTION
        self._committed = 0       # calls started in this block
        self._emitted_raw = 0     # broken block: how much of _buf went out as content
        # Current call
        self._index = -1
        self._spec: Optional[ToolSpec] = None
        self._seen: set[str] = set()
        # Current value
        self._key = ""
        self._kind: ParamType = ANY
        self._skip_value = False
        self._vstart = -1
        self._scan = 0
        self._emitted = 0

    # --- public ------------------------------------------------------------------------------

    @property
    def committed(self) -> bool:
        return self._committed > 0

    @property
    def in_value(self) -> bool:
        """A parameter value is open: special tokens arriving now are part of its text."""
        return self._state == _VALUE

    def feed(self, text: str) -> list[ParserEvent]:
        # Appending through a local lets CPython grow the string in place (no copy per token).
        buf, self._buf = self._buf, ""
        buf += text
        self._buf = buf
        events: list[ParserEvent] = []
        self._advance(events, complete=False)
        if len(self._buf) > _COMPACT_AT:
            self._compact()
        return events

    def _compact(self) -> None:
        """Drop the text no state refers to any more, so a long value does not make every later
        token pay for copying and scanning it."""
        state = self._state
        if state == _VALUE and self._vstart >= 0:
            if self._skip_value:
                needed = max(self._vstart, self._scan - 1)
            elif self._kind.is_string:
                needed = min(self._emitted, self._scan)
            else:
                needed = self._vstart
        elif state in (_PARAMS, _EXPECT_FUNCTION) and self._committed:
            needed = self._pos
        elif state == _BROKEN:
            needed = self._emitted_raw
        else:
            return
        if needed < _COMPACT_AT // 2:
            return
        self._buf = self._buf[needed:]
        self._pos = max(self._pos - needed, 0)
        self._vstart = max(self._vstart - needed, 0) if self._vstart >= 0 else -1
        self._scan = max(self._scan - needed, 0)
        self._emitted = max(self._emitted - needed, 0)
        self._emitted_raw = max(self._emitted_raw - needed, 0)

    def close(self, how: str) -> list[ParserEvent]:
        """The block ended (`END_TAG`, `END_STOP` or `END_TRUNCATED`): finish what is open."""
        events: list[ParserEvent] = []
        if self._state == _JSON:
            self._finish_json(events, how)
            return events
        self._advance(events, complete=True, truncated=how == END_TRUNCATED)
        if self._state == _PARAMS:
            self._close_call(events)
            self._state = _EXPECT_FUNCTION
        if self._state == _EXPECT_FUNCTION:
            rest = self._buf[self._pos:]
            if not self._committed:
                if (how == END_TRUNCATED and self._tolerant
                        and self._recover_cut_header(events, rest)):
                    return events
                self._break(events)
            elif rest.strip():
                events.append(ContentDelta(rest.strip()))
        if self._state == _BROKEN:
            tail = self._buf[self._emitted_raw:]
            if how == END_TAG:
                tail += "</tool_call>"
            if tail:
                events.append(ContentDelta(tail))
            self._emitted_raw = len(self._buf)
        return events

    # --- the state machine -------------------------------------------------------------------

    def _advance(self, events: list[ParserEvent], complete: bool, truncated: bool = False) -> None:
        while True:
            state = self._state
            if state == _EXPECT_FUNCTION:
                progressed = self._expect_function(events, complete)
            elif state == _PARAMS:
                progressed = self._params(events, complete)
            elif state == _VALUE:
                progressed = self._value(events, complete, truncated)
            elif state == _BROKEN:
                if len(self._buf) > self._emitted_raw:
                    events.append(ContentDelta(self._buf[self._emitted_raw:]))
                    self._emitted_raw = len(self._buf)
                return
            else:  # _JSON: wait for the end of the block
                return
            if not progressed:
                return

    def _skip_ws(self) -> int:
        buf, pos = self._buf, self._pos
        while pos < len(buf) and buf[pos] in WHITESPACE:
            pos += 1
        self._pos = pos
        return pos

    def _expect_function(self, events, complete) -> bool:
        pos = self._skip_ws()
        buf = self._buf
        if pos >= len(buf):
            return False
        if buf.startswith(FUNCTION_OPEN, pos):
            return self._header(events, pos, complete)
        rest = buf[pos:]
        if FUNCTION_OPEN.startswith(rest) and not complete:
            return False
        if not self._committed and rest[0] in "{[":
            self._state = _JSON
            return False
        # Text that is not a function block.
        if self._committed:
            # After a finished call: keep it as content, up to a further function block.
            found = buf.find(FUNCTION_OPEN, pos)
            end = found if found >= 0 else self._held_end(buf, pos, FUNCTION_OPEN, complete)
            if end > pos:
                events.append(ContentDelta(buf[pos:end]))
                self._pos = end
                return True
            return False
        if self._tolerant:
            found = buf.find(FUNCTION_OPEN, pos)
            if found < 0:
                return False  # keep waiting; close() returns the block as text if none comes
            if buf[pos:found].strip():
                events.append(ContentDelta(buf[pos:found].strip()))
            self._pos = found
            self._emitted_raw = found
            return True
        self._break(events)
        return True

    @staticmethod
    def _held_end(buf: str, pos: int, tag: str, complete: bool) -> int:
        """End of the text that can be released: hold back a tail that may start `tag`."""
        if complete:
            return len(buf)
        for size in range(min(len(tag) - 1, len(buf) - pos), 0, -1):
            if buf.endswith(tag[:size]):
                return len(buf) - size
        return len(buf)

    def _header(self, events, pos, complete) -> bool:
        buf = self._buf
        start = pos + len(FUNCTION_OPEN)
        close = buf.find(">", start)
        newline = buf.find("\n", start)
        if close < 0 or (0 <= newline < close):
            if newline >= 0 and self._tolerant:
                close = newline  # `<function=NAME` + newline: the name ends at the line end
            elif newline >= 0 or len(buf) - start > MAX_HEADER:
                return self._bad_header(events)
            else:
                return False  # wait; a header cut at the block end is close()'s decision
        name = buf[start:close].strip().strip("\"'")
        if not name or "<" in name:
            return self._bad_header(events)
        self._open_call(events, name)
        self._pos = close + 1
        self._state = _PARAMS
        return True

    def _bad_header(self, events) -> bool:
        if self._committed:
            # A later function block in an already-good block: the rest is content.
            events.append(ContentDelta(self._buf[self._pos:]))
            self._pos = len(self._buf)
            self._state = _BROKEN
            self._emitted_raw = len(self._buf)
            return False
        self._break(events)
        return True

    def _break(self, events) -> None:
        """The block is not a tool call: everything so far (and later) is content text."""
        if self._state != _BROKEN:
            self._state = _BROKEN
            events.append(ContentDelta(self._raw_prefix + self._buf[:]))
            self._emitted_raw = len(self._buf)

    def _params(self, events, complete) -> bool:
        pos = self._skip_ws()
        buf = self._buf
        if pos >= len(buf):
            return False
        if buf.startswith(PARAM_OPEN, pos):
            start = pos + len(PARAM_OPEN)
            close = buf.find(">", start)
            newline = buf.find("\n", start)
            if close < 0 or (0 <= newline < close):
                if newline < 0:
                    if complete:  # a parameter header cut at the block end: left out
                        self._pos = len(buf)
                    elif len(buf) - start <= MAX_HEADER:
                        return False
                    else:
                        self._pos = start
                        return True
                    return False
                close = newline  # `<parameter=KEY` + newline
            key = buf[start:close].strip().strip("\"'")
            self._open_value(events, key, close + 1)
            return True
        if buf.startswith(FUNCTION_CLOSE, pos):
            self._close_call(events)
            self._pos = pos + len(FUNCTION_CLOSE)
            self._state = _EXPECT_FUNCTION
            return True
        if buf.startswith(FUNCTION_OPEN, pos):  # next function without </function>
            self._close_call(events)
            self._state = _EXPECT_FUNCTION
            return True
        rest = buf[pos:]
        if not complete and any(tag.startswith(rest) for tag in (PARAM_OPEN, FUNCTION_CLOSE,
                                                                   FUNCTION_OPEN)):
            return False
        # Stray text between parameters (e.g. a lone </parameter>): skip to the next tag.
        found = [i for i in (buf.find(PARAM_OPEN, pos + 1), buf.find(FUNCTION_CLOSE, pos + 1),
                             buf.find(FUNCTION_OPEN, pos + 1)) if i >= 0]
        if found:
            self._pos = min(found)
            return True
        if complete:
            self._pos = len(buf)
        return False

    # --- calls and values --------------------------------------------------------------------

    def _open_call(self, events, name: str) -> None:
        self._index, call_id = self._start_call(name)
        self._spec = self._specs.get(name)
        self._seen = set()
        self._committed += 1
        events.append(ToolCallStart(self._index, call_id, name))
        events.append(ToolCallArgsDelta(self._index, "{"))

    def _close_call(self, events) -> None:
        events.append(ToolCallArgsDelta(self._index, "}"))
        events.append(ToolCallEnd(self._index))

    def _open_value(self, events, key: str, value_pos: int) -> None:
        self._key = key
        self._skip_value = key in self._seen or not key
        if not self._skip_value:
            self._seen.add(key)
        params = self._spec.params if self._spec is not None else {}
        self._kind = params.get(key, ANY)
        self._vstart = -1
        self._pos = value_pos
        self._state = _VALUE

    def _key_prefix(self) -> str:
        separator = ", " if len(self._seen) > 1 else ""
        return f"{separator}{json.dumps(self._key, ensure_ascii=False)}: "

    def _value(self, events, complete: bool, truncated: bool) -> bool:
        buf = self._buf
        if self._vstart < 0:
            if self._pos >= len(buf) and not complete:
                return False
            self._vstart = self._pos + 1 if buf.startswith("\n", self._pos) else self._pos
            self._scan = self._emitted = self._vstart
            if self._kind.is_string and not self._skip_value:
                events.append(ToolCallArgsDelta(self._index, self._key_prefix() + '"'))
        end, next_pos, safe = self._scan_value(complete)
        if end is None:
            if self._kind.is_string and not self._skip_value and safe > self._emitted:
                events.append(ToolCallArgsDelta(self._index, _escape(buf[self._emitted:safe])))
                self._emitted = safe
            return False
        # A value that runs to the end of a block cut by the output limit is incomplete.
        self._end_value(events, end, truncated=truncated and end == len(buf) == next_pos)
        self._pos = next_pos
        self._state = _PARAMS
        return True

    def _end_value(self, events, end: int, truncated: bool = False) -> None:
        buf = self._buf
        if self._vstart < 0:
            self._vstart = self._emitted = min(self._pos, len(buf))
        if truncated:
            # Cut mid-value: drop a tail that was the start of the closing tag.
            tail = buf[max(self._emitted, end - len(PARAM_CLOSE) - 1):end]
            for size in range(min(len(tail), len(PARAM_CLOSE) + 1), 0, -1):
                piece = tail[-size:]
                if ("\n" + PARAM_CLOSE).startswith(piece) or PARAM_CLOSE.startswith(piece):
                    end -= size
                    break
        if end > self._vstart and buf[end - 1] == "\n" and end - 1 >= self._emitted:
            end -= 1
        if self._skip_value:
            return
        if self._kind.is_string:
            if end > self._emitted:
                events.append(ToolCallArgsDelta(self._index, _escape(buf[self._emitted:end])))
            events.append(ToolCallArgsDelta(self._index, '"'))
            self._emitted = max(self._emitted, end)
        elif not truncated:
            value = convert_value(buf[self._vstart:end], self._kind)
            events.append(ToolCallArgsDelta(
                self._index, self._key_prefix() + json.dumps(value, ensure_ascii=False)))
        else:
            self._seen.discard(self._key)  # a cut non-string value is left out

    # --- recovery and the JSON form -----------------------------------------------------------

    def _recover_cut_header(self, events, rest: str) -> bool:
        if not rest.startswith(FUNCTION_OPEN):
            return False
        name = rest[len(FUNCTION_OPEN):].split(">")[0].strip().strip("\"'")
        if name not in self._specs:
            return False
        self._open_call(events, name)
        self._close_call(events)
        return True

    def _finish_json(self, events, how: str) -> None:
        parsed = decode_json_calls(self._buf, tolerant=self._tolerant,
                                   repair=self._tolerant and how == END_TRUNCATED)
        if parsed is None:
            self._state = _BROKEN
            self._emitted_raw = 0
            text = self._raw_prefix + self._buf + ("</tool_call>" if how == END_TAG else "")
            events.append(ContentDelta(text))
            self._emitted_raw = len(self._buf)
            return
        for name, arguments in parsed:
            index, call_id = self._start_call(name)
            self._committed += 1
            events.append(ToolCallStart(index, call_id, name))
            events.append(ToolCallArgsDelta(index, json.dumps(arguments, ensure_ascii=False)))
            events.append(ToolCallEnd(index))
