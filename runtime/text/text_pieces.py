"""Cutting a long text into pieces that tokenize to the same ids as the whole, so that the pieces
can be encoded in parallel (one `encode_batch_fast` call: the Rust library spreads a batch over
its threads; one long text is encoded on one thread: ~115 ms for a 105K-token prompt).

Where it is safe: right after a newline followed by a printable ASCII character, under the
Qwen pre-tokenizers (a `Split` by one of the patterns below, `Isolated`, then `ByteLevel`
without its own regex; no normalizer or NFC). No alternative of those patterns matches across
such a point: a newline only ever ends a match (`[\\r\\n]*` / `[\\r\\n]+` at the end, or a run of
whitespace), and the next match then starts at the character after it in the whole text just as
at the start of the second piece (the patterns have no look-behind, and a look-ahead at a piece's
end only decides among whitespace runs that end in a newline, which `\\s*[\\r\\n]+` takes first
either way). BPE merges never cross pre-tokens, NFC never composes across a newline, and no
added token contains a newline, so the pieces' ids concatenate to the whole's. A tokenizer of any
other shape is never cut (`cuttable` says no).
"""

from __future__ import annotations

import json
import re

# The split patterns of the Qwen tokenizers (tools/tokenizer_json.py builds them; a test checks
# they are the same): Qwen3.5 (letters carry combining marks) and Qwen2/3 / Qwen3-Next.
QWEN_SPLIT_PATTERNS = frozenset({
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
})
# Pieces are at least this many characters (thousands of tokens): work enough for a thread each,
# and few pieces per prompt.
PIECE_CHARS = 16384
_CUT = re.compile(r"\n(?=[!-~])")


def cuttable(pre_tokenizer_json: bytes, normalizer_json: bytes | None,
             added_tokens: list[str]) -> bool:
    """Whether texts may be cut for a tokenizer with this pre-tokenizer and normalizer (their
    JSON states) and these added tokens' texts (module docstring)."""
    if normalizer_json is not None and json.loads(normalizer_json) != {"type": "NFC"}:
        return False
    if any("\n" in token or "\r" in token for token in added_tokens):
        return False
    state = json.loads(pre_tokenizer_json)
    steps = state.get("pretokenizers") if state.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    return (split.get("type") == "Split" and split.get("behavior") == "Isolated"
            and not split.get("invert")
            and split.get("pattern", {}).get("Regex") in QWEN_SPLIT_PATTERNS
            and byte_level.get("type") == "ByteLevel" and byte_level.get("use_regex") is False
            and byte_level.get("add_prefix_space") is False)


def cut(text: str) -> list[str]:
    """`text` in pieces of at least `PIECE_CHARS` characters (the last may be shorter), each
    cut right after a newline followed by a printable ASCII character; [text] when short."""
    piece_chars = PIECE_CHARS
    pieces = []
    start = 0
    while len(text) - start >= 2 * piece_chars:
        point = _CUT.search(text, start + piece_chars)
        if point is None:
            break
        pieces.append(text[start:point.end()])
        start = point.end()
    pieces.append(text[start:])
    return pieces
