"""Thinking controls applied by the engine, on token ids only (seed 000).

- Thinking budget: at most `budget` model-origin tokens while the new-turn think block is open
  (the closing `</think>` counts when the model writes it). At that exact boundary, if the block
  is still open and nothing ends the request there (stop, output or context limit), the engine
  appends the canonical close span (early-close guidance + `</think>`) without sampling. The
  inserted ids are committed output: they count toward `max_new`.
- Reasoning-loop guard: every 512 thinking tokens, look at the last 2,000 words of the open
  thinking; when at least 25 % of 2,000 (500 words) lie inside 12-word passages that occur three
  or more times in that window, the thinking is looping: `stop` ends the reply (finish reason
  stop), `conclude` inserts the same close span as the budget and lets the model answer.

Words come from a per-token table the text layer derives from the tokenizer (`WORD_*` kinds):
a token whose text starts with whitespace begins a new word, a whitespace-only token separates
words, any other token continues the current word. Byte-level BPE pre-tokenises at word
boundaries, so the same word is the same id run wherever it occurs. Without a table every
token is a word.
"""

from __future__ import annotations

import collections
import enum
from typing import Optional

import numpy as np

from runtime.engine.api import ThinkingControl

WORD_CONTINUES = 0     # token text continues the current word
WORD_STARTS = 1        # token text starts with whitespace followed by a non-space character
WORD_SEPARATOR = 2     # token text is whitespace only

LOOP_CHECK_EVERY = 512      # thinking tokens between two checks
LOOP_WINDOW_WORDS = 2000    # words examined
LOOP_PASSAGE_WORDS = 12     # a passage is this many consecutive words
LOOP_MIN_OCCURRENCES = 3    # seen at least this many times in the window
LOOP_COVERED_SHARE = 0.25   # of LOOP_WINDOW_WORDS


class ThinkingAction(enum.Enum):
    NONE = "none"
    INSERT_CLOSE = "insert_close"    # budget reached, or loop guard `conclude`
    STOP = "stop"                    # loop guard `stop`


def budget_room_error(control: ThinkingControl, max_new: int, prompt_len: int,
                      max_context: int) -> Optional[str]:
    """Why a request cannot honour its thinking budget, or None.

    When the effective output capacity extends beyond the budget it must hold the whole close
    span plus one post-close model token; a smaller one is rejected rather than truncating it.
    """
    if control.budget is None or not control.starts_in_thinking:
        return None
    capacity = min(max_new, max_context - prompt_len)
    if capacity <= control.budget:
        return None
    needed = control.budget + len(control.close_ids) + 1
    if capacity < needed:
        return (f"the output limit {capacity} leaves no room after the thinking budget "
                f"{control.budget} for the {len(control.close_ids)}-token close span and one "
                f"answer token: allow at least {needed} output tokens or lower the budget")
    return None


def looping_share(words: list[int]) -> float:
    """Share of LOOP_WINDOW_WORDS covered by passages repeated >= LOOP_MIN_OCCURRENCES times."""
    n = LOOP_PASSAGE_WORDS
    if len(words) < n * LOOP_MIN_OCCURRENCES:
        return 0.0
    passages = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = collections.Counter(passages)
    covered = np.zeros(len(words), dtype=bool)
    for start, passage in enumerate(passages):
        if counts[passage] >= LOOP_MIN_OCCURRENCES:
            covered[start:start + n] = True
    return float(np.count_nonzero(covered)) / LOOP_WINDOW_WORDS


class _WordStream:
    """Turns token ids into word identities (hashes of their id runs)."""

    def __init__(self, word_kinds: Optional[np.ndarray]):
        self.word_kinds = word_kinds
        self.words: collections.deque[int] = collections.deque(maxlen=LOOP_WINDOW_WORDS)
        self._current: list[int] = []

    def push(self, token_id: int) -> None:
        if self.word_kinds is None:
            self.words.append(token_id)
            return
        kind = int(self.word_kinds[token_id]) if token_id < self.word_kinds.shape[0] else \
            WORD_STARTS
        if kind == WORD_CONTINUES:
            self._current.append(token_id)
            return
        self._flush()
        if kind == WORD_STARTS:
            self._current.append(token_id)

    def _flush(self) -> None:
        if self._current:
            self.words.append(hash(tuple(self._current)))
            self._current = []

    def window(self) -> list[int]:
        # The word being written is not complete yet; leave it out.
        return list(self.words)


class ThinkingTracker:
    """Per-request state of the new-turn think block."""

    def __init__(self, control: ThinkingControl):
        self.control = control
        self.open = control.starts_in_thinking
        self.model_tokens = 0          # model-origin tokens while open (incl. a natural close)
        self.inserted_close = False    # the close span was inserted (budget or conclude)
        self.loop_detected = False
        self._words = _WordStream(control.word_kinds) if control.loop_guard != "off" else None

    def on_model_token(self, token_id: int) -> ThinkingAction:
        """A sampled token was committed. Returns what the engine must do at this boundary
        (the engine checks stop and limits first: they take priority)."""
        if not self.open:
            return ThinkingAction.NONE
        self.model_tokens += 1
        if token_id == self.control.think_end_id:
            self.open = False
            return ThinkingAction.NONE
        if self._words is not None:
            self._words.push(token_id)
        budget = self.control.budget
        if budget is not None and self.model_tokens >= budget:
            return ThinkingAction.INSERT_CLOSE
        if self._words is not None and self.model_tokens % LOOP_CHECK_EVERY == 0:
            if looping_share(self._words.window()) >= LOOP_COVERED_SHARE:
                self.loop_detected = True
                return (ThinkingAction.STOP if self.control.loop_guard == "stop"
                        else ThinkingAction.INSERT_CLOSE)
        return ThinkingAction.NONE

    def on_inserted_close(self) -> None:
        self.open = False
        self.inserted_close = True
