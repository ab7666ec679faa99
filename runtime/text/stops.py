"""Stop conditions: stop token ids, stop strings and reasoning-stop strings.

- Stop token ids end the output when generated; the id itself is not part of the text. The engine
  stops sampling on them (`EngineRequest.stop_token_ids`); the output parser also ends on them.
- Stop strings (`--stop`, API `stop`/`stop_sequences`) apply to the answer's content: never
  inside a tool call (its markup and arguments are not text the client sees; the OpenAI and
  Anthropic APIs apply stop sequences to generated text) nor the reasoning. Reasoning-stop
  strings (`--reasoning-stop`) apply only inside the think block. The matched string is not
  part of the output.
- Matching is streaming: text that could still be the start of a stop string is held back until
  it either completes a match (dropped) or can no longer match (released), so a stop string never
  leaks to a client even when it arrives split over several tokens. Special tokens are not text:
  they cut a partial match (the held text is released).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


_REGEX_STOP_MAX = 200  # longest stop string whose partial matches go through the regex


@dataclass(frozen=True)
class StopConditions:
    """One request's stop conditions (all optional).

    stop_strings: end the answer where one of these appears in its content.
    reasoning_stop_strings: end the output where one of these appears inside the reasoning.
    stop_token_ids: ids that end the output (in addition to the tokenizer's eos ids).
    """

    stop_strings: tuple[str, ...] = ()
    reasoning_stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()

    @classmethod
    def build(cls, stop_strings: Iterable[str] | str | None = None,
              reasoning_stop_strings: Iterable[str] | str | None = None,
              stop_token_ids: Iterable[int] | None = None) -> "StopConditions":
        """Normalises API-style inputs: a single string or a list, empty strings removed,
        duplicates removed in order."""
        return cls(_strings(stop_strings), _strings(reasoning_stop_strings),
                   frozenset(stop_token_ids or ()))

    def end_ids(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """Every id that ends the output: the tokenizer's eos ids plus the stop token ids."""
        return frozenset(eos_ids) | self.stop_token_ids


def _strings(value: Iterable[str] | str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    seen: dict[str, None] = {}
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"stop strings must be strings, got {type(item).__name__}")
        if item:
            seen[item] = None
    return tuple(seen)


@dataclass(frozen=True)
class StopHit:
    """Why the output ended early. kind: "eos" | "stop_token" | "stop_string" |
    "reasoning_stop"; value: the id (int) or the matched string."""

    kind: str
    value: object


class StopStringMatcher:
    """Streaming matcher for a set of stop strings over one text channel.

    `push(text)` returns (text safe to release, the stop string matched or None). After a match
    the matcher is done: the text before the match is released, everything after is dropped.
    `release()` returns the held-back text (call it when the channel ends or a special token
    interrupts the text)."""

    __slots__ = ("_stops", "_pattern", "_prefix_pattern", "_long_stops", "_chars", "_held",
                 "matched")

    def __init__(self, stops: Sequence[str]):
        # Longest first: at equal positions the regex alternation then prefers the longest.
        self._stops = tuple(sorted({s for s in stops if s}, key=len, reverse=True))
        self._pattern = re.compile("|".join(re.escape(s) for s in self._stops)) \
            if self._stops else None
        self._chars = frozenset("".join(self._stops))
        # Partial matches: one regex for the usual short strings; nested groups would exceed
        # the regex compiler's recursion for very long ones, which are checked in a loop.
        short = [_proper_prefixes(s) for s in self._stops if 1 < len(s) <= _REGEX_STOP_MAX]
        self._prefix_pattern = re.compile(f"(?:{'|'.join(short)})\\Z") if short else None
        self._long_stops = tuple(s for s in self._stops if len(s) > _REGEX_STOP_MAX)
        self._held = ""
        self.matched: Optional[str] = None

    @property
    def active(self) -> bool:
        return bool(self._stops) and self.matched is None

    @property
    def held(self) -> str:
        return self._held

    def push(self, text: str) -> tuple[str, Optional[str]]:
        if not self._stops or self.matched is not None:
            return ("" if self.matched is not None else text), None
        buffer = self._held + text if self._held else text
        match = self._pattern.search(buffer)  # earliest match; the longest at a tie
        if match is not None:
            self.matched = match.group(0)
            self._held = ""
            return buffer[:match.start()], self.matched
        # Most text cannot end a partial match: its last character is in no stop string.
        keep = self._partial_suffix(buffer) if buffer and buffer[-1] in self._chars else 0
        if keep:
            self._held = buffer[-keep:]
            return buffer[:-keep], None
        self._held = ""
        return buffer, None

    def release(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        size = len(buffer)
        longest = 0
        if self._prefix_pattern is not None:
            match = self._prefix_pattern.search(buffer, max(0, size - _REGEX_STOP_MAX))
            longest = size - match.start() if match is not None else 0  # leftmost = longest
        for stop in self._long_stops:
            limit = min(len(stop) - 1, size)
            at = buffer.find(stop[0], size - limit)
            while 0 <= at and size - at > longest:
                if stop.startswith(buffer[at:]):
                    longest = size - at
                    break
                at = buffer.find(stop[0], at + 1)
        return longest


def _proper_prefixes(stop: str) -> str:
    """A regex matching exactly the proper prefixes of `stop`: a(?:b(?:c)?)? for "abcd"."""
    pattern = ""
    for ch in reversed(stop[1:-1]):
        pattern = f"(?:{re.escape(ch)}{pattern})?"
    return re.escape(stop[0]) + pattern
