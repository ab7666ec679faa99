"""The tokenizer's cache of long pieces (`runtime.text.piece_cache`): what it keeps and drops, and
that a conversation's next turn encodes only its new text while its ids stay the whole text's."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.text.piece_cache import MIN_CHARS, PieceCache
from runtime.text.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


def test_short_pieces_are_never_kept():
    cache = PieceCache()
    cache.put("x" * (MIN_CHARS - 1), True, [1, 2])
    assert len(cache) == 0 and cache.get("x" * (MIN_CHARS - 1), True) is None


def test_the_least_recently_used_piece_goes_first_past_the_budget():
    a, b, c = ("a" * MIN_CHARS, "b" * MIN_CHARS, "c" * MIN_CHARS)
    cache = PieceCache(max_chars=2 * MIN_CHARS)
    cache.put(a, True, [1])
    cache.put(b, True, [2])
    assert cache.get(a, True) == [1]          # a is now the most recently used
    cache.put(c, True, [3])
    assert cache.get(b, True) is None
    assert cache.get(a, True) == [1] and cache.get(c, True) == [3]
    assert cache.chars == 2 * MIN_CHARS


def test_a_piece_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    cache = PieceCache(max_chars=MIN_CHARS)
    cache.put("a" * MIN_CHARS, True, [1])
    cache.put("b" * (MIN_CHARS + 1), True, [2])
    assert cache.get("a" * MIN_CHARS, True) == [1] and len(cache) == 1


def test_parsing_special_tokens_or_not_are_different_entries():
    cache = PieceCache()
    cache.put("a" * MIN_CHARS, True, [1])
    assert cache.get("a" * MIN_CHARS, False) is None
    with pytest.raises(ValueError, match="max_chars"):
        PieceCache(max_chars=-1)


def _whole(tokenizer: Tokenizer, text: str, parse_special: bool) -> list[int]:
    hf = tokenizer._hf
    hf.encode_special_tokens = not parse_special
    try:
        return hf.encode(text, add_special_tokens=False).ids
    finally:
        hf.encode_special_tokens = False


def test_the_next_turn_encodes_only_its_new_text(qwen_tokenizer_json, monkeypatch):
    tokenizer = Tokenizer.from_json(qwen_tokenizer_json)  # a cache of its own
    encoded: list[str] = []
    real = tokenizer._encode_releasing_the_gil

    def recording(texts):
        encoded.extend(texts)
        return real(texts)

    monkeypatch.setattr(tokenizer, "_encode_releasing_the_gil", recording)
    history = (REPO / "runtime" / "engine" / "scheduler.py").read_text() + "\n<|im_end|>\n"
    turn = "Please rename the scheduler's fields."
    for parse_special in (True, False):
        encoded.clear()
        first = tokenizer.encode_many([history], parse_special=parse_special)
        assert first == [_whole(tokenizer, history, parse_special)]
        assert "".join(encoded) == history
        encoded.clear()
        second = tokenizer.encode_many([history, turn], parse_special=parse_special)
        assert second == [first[0], _whole(tokenizer, turn, parse_special)]
        assert encoded == [turn]                # the history came from the cache
    assert tokenizer.encode(history) != tokenizer.encode(history, parse_special=False)
