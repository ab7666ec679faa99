"""The ids of long text pieces already encoded, so a conversation's next turn does not encode its
whole history again.

`Tokenizer.encode_many` encodes every piece on its own (the texts between special tokens, long
ones cut by `text_pieces.cut`), so a piece's ids are a function of its text alone: looking them up
gives exactly what encoding would. Agents resend the whole history each turn; its messages
(and the cut pieces of a long one) come back as the same strings, and on the H200 bench a
117K-token turn spent 117 ms of its 795 ms time to first token tokenizing
(docs/performance.md). Only pieces of at least `MIN_CHARS` characters are kept (short ones cost
less to encode than to keep), least recently used first out past `max_chars` characters of kept
text. Not thread-safe by itself: the tokenizer calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIN_CHARS = 2048
# ~32 MiB of ASCII text plus ~4 bytes of ids per ~4 characters: a few hundred thousand tokens of
# history across conversations.
DEFAULT_MAX_CHARS = 32 << 20


class PieceCache:
    """text piece (and whether special tokens were parsed) -> its ids, int32, LRU by characters."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS):
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        self.max_chars = max_chars
        self.chars = 0
        self._ids: OrderedDict[tuple[str, bool], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, piece: str, parse_special: bool) -> list[int] | None:
        """The piece's ids when kept (it becomes the most recently used), else None."""
        if len(piece) < MIN_CHARS:
            return None
        key = (piece, parse_special)
        ids = self._ids.get(key)
        if ids is None:
            return None
        self._ids.move_to_end(key)
        return ids.tolist()

    def put(self, piece: str, parse_special: bool, ids: list[int]) -> None:
        """Keep a piece's ids (if long enough and not larger than the whole budget), dropping
        the least recently used pieces past the budget."""
        if len(piece) < MIN_CHARS or len(piece) > self.max_chars:
            return
        key = (piece, parse_special)
        if key in self._ids:
            self._ids.move_to_end(key)
            return
        self._ids[key] = np.asarray(ids, dtype=np.int32)
        self.chars += len(piece)
        while self.chars > self.max_chars:
            (old, _), _ = self._ids.popitem(last=False)
            self.chars -= len(old)
