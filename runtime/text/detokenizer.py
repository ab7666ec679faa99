"""Incremental detokenization that never emits part of a UTF-8 sequence.

Byte-level BPE tokens are byte strings: one CJK character or emoji is often split over two or
three tokens, and a token can end in the middle of a character. The text of a token sequence is
therefore computed on the concatenated bytes; a trailing incomplete (but possibly valid) UTF-8
sequence of at most 3 bytes is held back until the next token completes it, or until the stream
ends (then it becomes U+FFFD). Bytes that can never be valid UTF-8 become U+FFFD at once, exactly
as `bytes.decode("utf-8", "replace")` does on the whole output: the concatenation of all pieces
always equals the decode of all bytes.

Two forms:
- `detokenize_incremental`: a pure function from (token ids so far, offsets) to (new text, new
  offsets), for callers that keep the id list themselves;
- `Detokenizer`: the same thing as a small stateful object fed one id at a time (the output
  parser uses it; it keeps no id list).
"""

from __future__ import annotations

import codecs
from typing import NamedTuple, Sequence

_Utf8Decoder = codecs.getincrementaldecoder("utf-8")


class DetokenizerOffsets(NamedTuple):
    """Where emission stands in a token sequence.

    start: index of the first token whose bytes are not all emitted yet;
    skip: how many bytes of ids[start:] (concatenated) are already emitted (0..3).
    """

    start: int = 0
    skip: int = 0


def detokenize_incremental(token_bytes: Sequence[bytes], ids: Sequence[int],
                           offsets: DetokenizerOffsets = DetokenizerOffsets(), *,
                           final: bool = False) -> tuple[str, DetokenizerOffsets]:
    """The text that `ids` adds since `offsets`, and the offsets to pass next time.

    token_bytes: id -> bytes (`Tokenizer.token_bytes`); ids outside it decode to nothing.
    final: the sequence is complete; a held incomplete sequence is flushed as U+FFFD.
    """
    start, skip = offsets
    size = len(token_bytes)
    pieces = [token_bytes[i] if 0 <= i < size else b"" for i in ids[start:]]
    data = b"".join(pieces)[skip:] if skip else b"".join(pieces)
    decoder = _Utf8Decoder("replace")
    text = decoder.decode(data, final)
    held = len(decoder.getstate()[0])
    consumed = skip + len(data) - held
    for piece in pieces:
        if len(piece) > consumed:
            break
        consumed -= len(piece)
        start += 1
    return text, DetokenizerOffsets(start, consumed)


class Detokenizer:
    """Stateful incremental detokenizer: `push(id)` returns the new text (possibly ""),
    `flush()` returns what an unfinished UTF-8 sequence leaves (U+FFFD) at the end."""

    __slots__ = ("_table", "_size", "_decoder", "decode_bytes")

    def __init__(self, token_bytes: Sequence[bytes]):
        self._table = token_bytes
        self._size = len(token_bytes)
        self._decoder = _Utf8Decoder("replace")
        # decode_bytes(data) -> str: the incremental step itself, for callers that look ids up
        # in the byte table themselves (the output parser's hot loop).
        self.decode_bytes = self._decoder.decode

    def push(self, token_id: int) -> str:
        if 0 <= token_id < self._size:
            return self._decoder.decode(self._table[token_id])
        return ""

    def push_many(self, token_ids: Sequence[int]) -> str:
        table, size = self._table, self._size
        return self._decoder.decode(b"".join(table[i] for i in token_ids if 0 <= i < size))

    @property
    def pending(self) -> bool:
        """True while an incomplete UTF-8 sequence is held back."""
        return bool(self._decoder.getstate()[0])

    def flush(self) -> str:
        text = self._decoder.decode(b"", True)
        self._decoder.reset()
        return text
