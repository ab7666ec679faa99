"""Events of the streaming Qwen output parser, consumed by the CLI and the three API encoders.

The parser turns generated token ids into a sequence of these events. Encoders are pure
functions from events to wire events; nobody downstream re-parses text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class ReasoningDelta:
    """Text inside the think block (never includes the <think> / </think> markers)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """Answer text outside think blocks and tool calls."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call begins. `index` counts calls in this response from 0; `call_id` is unique."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """A piece of the call's arguments as JSON text; the concatenation of all pieces of one
    call is one valid JSON object once the matching ToolCallEnd has been emitted."""

    index: int
    json_fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int


ParserEvent = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]
