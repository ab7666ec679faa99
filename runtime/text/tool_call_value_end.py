"""Where a parameter value of an XML tool call ends (the block parser: tool_calls.py).

A value ends at `</parameter>` only when what follows (after whitespace) is `<parameter=`,
`</function>`, `<function=` or the end of the block; any other `</parameter>` is part of the value
(files that contain the tag). A missing `</parameter>` is tolerated before `</function>` (at the
block end) and before a line `<parameter=KEY>` that names another declared parameter and ends right
after the `>`.
"""

from __future__ import annotations

import re
from typing import Optional

from runtime.text.tool_call_markup import (FUNCTION_CLOSE, FUNCTION_OPEN, MAX_HEADER, PARAM_CLOSE,
                                           PARAM_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, WHITESPACE)

_PARAM_NAME = re.compile(r"[A-Za-z_$][\w$.\-]*")


class ValueEndScanner:
    """Mixin of ToolCallBlock: finds the end of the current parameter value. It reads the block's
    text and value state (_buf, _vstart, _emitted, _key, _seen, _spec) and moves its scan
    position (_scan)."""

    def _scan_value(self, complete: bool) -> tuple[Optional[int], int, int]:
        """Look for the end of the current value.

        Returns (end, next_pos, safe): `end` is where the value text stops (None while
        undecided), `next_pos` where parsing resumes, `safe` how far the text is certainly
        value text (for streaming)."""
        buf, n = self._buf, len(self._buf)
        i = self._scan
        while True:
            j = buf.find("<", i)
            if j < 0:
                break
            verdict, next_pos = self._candidate(j, complete)
            if verdict == "literal":
                i = j + 1
                continue
            if verdict == "pending":
                self._scan = j
                hold = j - 1 if j - 1 >= self._vstart and buf[j - 1] == "\n" else j
                return None, 0, max(hold, self._emitted)
            return j, next_pos, j  # terminator
        self._scan = n
        if complete:
            return n, n, n
        safe = n - 1 if n > self._vstart and buf[n - 1] == "\n" else n
        return None, 0, max(safe, self._emitted)

    def _candidate(self, j: int, complete: bool) -> tuple[str, int]:
        buf, n = self._buf, len(self._buf)
        if buf.startswith(PARAM_CLOSE, j):
            follow = self._follows(j + len(PARAM_CLOSE), complete,
                                   (PARAM_OPEN, FUNCTION_CLOSE, FUNCTION_OPEN))
            return follow, j + len(PARAM_CLOSE)
        if buf.startswith(FUNCTION_CLOSE, j):  # missing </parameter>
            return self._follows(j + len(FUNCTION_CLOSE), complete, (FUNCTION_OPEN,)), j
        if buf.startswith(TOOL_CALL_CLOSE, j):  # the block's end token, seen inside a value
            return self._follows(j + len(TOOL_CALL_CLOSE), complete, (TOOL_CALL_OPEN,)), j
        if buf.startswith(PARAM_OPEN, j) and j > self._vstart and buf[j - 1] == "\n":
            close = buf.find(">", j)
            if close < 0:
                partial = buf[j + len(PARAM_OPEN):]
                if complete or "\n" in partial or len(partial) > MAX_HEADER:
                    return "literal", 0
                return "pending", 0
            name = buf[j + len(PARAM_OPEN):close].strip()
            if not self._is_next_param(name):
                return "literal", 0
            # The format puts a value on the line after its header.
            if close + 1 >= n:
                return ("end" if complete else "pending"), j
            return ("end" if buf[close + 1] in "\r\n" else "literal"), j
        rest = buf[j:j + len(PARAM_CLOSE)]
        if not complete and n - j < len(PARAM_CLOSE) and any(
                tag.startswith(rest) for tag in (PARAM_CLOSE, FUNCTION_CLOSE, PARAM_OPEN,
                                                 TOOL_CALL_CLOSE)):
            return "pending", 0
        return "literal", 0

    def _follows(self, pos: int, complete: bool, openers: tuple[str, ...]) -> str:
        """After a closing tag: does the value end here? Whitespace, then one of `openers` or
        the end of the block, means yes."""
        buf, n = self._buf, len(self._buf)
        while pos < n and buf[pos] in WHITESPACE:
            pos += 1
        if pos >= n:
            return "end" if complete else "pending"
        if any(buf.startswith(tag, pos) for tag in openers):
            return "end"
        if buf.startswith(TOOL_CALL_CLOSE, pos):  # the block's end token, then nothing
            return self._follows(pos + len(TOOL_CALL_CLOSE), complete, (TOOL_CALL_OPEN,))
        rest = buf[pos:]
        if any(tag.startswith(rest) for tag in openers + (TOOL_CALL_CLOSE,)):
            return "end" if complete else "pending"
        return "literal"

    def _is_next_param(self, name: str) -> bool:
        if not name or name == self._key or name in self._seen:
            return False
        if self._spec is not None and self._spec.params:
            return name in self._spec.params
        return bool(_PARAM_NAME.fullmatch(name))
